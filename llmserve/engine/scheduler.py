"""Continuous batching: each step, pick work under a token and a sequence budget.

One scheduling path for everything: a request's computed-token count catches up with
its token count. Prefill, chunked prefill, prefix-cache hits, resumption after
preemption and decode are all that loop. Running requests go first (highest priority,
then earliest arrival); waiting ones fill what is left in the same order. When blocks
run out, the lowest-priority, latest running request is preempted: swapped to CPU
blocks when swap space allows, otherwise freed and later recomputed.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from llmserve.config import SchedulerConfig
from llmserve.engine.kv_cache_manager import KVCacheManager
from llmserve.engine.request import (
    PLACEHOLDER,
    EngineCoreOutput,
    Request,
    RequestStatus,
    SchedulerStats,
)
from llmserve.engine.spec_decode import SpecDecoder

_sort_key = attrgetter("priority", "arrival_time")  # Request.sort_key, read in C
_READING = -1  # `_admit`: the request waits for its disk blocks, read in the reader thread


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    block_table: list[int]  # the request's block ids (a live reference)
    # does this step reach the request's last token (so a new token is sampled)? Set when
    # scheduled (`scheduled`), before `after_launch` moves the counts; read three times a step
    samples: bool
    # speculative decoding (engine/spec_decode.py): the tokens proposed after the request's last
    # one, computed in this step with it (num_new_tokens = 1 + their count)
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: Any = None  # [k, V] the distributions they were drawn from (a draft model's); None: all on each

    @classmethod
    def scheduled(cls, req: Request, num_new_tokens: int, block_table: list[int]) -> ScheduledRequest:
        return cls(req, num_new_tokens, block_table, req.num_computed_tokens + num_new_tokens == req.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device)
    finished_request_ids: list[str] = field(default_factory=list)  # since the last step
    # the prefix cache's host tier (engine/kv_host_tier.py): copies at the step's start, offloads first
    kv_offload: list[tuple[int, int]] = field(default_factory=list)  # (device, host)
    # the disk tier's (engine/kv_disk_tier.py): (on host, block, slot, header) before the offloads,
    # (stage id, device block) after the host tier's loads
    kv_spill: list[tuple] = field(default_factory=list)
    kv_disk_load: list[tuple[int, int]] = field(default_factory=list)
    kv_load: list[tuple[int, int]] = field(default_factory=list)  # (host, device)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in or self.kv_offload
                    or self.kv_spill or self.kv_disk_load
                    or self.kv_load)  # fmt: skip


class Scheduler:
    # the per-request fast paths of the step's loops: a decode that fits its blocks (and releases no
    # block behind a sliding window) takes no `allocate_slots` call; a filled token that fills no block takes no `cache_full_blocks`
    # call, and one that only its length can end no `_check_stop` call. Each skips a call that would
    # change nothing (the call's own first test, inline). False: every call made (the reference the
    # tests compare; tests/test_host_fast_paths.py)
    fast_paths = True

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, swap_enabled: bool, max_loras: int | None = None,
        spec: SpecDecoder | None = None, batches_in_flight: int = 1,
    ) -> None:  # fmt: skip
        """`max_loras`: the most distinct LoRA adapters running at once (the device's slots);
        `spec`: speculative decoding's proposer and counts; `batches_in_flight` > 1: pipeline
        parallelism's batch queue (engine/pp_batches.py): each batch takes requests that no batch
        in flight holds, up to its share of the live requests."""
        self.config = config
        self.spec = spec
        self.max_loras = max_loras
        self.kv = kv
        self.swap_enabled = swap_enabled
        self.block_size = kv.block_size
        self.waiting: list[Request] = []  # kept sorted by (priority, arrival)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_computed_tokens_total = 0
        self._finished_ids: list[str] = []
        self.batches_in_flight = batches_in_flight
        # the requests of the batches in flight (the batch queue's; None: steps may share requests)
        self.in_flight: set[str] | None = set() if batches_in_flight > 1 else None
        self._batch_cap: int | None = None  # the batch queue's most sequences in the batch being scheduled
        # keep a few blocks free when admitting, so running decodes rarely preempt; and the blocks
        # running requests still need (`_growth_blocks`, config.admission_reserve_tokens)
        self.watermark = max(1, kv.num_blocks // 100)

    # -- queue changes ------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already running")
        self.requests[req.request_id] = req
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        bisect.insort_right(self.waiting, req, key=lambda r: r.sort_key)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Drop requests wherever they are and free their blocks at once."""
        aborted = []
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
            self._finish(req)
            aborted.append(request_id)
        return aborted

    def _finish(self, req: Request) -> None:
        self.kv.free(req)
        if self.spec is not None:
            self.spec.forget(req.request_id)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- the step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        if self.in_flight is not None:  # P batches of about equal size take turns in the pipeline
            live = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
            self._batch_cap = max(1, -(-live // self.batches_in_flight))
        budget, preempted = self._schedule_running(out, budget)
        if not preempted:
            budget = self._schedule_waiting(out, budget)
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget  # (each scheduled row took its tokens)
        if self.kv.host is not None:
            out.kv_offload, out.kv_load = self.kv.take_copies()
            if self.kv.disk is not None:
                out.kv_spill, out.kv_disk_load = self.kv.take_disk_copies()
        self.num_computed_tokens_total += out.num_batched_tokens
        if not out.scheduled and self.kv.disk_reader is not None and self.kv.reading_disk():
            self.kv.wait_for_disk_reads(0.01)  # nothing else to do: not a busy loop while a request's blocks are read
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """(Every running request every step: kept lean. Request's properties are read inline:
        num_tokens is len(all_token_ids); `_ends_by_length` and `ScheduledRequest.scheduled` too.)"""
        running = self.running
        running.sort(key=_sort_key)
        drafts = self.spec.propose(running) if self.spec is not None else {}
        in_flight = self.in_flight
        max_len = self.config.max_model_len
        allocate_slots, block_table, append = self.kv.allocate_slots, self.kv.block_table, out.scheduled.append
        # (`allocate_slots`'s first test, inline: the request's blocks have room for its tokens and, with a
        # sliding window, no block falls behind it yet: `_behind_windows`'s first test)
        kv = self.kv
        blocks_of = kv.req_blocks.get if self.fast_paths else None
        groups, sliding, release_at = kv.groups, kv.layout.sliding, kv.release_at_of
        block_size = self.block_size
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if in_flight is not None:  # the batch queue: a request in flight is not scheduled again
                if req.request_id in in_flight:
                    i += 1
                    continue
                if len(out.scheduled) >= self._batch_cap:
                    break
            num_tokens = len(req.all_token_ids)
            if req.num_pending and (
                num_tokens - len(req.prompt_token_ids) >= req.max_tokens or num_tokens >= max_len
            ):  # (`_ends_by_length`)
                i += 1  # its in-flight token is its last: nothing more to compute
                continue
            num_new = min(num_tokens - req.num_computed_tokens, budget)
            proposal = drafts.get(req.request_id) if drafts else None
            if proposal and 1 + len(proposal) <= budget and self.kv.allocate_slots(req, 1 + len(proposal)):
                sched = ScheduledRequest(req, 1 + len(proposal), self.kv.block_table(req.request_id), True, proposal,
                                         self.spec.draft_probs.get(req.request_id))  # fmt: skip
                out.scheduled.append(sched)
                budget -= sched.num_new_tokens
                i += 1
                continue
            if blocks_of is not None:
                blocks = blocks_of(req.request_id)
                computed = req.num_computed_tokens
                if (blocks and computed + num_new <= len(blocks) // groups * block_size
                        and (not sliding or computed < release_at(req.request_id, 0))):  # fmt: skip
                    append(ScheduledRequest(req, num_new, blocks, computed + num_new == num_tokens))
                    budget -= num_new
                    i += 1
                    continue
            while not allocate_slots(req, num_new):
                victim = self._victim()  # lowest priority, latest arrival
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            else:
                append(ScheduledRequest(req, num_new, block_table(req.request_id),
                                        req.num_computed_tokens + num_new == num_tokens))  # fmt: skip
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself: nothing below it can run either
        return budget, preempted

    def _victim(self) -> Request:
        """The running request to preempt: the last (lowest priority, latest arrival), but never
        one in a batch still in flight (the batch queue's: its blocks are still being written)."""
        if self.in_flight:
            for req in reversed(self.running):
                if req.request_id not in self.in_flight:
                    return req
        return self.running[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        mapping = self.kv.swap_out(req) if self.swap_enabled else None
        if mapping is not None:
            out.blocks_to_swap_out.extend(mapping)
            req.status = RequestStatus.SWAPPED
            self.num_swap_outs += 1
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests; returns the budget left."""
        if not self.waiting:
            return budget
        prefilling_groups = {r.share_group for r in self.running if self._fills_shared_blocks(r)}
        adapters = {r.lora_request.key for r in self.running if r.lora_request is not None}
        growth = None  # the running requests' `_growth_blocks`, summed when first needed
        idx = 0
        while idx < len(self.waiting) and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            if self._batch_cap is not None and len(out.scheduled) >= self._batch_cap:
                break
            req = self.waiting[idx]
            if req.share_group in prefilling_groups or req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                idx += 1  # wait until a sibling has filled the shared prompt blocks / the grammar compiled
                continue
            lora = req.lora_request.key if req.lora_request is not None else None
            if lora is not None and lora not in adapters and len(adapters) >= (self.max_loras or 0):
                idx += 1  # every adapter slot is held by running requests: wait for one to free
                continue
            reserve = 0
            if self.running:
                reserve = self.watermark
                # the blocks running requests still need, and those this one will need after its first
                # chunk (not summed when the watermark alone leaves no block: nothing is admitted then)
                if self.kv.pool.num_free > reserve:
                    if growth is None:
                        growth = sum(map(self._growth_blocks, self.running))
                    reserve += growth + self._own_growth_blocks(req, budget)
            num_new = self._admit(req, budget, reserve, out)
            if num_new is None:
                break
            if num_new == _READING:
                idx += 1  # its prefix's disk blocks are being read (engine/kv_disk_reader.py): others go first
                continue
            if growth is not None:
                growth += self._growth_blocks(req)
            self.waiting.pop(idx)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if lora is not None:
                adapters.add(lora)
            out.scheduled.append(ScheduledRequest.scheduled(req, num_new, self.kv.block_table(req.request_id)))
            budget -= num_new
            if self._fills_shared_blocks(req):
                prefilling_groups.add(req.share_group)
        return budget

    def _growth_blocks(self, req: Request) -> int:
        """Blocks a running request will still take: the rest of its prompt, and up to
        `admission_reserve_tokens` more of its output (its max_tokens at most). Admissions keep
        them free, so that the cache does not fill with prompts whose decodes then preempt."""
        allocated = self.kv.num_allocated_blocks(req.request_id) * self.block_size
        return self._blocks_to_come(req, allocated, len(req.prompt_token_ids))

    def _own_growth_blocks(self, req: Request, budget: int) -> int:
        """`_growth_blocks` of a waiting request once admitted with up to `budget` tokens (cache
        hits not counted: at most what it will be)."""
        return self._blocks_to_come(req, min(req.num_tokens, budget), req.num_tokens)

    def _blocks_to_come(self, req: Request, allocated: int, to_compute: int) -> int:
        """Blocks for `req`'s tokens past the `allocated` ones: the rest of its first `to_compute`
        tokens, then up to `admission_reserve_tokens` of its output (its max_tokens at most)."""
        horizon = self.config.admission_reserve_tokens
        if not horizon:
            return 0
        final = min(req.num_prompt_tokens + req.max_tokens, self.config.max_model_len)
        tokens = max(0, to_compute - allocated) + min(horizon, max(0, final - max(allocated, to_compute)))
        if self.kv.layout.simple:
            return -(-tokens // self.block_size)
        # several KV groups: the ids held at the end, less those held now (sliding groups release)
        end = max(allocated, to_compute) + min(horizon, max(0, final - max(allocated, to_compute)))
        return max(0, self.kv.blocks_for(end - 1, end) - self.kv.blocks_for(max(0, allocated - 1), allocated))

    def _fills_shared_blocks(self, req: Request) -> bool:
        """Is this n > 1 sibling still computing the full prompt blocks its siblings share?
        (Counted by blocks in the cache: a step in flight has not registered its blocks.)"""
        if req.share_group is None:
            return False
        shared_blocks = req.num_prompt_tokens // self.block_size
        return self.kv.num_cached_blocks(req) < shared_blocks

    def _admit(self, req: Request, budget: int, reserve: int, out: SchedulerOutput) -> int | None:
        """Give a waiting request its blocks; returns its new-token count, None (nothing more is
        admitted this step), or _READING (this one waits for its disk blocks)."""
        if req.status == RequestStatus.SWAPPED:
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            if num_new is None:
                return None
            if self.kv.swap_in_blocks_needed(req, num_new) > self.kv.pool.num_free - reserve:
                return None
            out.blocks_to_swap_in.extend(self.kv.swap_in(req))
            self.kv.allocate_slots(req, num_new)
            return num_new
        computed = self.kv.get_computed_blocks(req)
        if getattr(computed, "reading", False):
            return _READING
        num_hit = self.kv.num_hit_blocks(computed) * self.block_size
        num_new = self._chunk(req.num_tokens - num_hit, budget)
        if num_new is None or not self.kv.allocate_slots(req, num_new, computed, reserve):
            return None
        self.kv.record_prefix_lookup(req.num_tokens, num_hit)
        req.num_computed_tokens = num_hit
        if req.num_preemptions == 0:
            req.num_cached_tokens = num_hit
        return num_new

    def _chunk(self, remaining: int, budget: int) -> int | None:
        if remaining <= budget:
            return remaining
        return budget if self.config.enable_chunked_prefill else None

    # -- after the model ran ------------------------------------------------------------
    def after_launch(self, out: SchedulerOutput) -> None:
        """The step is on the device: its tokens count as computed, and each sampling
        request holds a PLACEHOLDER for its token, so the next step can be scheduled
        before this one's tokens are known (`update_from_output` fills them in). The full
        blocks a chunk fills go to the prefix cache here, while the device computes (as vLLM
        caches blocks when it allocates them): a request that finds them in a later step reads
        them after this step has written them, since steps run in order on the device. They
        used to be registered once the step was done, on the TTFT's path (a 7,680-token
        prompt's 480 blocks: about a millisecond and a half). A decode's block waits
        for its last token, which is still on the device. The stale entries of blocks evicted
        by this step's allocations are deleted here too."""
        for sched in out.scheduled:
            req = sched.request
            samples = sched.samples  # read before the count moves
            req.num_computed_tokens += sched.num_new_tokens
            if sched.draft_token_ids:  # its tokens, 1 to K + 1 of them, come with the step's end
                continue
            if samples:
                req.all_token_ids.append(PLACEHOLDER)
                req.num_pending += 1
            if sched.num_new_tokens > 1:  # (a decode's block waits: its input may still be on the device)
                self.kv.cache_full_blocks(req)
        self.kv.pool.drop_evicted()  # the prefix-cache entries this step's allocations left stale
        if self.in_flight is not None:
            self.in_flight.update(s.request.request_id for s in out.scheduled)

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int], logprobs: dict, prompt_logprobs: dict | None = None,
        verified: dict[str, list[int]] | None = None,
    ) -> list[EngineCoreOutput]:  # fmt: skip
        """Fill in the sampled tokens, cache newly full blocks, finish what stopped.
        `prompt_logprobs`: request id -> (first prompt position, entries), kept on the request
        until its first token goes out; `verified`: a speculating request's tokens of the step."""
        results = []
        append = results.append
        if self.in_flight is not None:  # the batch is back: its requests may be scheduled again
            self.in_flight.difference_update(s.request.request_id for s in out.scheduled)
        cache_full_blocks, check_stop, sampled_token = self.kv.cache_full_blocks, self._check_stop, sampled.get
        fast = self.fast_paths
        registered, block_size, max_len = self.kv.num_registered_of, self.block_size, self.config.max_model_len
        for sched in out.scheduled:  # (every running request every step: kept lean)
            req = sched.request
            rid = req.request_id
            if req.status.finished:
                continue  # aborted, or stopped by an earlier step while this one ran
            if sched.draft_token_ids:
                append(self._take_verified(sched, verified[rid], logprobs.get(rid)))
                continue
            if prompt_logprobs and rid in prompt_logprobs:
                _keep_prompt_logprobs(req, *prompt_logprobs[rid])
            token = sampled_token(rid)
            if token is None:  # a prefill chunk that did not reach the end
                cache_full_blocks(req)
                continue
            tokens = req.all_token_ids
            index = len(tokens) - req.num_pending  # (num_known_tokens)
            tokens[index] = token
            req.num_pending -= 1
            if not fast:
                cache_full_blocks(req)
                check_stop(req, token)
            else:
                # (`cache_full_blocks`'s first test: its tokens known now, index + 1, fill a block not yet offered)
                if min(req.num_computed_tokens, index + 1) // block_size > registered(rid, 0):
                    cache_full_blocks(req)
                params = req.sampling_params
                if (
                    req.matcher is None
                    and not params.stop_token_ids
                    and (params.ignore_eos or token not in req.eos_token_ids)
                ):  # only its length can end it (`_check_stop`'s last test)
                    if index + 1 - len(req.prompt_token_ids) >= req.max_tokens or index + 1 >= max_len:
                        req.status = RequestStatus.FINISHED_LENGTH
                else:
                    check_stop(req, token)
            status = req.status
            finished = status.finished
            if finished and req.num_pending:  # a later step sampled past the end
                del tokens[index + 1 :]
                req.num_pending = 0
            append(
                EngineCoreOutput(
                    rid,
                    [token],
                    logprobs.get(rid) if logprobs else None,
                    _take_prompt_logprobs(req) if req.prompt_logprobs else None,
                    status.finish_reason if finished else None,
                    req.stop_reason,
                    req.num_cached_tokens,
                    req.first_scheduled_time,
                    req.queued_time,
                )  # (positional: request_id, new_token_ids, new_logprobs, new_prompt_logprobs, finish_reason,
            )  # stop_reason, num_cached_tokens, first_scheduled_time, queued_time)
            if finished:
                if req in self.running:
                    self.running.remove(req)
                else:  # preempted while its token was in flight
                    self.waiting.remove(req)
                self._finish(req)
        return results

    def _take_verified(
        self, sched: ScheduledRequest, tokens: list[int], logprobs: list | None = None
    ) -> EngineCoreOutput:
        """A speculating request's step: `tokens` (the accepted proposals and the target's token
        after them) join it up to a stop; only their positions count as computed."""
        req = sched.request
        accepted = len(tokens) - 1
        self.spec.record(req.request_id, len(sched.draft_token_ids), accepted)
        # the step computed the last token and every proposal: keep the last and the accepted
        req.num_computed_tokens -= len(sched.draft_token_ids) - accepted
        taken = []
        for token in tokens:
            req.all_token_ids.append(token)
            taken.append(token)
            self._check_stop(req, token)
            if req.status.finished:
                break
        self.kv.cache_full_blocks(req)
        output = EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=taken,
            new_logprobs=logprobs[: len(taken)] if logprobs is not None else None,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            num_cached_tokens=req.num_cached_tokens,
            first_scheduled_time=req.first_scheduled_time,
            queued_time=req.queued_time,
        )
        if req.status.finished:
            self.running.remove(req)
            self._finish(req)
        return output

    def _ends_by_length(self, req: Request) -> bool:
        return req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len

    def _check_stop(self, req: Request, token: int) -> None:
        """`token` has just been filled in; later tokens may still be pending."""
        params = req.sampling_params
        num_known = len(req.all_token_ids) - req.num_pending
        num_output = num_known - len(req.prompt_token_ids)
        if req.matcher is not None:
            if not req.matcher.accept_token(token):  # only if sampling bypassed the mask
                req.status = RequestStatus.FINISHED_ABORTED
                return
            if req.matcher.is_terminated():  # the grammar is complete
                req.status = RequestStatus.FINISHED_STOPPED
                return
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                return
            if token in params.stop_token_ids:
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = token
                return
        if num_output >= req.max_tokens or num_known >= self.config.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_blocks_total=pool.num_blocks,
            num_blocks_used=pool.num_used,
            kv_cache_tokens=pool.num_blocks * self.kv.block_size,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_swap_outs=self.num_swap_outs,
            num_swapped_blocks=self.kv.num_swapped_blocks,
            num_computed_tokens_total=self.num_computed_tokens_total,
            **self._spec_stats(),
            **self._host_tier_stats(),
        )

    def _host_tier_stats(self) -> dict:
        host = self.kv.host
        if host is None:
            return {}
        tiers = dict(kv_offload_hit_tokens=self.kv.host_hits, kv_offload_stored_blocks=host.counts.stored,
                     kv_offload_loaded_blocks=host.counts.loaded)  # fmt: skip
        disk = self.kv.disk
        if disk is not None:
            tiers.update(kv_disk_hit_tokens=self.kv.disk_hits, kv_disk_stored_blocks=disk.counts.stored,
                         kv_disk_loaded_blocks=disk.counts.loaded)  # fmt: skip
        return tiers

    def _spec_stats(self) -> dict:
        if self.spec is None:
            return {}
        c = self.spec.counts
        return dict(spec_num_drafts=c.num_drafts, spec_num_draft_tokens=c.num_draft_tokens,
                    spec_num_accepted_tokens=c.num_accepted_tokens,
                    spec_accepted_per_position=tuple(c.accepted_per_position))  # fmt: skip


def _keep_prompt_logprobs(req: Request, first: int, entries: list) -> None:
    """Prompt logprobs of positions `first`.. for `req`; a position it has already had (a chunk
    recomputed after a preemption) is kept once."""
    if req.prompt_logprobs is None:
        return
    have = req.prompt_logprobs_sent + len(req.prompt_logprobs)  # positions 1 .. have
    skip = have + 1 - first
    if 0 <= skip < len(entries):
        req.prompt_logprobs.extend(entries[skip:])


def _take_prompt_logprobs(req: Request) -> list:
    """The prompt logprobs kept for `req`, now sent."""
    taken, req.prompt_logprobs = req.prompt_logprobs, []
    req.prompt_logprobs_sent += len(taken)
    return taken

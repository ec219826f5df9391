"""The engine core: scheduler + model runner. One step = schedule → run → update."""

from __future__ import annotations

import logging
import time

from llmserve.config import ConfigError, EngineConfig
from llmserve.engine.grammar_manager import GrammarManager
from llmserve.engine.kv_cache_manager import KVCacheManager
from llmserve.engine.kv_disk_store import DiskStore
from llmserve.engine.kv_events import KVEventLog, KVEventPublisher
from llmserve.engine.lora_manager import LoRAManager
from llmserve.engine.model_runner import ModelRunner, PendingStep, select_attention_backend
from llmserve.engine.pp_batches import BatchQueue, BatchQueueCounts, StageBusy
from llmserve.engine.pp_stages import RankPlace
from llmserve.engine.request import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Request,
    RequestStatus,
    SchedulerStats,
)
from llmserve.engine.request_checks import PromptError, check_request
from llmserve.engine.scheduler import Scheduler, SchedulerOutput
from llmserve.engine.spec_decode import SpecDecoder
from llmserve.engine.spec_draft import DraftProposer, draft_cache_blocks
from llmserve.engine.step_log import StepTimingLog
from llmserve.engine.step_plan import PlanBuilder
from llmserve.engine.structured_output import StructuredOutputs
from llmserve.engine.tp_workers import TPDriver
from llmserve.lora.errors import LoRAAdapterError
from llmserve.lora_request import LoRARequest

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, progress: bool = True, exit_on_worker_death: bool = False) -> None:
        """`exit_on_worker_death`: in the engine core process, a dead tensor-parallel worker
        ends the process (the front then reports the engine dead) instead of a hang."""
        start = time.perf_counter()
        self.config = config
        self.tp_driver: TPDriver | None = None
        self.grammars: GrammarManager | None = None
        self.loras: LoRAManager | None = None
        self._refused: list[EngineCoreOutput] = []  # their grammar did not compile: reported by the next finish
        try:
            self._start(config, progress, exit_on_worker_death)
        except BaseException:
            self.shutdown()
            raise
        num_blocks = self.kv.pool.num_blocks
        logger.info(
            "engine core ready in %.1f s: %d KV blocks (%d tokens), %d swap blocks",
            time.perf_counter() - start, num_blocks, num_blocks * self.kv.block_size,
            self.runner.num_swap_blocks(),
        )  # fmt: skip

    def _start(self, config: EngineConfig, progress: bool, exit_on_worker_death: bool) -> None:
        phases, mark = {}, time.perf_counter()

        def phase(name: str) -> None:  # the start-up's time by phase, logged when it is ready
            nonlocal mark
            now = time.perf_counter()
            phases[name], mark = now - mark, now

        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:  # worker processes
            self.tp_driver = TPDriver(config, exit_on_worker_death)
            self.runner = ModelRunner(config, progress, self.tp_driver.group, self.tp_driver.send,
                                      self.tp_driver.stage_place)  # fmt: skip
            self.tp_driver.wait_ready()
        else:
            self.runner = ModelRunner(config, progress=progress)
        phase("model")
        self.draft = None  # speculative decoding's draft model or EAGLE head (before the profile: its weights count)
        if config.speculative is not None and config.speculative.method == "draft_model":
            self.draft = DraftProposer(config, self.runner.device, select_attention_backend(config.attention_backend))
            phase("draft model")
        elif config.speculative is not None and config.speculative.eagle is not None:
            from llmserve.engine.spec_eagle import EagleProposer

            # (under tensor or pipeline parallelism the head runs here alone, over whole tables of the vocabulary)
            vocab = self.runner.proposer_vocab(not config.speculative.eagle.eagle3)
            self.draft = EagleProposer(config, self.runner.device, select_attention_backend(config.attention_backend),
                                       vocab)  # fmt: skip
            phase("EAGLE head")
        num_blocks = self.runner.num_blocks_for_memory()
        if self.draft is not None:
            num_blocks, draft_blocks = draft_cache_blocks(config, self.runner.device, num_blocks,
                                                          self.runner.bytes_per_block, self.draft.bytes_per_block)  # fmt: skip
            self.draft.init_cache(draft_blocks)
        phase("memory profile")
        num_cpu_blocks = self.runner.num_swap_blocks()
        bs = config.cache_config.block_size
        max_len = config.model_config.max_model_len
        layout = self.runner.kv_layout
        if layout.simple:
            one_sequence = -(-max_len // bs)
        else:  # a sequence of max_len, its last chunk computed, over every group (+ the null block)
            chunk = (
                config.scheduler_config.max_num_batched_tokens
                if config.scheduler_config.enable_chunked_prefill
                else max_len
            )
            one_sequence = layout.blocks_held(max(0, max_len - chunk), max_len, bs) + int(layout.sliding)
        if num_blocks < one_sequence:
            budget = self.runner.kv_budget  # a GPU's: where its memory went
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks x {bs} = {num_blocks * bs} tokens, "
                f"fewer than one sequence of max_model_len {max_len} needs ({one_sequence} blocks, {layout}): "
                "lower --max-model-len or give the KV cache more memory (--gpu-memory-utilization / "
                "kv_cache_memory_bytes)" + (f"; GPU memory {budget.describe()}" if budget is not None else "")
            )
        if not layout.simple:
            logger.info("KV cache layout: %s", layout)
        self.runner.init_kv_cache(num_blocks, num_cpu_blocks)
        num_host_blocks = config.cache_config.kv_offload_cpu_bytes // self.runner.bytes_per_block
        if num_host_blocks:
            if not config.cache_config.enable_prefix_caching:
                raise ConfigError("--kv-offload-cpu-gb extends the prefix cache: enable prefix caching")
            self.runner.init_host_tier(num_host_blocks)
        kv_scales = self.runner.set_kv_scales()
        if kv_scales.scales:
            logger.info("FP8 KV cache scales, %s", kv_scales.summary())
        phase("KV cache")
        self.runner.warmup()
        phase("kernel warm-up")
        self.runner.capture_cuda_graphs()
        phase("CUDA graphs")
        logger.info("start-up by phase: %s", ", ".join(f"{name} {secs:.1f} s" for name, secs in phases.items()))
        events = None
        if config.kv_events is not None:
            if not layout.simple:
                raise ConfigError(f"KV events take models of one KV group for now; this one has {layout}")
            events = KVEventLog(bs)
            self.kv_events = KVEventPublisher(config.kv_events)
            logger.info("KV events on %s (replay %s)", config.kv_events.endpoint, config.kv_events.replay_endpoint)
        self.kv = KVCacheManager(num_blocks, bs, config.cache_config.enable_prefix_caching, num_cpu_blocks, layout,
                                 num_host_blocks, events, self._open_disk_tier(config))  # fmt: skip
        spec = SpecDecoder(config.speculative, max_len, self.draft) if config.speculative is not None else None
        if config.speculative is not None and config.speculative.eagle is not None:  # (after the warm-up's forwards)
            self.runner.capture_hidden(self.draft.capture, self.draft.take_hidden)
        self.scheduler = Scheduler(config.scheduler_config, self.kv, swap_enabled=self.kv.swap_enabled,
                                   max_loras=config.lora.max_loras if config.lora is not None else None,
                                   spec=spec, batches_in_flight=config.pipeline_batches_in_flight)  # fmt: skip
        self.batch_counts = BatchQueueCounts()  # pipeline parallelism's batches in flight (engine/pp_batches.py)
        self.loras = LoRAManager(config.lora, config.model_config.arch, self.runner.lora) if self.runner.lora else None
        mc = config.model_config
        self.structured = StructuredOutputs(mc.tokenizer, mc.arch.vocab_size)  # compiles on first use
        self.grammars = GrammarManager(self.structured)
        self.plans = PlanBuilder()  # what the runner is told of each step, as data
        self._vocab_size = mc.arch.vocab_size

    kv_events: KVEventPublisher | None = None
    disk_errors = 0  # the disk tier's directory could not be used (so there is no tier)

    def _open_disk_tier(self, config: EngineConfig) -> DiskStore | None:
        """The prefix cache's disk tier (`--kv-offload-disk-path`), below the host tier, a file per
        tensor-parallel rank (engine/kv_tier_ranks.py); None without one, or when its directory
        cannot be used (logged: prefixes are recomputed)."""
        cc = config.cache_config
        if not cc.kv_offload_disk_bytes:
            return None
        max_seq_blocks = -(-config.model_config.max_model_len // cc.block_size)
        store, errors = self.runner.open_disk_store(max_seq_blocks + 1)
        if store is None:
            self.disk_errors = errors
            return None
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        logger.info("KV disk tier: %d blocks of %d bytes in %s (each of %d ranks its own file)", store.num_slots,
                    store.block_bytes, cc.kv_offload_disk_path, ranks)  # fmt: skip
        return store

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, the grammar compile threads, the KV events'
        sockets, and the KV disk tier's writes (finished, for a restart to find)."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        store = self.kv.disk_store if hasattr(self, "kv") else None
        if store is not None:
            if self.kv.disk_reader is not None:
                self.kv.disk_reader.close()
            store.close()
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.tp_driver is not None:
            if hasattr(self, "runner"):
                self.runner.release_cuda_graphs()  # before NCCL's teardown, which waits for them
            self.tp_driver.close()
            self.tp_driver = None

    def add_request(self, req: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request; a request the core cannot take comes back as an error output."""
        mc = self.config.model_config
        try:
            front_checked = req.ids_checked_vocab == mc.arch.vocab_size  # the front's pass over the ids stands
            check_request(
                req.prompt_token_ids, req.sampling_params, mc.max_model_len, mc.arch.vocab_size, front_checked
            )
            if req.request_id in self.scheduler.requests:
                raise PromptError(f"request id {req.request_id!r} is already in use")
            if req.lora_request is not None:
                if self.loras is None:
                    raise PromptError("this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)")
                self.loras.adapter(req.lora_request)  # read and checked once; LoRAAdapterError says why not
        except (PromptError, LoRAAdapterError) as exc:
            return EngineCoreOutput(req.request_id, [], finish_reason="abort", error=str(exc))
        request = Request(req)
        self.scheduler.add_request(request)
        if req.sampling_params.structured_outputs is not None:
            self.grammars.submit(request)  # compiled off the step loop; scheduled once ready
        return None

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled become schedulable; failures are refused. If
        nothing else can run, wait a little for a compile instead of spinning."""
        if not self.grammars.pending:
            return
        idle = all(r.status == RequestStatus.WAITING_FOR_GRAMMAR for r in self.scheduler.requests.values())
        failures = self.grammars.poll(wait_s=0.05 if idle else 0.0)
        for failure in failures:
            self.scheduler.abort_requests([failure.request_id])
            self._refused.append(EngineCoreOutput(failure.request_id, [], finish_reason="abort", error=failure.error))

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        self.grammars.forget(request_ids)
        return self.scheduler.abort_requests(request_ids)

    # -- LoRA adapters -------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> str | None:
        """Read and check an adapter now (a server's load call); None, or why it cannot load."""
        if self.loras is None:
            return "this engine serves no LoRA adapters: start it with enable_lora (--enable-lora)"
        try:
            self.loras.adapter(lora)
        except LoRAAdapterError as exc:
            logger.warning("LoRA adapter %r not loaded: %s", lora.lora_name, exc.detail)  # the client gets str(exc)
            return str(exc)
        return None

    def remove_lora(self, name: str) -> list[str]:
        """Forget the adapters called `name`; those that requests still use stay until evicted
        (no request that was accepted is lost). The keys dropped now."""
        if self.loras is None:
            return []
        in_use = {r.lora_request.key for r in self.scheduler.requests.values() if r.lora_request is not None}
        return self.loras.remove(name, keep=in_use)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._refused)

    def step(self) -> EngineCoreOutputs:
        """One step, synchronously (tests and simple drivers; see `StepPipeline`)."""
        return self.finish(self.launch())

    def launch(self) -> tuple[SchedulerOutput, PendingStep | None]:
        """Schedule and start a step on the device; the host is free until `finish`.
        With `can_overlap()`, this may be called once more before the previous step's
        `finish`: the new step then reads that step's tokens on the device."""
        self._admit_compiled()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            self.plans.forget(sched.finished_request_ids)
            self.runner.forget_requests(sched.finished_request_ids)
            return sched, None
        if self.loras is not None and sched.scheduled:  # the step's adapters in slots, its tokens mapped
            self.loras.prepare_step([s.request.lora_request for s in sched.scheduled],
                                    [s.num_new_tokens for s in sched.scheduled])  # fmt: skip
        pending = self.runner.execute_async(self.plans.plan(sched, self._vocab_size))
        self.scheduler.after_launch(sched)
        # a speculative step's token counts are known only when it ends: nothing overlaps it
        self._speculating = self.config.speculative is not None and any(s.draft_token_ids for s in sched.scheduled)
        return sched, pending

    _speculating = False  # the step launched last has speculative rows

    def can_overlap(self) -> bool:
        """May the next step be launched before the one in flight is finished? Not with
        tensor parallelism (the workers do not see sampled tokens) nor while a running
        request needs its previous token on the host (structured outputs: the grammar's
        mask; penalties with the reference sampler), nor around speculation: after a
        speculative step, or while the batch is small enough to speculate."""
        if not self.config.async_scheduling or self._speculating:
            return False
        spec = self.config.speculative
        if spec is not None and len(self.scheduler.running) <= spec.disable_by_batch_size:
            return False  # the next step may speculate: its requests' last tokens must be on the host
        return all(map(self.runner.sampler.overlap_safe, self.scheduler.running))

    def finish(self, launched: tuple[SchedulerOutput, PendingStep | None]) -> EngineCoreOutputs:
        """Wait for a launched step and apply its tokens (requests aborted meanwhile are skipped)."""
        sched, pending = launched
        refused, self._refused = self._refused, []
        if pending is None:
            return EngineCoreOutputs(refused, self.stats())
        result = pending.result()
        outputs = self.scheduler.update_from_output(sched, result.sampled, result.logprobs, result.prompt_logprobs,
                                                    result.verified)  # fmt: skip
        if self.kv_events is not None:  # the step's cache changes, one batch
            self.kv_events.publish(self.kv.events.take())
        return EngineCoreOutputs(refused + outputs, self.stats())

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.runner.lora is not None:
            stats.lora_slot_loads = self.runner.lora.slot_loads
        if self.kv.host is not None:
            latency = self.runner.host_load_latency
            stats.kv_offload_block_bytes = self.runner.bytes_per_block
            stats.kv_offload_load_seconds = (tuple(latency.counts), latency.total)
        store = self.kv.disk_store
        if store is not None:
            c = store.counts
            stats.kv_disk_errors, stats.kv_disk_corrupt_blocks = c.errors, c.corrupt
            stats.kv_disk_load_seconds = (tuple(c.latency.counts), c.latency.total)
        elif self.disk_errors:  # (the directory could not be used: no disk tier)
            stats.kv_disk_errors = self.disk_errors
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def stage_busy(self, reset: bool = False) -> list[StageBusy]:
        """Pipeline parallelism: each rank's time in its stage's layers over the wall time since
        the last reset (the bubble is the rest); `reset`: count again from now. Only between
        steps (it is a collective of every rank)."""
        if self.config.pipeline_parallel_size == 1:
            raise RuntimeError("stage busy times are kept under pipeline parallelism only")
        if self.scheduler.in_flight:
            raise RuntimeError("stage busy times are read between steps, with no batch in flight")
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        times = self.runner.stage_busy(reset)
        places = [RankPlace(rank, tp, pp) for rank in range(len(times))]
        return [StageBusy(p.stage, p.tp_rank, busy, wall) for p, (busy, wall) in zip(places, times, strict=True)]

    # -- sleep mode ----------------------------------------------------------------------
    sleep_level: int = 0  # 0: awake

    def sleep(self, level: int = 1) -> bool:
        """Free the device memory of an idle engine (level 1: weights to host memory; level
        2: weights dropped); False if it cannot sleep now (requests in flight). At level 1 with
        KV tiers (`--kv-offload-cpu-gb`), the device's cached prefixes move down into them first,
        so a woken engine finds them; otherwise (and at level 2, whose wake reads the weights
        again, perhaps new ones) every tier is reset."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if self.sleep_level:
            return True
        if self.has_unfinished():
            return False
        if level == 1 and self.kv.host is not None:
            self._move_cache_down()
        else:
            self.kv.reset_prefix_cache()  # the cached blocks' contents go with the cache
        self.runner.sleep(level)
        self.sleep_level = level
        logger.info("engine asleep (level %d)", level)
        return True

    def _move_cache_down(self) -> None:
        """Before a level-1 sleep: the device's cached blocks into the host tier (its LRU victims to
        disk), copied by a step of copies alone (every tensor-parallel rank its shard)."""
        moved = self.kv.move_cache_down()
        out = SchedulerOutput()
        out.kv_offload, out.kv_load = self.kv.take_copies()
        if self.kv.disk is not None:
            out.kv_spill, out.kv_disk_load = self.kv.take_disk_copies()
        if not out.is_empty:
            self.runner.execute_async(self.plans.plan(out, self._vocab_size)).result()
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.events.take())
        logger.info("sleep: %d cached KV blocks moved down to the host tier (%d to disk)", moved, len(out.kv_spill))

    def wake_up(self) -> bool:
        if self.sleep_level:
            start = time.perf_counter()
            self.runner.wake_up()
            logger.info("engine awake after level %d sleep in %.2f s", self.sleep_level, time.perf_counter() - start)
            self.sleep_level = 0
        return True

    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def memory_footprint(self) -> dict:
        return {**self.runner.memory_footprint(), "num_blocks": self.kv.num_blocks,
                "num_blocks_used": self.kv.pool.num_used}  # fmt: skip


def step_pipeline(core: EngineCore, step_log: StepTimingLog | None = None) -> StepPipeline | BatchQueue:
    """The step loop's driver: several batches in flight under pipeline parallelism (unless
    `pipeline_batches_in_flight` is 1), else one step, or two with async scheduling."""
    depth = core.config.pipeline_batches_in_flight
    if depth > 1:
        return BatchQueue(core, depth, core.batch_counts, step_log)
    return StepPipeline(core, step_log)


class StepPipeline:
    """Drives an EngineCore with up to two steps on the device: `launch()` starts the
    next step (while one is in flight only if the core allows the overlap), `finish()`
    completes the older one. Host work placed between the two calls runs while the
    device computes."""

    def __init__(self, core: EngineCore, step_log: StepTimingLog | None = None) -> None:
        self.core = core
        self.step_log = step_log
        self.in_flight: tuple[SchedulerOutput, PendingStep | None] | None = None
        self._next: tuple[SchedulerOutput, PendingStep | None] | None = None

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    def launch(self) -> None:
        if self.core.has_unfinished() and (self.in_flight is None or self.core.can_overlap()):
            began = time.time()
            self._next = self.core.launch()
            if self.step_log is not None:
                self.step_log.launched(self._next[0], began, len(self.core.scheduler.waiting))

    def finish(self) -> EngineCoreOutputs | None:
        """The outputs of the step in flight (None if there was none); the step launched
        since becomes the one in flight."""
        done = None
        if self.in_flight is not None:
            done = self.core.finish(self.in_flight)
            if self.step_log is not None:
                self.step_log.finished()
        self.in_flight, self._next = self._next, None
        return done

"""A request as the engine core sees it, and the messages that cross the IPC boundary."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llmserve.lora_request import LoRARequest
from llmserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status after SWAPPED is a finished one."""

    WAITING = enum.auto()
    WAITING_FOR_GRAMMAR = enum.auto()  # in the waiting queue, passed over until its grammar compiles
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # back in the waiting queue, KV recomputed on resume
    SWAPPED = enum.auto()  # back in the waiting queue, KV held in CPU swap blocks
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS  # a set lookup: this runs for every request every step

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True)
class EngineCoreRequest:
    """Sent once from the front to the core: everything the core needs to run a request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never past max_model_len
    eos_token_ids: tuple[int, ...]
    priority: int = 0  # lower runs first, as in vLLM and Triton
    arrival_time: float = field(default_factory=time.time)
    share_group: str | None = None  # siblings of an n > 1 request share prompt blocks
    received_time: float | None = None  # wall clock: the core process read it (its input thread sets it)
    lora_request: LoRARequest | None = None  # the adapter this request runs with (None: the base model)
    # the vocabulary size the front checked prompt_token_ids against (None: not checked); the
    # core checks again only when it differs from its own (0.4 ms at 7,680 tokens, before the
    # first step of a request)
    ids_checked_vocab: int | None = None


@dataclass(slots=True)
class TokenLogprobs:
    token_logprob: float
    token_rank: int
    top: list[tuple[int, float]]  # (token id, logprob) best first


@dataclass(slots=True)
class EngineCoreOutput:
    """Sent from the core to the front after each step for each request that moved."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # the prompt's logprobs (positions 1.. in order, sent once, with the first token) when asked
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # wall clock, for queue-time metrics
    queued_time: float | None = None  # wall clock: when the core process read the request
    error: str | None = None


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks_total: int = 0
    num_blocks_used: int = 0
    kv_cache_tokens: int = 0  # blocks x block size: what the cache holds (FP8: twice bf16's)
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_preemptions: int = 0  # cumulative
    num_swap_outs: int = 0  # cumulative: preemptions that kept their KV in swap blocks
    num_swapped_blocks: int = 0
    num_computed_tokens_total: int = 0  # cumulative: tokens run through the model
    lora_slot_loads: int = 0  # cumulative: LoRA adapters written into a device slot (first loads and swaps)
    # speculative decoding, cumulative (vLLM's spec_decode counters): verification rows, tokens
    # proposed, proposals accepted, and accepted at each proposal position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # the prefix cache's host tier, cumulative: prompt tokens found there, blocks written and read back
    kv_offload_hit_tokens: int = 0
    kv_offload_stored_blocks: int = 0
    kv_offload_loaded_blocks: int = 0
    # the disk tier below it (engine/kv_disk_tier.py), cumulative: prompt tokens found there, blocks
    # written and read back; I/O errors (a full disk, an unwritable directory) and torn or corrupt
    # blocks, each a miss (recomputed)
    kv_disk_hit_tokens: int = 0
    kv_disk_stored_blocks: int = 0
    kv_disk_loaded_blocks: int = 0
    kv_disk_errors: int = 0
    kv_disk_corrupt_blocks: int = 0
    kv_offload_block_bytes: int = 0  # one block's bytes in the tiers: bytes moved = blocks x this
    # each tier's block loads, seconds: (the count in each of kv_disk_store.LOAD_BUCKETS and +Inf, the sum)
    kv_offload_load_seconds: tuple = ()
    kv_disk_load_seconds: tuple = ()


@dataclass(slots=True)
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float = field(default_factory=time.time)


PLACEHOLDER = -1  # a token id sampled on the device, not yet known on the host


class Request:
    """Mutable core-side state of one sequence."""

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "max_tokens", "eos_token_ids",
        "priority", "arrival_time", "share_group", "all_token_ids", "num_computed_tokens",
        "num_cached_tokens", "status", "stop_reason", "num_preemptions", "block_hashes", "event_hashes",
        "first_scheduled_time", "queued_time", "num_pending", "matcher", "logit_bias", "lora_request",
        "prompt_logprobs", "prompt_logprobs_sent",
    )  # fmt: skip

    def __init__(self, req: EngineCoreRequest) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = req.prompt_token_ids
        self.sampling_params = req.sampling_params
        self.max_tokens = req.max_tokens
        self.eos_token_ids = req.eos_token_ids
        self.priority = req.priority
        self.arrival_time = req.arrival_time
        self.share_group = req.share_group
        self.lora_request = req.lora_request
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # chained hash of each full block, filled lazily
        self.event_hashes: list[int] = []  # with KV events: each full block's announced hash (engine/kv_events.py)
        self.first_scheduled_time: float | None = None
        self.queued_time = req.received_time or time.time()  # in the core (the front stamped arrival_time)
        # tokens sampled by launched steps but not yet read back: the last `num_pending`
        # entries of all_token_ids are PLACEHOLDER until the step's result arrives
        self.num_pending = 0
        self.matcher = None  # structured outputs: the grammar matcher following this output
        self.logit_bias = None  # (token ids, biases) as device tensors, built on first use
        # prompt logprobs computed and not yet sent (None: not asked), and how many were sent
        self.prompt_logprobs: list[TokenLogprobs] | None = (
            [] if req.sampling_params.prompt_logprobs is not None else None
        )
        self.prompt_logprobs_sent = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def has_grammar(self) -> bool:
        return self.matcher is not None

    @property
    def num_known_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

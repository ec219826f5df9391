"""Runs the model on one scheduled batch: flatten inputs, forward, sample.

Owns the device-side state: the model, the paged KV cache (one tensor per layer), the
CPU swap cache, and the sampler (with its device-side penalty counts).

Under tensor parallelism one ModelRunner runs per rank, each holding its shard of the
weights and of the KV heads. The driver's (rank 0) builds the batch and samples; every
method marked `on_every_rank` is first sent to the workers (`mirror`), so all ranks run
it in lockstep.
"""

from __future__ import annotations

import functools
import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from llmserve.config import ConfigError, EngineConfig, kv_torch_dtype
from llmserve.engine import seeded_noise
from llmserve.engine.argmax import row_argmax
from llmserve.engine.cuda_graphs import DecodeGraphs, PiecewiseGraphs, capture_sizes
from llmserve.engine.input_builder import BatchInputs, InputBuilder, RowInput, table_width
from llmserve.engine.kv_disk_store import DiskStore, LoadLatency, SlotMeta
from llmserve.engine.kv_sizing import KVBudget, bytes_per_block, cpu_num_blocks, kv_budget, kv_layout
from llmserve.engine.kv_tier_ranks import RankTierCounts, gather_counts, open_rank_store, read_on_every_rank
from llmserve.engine.logits_rows import is_range, step_logits, warm_counts
from llmserve.engine.lora_runner import RunnerLoRA
from llmserve.engine.pp_batches import DeferredStep
from llmserve.engine.pp_stages import SINGLE_STAGE, StageCapture, StagePlace, run_stage, stage_slots
from llmserve.engine.prompt_logprobs import PendingPromptLogprobs, PromptRows, compute_prompt_logprobs, prompt_rows
from llmserve.engine.request import TokenLogprobs
from llmserve.engine.runner_sleep import RunnerSleep
from llmserve.engine.sampler import PendingSample, Sampler
from llmserve.engine.sampler_reference import ReferenceSampler, apply_top_k_top_p_min_p, token_logprobs
from llmserve.engine.spec_decode import kept_tokens, rejection_sample, verify_greedy
from llmserve.engine.step_plan import RunnerRequest, RunnerRequests, StepPlan
from llmserve.engine.warmup_pool import WarmupPool
from llmserve.host_copy import staged, to_device
from llmserve.kernels import tuning
from llmserve.lora.adapter import LoRAAdapter
from llmserve.model.attention import FP8_KV, AttentionBackend, reference_paged_attention
from llmserve.model.interface import HiddenCapture
from llmserve.model.kv_scales import KVScales, calibration_length, choose_scales
from llmserve.model.layers import REFERENCE_OPS, triton_ops
from llmserve.model.loader import load_model
from llmserve.model.tensor_parallel import SINGLE, TPGroup, local_arch, rank_device
from llmserve.model.whole_vocab import WholeVocab, gather_embedding, gather_logits_weight
from llmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _sample_once(sampler, logits: torch.Tensor, requests: list[RunnerRequest]) -> None:
    try:
        sampler.sample_async(logits, requests).result()
    finally:  # a failed path still leaves no penalty slot or plan behind
        sampler.forget([request.request_id for request in requests])


def warm_sampling_batches() -> tuple[tuple[SamplingParams, ...], ...]:
    """The batches the warm-up samples once each: every path of the sampler (the random race,
    top-k/top-p, top-p alone, seeds, penalties, logprobs: the kernel's two widths, every row asking
    and some), alone and beside another kind of row. The sampling kernels specialize on whether a
    launch has a row list, temperatures and seeds, so the filtered race gets each of its eight
    variants and the race its four (a variant first met inside a timed run compiles there)."""
    greedy = SamplingParams(temperature=0.0)
    filtered = [SamplingParams(temperature=t, top_p=0.95, seed=seed) for t in (0.8, 1.0) for seed in (None, 1)]
    return ((SamplingParams(temperature=1.0),), (SamplingParams(temperature=0.8),),
            (greedy, SamplingParams(temperature=1.0)), (greedy, SamplingParams(temperature=0.8)),
            (SamplingParams(temperature=0.8, top_p=0.95, top_k=50),),
            *((params,) for params in filtered), *((greedy, params) for params in filtered),
            (SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5),),
            (SamplingParams(temperature=0.0, repetition_penalty=1.1),),
            (SamplingParams(temperature=0.0, repetition_penalty=1.1), SamplingParams(temperature=0.0, presence_penalty=0.5)),
            (SamplingParams(temperature=0.0, logprobs=5),), (greedy, SamplingParams(temperature=0.0, logprobs=0)))  # fmt: skip


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, list[TokenLogprobs]]
    # request id -> (first prompt position, its entries): prompt logprobs (engine/prompt_logprobs.py)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None
    verified: dict[str, list[int]] | None = None  # speculating request id -> the step's kept tokens


@dataclass(slots=True)
class Verification:
    """A step's speculating rows: each request's runner state and proposals, and the target's
    greedy token at every one of their positions (on the device, in row order)."""

    speculating: list[tuple[RunnerRequest, tuple[int, ...]]]
    targets: torch.Tensor | None  # the greedy requests' rows, in order
    drawn: dict[str, tuple[torch.Tensor, ...]]  # a sampled request's `rejection_sample` result
    raw: dict[str, torch.Tensor]  # a request asking logprobs: the log-softmax of its K + 1 rows
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)  # of the kept tokens, with `result`

    def result(self) -> dict[str, list[int]]:
        """Each request's kept tokens (engine/spec_decode.py), also appended to its runner state;
        the logprobs of those that ask go to `logprobs`."""
        targets = self.targets.tolist() if self.targets is not None else []
        kept, i = {}, 0
        for state, drafts in self.speculating:
            draw = self.drawn.get(state.request_id)
            if draw is None:
                tokens = verify_greedy(list(drafts), targets[i : i + len(drafts) + 1])
                i += len(drafts) + 1
            else:
                accepted, replacements, bonus = (t.tolist() for t in draw)
                tokens = kept_tokens(list(drafts), accepted, replacements, bonus[0])
            state.token_ids.extend(tokens)
            kept[state.request_id] = tokens
            raw = self.raw.get(state.request_id)
            if raw is not None:
                k = state.sampling_params.logprobs
                self.logprobs[state.request_id] = [token_logprobs(raw[j], t, k) for j, t in enumerate(tokens)]
        return kept


def _draw(logits: torch.Tensor, drafts: tuple[int, ...], state: RunnerRequest,
          draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`rejection_sample` for a sampled request's K + 1 logits rows: its temperature, top-k, top-p
    and min-p, and its noise (from its seed and output positions, as the sampler's, if it has one);
    `draft_probs` [K, V]: the draft model's distributions of the proposals (None: n-gram's)."""
    p = state.sampling_params
    rows = logits.float() / p.temperature
    n = rows.shape[0]
    filtered = apply_top_k_top_p_min_p(rows, [p.top_k] * n, [p.top_p] * n, [p.min_p] * n)
    vocab = rows.shape[1]
    if p.seed is None:
        noise = torch.empty_like(filtered).exponential_()
        uniform = torch.rand(n - 1, device=rows.device)
    else:  # a column past the vocabulary gives each position's acceptance draw
        first = state.num_output_tokens
        keys = torch.tensor([seeded_noise.row_key(p.seed, first + j) for j in range(n)], device=rows.device)
        all_noise = seeded_noise.exponential(keys, torch.arange(vocab + 1, device=rows.device))
        noise, uniform = all_noise[:, :vocab], torch.exp(-all_noise[: n - 1, vocab])
    drafts_t = torch.tensor(drafts, dtype=torch.long, device=rows.device)
    return rejection_sample(filtered, drafts_t, uniform, noise, draft_probs)


class PendingStep:
    """A launched step: its sampled tokens arrive with `result()`. Until then the next
    step can read them on the device (`device_tokens`, row i = `sampling[i]`)."""

    def __init__(self, sampling: list, pending: PendingSample | None,
                 on_result: Callable[[list, list[int]], None] | None = None,
                 prompt: PendingPromptLogprobs | None = None, verify: Verification | None = None) -> None:  # fmt: skip
        self.sampling = sampling
        self.pending = pending
        self.prompt = prompt  # the step's prompt logprobs, if a request asked
        self.verify = verify  # speculating rows (engine/spec_decode.py)
        self.on_result = on_result  # the runner's own token state takes the sampled tokens
        self.device_tokens = pending.device_tokens if pending is not None else None
        self.row_of = {r.request_id: i for i, r in enumerate(sampling)}

    def result(self) -> ModelRunnerOutput:
        prompt = self.prompt.result() if self.prompt is not None else None
        verified = None
        spec_logprobs = {}
        if self.verify is not None:
            verified = self.verify.result()
            spec_logprobs, self.verify = self.verify.logprobs, None  # (once)
        if self.pending is None:
            return ModelRunnerOutput({}, spec_logprobs, prompt, verified)
        with torch.inference_mode():
            out = self.pending.result()
        ids = [r.request_id for r in self.sampling]
        sampled = dict(zip(ids, out.token_ids))
        logprobs = {}
        if self.pending.logprobs is not None:  # (else every row's is None)
            logprobs = {rid: [lp] for rid, lp in zip(ids, out.logprobs) if lp is not None}
        logprobs.update(spec_logprobs)
        if self.on_result is not None:
            self.on_result(self.sampling, out.token_ids)
            self.on_result = None  # once
        return ModelRunnerOutput(sampled, logprobs, prompt, verified)


@dataclass(slots=True)
class StepInputs:
    """What every rank needs to run one step (sent to the workers as is)."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    batch: BatchInputs | None
    lora_slots: list[int] | None = None  # with LoRA: each token's adapter slot (the driver's choice)
    prompt_rows: PromptRows | None = None  # rows whose logits give prompt logprobs (a request asked)
    kv_offload: list[tuple[int, int]] = field(default_factory=list)  # host tier: (device, host), first
    kv_load: list[tuple[int, int]] = field(default_factory=list)  # then (host, device)
    # the disk tier (engine/kv_disk_tier.py): (on host, block, slot, header) spills before the offloads,
    # (stage id, device block) loads of blocks read back, last
    kv_spill: list[tuple] = field(default_factory=list)
    kv_disk_load: list[tuple[int, int]] = field(default_factory=list)
    seq: int = 0  # pipeline parallelism: the batch's number, the tag of its hand-overs between stages


def on_every_rank(method: Callable) -> Callable:
    """A ModelRunner method that every tensor-parallel rank runs in lockstep: on the
    driver, the call (name and arguments) goes to the workers first."""

    @functools.wraps(method)
    def call(self: ModelRunner, *args):
        if self.mirror is None or self._mirroring:  # a worker, or a call made inside a mirrored one
            return method(self, *args)
        self.mirror(method.__name__, args)
        self._mirroring = True
        try:
            return method(self, *args)
        finally:
            self._mirroring = False

    return call


def select_attention_backend(name: str) -> AttentionBackend:
    if name == "triton":
        from llmserve.kernels import triton_paged_attention

        return triton_paged_attention
    return reference_paged_attention


class ModelRunner:
    def __init__(
        self, config: EngineConfig, progress: bool = True, tp: TPGroup = SINGLE,
        mirror: Callable[[str, tuple], None] | None = None, stage: StagePlace = SINGLE_STAGE,
    ) -> None:  # fmt: skip
        """`tp`: this rank's group; `mirror` (driver only): sends a call to the workers; `stage`:
        this rank's pipeline stage (engine/pp_stages.py; the driver runs the last one)."""
        self.config = config
        self.tp = tp
        self.stage = stage
        self.mirror = mirror
        self._mirroring = False  # inside a mirrored call (whose inner calls the workers make themselves)
        mc = config.model_config
        self.device = rank_device(config.device, stage.device_rank)  # (global rank == tp.rank without stages)
        self._gpu_used_at_start = self._check_free_gpu_memory() if self.device.type == "cuda" else 0
        self.dtype = mc.dtype
        self.kv_dtype = kv_torch_dtype(config.cache_config.kv_cache_dtype, mc.dtype)
        self.block_size = config.cache_config.block_size
        self.arch = local_arch(mc.arch, tp.world_size)  # this rank's heads
        # the kernels' settings for this card (kernels/tuning.py), before any is compiled or run
        self.card_settings = tuning.apply(self.device)
        if tp.rank == 0:
            logger.info("kernel settings for %s", self.card_settings.summary())
        self.kv_layout = kv_layout(self.arch)  # how the layers share the cache: one block table per group
        self.kv_slots = stage_slots(self.kv_layout.layer_slot, stage.stage)  # the cache tensors this rank holds
        self.model = load_model(
            mc.model, mc.arch, mc.dtype, str(self.device), select_attention_backend(config.attention_backend),
            load_format=mc.load_format, seed=mc.seed, progress=progress and tp.rank == 0,
            max_positions=mc.max_model_len, tp=tp, quantization=mc.quantization, quantization_ignore=mc.quantization_ignore,
            stage=stage.stage, int8_embedding=mc.int8_embedding,
            ops=triton_ops(mc.fp8_fast_accum_tokens) if config.attention_backend == "triton" else REFERENCE_OPS,
        )  # fmt: skip
        self.kv_scales = KVScales("none (the cache is not FP8)", ())  # set_kv_scales: an FP8 cache's
        self.lora: RunnerLoRA | None = None  # --enable-lora: adapter slots around the projections
        if config.lora is not None:
            # with CUDA graphs the LoRA ops are always in the step (captured once, for any mix of adapters)
            self.lora = RunnerLoRA(config.lora, self.model, config.scheduler_config.max_num_batched_tokens,
                                   self.dtype, self.device, use_kernels=config.attention_backend == "triton",
                                   always_apply=not config.enforce_eager, write_slot=self.write_lora_slot)  # fmt: skip
        self.sampler = (Sampler(self.device, use_kernels=config.attention_backend == "triton")
                        if config.sampler == "batched" else ReferenceSampler(self.device))  # fmt: skip
        self.kv_caches: list[torch.Tensor] = []
        self.kv_budget: KVBudget | None = None  # a GPU's memory by parts (the profile run): named by no-fit errors
        self.cpu_caches: list[torch.Tensor] = []
        self.host_tier_caches: list[torch.Tensor] = []  # the prefix cache's host tier (engine/kv_host_tier.py)
        self.disk_store: DiskStore | None = None  # the disk tier's file, below it (engine/kv_disk_store.py)
        self.host_load_latency = LoadLatency()  # the host tier's loads, a block's share of a step's copy
        self.tier_counts = RankTierCounts(tp.rank)  # this rank's own copies between the tiers
        sc = config.scheduler_config
        # block table columns: enough for max_model_len, in the kernel-friendly width (`table_width`)
        self.max_blocks = table_width(-(-mc.max_model_len // self.block_size))
        # later chunks of up to twice a step's tokens in all may go to SDPA over the whole sequence
        # (`paged_attention.sdpa_after_prefix`): its transient q/k/v/output (about 20 KiB a token on
        # the 8B shape) stay below the profile run's MLP transients (86 KiB a step's token)
        self.sdpa_chunk_limit = min(mc.max_model_len, 2 * sc.max_num_batched_tokens)
        self.inputs = InputBuilder(self.block_size, sc.max_num_seqs, self.max_blocks, self.sdpa_chunk_limit,
                                   self.kv_layout.num_groups)  # fmt: skip
        self.graphs: DecodeGraphs | None = None
        self.mixed_graphs: PiecewiseGraphs | None = None
        self._last_step: PendingStep | None = None  # the latest launched step (driver)
        self._batch_seq = 0  # pipeline parallelism: the number of the batch launched last (driver)
        self.requests = RunnerRequests()  # each running request's tokens and blocks (driver)
        self.sleep_mode = RunnerSleep(self)  # sleep and wake (engine/runner_sleep.py)
        # an EAGLE head's: the hidden states the model keeps, and who takes them with each step's rows
        self.hidden_sink: tuple[HiddenCapture, Callable[[list[RowInput], list[torch.Tensor]], None]] | None = None
        self.every_row = False  # the last layer runs on every row (`share_capture`, the same on every rank)
        self.stage_capture: StageCapture | None = None  # pipeline parallelism: the head's states between stages
        if config.enable_sleep_mode:  # weights in an arena of fixed addresses: a wake keeps the graphs
            self.sleep_mode.move_weights_to_arena()

    # -- KV cache sizing ----------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.arch, self.block_size, self.kv_dtype)

    def num_blocks_for_memory(self) -> int:
        """Device blocks: the override, else a byte budget (CPU) or what the GPU has left."""
        cc = self.config.cache_config
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self.profile_kv_budget()
        else:
            sc = self.config.scheduler_config
            return cpu_num_blocks(self.bytes_per_block, self.block_size, sc.max_model_len, sc.max_num_seqs,
                                  self.kv_layout)  # fmt: skip
        return max(0, budget // self.bytes_per_block)

    def num_swap_blocks(self) -> int:
        return self.config.cache_config.swap_space_bytes // self.bytes_per_block

    def _check_free_gpu_memory(self) -> int:
        """Memory the GPU holds before this engine starts (other processes); refuses a
        `gpu_memory_utilization` that would need more than is free."""
        free, total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device)  # this process's, reusable (an earlier engine's)
        cc = self.config.cache_config
        sized = cc.kv_cache_memory_bytes is not None or cc.num_gpu_blocks_override is not None
        wanted = total * cc.gpu_memory_utilization
        if wanted > free + cached and not sized:  # a KV cache of a set size shares the GPU with others
            raise ConfigError(
                f"gpu_memory_utilization {self.config.cache_config.gpu_memory_utilization} asks for "
                f"{wanted / 2**30:.1f} GiB of {self.device}, but only {(free + cached) / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB are free (other processes hold the rest): lower it"
            )
        return total - free - cached

    @on_every_rank
    def profile_kv_budget(self) -> int:
        """Run the largest batch once; what is left under the utilization goes to KV
        (the smallest budget of all ranks, so that every rank holds the same blocks)."""
        sc = self.config.scheduler_config
        num_tokens = sc.max_num_batched_tokens
        num_seqs = min(sc.max_num_seqs, num_tokens)
        groups = self.kv_layout.num_groups
        blocks_needed = num_seqs * (-(-sc.max_model_len // self.block_size)) * groups + 1
        blocks = min(blocks_needed, (-(-num_tokens // self.block_size) + num_seqs) * groups)
        self.init_kv_cache(blocks, 0, False)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        seq_len = min(-(-num_tokens // num_seqs), sc.max_model_len)
        self._dummy_forward(num_seqs, seq_len)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        kv_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        self.kv_caches = []
        free, total = torch.cuda.mem_get_info(self.device)
        # this process's memory outside torch's allocator (CUDA context, NCCL buffers);
        # what other processes held at start does not count: the fraction is this engine's
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device) - self._gpu_used_at_start
        # (weights in an arena are outside torch's allocator: counted in `non_torch` instead)
        weights = (
            0
            if self.sleep_mode.weights_arena is not None
            else sum(p.numel() * p.element_size() for p in self.model.parameters())
        )
        parts = kv_budget(self.config, total, peak, kv_bytes, weights, non_torch, self.arch.vocab_size)
        self.kv_budget = parts
        logger.info("GPU memory %s", parts.describe())
        budget = parts.kv_bytes
        if self.stage.link is not None:  # every stage holds the same blocks: the fewest any rank has room for
            stage_bytes = self.bytes_per_block * len(self.kv_slots) // self.kv_layout.layers_per_group
            return self.stage.link.min_over_world(budget // stage_bytes) * self.bytes_per_block
        return self.tp.min_over_ranks(budget)

    def _dummy_forward(self, num_seqs: int, seq_len: int, token_ids: list[int] | None = None) -> None:
        bs = self.block_size
        blocks_per_seq = -(-seq_len // bs) * self.kv_layout.num_groups  # (interleaved: engine/kv_layout.py)
        num_blocks = self.kv_caches[0].shape[1]
        rows = [
            RowInput(f"profile-{i}", [(i * blocks_per_seq + j) % num_blocks for j in range(blocks_per_seq)],
                     0, seq_len, token_ids or [0] * seq_len, True)
            for i in range(num_seqs)
        ]  # fmt: skip
        batch = self.inputs.build(rows)
        self.inputs.forget_all()  # forget the profile rows
        with torch.inference_mode():
            input_ids, positions, meta = batch.to_device(self.device)
            hidden = self._run_model(input_ids, positions, meta)
            if hidden is not None:  # (the last pipeline stage's)
                self.model.compute_logits(hidden[to_device(batch.logits_indices, torch.long, self.device)])

    @on_every_rank
    def init_kv_cache(self, num_blocks: int, num_cpu_blocks: int, arena: bool = True) -> None:
        """The KV cache: one tensor per cache slot of the KV layout (per layer with one group: the
        groups' layers share them); with sleep mode (`arena`), views of one arena."""
        a = self.arch
        shape = (2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        slots = len(self.kv_slots)
        if arena and self.config.enable_sleep_mode and num_blocks:
            self.kv_caches = self.sleep_mode.arena_kv_caches(num_blocks, shape, self.kv_dtype)
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(slots)]
        self._bind_kv_caches()
        self.init_cpu_caches(num_cpu_blocks)

    def _bind_kv_caches(self) -> None:
        """Each attention layer's cache tensor and KV group (its block table)."""
        layout = self.kv_layout
        tensor_of = {slot: k for k, slot in enumerate(self.kv_slots)}  # (a pipeline stage holds its layers' slots)
        layers = self.stage.stage.layers(len(layout.layer_slot))
        for i, layer in zip(layers, self.model.attention_layers(), strict=True):
            layer.kv_cache = self.kv_caches[tensor_of[layout.layer_slot[i]]] if self.kv_caches else torch.empty(0)
            layer.kv_group = layout.layer_group[i]

    @on_every_rank
    def set_kv_scales(self) -> KVScales:
        """An FP8 cache's per-layer key and value scales, before warm-up and graph capture (the
        graphs keep them): calibrated on one prompt of random tokens (`--calculate-kv-scales`,
        the default unless the checkpoint gives them), else the checkpoint's, else 1."""
        if self.kv_dtype != FP8_KV:
            self.kv_scales = KVScales("none (the cache is not FP8)", ())
            return self.kv_scales
        sc = self.config.scheduler_config
        n = calibration_length(
            sc.max_num_batched_tokens, sc.max_model_len, self.kv_caches[0].shape[1] * self.block_size
        )
        self.kv_scales = choose_scales(self.model, self.config.cache_config.calculate_kv_scales,
                                       lambda ids: self._dummy_forward(1, len(ids), ids),
                                       self.config.model_config.arch.vocab_size, n)  # fmt: skip
        return self.kv_scales

    def init_cpu_caches(self, num_cpu_blocks: int) -> None:
        """Host memory for swapped-out blocks (pinned on a GPU), one tensor per layer."""
        a = self.arch
        cpu_shape = (2, num_cpu_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        pin = self.device.type == "cuda"
        self.cpu_caches = [
            torch.zeros(cpu_shape, dtype=self.kv_dtype, pin_memory=pin) for _ in range(len(self.kv_slots))
        ] if num_cpu_blocks else []  # fmt: skip

    def cache_sizes(self) -> tuple[int, int]:
        """(device blocks, host swap blocks) of the caches now: what a wake makes again."""
        return (self.kv_caches[0].shape[1] if self.kv_caches else 0,
                self.cpu_caches[0].shape[1] if self.cpu_caches else 0)  # fmt: skip

    @on_every_rank
    def warmup(self) -> None:
        """Compile the Triton attention variants, the LM head's and the sampler's kernels before
        serving (no JIT stall mid-traffic). The independent launches (attention variants, SDPA
        plans, the fresh-prompt tiles, the sampling batches) run on a few threads
        (engine/warmup_pool.py), so their compiles overlap; the model's own forwards stay on this one."""
        if self.config.attention_backend != "triton" or self.device.type != "cuda":
            return
        from llmserve.kernels.fresh_prefill import warmup_fresh_prefill
        from llmserve.kernels.paged_attention import warmup_paged_attention, warmup_sdpa_prefill

        a = self.arch
        sc = self.config.scheduler_config
        start = time.perf_counter()
        try:
            with WarmupPool(self.device) as pool:
                n = warmup_paged_attention(a.num_heads, self.kv_caches[0], a.head_dim**-0.5, sc.max_num_seqs,
                                           self.dtype, pool.submit)  # fmt: skip
                # SDPA's plans for the padded lengths of a fresh prompt's chunk and of a later chunk's
                # whole sequence, one per shape (the limit is at least the longest fresh chunk)
                plans = pool.submit(functools.partial(warmup_sdpa_prefill, a.num_heads, a.num_kv_heads, a.head_dim,
                                                      self.dtype, self.device, self.sdpa_chunk_limit))  # fmt: skip
                # the fresh prompts' own kernel, each tile shape
                n += warmup_fresh_prefill(a.num_heads, a.num_kv_heads, a.head_dim, self.dtype, self.device, pool.submit)
                # sliding layers: the kernels' SLIDING variants too (one compile serves every window size)
                window = next((w for w in map(a.layer_window, range(a.num_layers)) if w is not None), None)
                if window is not None:
                    n += warmup_paged_attention(a.num_heads, self.kv_caches[0], a.head_dim**-0.5, sc.max_num_seqs,
                                                self.dtype, pool.submit, window=window)  # fmt: skip
                    n += warmup_fresh_prefill(a.num_heads, a.num_kv_heads, a.head_dim, self.dtype, self.device,
                                              pool.submit, window=window)  # fmt: skip
                heads = self._warm_lm_head(pool)
            pooled_s = time.perf_counter() - start
            # the elementwise kernels specialize on token counts (1, multiples of 16, others):
            # a few small eager forwards compile those variants too
            for num_seqs, seq_len in ((1, 1), (1, 7), (1, 16), (3, 37)):
                self._dummy_forward(num_seqs, seq_len)
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001 - a missed warm-up only costs a later compile
            logger.exception("kernel warm-up failed; kernels will compile on first use")
            return
        logger.info("compiled %d paged-attention launch variants and the elementwise kernels; %d SDPA plans; LM head "
                    "at %d row counts; the sampler's paths. %.1f s on %d threads (%.1f s of work), then the small "
                    "forwards %.1f s", n, plans.result(), heads, pooled_s, pool.workers, pool.busy_s,
                    time.perf_counter() - start - pooled_s)  # fmt: skip

    def _warm_lm_head(self, pool: WarmupPool | None = None) -> int:
        """The LM head at every row count a step can take (engine/logits_rows.py), and greedy
        sampling's argmax on few rows and on many: a kernel's first launch in the process
        loads its module and blocks the host until the device is idle (hundreds of ms of a run's
        first steps otherwise; docs/history/benchmarks.md). Then each sampling path
        (`_warm_sampling`, on `pool`'s threads if given). Returns the number of row counts."""
        counts = warm_counts(self.config.scheduler_config.max_num_seqs)
        with torch.inference_mode():
            hidden = torch.zeros(counts[-1], self.arch.hidden_size, dtype=self.dtype, device=self.device)
            for count in counts:
                logits = self.model.compute_logits(hidden[:count])
            row_argmax(logits[:1])  # two stages
            row_argmax(logits)  # one (at more than TWO_STAGE_MAX_ROWS rows)
            self._warm_sampling(logits[:2], pool)
        return len(counts)

    def _warm_sampling(self, logits: torch.Tensor, pool: WarmupPool | None = None) -> None:
        """The sampler once on each batch of `warm_sampling_batches`, on rows of `logits` (so no
        first sampling run compiles while serving); every trace of
        the dummy requests is then forgotten. On a pool's threads each batch has a sampler of its
        own (a sampler keeps a batch's plan); the compiled kernels are the process's."""
        threads = pool is not None and pool.workers > 1 and type(self.sampler) is Sampler
        for i, batch in enumerate(b for b in warm_sampling_batches() if len(b) <= len(logits)):
            requests = [RunnerRequest(f"warmup-{i}-{j}", [0], params, (), [0, 0], []) for j, params in enumerate(batch)]
            sampler = (
                Sampler(self.device, self.sampler.vocab_size, self.sampler.use_kernels) if threads else self.sampler
            )
            unit = functools.partial(_sample_once, sampler, logits[: len(requests)], requests)
            if threads:
                pool.submit(unit)
            else:
                unit()

    @on_every_rank
    def capture_cuda_graphs(self) -> None:
        if self.config.enforce_eager:
            return
        sc = self.config.scheduler_config
        sizes = capture_sizes(sc.max_num_seqs)
        try:  # buffers and capture: a failure (memory, a collective) falls back to eager steps
            self.graphs = DecodeGraphs(
                self.model,
                sizes[-1],
                self.max_blocks,
                self.config.model_config.max_model_len,
                self.device,
                self.kv_layout.num_groups,
            )
            self.graphs.capture(sizes)
            captured = 1
        except Exception:  # noqa: BLE001 - e.g. a collective that cannot be captured
            logger.exception("CUDA graph capture failed; decode steps run eagerly")
            captured = 0
        if not self.tp.min_over_ranks(captured):  # every rank takes the same path
            self.graphs = None
        mixed_tokens = self.config.max_mixed_graph_tokens
        if self.graphs is None or mixed_tokens <= 0:
            return
        try:
            self.mixed_graphs = PiecewiseGraphs(self.model, mixed_tokens, self.device)
            self.mixed_graphs.capture()
            captured = 1
        except Exception:  # noqa: BLE001 - as above
            logger.exception("piecewise CUDA graph capture failed; mixed steps run eagerly")
            captured = 0
        if not self.tp.min_over_ranks(captured):
            self.mixed_graphs = None

    # -- sleep mode (engine/runner_sleep.py) ----------------------------------------------------
    @on_every_rank
    def sleep(self, level: int) -> None:
        """Give the device memory back (level 1: weights to host memory; 2: dropped)."""
        self.sleep_mode.sleep(level)

    @on_every_rank
    def wake_up(self) -> None:
        """Weights, an empty KV cache of the same size and the CUDA graphs back on the device."""
        self.sleep_mode.wake_up()

    def memory_footprint(self) -> dict:
        return self.sleep_mode.memory_footprint()

    def drop_last_step(self) -> None:
        """Forget the latest launched step (its inputs are not fed to the next one)."""
        self._last_step = None

    def release_cuda_graphs(self) -> None:
        """Destroy the CUDA graphs (decode and piecewise). Called on every rank before it
        leaves the process group: a graph that captured an NCCL collective holds a reference
        on the communicator, and NCCL's teardown waits until every such graph is gone."""
        if self.graphs is None and self.mixed_graphs is None:
            return
        self.graphs = self.mixed_graphs = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @on_every_rank
    def write_lora_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Every rank writes its share of `adapter` into `slot` (None: clears it), the slot the
        driver's table chose."""
        self.lora.write_shard(slot, adapter)

    def capture_hidden(self, capture: HiddenCapture | None,
                       sink: Callable[[list[RowInput], list[torch.Tensor]], None] | None = None) -> None:  # fmt: skip
        """Speculative decoding's EAGLE head (and `llmserve train-eagle`'s data): every step's hidden
        states that `capture` names (kept by the model's eager forward) go to `sink` with the
        step's rows. None: stop. Only this rank keeps them (under tensor parallelism the states
        are whole on every rank); every rank learns whether the last layer runs on every row."""
        self.model.set_hidden_capture(capture)
        self.hidden_sink = None if capture is None or sink is None else (capture, sink)
        kept = self.hidden_sink is not None
        self.share_capture(capture.layers if kept else (), kept and capture.final)

    @on_every_rank
    def share_capture(self, layers: tuple[int, ...], final: bool) -> None:
        """Every rank learns what the driver's capture reads: whether the last layer runs on every
        row of every step (EAGLE-1 reads the final states of all; the all-reduces must meet with the
        same rows on every rank), and under pipeline parallelism which layers' states travel with
        the carried tensors to the last stage (engine/pp_stages.py `StageCapture`)."""
        self.every_row = final
        if self.stage.link is None:
            return
        if not layers and not final:
            self.stage_capture = None
            if self.hidden_sink is None:
                self.model.set_hidden_capture(None)
            return
        capture = self.hidden_sink[0] if self.hidden_sink is not None else HiddenCapture(layers=layers, final=final)
        if self.hidden_sink is None:  # (the driver's model has it already)
            self.model.set_hidden_capture(capture)
        self.stage_capture = StageCapture(capture, sum(1 for i in layers if i < self.stage.stage.start))

    @on_every_rank
    def proposer_vocab(self, with_logits: bool):
        """What a proposer on this rank reads the target's embedding (and with `with_logits` its
        logits) through: the model itself with one rank; under tensor parallelism whole tables
        gathered from every rank's rows (model/whole_vocab.py; a worker drops its copy); under
        pipeline parallelism the embedding from the first stage, handed to the driver, and the
        logits' weight from the last."""
        link = self.stage.link
        if self.tp.world_size == 1 and link is None:
            return self.model
        if link is None:
            vocab = WholeVocab.gather(self.model, with_logits, self.device)
        else:
            stage = self.stage.stage
            embedding = gather_embedding(self.model, self.device).to(self.dtype) if stage.is_first else None
            head = gather_logits_weight(self.model, self.dtype, self.device) if with_logits and stage.is_last else None
            shape = (self.config.model_config.arch.vocab_size, self.arch.hidden_size)
            embedding = link.first_to_driver(embedding, shape, self.dtype, self.device)
            vocab = WholeVocab(embedding, head) if embedding is not None else None
        if self.mirror is None:
            return None
        logger.info("the proposer's whole vocabulary tables on rank 0: %.1f MB", vocab.nbytes / 1e6)
        return vocab

    # -- one step -----------------------------------------------------------------------
    def forget_requests(self, request_ids: list[str]) -> None:
        """Requests that ended in a step with nothing to run: their sampler rows and state go."""
        self.sampler.forget(request_ids)
        self.requests.forget(request_ids)

    @torch.inference_mode()
    def execute_async(self, plan: StepPlan) -> PendingStep:
        """Launch the step on the device; `.result()` waits for its sampled tokens. The plan is
        plain data (engine/step_plan.py): the runner keeps each request's tokens and blocks."""
        self.sampler.forget(plan.finished_request_ids)
        rows, sampling = self.requests.rows_for(plan)
        batch = self.inputs.build(rows, self._last_step.row_of if self._last_step else {}) if rows else None
        if batch is None and not (plan.blocks_to_swap_out or plan.blocks_to_swap_in or plan.kv_offload or plan.kv_load
                                  or plan.kv_spill or plan.kv_disk_load):  # fmt: skip
            return PendingStep([], None)
        lora_slots = self.lora.take_step_slots() if self.lora is not None and batch is not None else None
        prompt = None
        if self.requests.prompt_logprobs and batch is not None:  # (only while a request asks)
            prompt = prompt_rows(rows, batch.query_start_loc, self.requests.prompt_logprobs)
        inputs = StepInputs(plan.blocks_to_swap_out, plan.blocks_to_swap_in, batch, lora_slots, prompt,
                            plan.kv_offload, plan.kv_load, plan.kv_spill, plan.kv_disk_load)  # fmt: skip
        if self.stage.link is not None and self.mirror is not None:
            return self._launch_stages(inputs, rows, sampling, plan)
        step = self._sampled_step(inputs, rows, sampling, plan, *self.run_step(inputs))
        self._last_step = step
        return step

    def _sampled_step(self, inputs: StepInputs, rows: list[RowInput], sampling: list[RunnerRequest], plan: StepPlan,
                      logits: torch.Tensor | None, prompt_logprobs: PendingPromptLogprobs | None) -> PendingStep:  # fmt: skip
        """The step's sampling, launched after its forward; its rows hold their tokens' places."""
        batch = inputs.batch
        if self.hidden_sink is not None and batch is not None:  # (an EAGLE head's features of every row)
            self.hidden_sink[1](rows, self.hidden_sink[0].states)
        step = PendingStep([], None, prompt=prompt_logprobs)
        if logits is not None:
            verify = None
            if batch.verifies:  # speculating rows: their positions' greedy tokens, the rest sampled
                logits, verify = self._split_verification(rows, logits)
            pending = self.sampler.sample_async(logits, sampling, plan.grammar) if sampling else None
            step = PendingStep(sampling, pending, self.requests.fill, prompt_logprobs, verify)
        self.requests.hold_places(sampling)
        return step

    def _launch_stages(self, inputs: StepInputs, rows: list[RowInput], sampling: list[RunnerRequest],
                       plan: StepPlan) -> DeferredStep:  # fmt: skip
        """Pipeline parallelism, on the driver: the batch goes to the workers now (the first stage
        starts it), numbered for the hand-overs; this rank's part (the last stage) and the sampling
        run when the step is finished, after the batches launched before it (engine/pp_batches.py)."""
        self._batch_seq = inputs.seq = (self._batch_seq + 1) & 0x3FFFFFFF
        self.mirror("run_step", (inputs,))

        def run_last_stage() -> PendingStep:
            self._mirroring = True  # (the workers have it already)
            try:
                logits, prompt_logprobs = self.run_step(inputs)
            finally:
                self._mirroring = False
            step = self._sampled_step(inputs, rows, sampling, plan, logits, prompt_logprobs)
            gone = [s.request_id for s in sampling if self.requests.requests.get(s.request_id) is not s]
            if gone:  # aborted while the batch was in flight: the sampler's rows of them go too
                self.sampler.forget(gone)
            return step

        return DeferredStep(run_last_stage)

    @on_every_rank
    def stage_busy(self, reset: bool = False) -> list[tuple[float, float]]:
        """Pipeline parallelism: every rank's (seconds in its stage's layers, wall seconds) since
        the last reset, by global rank; only with no batch in flight (a collective of all ranks)."""
        return self.stage.link.gather_busy(reset)

    def _split_verification(self, rows: list[RowInput], logits: torch.Tensor) -> tuple[torch.Tensor, Verification]:
        """The logits rows of the sampling rows, and the verification of the speculating rows:
        a greedy request's greedy token at each of its positions (row_argmax, as the sampler's
        greedy path); a sampled one's rejection sampling (engine/spec_decode.py)."""
        sample_at, greedy_at, speculating, drawn, raw = [], [], [], {}, {}
        i = 0
        for row in rows:
            if row.drafts:
                state = self.requests.requests[row.request_id]
                speculating.append((state, row.drafts))
                if state.sampling_params.logprobs is not None:  # the model's own, as the sampler reports them
                    raw[row.request_id] = torch.log_softmax(logits[i : i + row.count].float(), dim=-1)
                if state.sampling_params.greedy:
                    greedy_at.extend(range(i, i + row.count))
                else:
                    drawn[row.request_id] = _draw(logits[i : i + row.count], row.drafts, state, row.draft_probs)
                i += row.count
            elif row.samples:
                sample_at.append(i)
                i += 1
        index = torch.tensor(greedy_at, dtype=torch.long).to(logits.device, non_blocking=True)
        targets = row_argmax(logits.index_select(0, index)) if greedy_at else None
        kept = torch.tensor(sample_at, dtype=torch.long).to(logits.device, non_blocking=True)
        return logits.index_select(0, kept), Verification(speculating, targets, drawn, raw)

    @on_every_rank
    @torch.inference_mode()
    def run_step(self, step: StepInputs) -> tuple[torch.Tensor | None, PendingPromptLogprobs | None]:
        """Swap blocks, run the forward; returns the logits of the sampling rows (if any), and
        the prompt logprobs of `step.prompt_rows` (if given) on their way from the device."""
        self._spill_to_disk(step.kv_spill)  # (before the offloads write the host blocks)
        self._tier_copy(step.kv_offload, to_host=True)  # (before the swaps and the forward write the blocks)
        self._tier_copy(step.kv_load, to_host=False)
        self._load_from_disk(step.kv_disk_load)
        self._swap(step.swap_out, to_cpu=True)
        self._swap(step.swap_in, to_cpu=False)
        if step.batch is None:
            return None, None
        if self.stage.link is not None:
            self.stage.link.tag = step.seq
        if step.lora_slots is not None:
            self.lora.context.set_token_slots(step.lora_slots)
        hidden, rows = self._forward(step.batch, every_row=step.prompt_rows is not None)
        if hidden is None:  # a pipeline stage before the last: its output went to the next stage
            return None, None
        pad = self.device.type == "cuda"
        prompt = None
        if step.prompt_rows is not None:  # (every rank: the LM head's all-gather under tensor parallelism)
            prompt = compute_prompt_logprobs(
                self.model.compute_logits,
                hidden,
                step.prompt_rows,
                self.config.attention_backend == "triton",
                pad,
                self.config.scheduler_config.max_num_seqs,
            )  # (the warmed LM head counts)
        if not rows:
            return None, prompt
        # on a GPU the LM head runs on few distinct row counts, each warmed up (engine/logits_rows.py)
        return step_logits(self.model.compute_logits, hidden, rows, pad), prompt

    def _forward(self, batch: BatchInputs, every_row: bool = False) -> tuple[torch.Tensor, list[int]]:
        """The final hidden states and the rows of them that sample, in order: in steps that run
        eagerly with rows that do not sample, the last layer runs on the sampling rows alone
        (unless `every_row`: a request's prompt logprobs read its prompt's rows)."""
        fill = self._fill_from_last_step(batch)
        return (self._forward_graphs(batch, fill)
                or self._forward_eager(batch, fill, not every_row and self.samples_only(batch)))  # fmt: skip

    def samples_only(self, batch: BatchInputs) -> bool:
        """Does this step's last layer run on its sampling rows alone (`LlamaModel.forward`'s
        `sampled`)? Where some rows do not sample (prompt chunks) and no LoRA adapter's deltas
        follow the batch's rows. A fresh 7,680-token prompt then spends 1/32 less of its
        prefill's GEMMs and attention on rows whose hidden states nobody reads."""
        return (self.lora is None and len(batch.logits_indices) < len(batch.input_ids) and not batch.verifies
                and not self.every_row)  # fmt: skip

    def _forward_graphs(self, batch: BatchInputs, fill: Callable[[torch.Tensor], None] | None,
                        ) -> tuple[torch.Tensor, list[int]] | None:  # fmt: skip
        """A decode step by its CUDA graph, or a small mixed one by the piecewise graphs (None:
        the step runs eagerly). `fill`: the input tokens still on the device (`_fill_from_last_step`)."""
        n = len(batch.seq_lens)
        decode_only = batch.max_query_len == 1
        if self.graphs is not None and decode_only and self.graphs.padded_size(n) is not None:
            return self.graphs.run(  # staged: the copies into the graph's buffers do not wait
                staged(batch.input_ids, torch.long, self.device),
                staged(batch.positions, torch.long, self.device),
                staged(batch.slot_mapping, torch.long, self.device),
                staged(batch.seq_lens, torch.int32, self.device),
                staged(batch.block_tables, torch.int32, self.device),
                fill,
                *(
                    ()
                    if batch.group_slots is None
                    else (
                        staged(batch.group_slots, torch.long, self.device),
                        staged(batch.group_tables, torch.int32, self.device),
                    )
                ),
            ), batch.logits_indices
        if self.mixed_graphs is not None and self.mixed_graphs.padded_size(len(batch.input_ids)) is not None:
            return self.mixed_graphs.run(
                staged(batch.input_ids, torch.long, self.device),
                staged(batch.positions, torch.long, self.device),
                batch.metadata(self.device),
                fill,
            ), batch.logits_indices
        return None

    def _forward_eager(self, batch: BatchInputs, fill: Callable[[torch.Tensor], None] | None,
                       samples_only: bool) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
        """The plain forward; with `samples_only`, the hidden states of the sampling rows alone
        (their rows are then 0 .. k-1)."""
        input_ids, positions, meta = batch.to_device(self.device)
        if fill is not None:
            fill(input_ids)
        if not samples_only:
            return self._run_model(input_ids, positions, meta), batch.logits_indices
        hidden = self._run_model(input_ids, positions, meta, batch.sampled_rows(meta, self.device))
        return hidden, list(range(len(batch.logits_indices)))

    def _run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, sampled=None) -> torch.Tensor | None:
        """The model's forward; under pipeline parallelism this stage's part (engine/pp_stages.py),
        None on a stage before the last."""
        if self.stage.link is None:
            return self.model(input_ids, positions, meta, sampled)
        return run_stage(self.model, self.stage.link, input_ids, positions, meta, sampled, self.dtype,
                         self.stage_capture)  # fmt: skip

    def _fill_from_last_step(self, batch: BatchInputs) -> Callable[[torch.Tensor], None] | None:
        """Tokens the previous step sampled and the host has not seen yet: copied on the
        device from that step's output into this step's input ids."""
        if not batch.fill_positions:
            return None
        source = self._last_step.device_tokens
        count = len(batch.fill_positions)
        if is_range(batch.fill_positions, 0) and is_range(batch.fill_rows, batch.fill_rows[0]):
            first = batch.fill_rows[0]  # the usual decode step: one slice copy, no index tensors

            def fill_slice(input_ids: torch.Tensor) -> None:
                input_ids[:count].copy_(source[first : first + count])

            return fill_slice
        positions = to_device(batch.fill_positions, torch.long, self.device)
        rows = to_device(batch.fill_rows, torch.long, self.device)

        def fill(input_ids: torch.Tensor) -> None:
            input_ids[positions] = source[rows]

        return fill

    def _tier_copy(self, pairs: list[tuple[int, int]], to_host: bool) -> None:
        """Blocks between the device cache and the prefix cache's host tier: (device, host) pairs
        to the host, (host, device) pairs back."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        start = time.perf_counter()
        if to_host:
            self.tier_counts.host_stored += len(pairs)
        else:
            self.tier_counts.host_loaded += len(pairs)
        for dev_cache, host_cache in zip(self.kv_caches, self.host_tier_caches):
            if to_host:
                host_cache[:, dst] = dev_cache[:, src.to(self.device)].to("cpu")
            else:
                dev_cache[:, dst.to(self.device)] = host_cache[:, src].to(self.device, non_blocking=True)
        if not to_host:
            share = (time.perf_counter() - start) / len(pairs)
            for _ in pairs:
                self.host_load_latency.observe(share)

    def _spill_to_disk(self, spills: list[tuple]) -> None:
        """Blocks to the disk tier, (on host, block, slot, header): copied out of host memory (or the
        device cache, for a block stored on the host and evicted in one step) here, one gather a
        layer, before this step's offloads and forward write those blocks; written by the store's thread."""
        if not spills:
            return
        rows = [None] * len(spills)
        for on_host, caches in ((True, self.host_tier_caches), (False, self.kv_caches)):
            at = [i for i, s in enumerate(spills) if s[0] == on_host]
            if not at:
                continue
            index = torch.tensor([spills[i][1] for i in at], dtype=torch.long).to(caches[0].device)
            gathered = torch.cat([c[:, index].transpose(0, 1).reshape(len(at), -1).view(torch.uint8)
                                  for c in caches], dim=1).to("cpu")  # fmt: skip
            for i, row in zip(at, gathered):
                rows[i] = row
        for (_, _, slot, meta), row in zip(spills, rows):  # (in order: a slot written twice keeps the last)
            self.disk_store.write(slot, meta, row)
        self.tier_counts.disk_spilled += len(spills)

    def _load_from_disk(self, loads: list[tuple[int, int]]) -> None:
        """Blocks read back from the disk tier (checked when their request was admitted) into
        their device blocks: one copy a layer."""
        if not loads:
            return
        rows = torch.stack([self.disk_store.take(stage) for stage, _ in loads])
        self.tier_counts.disk_loaded += len(loads)
        dst = torch.tensor([d for _, d in loads], dtype=torch.long).to(self.device)
        offset = 0
        for dev_cache in self.kv_caches:
            width = dev_cache[:, 0].numel() * dev_cache.element_size()
            part = rows[:, offset : offset + width].contiguous().view(self.kv_dtype)
            part = part.view(len(loads), 2, *dev_cache.shape[2:]).transpose(0, 1)
            dev_cache[:, dst] = part.to(self.device)
            offset += width

    @on_every_rank
    def init_host_tier(self, num_blocks: int) -> None:
        """Host memory for the prefix cache's host tier (pinned on a GPU), one tensor per cache slot."""
        a = self.arch
        shape = (2, num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        pin = self.device.type == "cuda"
        self.host_tier_caches = [torch.zeros(shape, dtype=self.kv_dtype, pin_memory=pin)
                                 for _ in range(len(self.kv_slots))] if num_blocks else []  # fmt: skip

    @on_every_rank
    def open_disk_store(self, max_staged: int) -> tuple[DiskStore | None, int]:
        """Each rank's own disk tier file (engine/kv_tier_ranks.py), after `init_host_tier`: (the
        store, else None on every rank; this rank's errors opening it)."""
        self.disk_store, errors = open_rank_store(self.config, self, max_staged)
        if self.disk_store is not None and self.mirror is not None:  # rank 0 of several: reads on every rank
            self.disk_store.peers = self
        return self.disk_store, errors

    @on_every_rank
    def read_disk_blocks(self, reads: list[tuple[int, int, SlotMeta]], drops: list[int]) -> int:
        """Disk blocks read back on every rank (rank 0's `DiskStore.stage_run`): how many every rank read."""
        return read_on_every_rank(self.disk_store, self, reads, drops)

    @on_every_rank
    def clear_disk_store(self) -> None:
        """The prefix cache was reset: every rank forgets its disk blocks."""
        self.disk_store.clear_local()

    @on_every_rank
    def tier_counts_by_rank(self) -> list[dict]:
        """Every rank's own tier copies and disk counts, in rank order (on rank 0)."""
        return gather_counts(self, self.tier_counts.with_store(self.disk_store))

    def _swap(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        if not pairs:
            return
        src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long)
        for dev_cache, cpu_cache in zip(self.kv_caches, self.cpu_caches):
            if to_cpu:
                cpu_cache[:, dst_ids] = dev_cache[:, src_ids.to(self.device)].to("cpu")
            else:
                dev_cache[:, dst_ids.to(self.device)] = cpu_cache[:, src_ids].to(self.device)

"""`llmserve bench host-step`: the engine's host (Python) work per step, without the model.

The real engine (`LLM`: scheduler, KV cache manager, plan builder, runner request state, input
builder, sampler, output processor and detokenizer) runs N sequences for M decode steps; only
the model's forward is replaced: `ModelRunner.run_step` returns fixed logits rows whose argmax
is a token chosen per row and step (a token of the tokenizer's vocabulary, never a special one),
instantly. Times are this thread's CPU time (torch held to one thread), so that other jobs
on a shared machine count less than in wall time. What remains is the host path that limits a small model on a GPU, where the forward
of a 270M model takes a few milliseconds. Each component is timed around its real method (a
perf_counter pair per call, no profiler); the stub's own time is reported and left out.

    llmserve bench host-step --num-seqs 64 256 1024 --steps 64
    llmserve bench host-step --num-seqs 256 --reference   # the fast paths off: the references

With no --model a tiny random Llama folder is made (a 512-token BPE tokenizer); the model's
size does not matter here, its vocabulary only sets the logits' width.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

# the components timed, in step order: (label, what it covers)
COMPONENTS = (
    ("schedule", "Scheduler.schedule"),
    ("plan", "PlanBuilder.plan"),
    ("rows_for", "RunnerRequests.rows_for"),
    ("input_build", "InputBuilder.build"),
    ("sample", "Sampler.sample_async (host side; CPU argmax)"),
    ("after_launch", "Scheduler.after_launch"),
    ("update", "Scheduler.update_from_output"),
    ("stats", "EngineCore.stats"),
    ("output", "OutputProcessor.process (detokenizer included)"),
)


@dataclass
class HostStepResult:
    num_seqs: int
    steps: int  # engine steps run (the prefill step and the decode steps)
    decode_steps_timed: int  # the steady decode steps the per-component means are over
    # the generate loop's CPU time (this thread's: on a shared machine other jobs' time counts less
    # than in wall time) less the stub forward's, per step (all steps)
    host_ms_per_step: float
    wall_ms_per_step: float  # the same in wall time (with whatever else the machine ran)
    decode_host_ms_per_step: float  # the components' sum, per steady decode step
    component_ms: dict[str, float] = field(default_factory=dict)  # mean per steady decode step
    stub_forward_ms: float = 0.0  # per step (left out of the host times)
    num_blocks: int = 0
    startup_s: float = 0.0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("host-step", help="host (Python) time of an engine step, the model's forward stubbed")
    p.add_argument("--num-seqs", type=int, nargs="+", default=[64, 256, 1024], help="concurrent sequences (each a run)")
    p.add_argument("--steps", type=int, default=64, help="decode steps (tokens per sequence)")
    p.add_argument("--input-len", type=int, default=8)
    p.add_argument("--model", default=None, help="a model folder (default: a tiny random Llama, made here)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: the CPU sizing)")
    p.add_argument("--repeat", type=int, default=1, help="runs per size; the best is reported")
    p.add_argument("--profile", default=None, help="write a cProfile of the last run to this file")
    p.add_argument("--reference", action="store_true",
                   help="the host path's references: Scheduler.fast_paths and OutputProcessor.defer_detok off")  # fmt: skip
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)


def tiny_model(path: str) -> str:
    from llmserve.model.random_model import make_random_model

    make_random_model(path, "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=1024, head_dim=16)  # fmt: skip
    return path


class Timers:
    """Per-call durations of wrapped methods, by label."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}

    def wrap(self, obj, name: str, label: str) -> None:
        method = getattr(obj, name)
        calls = self.calls.setdefault(label, [])
        clock = time.thread_time  # CPU time of this thread: other jobs on a shared machine count less

        def timed(*args, **kwargs):
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                calls.append(clock() - start)

        setattr(obj, name, timed)  # on the instance: the class (and other engines) stay as they are


class StubForward:
    """`ModelRunner.run_step` without the model: the sampling rows' logits, a one-hot row per
    sequence whose token changes from step to step (16 tables in turn)."""

    def __init__(self, max_rows: int, vocab_size: int, text_vocab: int, seed: int = 0) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        low = 3  # (the random tokenizer's <s>, </s>, <pad>)
        self.tables = []
        for _ in range(16):
            tokens = torch.randint(low, max(low + 1, text_vocab), (max_rows,), generator=g)
            logits = torch.zeros(max_rows, vocab_size)
            logits[torch.arange(max_rows), tokens] = 1.0
            self.tables.append(logits)
        self.turn = 0
        self.seconds = 0.0

    def __call__(self, step):
        start = time.thread_time()
        try:
            if step.batch is None:
                return None, None
            n = len(step.batch.logits_indices)
            if n == 0:
                return None, None
            self.turn = (self.turn + 1) % len(self.tables)
            return self.tables[self.turn][:n], None
        finally:
            self.seconds += time.thread_time() - start


def measure(model: str, num_seqs: int, steps: int, input_len: int, num_blocks: int | None,
            profile: str | None = None) -> HostStepResult:  # fmt: skip
    import torch

    from llmserve import LLM, SamplingParams
    from llmserve.heap import frozen

    torch.set_num_threads(1)  # the CPU sampler's work in this thread, where it is timed (a GPU's is launches)

    began = time.perf_counter()
    llm = LLM(
        model=model, device="cpu", dtype="float32", max_num_seqs=num_seqs, max_model_len=input_len + steps + 16,
        max_num_batched_tokens=max(8192, num_seqs * input_len), num_gpu_blocks_override=num_blocks,
    )  # fmt: skip
    startup = time.perf_counter() - began
    core, runner = llm.core, llm.core.runner
    stub = StubForward(num_seqs, core.config.model_config.arch.vocab_size, len(llm.tokenizer))
    runner.run_step = stub
    timers = Timers()
    for obj, name, label in (
        (core.scheduler, "schedule", "schedule"),
        (core.plans, "plan", "plan"),
        (runner.requests, "rows_for", "rows_for"),
        (runner.inputs, "build", "input_build"),
        (runner.sampler, "sample_async", "sample"),
        (core.scheduler, "after_launch", "after_launch"),
        (core.scheduler, "update_from_output", "update"),
        (core, "stats", "stats"),
        (llm.output_processor, "process", "output"),
    ):
        timers.wrap(obj, name, label)
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 200 for j in range(input_len)]} for i in range(num_seqs)]
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
    with frozen("bench host-step"):
        start, wall = time.thread_time(), time.perf_counter()
        if profiler is not None:
            profiler.enable()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        elapsed, wall = time.thread_time() - start, time.perf_counter() - wall
    assert all(len(o.outputs[0].token_ids) == steps for o in outputs), "a sequence ended early"
    num_steps = len(timers.calls["schedule"])
    # steady decode steps: past the prefill (1-2 calls) and before the last two (the finishing ones)
    component = {}
    for label, _ in COMPONENTS:
        calls = timers.calls[label][2:-2]
        component[label] = round(1e3 * statistics.fmean(calls), 4) if calls else 0.0
    result = HostStepResult(
        num_seqs=num_seqs,
        steps=num_steps,
        decode_steps_timed=max(0, len(timers.calls["update"]) - 4),
        host_ms_per_step=round(1e3 * (elapsed - stub.seconds) / num_steps, 4),
        wall_ms_per_step=round(1e3 * wall / num_steps, 4),
        decode_host_ms_per_step=round(sum(component.values()), 4),
        component_ms=component,
        stub_forward_ms=round(1e3 * stub.seconds / num_steps, 4),
        num_blocks=core.kv.pool.num_blocks,
        startup_s=round(startup, 3),
    )
    llm.shutdown()
    return result


def best(results: list[HostStepResult]) -> HostStepResult:
    return min(results, key=lambda r: r.host_ms_per_step)


def table(results: list[HostStepResult]) -> str:
    labels = [label for label, _ in COMPONENTS]
    head = ["seqs", "host ms/step", "decode sum"] + labels
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in results:
        cells = [str(r.num_seqs), f"{r.host_ms_per_step:.2f}", f"{r.decode_host_ms_per_step:.2f}"]
        cells += [f"{r.component_ms[label]:.3f}" for label in labels]
        lines.append(" | ".join(cells))
    return "\n".join(lines)


@contextmanager
def reference_paths(on: bool) -> Iterator[None]:
    """With `on`, the host path's fast paths off for the block: every call the scheduler's loops
    skip made, each step's tokens detokenized at once (the references tests/test_host_fast_paths.py
    compares them with), so that one tree measures both."""
    from llmserve.engine.output_processor import OutputProcessor
    from llmserve.engine.scheduler import Scheduler

    if not on:
        yield
        return
    saved = Scheduler.fast_paths, OutputProcessor.defer_detok
    Scheduler.fast_paths = OutputProcessor.defer_detok = False
    try:
        yield
    finally:
        Scheduler.fast_paths, OutputProcessor.defer_detok = saved


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> list[HostStepResult]:
    with tempfile.TemporaryDirectory() as tmp, reference_paths(getattr(args, "reference", False)):
        model = args.model or tiny_model(tmp + "/model")
        results = []
        for n in args.num_seqs:
            runs = [measure(model, n, args.steps, args.input_len, args.num_blocks,
                            args.profile if i == args.repeat - 1 else None) for i in range(args.repeat)]  # fmt: skip
            results.append(best(runs))
            r = results[-1]
            log(f"{n} sequences: {r.host_ms_per_step:.2f} ms host per step ({r.steps} steps; stub forward "
                f"{r.stub_forward_ms:.3f} ms left out; {r.num_blocks} KV blocks, start-up {r.startup_s:.1f} s)")  # fmt: skip
    log("ms per steady decode step, by component:")
    log(table(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return results

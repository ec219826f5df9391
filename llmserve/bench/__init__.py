"""`llmserve bench`: load generation and reports.

throughput   offline: N requests at once through the in-process engine
latency      offline: one batch, TTFT and time per output token
serve        online: any OpenAI-compatible server, timed on the client
hf-baseline  the throughput workload through transformers generate()
accuracy     perplexity and greedy agreement of a model against its quantized form
placement    placement policies for many models on one GPU, on simulated traffic
soak         a long run at a steady rate: SLO attainment, errors, memory per process over time
aborts       streams cut at random points, then nothing may be left running (requests, KV blocks)
multiturn    conversations whose KV working set exceeds the server's cache: TTFT by turn, hit rates per tier
host-step    the engine's host (Python) time per step, the model's forward stubbed: ms per component
"""


def add_bench_parsers(subparsers) -> None:
    """Register every `llmserve bench` subcommand (each module imports its heavy parts lazily)."""
    from llmserve.bench import (
        aborts,
        accuracy,
        hf_baseline,
        host_step,
        latency,
        multiturn,
        placement,
        serve,
        soak,
        throughput,
    )

    modules = (throughput, latency, serve, hf_baseline, accuracy, placement, soak, aborts, multiturn, host_step)
    for module in modules:
        module.add_parser(subparsers)

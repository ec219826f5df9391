"""`llmserve bench`: load generation and reports.

    throughput   offline: N requests at once through the in-process engine
    latency      offline: one batch, TTFT and time per output token
    serve        online: any OpenAI-compatible server, timed on the client
    hf-baseline  the throughput workload through transformers generate()
"""


def add_bench_parsers(subparsers) -> None:
    """Register every `llmserve bench` subcommand (each module imports its heavy parts lazily)."""
    from llmserve.bench import hf_baseline, latency, serve, throughput

    for module in (throughput, latency, serve, hf_baseline):
        module.add_parser(subparsers)

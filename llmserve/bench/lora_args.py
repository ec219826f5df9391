"""Many LoRA adapters in the offline benchmarks (`--lora-adapters N --lora-rank R`): N random
adapters of the model's shape are written to a temporary folder, the engine runs with LoRA on,
and the requests take the adapters in turn (request i: adapter i mod N), as a multi-tenant
server sees them. `--max-loras` is how many fit in device slots at once: with fewer slots
than adapters, adapters are swapped in and out while the run goes on."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from llmserve.lora_request import LoRARequest


def add_lora_bench_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument("--lora-adapters", type=int, default=0,
                       help="random adapters the requests take in turn (0: the base model only); --max-loras "
                            "left at its default gives each its own device slot")  # fmt: skip
    group.add_argument("--lora-rank", type=int, default=16, help="their rank")


def enable_lora_for_bench(args: argparse.Namespace) -> None:
    """Before the engine starts: LoRA on, slots for every adapter unless --max-loras says fewer."""
    if args.lora_adapters < 0 or args.lora_rank < 1:
        raise ValueError("--lora-adapters must be >= 0 and --lora-rank >= 1")
    if args.lora_adapters == 0:
        return
    args.enable_lora = True
    args.max_lora_rank = max(args.max_lora_rank, args.lora_rank)
    if args.max_loras == 1:  # the default: a slot for every adapter
        args.max_loras = args.lora_adapters
    if args.max_cpu_loras is None:  # every adapter stays read in host memory
        args.max_cpu_loras = max(args.lora_adapters, args.max_loras)


class BenchAdapters:
    """The adapters of one run: written for the engine's model, removed by `close()`."""

    def __init__(self, llm, args: argparse.Namespace):
        self.requests: list[LoRARequest] = []
        self.rank = args.lora_rank
        self._root: str | None = None
        self._loads_before = llm.stats().lora_slot_loads
        if args.lora_adapters > 0:
            from llmserve.lora.synthetic import write_random_adapters

            self._root = tempfile.mkdtemp(prefix="llmserve-bench-lora-")
            arch = llm.config.model_config.arch
            paths = write_random_adapters(arch, self._root, args.lora_adapters, args.lora_rank, args.bench_seed)
            self.requests = [LoRARequest(Path(p).name, i + 1, str(p)) for i, p in enumerate(paths)]

    def for_requests(self, n: int) -> list[LoRARequest | None] | None:
        """Request i's adapter (adapter i mod N), or None for a base-model run."""
        if not self.requests:
            return None
        return [self.requests[i % len(self.requests)] for i in range(n)]

    def label(self, llm) -> dict | None:
        """For reports: how many adapters, their rank, the device slots they shared, and how many
        times an adapter was written into a slot during the run (warm-up included)."""
        if not self.requests:
            return None
        return {
            "adapters": len(self.requests),
            "rank": self.rank,
            "max_loras": llm.config.lora.max_loras,
            "slot_loads": llm.stats().lora_slot_loads - self._loads_before,
        }

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None

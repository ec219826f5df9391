"""Sampling settings of the offline benchmarks (`bench throughput`, `bench latency`), spelled
as vLLM's and OpenAI's: each workload of the comparison tables is one command line."""

from __future__ import annotations

import argparse

SAMPLING_FLAGS = {
    "temperature": (float, 1.0, "0: greedy"),
    "top_p": (float, 1.0, ""),
    "top_k": (int, 0, "0: off"),
    "min_p": (float, 0.0, ""),
    "presence_penalty": (float, 0.0, ""),
    "frequency_penalty": (float, 0.0, ""),
    "repetition_penalty": (float, 1.0, ""),
    "n": (int, 1, "samples per prompt"),
    "logprobs": (int, None, "top logprobs per token (off when unset)"),
    "sampling_seed": (int, None, "a seed per request (this plus the request's index)"),
}


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    for name, (kind, default, note) in SAMPLING_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                           help=f"{note} (default: {default})" if note else f"default: {default}")  # fmt: skip


def sampling_params(args: argparse.Namespace, max_tokens: int, index: int = 0):
    """The SamplingParams of request `index` (ignore_eos: exact output lengths)."""
    from llmserve import SamplingParams

    values = {name: getattr(args, name) for name in SAMPLING_FLAGS if name != "sampling_seed"}
    seed = None if args.sampling_seed is None else (args.sampling_seed + index) % 2**64
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, **values)


def sampling_label(args: argparse.Namespace) -> dict:
    """The settings that differ from the defaults, for reports."""
    return {name: getattr(args, name) for name, (_, default, _) in SAMPLING_FLAGS.items() if getattr(args, name) != default}

"""Sampling settings of the offline benchmarks (`bench throughput`, `bench latency`), spelled
as vLLM's and OpenAI's: each workload of the comparison tables is one command line."""

from __future__ import annotations

import argparse
import json

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
    group.add_argument("--sampling-mix", type=sampling_mix, default=None, metavar="JSON",
                       help='requests of several kinds in one batch: a JSON list of settings (the names above, '
                            'with underscores), request i taking entry i %% len over the flags, e.g. '
                            '\'[{"temperature": 0}, {"top_p": 0.9, "presence_penalty": 0.3}]\'')  # fmt: skip


def sampling_mix(text: str) -> list[dict]:
    """`--sampling-mix`: a non-empty JSON list of objects whose keys are sampling flags."""
    try:
        mix = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(mix, list) or not mix or not all(isinstance(entry, dict) for entry in mix):
        raise argparse.ArgumentTypeError("a non-empty JSON list of objects, one per kind of request")
    from llmserve import SamplingParams

    for entry in mix:
        for name, value in entry.items():
            if name not in SAMPLING_FLAGS:
                raise argparse.ArgumentTypeError(f"unknown setting {name!r} (known: {', '.join(SAMPLING_FLAGS)})")
            kind = SAMPLING_FLAGS[name][0]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or (kind is int and not isinstance(value, int))):  # fmt: skip
                raise argparse.ArgumentTypeError(
                    f"{name}: {value!r} is not {'an integer' if kind is int else 'a number'}"
                )
        try:  # each entry must make valid settings on its own (over the defaults)
            SamplingParams(max_tokens=1, **{k: v for k, v in entry.items() if k != "sampling_seed"})
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(f"{json.dumps(entry)}: {e}") from None
    return mix


def _settings(args: argparse.Namespace, index: int) -> dict:
    """Request `index`'s settings: the flags, with its entry of `--sampling-mix` over them."""
    values = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    mix = getattr(args, "sampling_mix", None)
    if mix:
        values.update(mix[index % len(mix)])
    return values


def sampling_params(args: argparse.Namespace, max_tokens: int, index: int = 0):
    """The SamplingParams of request `index` (ignore_eos: exact output lengths)."""
    from llmserve import SamplingParams

    values = _settings(args, index)
    base_seed = values.pop("sampling_seed")
    seed = None if base_seed is None else (base_seed + index) % 2**64
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=seed, **values)


def sampling_label(args: argparse.Namespace) -> dict:
    """The settings that differ from the defaults, for reports (and the mix, when there is one)."""
    label = {
        name: getattr(args, name) for name, (_, default, _) in SAMPLING_FLAGS.items() if getattr(args, name) != default
    }
    mix = getattr(args, "sampling_mix", None)
    if mix:
        label["mix"] = mix
    return label

"""`llmserve bench accuracy`: what a quantization costs on real text.

The same model twice, as configured and with `--quantization` (and/or `--kv-cache-dtype`)
added, reads a held-out text teacher-forced (windows of `--window` tokens, each from an
empty cache, through the engine's own layers and paged KV cache): perplexity of each, and
how often their greedy next-token choices agree, position by position.

    llmserve bench accuracy --model M --quantization fp8 --text docs/architecture.md docs/gateway.md

Several texts: each is read up to `--max-positions`, and the result is over all their
positions together (and per text), since one text's change varies by a point or more.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from llmserve.attention_metadata import FP8_KV
from llmserve.cli_args import add_engine_args, engine_args_from_cli
from llmserve.config import kv_torch_dtype
from llmserve.model.kv_scales import calibration_length, choose_scales


@dataclass
class Reading:
    nll: list[float]  # per predicted position
    top1: list[int]  # the greedy choice at each position

    @property
    def perplexity(self) -> float:
        return math.exp(sum(self.nll) / len(self.nll))


@dataclass
class TextAccuracy:
    text: str
    positions: int
    perplexity_baseline: float
    perplexity_candidate: float
    perplexity_change_pct: float
    top1_agreement: float


def compare(text: str, base: Reading, cand: Reading) -> TextAccuracy:
    agree = sum(a == b for a, b in zip(base.top1, cand.top1)) / len(base.top1)
    return TextAccuracy(text, len(base.nll), round(base.perplexity, 4), round(cand.perplexity, 4),
                        round(100 * (cand.perplexity / base.perplexity - 1), 3), round(agree, 4))  # fmt: skip


@dataclass
class AccuracyResult:
    model: str
    text: str  # the texts, comma-separated
    positions: int
    window: int
    baseline: str
    candidate: str
    perplexity_baseline: float
    perplexity_candidate: float
    perplexity_change_pct: float
    top1_agreement: float
    seconds: float
    per_text: list[TextAccuracy] | None = None  # with several texts


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("accuracy", help="perplexity and greedy agreement: the model against its quantized form")
    p.add_argument(
        "--text", required=True, nargs="+", help="held-out text files (UTF-8): the result is over all of them"
    )
    p.add_argument("--window", type=int, default=512, help="tokens per teacher-forced window")
    p.add_argument("--max-positions", type=int, default=4096, help="positions read at most, per text")
    p.add_argument("--baseline-model", default=None, help="the unquantized model to compare with (default: --model "
                   "itself without --quantization / --kv-cache-dtype); e.g. the source of an FP8 checkpoint")  # fmt: skip
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)


def read_text(model, tokenizer_ids: list[int], window: int, device: torch.device, kv_dtype: torch.dtype) -> Reading:
    """Teacher-forced next-token log-likelihoods of `tokenizer_ids`, window by window."""
    from llmserve.model.attention import AttentionMetadata

    layers = model.attention_layers()
    arch = model.shard
    nll: list[float] = []
    top1: list[int] = []
    block = 16
    for start in range(0, len(tokenizer_ids) - 1, window):
        ids = tokenizer_ids[start : start + window + 1]
        if len(ids) < 2:
            break
        inputs, targets = ids[:-1], ids[1:]
        n = len(inputs)
        blocks = -(-n // block)
        for layer in layers:
            layer.kv_cache = torch.zeros(
                2, blocks, block, arch.num_kv_heads, arch.head_dim, dtype=kv_dtype, device=device
            )
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
            max_query_len=n,
            max_seq_len=n,
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(inputs, device=device), torch.arange(n, device=device), meta)
            logp = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
        target = torch.tensor(targets, device=device)
        nll.extend((-logp.gather(-1, target[:, None]).squeeze(-1)).tolist())
        top1.extend(logp.argmax(dim=-1).tolist())
    return Reading(nll, top1)


def load_for_reading(engine_args):
    """The model and tokenizer an engine would run, with the reference attention (no kernels)."""
    from llmserve.model.attention import reference_paged_attention
    from llmserve.model.loader import load_model
    from llmserve.tokenizer import load_tokenizer

    cfg = engine_args.create_engine_config()
    mc = cfg.model_config
    model = load_model(mc.model, mc.arch, mc.dtype, cfg.device, reference_paged_attention, load_format=mc.load_format,
                       seed=mc.seed, progress=False, max_positions=mc.max_model_len, quantization=mc.quantization,
                       quantization_ignore=mc.quantization_ignore, int8_embedding=mc.int8_embedding)  # fmt: skip
    return model, load_tokenizer(mc.tokenizer), cfg


def describe(cfg) -> str:
    mc = cfg.model_config
    kv = cfg.cache_config.kv_cache_dtype
    kept = f" (kept: {', '.join(mc.quantization_ignore)})" if mc.quantization_ignore else ""
    embedding = " with an int8 embedding" if mc.int8_embedding else ""
    return f"{str(mc.dtype).removeprefix('torch.')}, quantization {mc.quantization or 'none'}{kept}{embedding}, KV {kv}"


def run(args: argparse.Namespace) -> AccuracyResult:
    import dataclasses

    started = time.perf_counter()
    candidate_args = engine_args_from_cli(args)
    # the baseline: the model's dtype, every GGUF tensor dequantized at load
    baseline_args = dataclasses.replace(candidate_args, quantization=None, quantization_ignore=None, kv_cache_dtype="auto",
                                        calculate_kv_scales=None, gguf_keep_quantized=False,
                                        int8_embedding=False)  # fmt: skip
    two_models = bool(getattr(args, "baseline_model", None))
    if two_models:
        baseline_args = dataclasses.replace(baseline_args, model=args.baseline_model, tokenizer=None)
    texts = list(args.text)
    contents = [Path(t).read_text(encoding="utf-8") for t in texts]
    readings: list[list[Reading]] = []  # [model][text]
    token_ids: list[list[int]] = []  # the baseline's, per text: the candidate must read the same
    labels = []
    for engine_args in (baseline_args, candidate_args):
        model, tokenizer, cfg = load_for_reading(engine_args)
        if not two_models and cfg.model_config.checkpoint_quantization is not None:
            raise ValueError(f"{candidate_args.model!r} is an FP8 checkpoint, which runs as FP8 whatever the flags: "
                             "compare it with its source (--baseline-model)")  # fmt: skip
        kv_dtype = kv_torch_dtype(cfg.cache_config.kv_cache_dtype, cfg.model_config.dtype)
        label = describe(cfg)
        if two_models:  # say which is which
            label = f"{Path(cfg.model_config.model).name}, {label}"
        if kv_dtype == FP8_KV:  # the scales the engine would use: the checkpoint's, or calibrated as it does
            device = torch.device(cfg.device)
            n = calibration_length(cfg.scheduler_config.max_num_batched_tokens, cfg.model_config.max_model_len)
            scales = choose_scales(model, cfg.cache_config.calculate_kv_scales,
                                   lambda ids, m=model: read_text(m, [*ids, 0], len(ids), device, kv_dtype),
                                   cfg.model_config.arch.vocab_size, n)  # fmt: skip
            label += f" (scales {scales.summary()})"
        per_text = []
        for text, content in zip(texts, contents):
            ids = tokenizer.encode(content, add_special_tokens=False, verbose=False)[: args.max_positions + 1]
            if len(ids) < 2:
                raise ValueError(f"{text}: {len(ids)} token(s), nothing to predict (at least 2 are needed)")
            if len(token_ids) < len(texts):
                token_ids.append(ids)
            elif ids != token_ids[len(per_text)]:
                raise ValueError(
                    f"{text}: the two models' tokenizers give different tokens (compare models with one tokenizer)"
                )
            per_text.append(read_text(model, ids, args.window, torch.device(cfg.device), kv_dtype))
        readings.append(per_text)
        labels.append(label)
        del model
    each = [compare(t, b, c) for t, b, c in zip(texts, readings[0], readings[1])]
    base, cand = (Reading([v for r in rs for v in r.nll], [v for r in rs for v in r.top1]) for rs in readings)
    whole = compare(", ".join(texts), base, cand)
    result = AccuracyResult(
        model=candidate_args.model, text=whole.text, positions=whole.positions, window=args.window,
        baseline=labels[0], candidate=labels[1],
        perplexity_baseline=whole.perplexity_baseline, perplexity_candidate=whole.perplexity_candidate,
        perplexity_change_pct=whole.perplexity_change_pct, top1_agreement=whole.top1_agreement,
        seconds=round(time.perf_counter() - started, 1), per_text=each if len(each) > 1 else None,
    )  # fmt: skip
    print(f"Accuracy over {result.positions} positions of {result.text} (windows of {args.window}):\n"
          f"  {result.baseline}: perplexity {result.perplexity_baseline:.4f}\n"
          f"  {result.candidate}: perplexity {result.perplexity_candidate:.4f} ({result.perplexity_change_pct:+.2f} %)\n"
          f"  greedy top-1 agreement: {100 * result.top1_agreement:.2f} %")  # fmt: skip
    for t in result.per_text or []:
        print(
            f"  {t.text}: {t.positions} positions, perplexity {t.perplexity_baseline:.4f} -> "
            f"{t.perplexity_candidate:.4f} ({t.perplexity_change_pct:+.2f} %), top-1 agreement {100 * t.top1_agreement:.2f} %"
        )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(asdict(result), indent=2))
    return result

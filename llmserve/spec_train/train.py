"""`llmserve train-eagle`: an EAGLE-3 head for a registered target, trained on text the target
generates itself.

1. The target (an `LLM`, eager, no prefix cache) answers chat prompts built from a built-in list
   of instructions (or random token seeds), greedy or sampled; its forward keeps the states
   entering the head's three aux layers at every position (data.py), the runtime's own features.
2. The draft vocabulary: the tokens it generated, most frequent first (vocab.py).
3. The head (model/eagle3_train_head.py) learns to predict the target's next token at every generated position,
   unrolled over `ttt_steps` proposal steps (EAGLE-3's training-time test): cross-entropy over
   the draft vocabulary, step j weighted 0.8^j, AdamW with warm-up and cosine decay (loop.py;
   what it reports: metrics.py).
4. It is written as published EAGLE-3 heads are (checkpoint.py) and read back by the runtime's
   checker (model/eagle_format.py), so a head this writes is a head `--speculative-config` loads.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.model.arch import ModelArch
from llmserve.model.eagle3_train_head import Eagle3TrainHead
from llmserve.spec_train.checkpoint import head_arch, head_config, write_head
from llmserve.spec_train.data import (
    Sequence,
    generate_sequences,
    instruction_prompts,
    prompt_token_ids,
    random_prompt_ids,
)
from llmserve.spec_train.loop import TargetInputs, fit
from llmserve.spec_train.options import TrainOptions, check_aux_layers, default_aux_layers
from llmserve.spec_train.vocab import DraftVocab, choose_draft_vocab

logger = logging.getLogger(__name__)

EAGLE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # the targets the runtime takes heads for


@dataclass
class TrainResult:
    out: Path
    sequences: int
    generated_tokens: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]
    epochs: list[dict]  # per epoch: train and held-out EpochStats, seconds
    generate_s: float
    train_s: float


def train_eagle3(options: TrainOptions, use_tqdm: bool = True) -> TrainResult:
    """Generate, train, write the head to `options.out`; returns what it did."""
    from llmserve.model.eagle_format import read_eagle_head

    torch.manual_seed(options.seed)
    data = _generate(options, use_tqdm)
    cfg = head_config(data.target, data.aux, data.vocab.size)
    max_len = max(len(s.token_ids) for s in data.train + data.holdout) + options.ttt_steps
    head = Eagle3TrainHead(head_arch(cfg), len(data.aux), data.vocab.size, max_len)
    head.init_weights(options.seed)
    head.to(data.device)
    started = time.perf_counter()
    target = TargetInputs(data.embeddings.to(data.device), data.vocab)
    epochs = fit(head, data.train, data.holdout, target, options, use_tqdm)
    train_s = time.perf_counter() - started
    sequences = len(data.train) + len(data.holdout)
    generated = sum(s.generated for s in data.train + data.holdout)
    training = {"target": str(options.model), "options": {k: v for k, v in vars(options).items() if k != "engine"},
                "sequences": sequences, "held_out": len(data.holdout), "generated_tokens": generated,
                "aux_layers": list(data.aux), "draft_vocab_size": data.vocab.size, "generate_s": data.generate_s,
                "train_s": train_s, "epochs": epochs}  # fmt: skip
    out = write_head(Path(options.out), cfg, head, data.vocab, training)
    read_eagle_head(out, "eagle3", data.target)  # the runtime's checks: refuses what it could not load
    logger.info("train-eagle: wrote the head to %s (%.1f s generating, %.1f s training)", out, data.generate_s, train_s)
    return TrainResult(out, sequences, generated, data.vocab.size, data.aux, epochs, data.generate_s, train_s)


@dataclass
class _Data:
    """What the target gave: its shape, the training and held-out text with its states, the
    draft vocabulary, its embedding table (float32, host)."""

    target: ModelArch
    aux: tuple[int, ...]
    train: list[Sequence]
    holdout: list[Sequence]
    vocab: DraftVocab
    embeddings: torch.Tensor
    device: torch.device
    generate_s: float


def _generate(options: TrainOptions, use_tqdm: bool) -> _Data:
    """Start the target, let it write the training text, and take what training needs from it
    (the engine is shut down on return: its memory is the head's on a GPU)."""
    from llmserve import LLM, SamplingParams

    started = time.perf_counter()
    engine = {"enforce_eager": True, "enable_prefix_caching": False, "seed": options.seed, **options.engine}
    with LLM(options.model, **engine) as llm:
        target = llm.config.model_config.arch
        if target.family not in EAGLE_FAMILIES:
            raise ValueError(f"train-eagle: EAGLE heads take Llama-family targets ({', '.join(EAGLE_FAMILIES)}); "
                             f"{target.architecture} is not one")  # fmt: skip
        aux = (
            check_aux_layers(options.aux_layers, target.num_layers)
            if options.aux_layers
            else default_aux_layers(target.num_layers)
        )
        prompts = _prompts(llm, options)
        params = [SamplingParams(temperature=options.temperature, max_tokens=options.gen_len,
                                 seed=options.seed + i if options.temperature > 0 else None)
                  for i in range(len(prompts))]  # fmt: skip
        logger.info("train-eagle: %d prompts, the target generates up to %d tokens each (%s), keeping the states "
                    "entering layers %s of %d", len(prompts), options.gen_len,
                    f"temperature {options.temperature}" if options.temperature else "greedy", aux, target.num_layers)  # fmt: skip
        sequences = generate_sequences(llm, prompts, params, aux, use_tqdm)
        holdout = sequences[len(sequences) - options.num_holdout :] if options.num_holdout else []
        train = sequences[: len(sequences) - len(holdout)]
        vocab = _draft_vocab(train, target.vocab_size, options.draft_vocab_size)
        model = llm.core.runner.model
        embeddings = _embedding_table(model, target.vocab_size)
        device = llm.core.runner.device
        del model
    generate_s = time.perf_counter() - started
    logger.info("train-eagle: %d sequences (%d held out), %d generated tokens, in %.1f s", len(sequences),
                len(holdout), sum(s.generated for s in sequences), generate_s)  # fmt: skip
    return _Data(target, aux, train, holdout, vocab, embeddings, device, generate_s)


def _prompts(llm, options: TrainOptions) -> list[list[int]]:
    """The prompts' token ids: chat prompts through the tokenizer, or random seeds of 8 tokens."""
    vocab_size = llm.config.model_config.arch.vocab_size
    if options.prompts == "random":
        prompts = random_prompt_ids(options.num_prompts, vocab_size, 8, options.seed)
    else:
        tokenizer = llm.get_tokenizer()
        if tokenizer is None:
            raise ValueError("train-eagle: the target has no tokenizer for chat prompts; use --prompts random")
        prompts = prompt_token_ids(tokenizer, instruction_prompts(options.num_prompts, options.seed))
    max_len = llm.config.model_config.max_model_len
    if max(len(p) for p in prompts) + options.gen_len > max_len:
        raise ValueError(f"train-eagle: the prompts (up to {max(len(p) for p in prompts)} tokens) and --gen-len "
                         f"{options.gen_len} do not fit the target's max_model_len {max_len}")  # fmt: skip
    return prompts


@torch.inference_mode()
def _embedding_table(model, vocab_size: int, chunk: int = 8192) -> torch.Tensor:
    """The target's input embedding [V, hidden], float32 on the host (the head reads it frozen)."""
    rows = [model.token_embeddings(torch.arange(i, min(i + chunk, vocab_size), device=_device_of(model)))
            .to("cpu", torch.float32) for i in range(0, vocab_size, chunk)]  # fmt: skip
    return torch.cat(rows).clone()


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def _draft_vocab(train: list[Sequence], vocab_size: int, size: int) -> DraftVocab:
    labels: Counter[int] = Counter()
    context: Counter[int] = Counter()
    for s in train:
        labels.update(s.token_ids[s.prompt_len :])
        context.update(s.token_ids[: s.prompt_len])
    return choose_draft_vocab(labels, context, vocab_size, size)

"""`llmserve train-eagle`'s settings, checked where they are made (a bad one is refused before the
target loads, naming its flag)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmserve.config import DEFAULT_MODEL

PROMPT_SOURCES = ("chat", "random")


@dataclass(frozen=True)
class TrainOptions:
    """What to generate and how to train (defaults: a few minutes for the default model on 2 CPU cores)."""

    out: str
    model: str = DEFAULT_MODEL
    num_prompts: int = 64  # sequences the target generates
    gen_len: int = 128  # tokens it generates for each (fewer where it stops)
    epochs: int = 6  # passes over the training sequences (0: write the untrained head, a baseline)
    lr: float = 1e-3  # AdamW's peak learning rate (warm-up, then cosine decay to 0)
    batch_size: int = 8  # sequences an optimizer step
    ttt_steps: int = 3  # proposal steps unrolled in training (EAGLE-3's training-time test)
    draft_vocab_size: int = 4096  # rows of the head's LM head (at most the target's vocabulary)
    aux_layers: tuple[int, ...] | None = (
        None  # the target layers whose input states it reads (None: default_aux_layers)
    )
    temperature: float = 0.0  # 0: the target's greedy text; > 0: sampled (seeded)
    prompts: str = "chat"  # chat: built-in instructions through the chat template; random: random token seeds
    holdout: float = 0.1  # the share of sequences kept out of training, to report accuracy on
    seed: int = 0
    engine: dict = field(default_factory=dict)  # more LLM(...) arguments for the target (dtype, max_model_len, ...)

    def __post_init__(self) -> None:
        for flag, value, least in (("--num-prompts", self.num_prompts, 1), ("--gen-len", self.gen_len, 1),
                                   ("--epochs", self.epochs, 0), ("--batch-size", self.batch_size, 1),
                                   ("--ttt-steps", self.ttt_steps, 1), ("--draft-vocab-size", self.draft_vocab_size, 1)):  # fmt: skip
            if not isinstance(value, int) or value < least:
                raise ValueError(f"train-eagle: {flag} must be an integer >= {least}; got {value!r}")
        if self.ttt_steps > 16:
            raise ValueError(
                f"train-eagle: --ttt-steps must be at most 16 (the most tokens a step proposes); got {self.ttt_steps}"
            )
        if not self.lr > 0:
            raise ValueError(f"train-eagle: --lr must be > 0; got {self.lr}")
        if not self.temperature >= 0:
            raise ValueError(f"train-eagle: --temperature must be >= 0 (0: greedy); got {self.temperature}")
        if not 0 <= self.holdout < 1:
            raise ValueError(f"train-eagle: --holdout is a share of the sequences in [0, 1); got {self.holdout}")
        if self.prompts not in PROMPT_SOURCES:
            raise ValueError(f"train-eagle: --prompts is one of {', '.join(PROMPT_SOURCES)}; got {self.prompts!r}")
        if self.aux_layers is not None and (len(self.aux_layers) != 3 or len(set(self.aux_layers)) != 3):
            raise ValueError(f"train-eagle: --aux-layers names 3 distinct target layers; got {list(self.aux_layers)}")
        if not self.out:
            raise ValueError("train-eagle: --out (the head's folder) is required")
        out = Path(self.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"train-eagle: --out {out} exists and is not an empty folder (pick another, or remove it)")

    @property
    def num_holdout(self) -> int:
        """Sequences kept out (none when that would leave no training sequence)."""
        n = int(self.num_prompts * self.holdout)
        return n if n < self.num_prompts else 0


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's (2, L // 2, L - 3) where those are 3 distinct layers; else spread as (L // 4, L // 2,
    3 L // 4) (a shallow target, such as the 6-layer tiny model)."""
    for layers in ((2, num_layers // 2, num_layers - 3), (num_layers // 4, num_layers // 2, 3 * num_layers // 4)):
        if len(set(layers)) == 3 and all(0 <= i < num_layers for i in layers):
            return tuple(sorted(layers))
    raise ValueError(f"train-eagle: an EAGLE-3 head reads 3 distinct layers; the target has {num_layers}")


def check_aux_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    if not all(0 <= i < num_layers for i in layers):
        raise ValueError(f"train-eagle: --aux-layers {list(layers)}: the target's layers are 0 .. {num_layers - 1}")
    return tuple(sorted(layers))

"""The training loop of `llmserve train-eagle`: batches of whole sequences through the head,
unrolled over `ttt_steps` proposal steps (model/eagle3_train_head.py), cross-entropy over the draft vocabulary, step
j weighted 0.8^j; AdamW with warm-up and cosine decay; per-epoch lines."""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmserve.model.eagle3_train_head import Eagle3TrainHead
from llmserve.spec_train.data import Sequence
from llmserve.spec_train.metrics import BatchStats, EpochStats, walk
from llmserve.spec_train.options import TrainOptions
from llmserve.spec_train.vocab import DraftVocab

logger = logging.getLogger(__name__)

STEP_DECAY = 0.8  # step j's loss weight is STEP_DECAY ** j (EAGLE-3's)
WARMUP = 0.05  # of the optimizer steps


@dataclass
class TargetInputs:
    """What the loss reads of the target, on the training device: its embedding table (the
    head's inputs) and the draft vocabulary's index (its labels)."""

    embeddings: torch.Tensor  # [V, hidden]
    vocab: DraftVocab

    def __post_init__(self) -> None:
        self.draft_index = self.vocab.draft_index().to(self.embeddings.device)


def fit(head: Eagle3TrainHead, train: list[Sequence], holdout: list[Sequence], target: TargetInputs,
        options: TrainOptions, use_tqdm: bool) -> list[dict]:  # fmt: skip
    """The training loop; per epoch its train and held-out stats (held-out also before training)."""
    from tqdm import tqdm

    batches_per_epoch = math.ceil(len(train) / options.batch_size)
    total = max(1, batches_per_epoch * options.epochs)
    warmup = max(1, int(WARMUP * total))
    opt = torch.optim.AdamW(head.parameters(), lr=options.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))))
    )
    rng = random.Random(options.seed)
    history = []
    if holdout:
        held = evaluate(head, holdout, target, options)
        logger.info("train-eagle: before training: held-out top-1 %.3f, acceptance length %.2f", held.top1,
                    held.acceptance_length)  # fmt: skip
        history.append({"epoch": 0, "held_out": held.as_dict()})
    for epoch in range(1, options.epochs + 1):
        started = time.perf_counter()
        order = list(train)
        rng.shuffle(order)
        stats = EpochStats()
        head.train()
        bar = tqdm(range(0, len(order), options.batch_size), desc=f"epoch {epoch}/{options.epochs}", disable=not use_tqdm,
                   leave=False)  # fmt: skip
        for i in bar:
            loss, batch = step_loss(head, order[i : i + options.batch_size], target, options.ttt_steps)
            stats.add(batch)
            if not loss.requires_grad:  # (no position to learn from in these sequences)
                continue
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            schedule.step()
            bar.set_postfix(loss=f"{stats.loss:.3f}", top1=f"{stats.top1:.3f}")
        row = {"epoch": epoch, "train": stats.as_dict(), "seconds": time.perf_counter() - started}
        line = (f"train-eagle: epoch {epoch}/{options.epochs}: loss {stats.loss:.3f}, top-1 {stats.top1:.3f}, "
                f"acceptance length {stats.acceptance_length:.2f} (train)")  # fmt: skip
        if holdout:
            held = evaluate(head, holdout, target, options)
            row["held_out"] = held.as_dict()
            line += f"; top-1 {held.top1:.3f}, acceptance length {held.acceptance_length:.2f} (held out)"
        logger.info("%s; %.1f s", line, row["seconds"])
        history.append(row)
    head.eval()
    return history


@torch.no_grad()
def evaluate(
    head: Eagle3TrainHead, sequences: list[Sequence], target: TargetInputs, options: TrainOptions
) -> EpochStats:
    head.eval()
    stats = EpochStats()
    for i in range(0, len(sequences), options.batch_size):
        stats.add(step_loss(head, sequences[i : i + options.batch_size], target, options.ttt_steps)[1])
    return stats


def step_loss(head: Eagle3TrainHead, seqs: list[Sequence], target: TargetInputs,
              steps: int) -> tuple[torch.Tensor, BatchStats]:  # fmt: skip
    """The weighted loss of a batch of sequences, unrolled `steps` steps, and its stats. Step j's
    index t predicts token t + 2 + j (the target's greedy choice there, for greedy text); a token
    outside the draft vocabulary is left out of the loss (the head cannot propose it)."""
    device = target.embeddings.device
    B, P = len(seqs), max(len(s.token_ids) - 1 for s in seqs)
    ids = torch.zeros((B, P + 1 + steps), dtype=torch.long)
    labelled = torch.zeros((B, P + 1 + steps), dtype=torch.bool)  # generated tokens: the positions to predict
    states = torch.zeros((B, P, seqs[0].states.shape[1]), dtype=torch.float32)
    for b, s in enumerate(seqs):
        n = len(s.token_ids)
        ids[b, :n] = torch.tensor(s.token_ids)
        labelled[b, s.prompt_len : n] = True
        states[b, : n - 1] = s.states
    ids, labelled, states = ids.to(device), labelled.to(device), states.to(device)
    outs = head.unroll(target.embeddings[ids[:, 1:]], states, steps)
    loss = torch.zeros((), device=device)
    weights = 0.0
    chain = torch.ones((B, P), dtype=torch.bool, device=device)  # every proposal right so far
    lead = torch.zeros((B, P), dtype=torch.long, device=device)  # leading right proposals at each index
    correct0 = 0
    for j, out in enumerate(outs):
        mask = labelled[:, 2 + j : 2 + j + P]
        token = target.draft_index[ids[:, 2 + j : 2 + j + P]]  # (-1: outside the draft vocabulary)
        trainable = mask & (token >= 0)
        logits = head.logits(out[trainable]).float()
        if logits.shape[0]:
            loss = loss + STEP_DECAY**j * F.cross_entropy(logits, token[trainable])
            weights += STEP_DECAY**j
        right = torch.zeros_like(mask)
        right[trainable] = logits.argmax(-1) == token[trainable]
        chain &= right
        lead += chain
        if j == 0:
            correct0 = int(right.sum())
    loss = loss / weights if weights else loss
    walked, verifications = walk(lead.tolist(), [s.prompt_len for s in seqs], [len(s.token_ids) for s in seqs])
    positions = int(labelled[:, 2 : 2 + P].sum())
    return loss, BatchStats(float(loss.detach()), correct0, positions, walked, verifications)

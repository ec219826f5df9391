"""The training text: the target generates it itself, from chat prompts built from a small list
of instructions (or from random token seeds), and its forward keeps the states an EAGLE-3 head
reads. The states come from the engine's own forward (`HiddenCapture`, the hook the EAGLE
runtime uses), so the head trains on exactly the features it is fed when it serves."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from llmserve.model.interface import HiddenCapture

# instructions x topics: many distinct chat prompts from a short list (none of them the
# workloads of llmserve/bench/workloads/, which measure the heads)
INSTRUCTIONS = (
    "Explain {} to a beginner in a few sentences.",
    "Write a short paragraph about {}.",
    "List three facts about {}.",
    "What are the advantages and disadvantages of {}?",
    "Give me a simple example that involves {}.",
    "Write a short story in which {} plays a part.",
    "Summarise what people should know about {}.",
    "Describe how {} works, step by step.",
    "Write a haiku about {}.",
    "What is the history of {}? Keep it brief.",
    "Compare {} with something similar, in a few sentences.",
    "Write an email to a friend recommending {}.",
    "What questions do students often ask about {}? Answer two of them.",
    "Write a Python function related to {}, with a docstring.",
    "Give five tips about {}.",
    "Why does {} matter today?",
)
TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "the moon", "honey bees", "rainforests",
    "electric cars", "the printing press", "bread baking", "chess", "the piano", "recycling",
    "sorting a list", "binary numbers", "the internet", "solar panels", "bicycles", "coffee",
    "the Roman Empire", "gardening", "sleep", "exercise", "saving money", "learning a language",
    "maps", "dinosaurs", "the human heart", "earthquakes", "trains", "libraries", "cooking rice",
    "prime numbers", "weather forecasts", "the ocean", "birds migrating", "friendship",
    "time management", "a city park", "spreadsheets", "music theory",
)  # fmt: skip


def instruction_prompts(num: int, seed: int) -> list[str]:
    """`num` user messages, distinct while the instruction x topic pairs last (then repeated)."""
    pairs = [(i, t) for i in INSTRUCTIONS for t in TOPICS]
    random.Random(seed).shuffle(pairs)
    return [pairs[k % len(pairs)][0].format(pairs[k % len(pairs)][1]) for k in range(num)]


def prompt_token_ids(tokenizer, messages: list[str]) -> list[list[int]]:
    """Each message as a chat's user turn (the tokenizer's chat template), else as plain text."""
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                               tokenize=False) for m in messages]  # fmt: skip
        return [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]
    return [list(tokenizer.encode(m)) for m in messages]


def random_prompt_ids(num: int, vocab_size: int, length: int, seed: int) -> list[list[int]]:
    """Random token seeds (a target without a tokenizer, or a check that needs no text)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (num, length), generator=g).tolist()


@dataclass(frozen=True)
class Sequence:
    """One generated sequence: its tokens, where the generated part starts, and the target's
    captured states of positions 0 .. len(token_ids) - 2: those entering the aux layers, the
    runtime's features of each pair."""

    token_ids: list[int]
    prompt_len: int
    states: torch.Tensor  # [len(token_ids) - 1, aux * hidden], on the host

    @property
    def generated(self) -> int:
        return len(self.token_ids) - self.prompt_len


class StateSink:
    """Collects a step's captured states by request and position (the runner's hidden sink); a
    position computed again (preemption by recompute) keeps its latest states."""

    def __init__(self) -> None:
        self.chunks: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def __call__(self, rows, states: list[torch.Tensor]) -> None:
        step = torch.cat(states, dim=-1).to("cpu")
        offset = 0
        for row in rows:
            self.chunks.setdefault(row.request_id, []).append((row.start, step[offset : offset + row.count]))
            offset += row.count

    def states(self, request_id: str, length: int) -> torch.Tensor:
        """Positions [0, length) of the request, every one required."""
        chunks = self.chunks.get(request_id, [])
        width = chunks[0][1].shape[1] if chunks else 0
        out = torch.empty((length, width), dtype=chunks[0][1].dtype if chunks else torch.float32)
        seen = torch.zeros(length, dtype=torch.bool)
        for start, c in chunks:
            n = max(0, min(len(c), length - start))
            out[start : start + n] = c[:n]
            seen[start : start + n] = True
        if not bool(seen.all()):
            raise RuntimeError(f"request {request_id}: the target's states of {int((~seen).sum())} of its {length} "
                               "positions were not captured")  # fmt: skip
        return out


def generate_sequences(llm, prompts: list[list[int]], params, aux_layers: tuple[int, ...],
                       use_tqdm: bool = True) -> list[Sequence]:  # fmt: skip
    """The target's own continuations of `prompts` (one SamplingParams each, or one for all)
    with the states entering `aux_layers` (in layer order) at every position it computed. The
    engine must run eagerly and without prefix caching (a cached prefix is never computed)."""
    runner = llm.core.runner
    sink = StateSink()
    runner.capture_hidden(HiddenCapture(layers=tuple(sorted(aux_layers))), sink)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=use_tqdm)
    finally:
        runner.capture_hidden(None)
    sequences = []
    for prompt, out in zip(prompts, outputs):
        tokens = list(prompt) + list(out.outputs[0].token_ids)
        sequences.append(Sequence(tokens, len(prompt), sink.states(out.request_id, len(tokens) - 1)))
    return sequences

"""The `llmserve train-eagle` command (parser and handler; the work is in train.py). Imports
nothing heavy until it runs."""

from __future__ import annotations

import argparse


def _layers(value: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in value.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"layer ids separated by commas, such as 2,15,27; got {value!r}") from None


def _train_eagle(args: argparse.Namespace) -> None:
    from llmserve.spec_train.options import TrainOptions
    from llmserve.spec_train.train import train_eagle3

    engine = {k: v for k, v in (("dtype", args.dtype), ("max_model_len", args.max_model_len),
                                ("device", args.device)) if v is not None}  # fmt: skip
    options = TrainOptions(out=args.out, model=args.model, num_prompts=args.num_prompts, gen_len=args.gen_len,
                           epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, ttt_steps=args.ttt_steps,
                           draft_vocab_size=args.draft_vocab_size, aux_layers=args.aux_layers,
                           temperature=args.temperature, prompts=args.prompts, holdout=args.holdout, seed=args.seed,
                           engine=engine)  # fmt: skip
    result = train_eagle3(options, use_tqdm=not args.no_progress)
    last = result.epochs[-1] if result.epochs else {}
    held = last.get("held_out")
    print(f"wrote an EAGLE-3 head ({result.draft_vocab_size}-token draft vocabulary, reading layers "
          f"{list(result.aux_layers)}; {result.sequences} sequences, {result.generated_tokens} generated tokens"
          + (f"; held out: top-1 {held['top1']:.3f}, acceptance length {held['acceptance_length']:.2f} at K = "
             f"{options.ttt_steps}" if held else "")
          + f") to {result.out}\nuse it: --speculative-config '{{\"method\": \"eagle3\", \"model\": \"{result.out}\", "
          f"\"num_speculative_tokens\": {options.ttt_steps}}}'")  # fmt: skip


def add_parser(sub) -> None:
    """Add `train-eagle` to the `llmserve` subparsers."""
    from llmserve.config import DEFAULT_MODEL
    from llmserve.spec_train.options import PROMPT_SOURCES, TrainOptions

    d = TrainOptions.__dataclass_fields__
    p = sub.add_parser("train-eagle", help="train an EAGLE-3 speculative-decoding head for a model on text the model "
                       "generates itself")  # fmt: skip
    p.add_argument("--model", default=DEFAULT_MODEL, help="the target: a Hugging Face folder, a GGUF file, or the "
                   f"default model's name (default {DEFAULT_MODEL})")  # fmt: skip
    p.add_argument("--out", required=True, help="the head's folder (config.json, model.safetensors); new or empty")
    p.add_argument("--num-prompts", type=int, default=d["num_prompts"].default, help="sequences the target writes")
    p.add_argument("--gen-len", type=int, default=d["gen_len"].default, help="tokens it writes for each (at most)")
    p.add_argument("--epochs", type=int, default=d["epochs"].default, help="passes over the text (0: write the "
                   "untrained head, a baseline)")  # fmt: skip
    p.add_argument("--lr", type=float, default=d["lr"].default, help="peak learning rate (AdamW, warm-up, cosine)")
    p.add_argument("--batch-size", type=int, default=d["batch_size"].default, help="sequences an optimizer step")
    p.add_argument("--ttt-steps", type=int, default=d["ttt_steps"].default, help="proposal steps unrolled in "
                   "training (EAGLE-3's training-time test)")  # fmt: skip
    p.add_argument("--draft-vocab-size", type=int, default=d["draft_vocab_size"].default, help="tokens the head can "
                   "propose: the most frequent it saw generated")  # fmt: skip
    p.add_argument("--aux-layers", type=_layers, default=None, help="the 3 target layers whose input states the head "
                   "reads, such as 2,15,27 (default: vLLM's 2, L/2, L-3)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=d["temperature"].default, help="the target's sampling "
                   "temperature for the training text (0: greedy)")  # fmt: skip
    p.add_argument("--prompts", default=d["prompts"].default, choices=PROMPT_SOURCES, help="chat: built-in "
                   "instructions through the chat template; random: random token seeds")  # fmt: skip
    p.add_argument("--holdout", type=float, default=d["holdout"].default, help="share of the sequences kept out of "
                   "training to report accuracy on")  # fmt: skip
    p.add_argument("--seed", type=int, default=d["seed"].default)
    p.add_argument("--dtype", default=None, help="the target's dtype (default: the engine's)")
    p.add_argument("--max-model-len", type=int, default=None, help="the target's context (default: the engine's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the engine's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (the per-epoch lines stay)")
    p.set_defaults(func=_train_eagle)

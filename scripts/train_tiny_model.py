#!/usr/bin/env python3
"""Train llmserve's tiny test model (the default until 2026-12-01): a tiny Llama that knows some Python docs.

Everything happens offline on a CPU:

1. Gather training text from Python's own documentation: the docstrings of the
   standard library (modules, classes, functions, methods), the language
   reference topics bundled in ``pydoc_data``, and, when installed, Debian's
   python3-doc HTML pages.
2. Build a small synthetic chat set from those docstrings ("What does
   `json.dumps` do?" -> first sentence of the docstring) rendered with the
   model's chat template, and mix it into the stream.
3. Train a byte-level BPE tokenizer with ``tokenizers`` and wrap it as a
   ``transformers`` fast tokenizer with ``<s>``/``</s>`` and chat tokens.
4. Train a small ``LlamaForCausalLM`` (AdamW, warmup + cosine schedule over a
   wall-clock budget) on 256-token windows, single-threaded, float32.
5. Save it in float16 with safetensors, plus tokenizer and generation config,
   and print a few greedy and sampled completions.

Example::

    nice -n 19 python scripts/train_tiny_model.py \
        --out llmserve/assets/tiny_model --minutes 35 --seed 0
"""

from __future__ import annotations

import argparse
import contextlib
import html.parser
import importlib
import inspect
import io
import json
import math
import os
import pkgutil
import random
import re
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# --------------------------------------------------------------------------
# Tokens and chat template
# --------------------------------------------------------------------------

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, END]  # ids 0..6

# Each turn is "<|role|>\n{content}" closed by <|end|>; assistant turns are
# closed by the eos token </s> instead, so generation stops right there.
# Roles other than system/assistant are rendered as user turns; content may
# be a string or a list of OpenAI-style {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{- '<|system|>\\n' -}}"
    "{%- elif message['role'] == 'assistant' -%}{{- '<|assistant|>\\n' -}}"
    "{%- else -%}{{- '<|user|>\\n' -}}{%- endif -%}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- eos_token -}}"
    "{%- else -%}{{- '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

SYSTEM_PROMPTS = [
    "You are a helpful assistant that answers questions about Python.",
    "You are a concise Python documentation assistant.",
    "Answer questions about the Python standard library.",
]

# --------------------------------------------------------------------------
# Gathering documentation text
# --------------------------------------------------------------------------

# Modules that open windows/browsers, print at import, start a REPL, are huge
# test suites, or are just boilerplate (generated codec modules).
SKIP_MODULES = {
    "antigravity",
    "this",
    "idlelib",
    "tkinter",
    "turtle",
    "turtledemo",
    "test",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "encodings",
    "xxsubtype",
    "xxlimited",
    "xxlimited_35",
    "__hello__",
    "__phello__",
}
SKIP_PARTS = {"test", "tests", "idle_test", "__main__"}
BOILERPLATE = ("Initialize self.", "Create and return a new object.")


@dataclass
class DocEntry:
    """One documented object of a module, with its cleaned docstring."""

    module: str
    name: str  # dotted name, e.g. "json.dumps"
    signature: str  # e.g. "(obj, *, skipkeys=False, ...)" or ""
    kind: str  # "module", "class", "function" or "method"
    doc: str


def stdlib_module_names() -> list[str]:
    """Public stdlib top-level module names plus their public submodules."""
    names: list[str] = []
    for top in sorted(sys.stdlib_module_names):
        if top.startswith("_") or top in SKIP_MODULES:
            continue
        names.append(top)
        module = quiet_import(top)
        if module is None or not hasattr(module, "__path__"):
            continue
        for info in pkgutil.walk_packages(module.__path__, top + ".", onerror=lambda _: None):
            parts = info.name.split(".")
            if any(p in SKIP_PARTS or p.startswith("_") for p in parts):
                continue
            names.append(info.name)
    return names


def quiet_import(name: str):
    """Import a module with stdout/stderr and warnings silenced; None on failure."""
    if any(name == s or name.startswith(s + ".") for s in SKIP_MODULES):
        return None
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except BaseException:  # ImportError, SystemExit, platform errors, ...
        return None


def is_doctest(line: str) -> bool:
    """True for doctest prompt lines (``>>>`` or ``...``)."""
    return line.lstrip().startswith((">>>", "..."))


def strip_addresses(text: str) -> str:
    """``<function f at 0x7f...>`` -> ``<function f>`` (reprs vary per run)."""
    return re.sub(r" at 0x[0-9a-fA-F]+>", ">", text)


def clean_doc(doc: str | None, min_chars: int = 30) -> str | None:
    """Normalise a docstring; None if tiny, boilerplate or mostly doctest."""
    if not doc:
        return None
    doc = inspect.cleandoc(doc).replace("\t", "    ")
    doc = strip_addresses(doc)
    doc = re.sub(r"\n\s*\n+", "\n\n", doc).strip()
    lines = [ln for ln in doc.splitlines() if ln.strip()]
    if sum(map(is_doctest, lines)) > 0.6 * len(lines):
        return None  # e.g. pickletools' byte-level test vectors
    if len(doc) < min_chars or doc.startswith(BOILERPLATE):
        return None
    return doc


def signature_of(obj) -> str:
    """A short ``(args)`` string for callables, or "" when unavailable."""
    try:
        sig = str(inspect.signature(obj))
    except Exception:  # no signature, or a broken __text_signature__
        return ""
    sig = strip_addresses(sig)
    return sig if len(sig) <= 240 else "(...)"


def public_members(module) -> Iterator[tuple[str, object]]:
    """Public classes and functions defined in ``module`` itself."""
    try:
        members = inspect.getmembers(module)
    except Exception:
        return
    for name, obj in members:
        if name.startswith("_") or not (inspect.isclass(obj) or callable(obj)):
            continue
        if getattr(obj, "__module__", None) not in (module.__name__, None):
            continue
        yield name, obj


def class_methods(cls) -> Iterator[tuple[str, object]]:
    """Public methods defined directly in ``cls`` (not inherited)."""
    for name, obj in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if callable(obj) or isinstance(obj, property):
            yield name, obj


def module_entries(module) -> list[DocEntry]:
    """Docstring entries for a module, its classes, functions and methods."""
    mod = module.__name__
    entries = []
    if doc := clean_doc(inspect.getdoc(module)):
        entries.append(DocEntry(mod, mod, "", "module", doc))
    for name, obj in public_members(module):
        qual = f"{mod}.{name}"
        kind = "class" if inspect.isclass(obj) else "function"
        if doc := clean_doc(inspect.getdoc(obj)):
            entries.append(DocEntry(mod, qual, signature_of(obj), kind, doc))
        if kind != "class":
            continue
        for mname, member in class_methods(obj):
            if doc := clean_doc(getattr(member, "__doc__", None)):
                entries.append(DocEntry(mod, f"{qual}.{mname}", signature_of(member), "method", doc))
    return entries


def gather_stdlib_entries() -> list[DocEntry]:
    """All de-duplicated docstring entries of the importable public stdlib."""
    entries, seen = [], set()
    for name in stdlib_module_names():
        module = quiet_import(name)
        if module is None:
            continue
        for entry in module_entries(module):
            if entry.doc not in seen:
                seen.add(entry.doc)
                entries.append(entry)
    return entries


def entries_to_documents(entries: list[DocEntry]) -> list[str]:
    """Group entries per module into pydoc-like plain-text documents."""
    docs: dict[str, list[str]] = {}
    for e in entries:
        head = f"Module {e.name}" if e.kind == "module" else e.name + e.signature
        docs.setdefault(e.module, []).append(f"{head}\n\n{e.doc}")
    return ["\n\n".join(parts) for parts in docs.values()]


def pydoc_topic_documents() -> list[str]:
    """The language-reference help topics shipped in ``pydoc_data``."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        return []
    return [inspect.cleandoc(text) for text in topics.values() if len(text) > 100]


class _TextExtractor(html.parser.HTMLParser):
    """Collects the visible text of the main body of a Sphinx HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style", "nav", "head"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("script", "style", "nav", "head") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def debian_html_documents(limit_mb: float = 20.0) -> list[str]:
    """Text of Debian's python3-doc HTML pages if installed (else empty)."""
    docs, total = [], 0
    for root in sorted(Path("/usr/share/doc").glob("python3*/html")):
        for page in sorted(root.rglob("*.html")):
            parser = _TextExtractor()
            parser.feed(page.read_text(encoding="utf-8", errors="replace"))
            text = re.sub(r"\n\s*\n+", "\n\n", "".join(parser.parts)).strip()
            if len(text) > 500:
                docs.append(text)
                total += len(text)
            if total > limit_mb * 1e6:
                return docs
    return docs


# --------------------------------------------------------------------------
# Synthetic chat data
# --------------------------------------------------------------------------

QUESTIONS = {
    "module": [
        "What is the `{n}` module?",
        "Tell me about the {n} module.",
        "What is {n} used for?",
        "What does the `{n}` module provide?",
    ],
    "other": [
        "What does `{n}` do?",
        "What is `{n}`?",
        "Explain {n} briefly.",
        "What is {n} used for?",
        "Can you describe `{n}`?",
    ],
}


def summary(doc: str, max_sentences: int = 2, max_chars: int = 400) -> str | None:
    """The first one or two sentences of a docstring's first paragraph."""
    para = doc.split("\n\n")[0]
    if para.lstrip().startswith((">>>", "..")) or re.match(r"^[\w.]+\(.*\)\s*(->.*)?$", para):
        return None  # a bare signature line (C builtins) or an example
    para = " ".join(para.split())
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z`])", para)
    text = " ".join(sentences[:max_sentences])
    if len(text) > max_chars:
        text = sentences[0]
    return text if 20 <= len(text) <= max_chars else None


def chat_example(entries: list[DocEntry], rng: random.Random) -> list[dict] | None:
    """One conversation of one or two Q/A turns about random documented names."""
    messages: list[dict] = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(2 if rng.random() < 0.2 else 1):
        entry = rng.choice(entries)
        answer = summary(entry.doc)
        if answer is None:
            return None
        kind = "module" if entry.kind == "module" else "other"
        question = rng.choice(QUESTIONS[kind]).format(n=entry.name)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


def save_tokenizer(tokenizer, out: Path) -> None:
    """Save tokenizer.json/tokenizer_config.json/special_tokens_map.json."""
    tokenizer.save_pretrained(out, save_jinja_files=False)  # template in the config
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # Spell the config the way both transformers 4.x and 5.x understand it.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("extra_special_tokens", None)
    config["additional_special_tokens"] = [SYSTEM, USER, ASSISTANT, END]
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT, END],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def check_tokenizer(tokenizer) -> None:
    """Assert byte-level round-trips and that the chat template renders."""
    sample = "def f(x):\n    return {'a': x}  # ünïcode ✓\n\n\tdone  "
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == sample, "tokenizer does not round-trip"
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "Q2"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    expected = f"{BOS}{SYSTEM}\nS{END}{USER}\nQ{END}{ASSISTANT}\nA{EOS}{USER}\nQ2{END}{ASSISTANT}\n"
    assert text == expected, f"unexpected chat rendering: {text!r}"


# --------------------------------------------------------------------------
# Training data
# --------------------------------------------------------------------------


def encode_documents(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text wrapped as ``<s> text </s>``."""
    backend = tokenizer.backend_tokenizer
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    encodings = backend.encode_batch(texts, add_special_tokens=False)
    return [[bos] + enc.ids + [eos] for enc in encodings]


def encode_chats(tokenizer, chats: list[list[dict]]) -> list[list[int]]:
    """Token ids of conversations rendered with the chat template."""
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in chats]
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return [enc.ids for enc in encodings]


def make_chats(entries: list[DocEntry], n_tokens: int, tokenizer, rng: random.Random) -> list[list[int]]:
    """Generate chat examples until they hold about ``n_tokens`` tokens."""
    usable = [e for e in entries if summary(e.doc)]
    chats: list[list[int]] = []
    total = 0
    while total < n_tokens:
        batch = [c for c in (chat_example(usable, rng) for _ in range(512)) if c]
        for ids in encode_chats(tokenizer, batch):
            chats.append(ids)
            total += len(ids)
    return chats


def split_validation(
    docs: list[list[int]], rng: random.Random, val_tokens: int = 20_000
) -> tuple[list[list[int]], list[list[int]]]:
    """Hold out random whole documents totalling about ``val_tokens`` tokens."""
    docs = docs[:]
    rng.shuffle(docs)
    n_val, total = 0, 0
    while total < val_tokens:
        total += len(docs[n_val])
        n_val += 1
    return docs[n_val:], docs[:n_val]


def pack(docs: list[list[int]], rng: random.Random) -> torch.Tensor:
    """Shuffle documents and concatenate them into one 1-D token stream."""
    docs = docs[:]
    rng.shuffle(docs)
    return torch.tensor([t for d in docs for t in d], dtype=torch.long)


def random_batch(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``seq`` tokens from the stream."""
    starts = torch.randint(0, len(stream) - seq, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq] for s in starts.tolist()])


# --------------------------------------------------------------------------
# Model and training
# --------------------------------------------------------------------------


def build_model(vocab_size: int, args: argparse.Namespace, tokenizer):
    """A small Llama (GQA, tied embeddings) in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(config)


def learning_rate(step: int, elapsed: float, args: argparse.Namespace) -> float:
    """Linear warmup by steps, then cosine decay over the wall-clock budget."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, elapsed / (args.minutes * 60))
    if args.max_steps:
        frac = max(frac, step / args.max_steps)
    floor = args.lr * 0.1
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * frac))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq: int, n_batches: int = 8) -> float:
    """Mean loss over fixed windows of the validation stream."""
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(n_batches):
        batch = random_batch(stream, 8, seq, gen)
        losses.append(model(input_ids=batch, labels=batch).loss.item())
    model.train()
    return sum(losses) / len(losses)


def train(model, train_stream: torch.Tensor, val_stream: torch.Tensor, args: argparse.Namespace) -> float:
    """Train until the wall-clock budget (or --max-steps) is used; return loss."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    start, step, ema = time.time(), 0, None
    model.train()
    while True:
        elapsed = time.time() - start
        if elapsed > args.minutes * 60 or (args.max_steps and step >= args.max_steps):
            break
        for group in optim.param_groups:
            group["lr"] = learning_rate(step, elapsed, args)
        batch = random_batch(train_stream, args.batch, args.seq, gen)
        loss = model(input_ids=batch, labels=batch).loss  # shifted internally
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        step += 1
        if step % args.log_every == 0:
            tps = step * args.batch * args.seq / (time.time() - start)
            print(
                f"step {step:5d}  {elapsed / 60:5.1f} min  loss {loss.item():.3f}  "
                f"ema {ema:.3f}  lr {optim.param_groups[0]['lr']:.2e}  {tps:.0f} tok/s",
                flush=True,
            )
        if step % args.eval_every == 0:
            print(f"  val loss {evaluate(model, val_stream, args.seq):.3f}", flush=True)
    print(
        f"trained {step} steps, {step * args.batch * args.seq:,} tokens in {(time.time() - start) / 60:.1f} min",
        flush=True,
    )
    return ema


# --------------------------------------------------------------------------
# Saving and samples
# --------------------------------------------------------------------------


def save_model(model, tokenizer, out: Path, max_bytes: int) -> int:
    """Save float16 safetensors weights, configs and tokenizer; return size."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float16)
    model.config.dtype = torch.float16
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        model.save_pretrained(out, safe_serialization=True)
    else:  # transformers >= 5 always writes safetensors
        model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    weights = out / "model.safetensors"
    weights.chmod(0o644)  # written 0600 via a temp file; the package ships it
    size = weights.stat().st_size
    assert size <= max_bytes, f"{weights} is {size} bytes > {max_bytes}"
    return size


def print_samples(out: Path) -> None:
    """Reload the saved model and print greedy and sampled completions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    check_tokenizer(tokenizer)
    prompts = {
        text: tokenizer(text, return_tensors="pt").input_ids
        for text in ("The json module", "Return a new list", "The os.path module")
    }
    for question in ("What does `json.dumps` do?", "What is the `collections` module?", "How do I read a file?"):
        chat = [{"role": "user", "content": question}]
        prompts[f"chat: {question}"] = tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, return_tensors="pt", return_dict=True
        ).input_ids
    for label, ids in prompts.items():
        for mode, kwargs in (
            ("greedy", {"do_sample": False}),
            ("sampled", {"do_sample": True, "temperature": 0.8, "top_p": 0.95}),
        ):
            torch.manual_seed(0)
            gen = model.generate(ids, max_new_tokens=60, **kwargs)
            text = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=False)
            print(f"--- [{mode}] {label!r}\n{text}\n", flush=True)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("llmserve/assets/tiny_model"))
    p.add_argument("--minutes", type=float, default=35.0, help="training wall-clock budget")
    p.add_argument("--max-steps", type=int, default=0, help="stop early (smoke tests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--chat-fraction", type=float, default=0.25)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--nice", type=int, default=19)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--max-mb", type=float, default=16.0, help="weights size limit")
    return p.parse_args()


def gather_corpus() -> tuple[list[DocEntry], list[str]]:
    """Docstring entries (for chat data) and plain-text documents."""
    t0 = time.time()
    entries = gather_stdlib_entries()
    docs = entries_to_documents(entries)
    topics, html_docs = pydoc_topic_documents(), debian_html_documents()
    print(
        f"stdlib: {len(entries)} docstrings in {len(docs)} modules, "
        f"{sum(map(len, docs)) / 1e6:.2f} MB; pydoc topics: {len(topics)} "
        f"({sum(map(len, topics)) / 1e6:.2f} MB); python3-doc html: {len(html_docs)} pages "
        f"({sum(map(len, html_docs)) / 1e6:.2f} MB)  [{time.time() - t0:.0f}s]",
        flush=True,
    )
    return entries, docs + topics + html_docs


def main() -> None:
    args = parse_args()
    os.nice(max(0, args.nice - os.nice(0)))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    entries, documents = gather_corpus()
    tokenizer = train_tokenizer(documents, args.vocab_size)
    check_tokenizer(tokenizer)
    print(
        f"tokenizer: {len(tokenizer)} tokens; specials "
        f"{ {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS} }",
        flush=True,
    )

    train_docs, val_docs = split_validation(encode_documents(tokenizer, documents), rng)
    n_text = sum(map(len, train_docs))
    chats = make_chats(entries, int(n_text * args.chat_fraction / (1 - args.chat_fraction)), tokenizer, rng)
    train_stream, val_stream = pack(train_docs + chats, rng), pack(val_docs, rng)
    print(
        f"train tokens: {len(train_stream):,} ({n_text:,} text + "
        f"{len(train_stream) - n_text:,} in {len(chats):,} chats); "
        f"val tokens: {len(val_stream):,}",
        flush=True,
    )

    model = build_model(len(tokenizer), args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters (tied embeddings)", flush=True)
    final_loss = train(model, train_stream, val_stream, args)
    val_loss = evaluate(model, val_stream, args.seq)
    print(f"final train loss (ema) {final_loss:.3f}  val loss {val_loss:.3f}", flush=True)

    size = save_model(model, tokenizer, args.out, int(args.max_mb * 2**20))
    print(f"saved to {args.out}: model.safetensors {size:,} bytes", flush=True)
    print_samples(args.out)


if __name__ == "__main__":
    main()

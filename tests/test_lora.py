"""Batched multi-LoRA at the model level, on CPU in float32, against Hugging Face PEFT.

PEFT adapters are made here with the real `peft` package on a tiny random Llama and saved with
save_pretrained. The oracle: transformers with the adapter merged (`merge_and_unload`), one
prompt at a time. llmserve runs four adapters of different ranks and targets and the base model
in ONE flat batch (prefill, then a decode step over the cache), teacher-forced, and must give
every position the oracle's logits and greedy token.

transformers and peft import triton: they are imported inside the fixtures, never at module
level, so that tests/test_lora_kernels.py (collected after this module) still sets
TRITON_INTERPRET=1 before triton is first imported.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from llmserve.lora import (
    LoRAAdapterError,
    LoRAContext,
    LoRAErrorKind,
    LoRASlotStore,
    apply_lora,
    read_peft_adapter,
)
from llmserve.lora.errors import UNUSABLE_PATH_MESSAGE
from llmserve.lora.ops import REFERENCE_LORA_OPS, LoRAOps
from llmserve.lora.reference import lora_expand_reference, lora_shrink_reference
from llmserve.lora.slot_table import SlotTable
from llmserve.lora_batch import NO_ADAPTER, make_lora_batch
from llmserve.model.arch import read_model_arch
from llmserve.model.attention import AttentionMetadata, reference_paged_attention
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.unit

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # four ranks and target sets; rsLoRA scaling; one adapter on layer 1 only
    "r4-qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "r8-all": dict(r=8, lora_alpha=16, target_modules=ALL),
    "r16-mlp-rslora": dict(r=16, lora_alpha=16, use_rslora=True,
                           target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"]),
    "r8-layer1": dict(r=8, lora_alpha=32, target_modules=["k_proj", "o_proj", "down_proj"], layers_to_transform=[1]),
}  # fmt: skip
PROMPTS = [[1, 17, 94, 250, 33, 7, 401, 62, 5], [1, 300, 12, 12, 88, 140], [1, 5, 230, 77, 19, 402, 9]]
MAX_RANK = 16
BLOCK = 16


def make_adapter(base, out: Path, seed: int, **config) -> Path:
    """A PEFT LoRA adapter of `base` (a model folder or an in-memory model) with random A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32) if isinstance(base, str | Path) else base
    get_peft_model(model, LoraConfig(init_lora_weights=False, **config)).save_pretrained(out)  # B is not zero
    return out


def merged_logits(base_dir: str, adapter_dir: Path | None) -> list[torch.Tensor]:
    """The oracle: transformers, the adapter merged into the weights, each prompt alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in PROMPTS]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> str:
    return str(make_random_model(tmp_path_factory.mktemp("lora_base"), "llama", seed=3))


@pytest.fixture(scope="module")
def adapter_dirs(base_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(base_dir, root / name, i, **cfg) for i, (name, cfg) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def oracle(base_dir, adapter_dirs) -> dict[str | None, list[torch.Tensor]]:
    return {None: merged_logits(base_dir, None)} | {n: merged_logits(base_dir, p) for n, p in adapter_dirs.items()}


@pytest.fixture(scope="module")
def adapters(base_dir, adapter_dirs):
    arch = read_model_arch(Path(base_dir))
    return {name: read_peft_adapter(path, name, arch, MAX_RANK) for name, path in adapter_dirs.items()}


class LoRAModel:
    """llmserve's model with LoRA layers, run over flat batches with the reference attention."""

    def __init__(self, base_dir: str, num_slots: int, quantization: str | None = None) -> None:
        from llmserve.model.loader import load_model

        self.arch = read_model_arch(Path(base_dir))
        self.model = load_model(base_dir, self.arch, torch.float32, "cpu", reference_paged_attention, progress=False,
                                quantization=quantization)  # fmt: skip
        self.store = LoRASlotStore(self.arch, num_slots, MAX_RANK)
        self.context = LoRAContext(max_num_tokens=256, num_slots=num_slots)
        self.applied = apply_lora(self.model, self.store, self.context)

    def run(self, seqs: list[tuple[list[int], str | None]]) -> list[torch.Tensor]:
        """Teacher-forced logits of each (prompt, adapter) in one batch: a prefill of all but the
        last token, then a decode step of the last tokens over the cache."""
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.zeros(2, len(seqs), BLOCK, self.arch.num_kv_heads, self.arch.head_dim)
        slots = [NO_ADAPTER if name is None else self.store.slot_of(name) for _, name in seqs]
        prefill = self._step([(p[:-1], 0, slot) for (p, _), slot in zip(seqs, slots)])
        decode = self._step([(p[-1:], len(p) - 1, slot) for (p, _), slot in zip(seqs, slots)])
        return [torch.cat([a, b]) for a, b in zip(prefill, decode)]

    def _step(self, chunks: list[tuple[list[int], int, int]]) -> list[torch.Tensor]:
        ids, positions, slot_mapping, token_slots, starts = [], [], [], [], [0]
        for block, (tokens, start, slot) in enumerate(chunks):
            pos = list(range(start, start + len(tokens)))
            ids += tokens
            positions += pos
            slot_mapping += [block * BLOCK + p for p in pos]
            token_slots += [slot] * len(tokens)
            starts.append(len(ids))
        seq_lens = [c[1] + len(c[0]) for c in chunks]
        meta = AttentionMetadata(torch.tensor(slot_mapping), torch.tensor(starts, dtype=torch.int32),
                                 torch.tensor(seq_lens, dtype=torch.int32),
                                 torch.arange(len(chunks), dtype=torch.int32)[:, None],
                                 max(len(c[0]) for c in chunks), max(seq_lens))  # fmt: skip
        self.context.set_token_slots(token_slots)
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(torch.tensor(ids), torch.tensor(positions), meta))
        return list(logits.split([len(c[0]) for c in chunks]))


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_four_adapters_and_the_base_in_one_batch_equal_merged_peft(base_dir, adapters, oracle):
    lm = LoRAModel(base_dir, num_slots=4)
    for adapter in adapters.values():
        lm.store.load(adapter)
    names = [None, *ADAPTERS]
    # every prompt with every adapter and the base, interleaved so that slots are not contiguous
    seqs = [(p, names[(i + k) % len(names)]) for k, p in enumerate(PROMPTS) for i in range(len(names))]
    for (prompt, name), got in zip(seqs, lm.run(seqs)):
        assert_matches(got, oracle[name][PROMPTS.index(prompt)])
    for name in ADAPTERS:  # the oracle has teeth: every adapter changes the greedy tokens
        assert any(not torch.equal(oracle[name][i].argmax(-1), oracle[None][i].argmax(-1)) for i in range(3)), name


@pytest.mark.parametrize(
    "family, shape",
    [
        ("qwen2", dict(tie_word_embeddings=True)),  # q/k/v biases, tied head
        ("qwen3", dict(head_dim=32)),
    ],
)  # q/k norms; q_size 128 != hidden 64
def test_other_families_equal_merged_peft(family, shape, tmp_path):
    base = str(make_random_model(tmp_path / family, family, seed=1, **shape))
    folder = make_adapter(base, tmp_path / "adapter", 0, r=8, lora_alpha=16, target_modules=ALL)
    lm = LoRAModel(base, num_slots=1)
    lm.store.load(read_peft_adapter(folder, "a", lm.arch, MAX_RANK))
    for got, want in zip(lm.run([(p, "a") for p in PROMPTS]), merged_logits(base, folder)):
        assert_matches(got, want)


def test_adapters_read_with_their_rank_scaling_and_targets(adapters):
    assert {n: (a.rank, a.scaling) for n, a in adapters.items()} == {
        "r4-qv": (4, 2.0), "r8-all": (8, 2.0), "r16-mlp-rslora": (16, 4.0), "r8-layer1": (8, 4.0)}  # fmt: skip
    assert adapters["r4-qv"].target_modules == ("q_proj", "v_proj")
    assert {layer for layer, _ in adapters["r8-layer1"].modules} == {1}


def test_a_batch_without_adapters_is_the_base_model(base_dir, adapters, oracle):
    lm = LoRAModel(base_dir, num_slots=2)
    lm.store.load(adapters["r8-all"])
    seqs = [(p, None) for p in PROMPTS]
    for (prompt, _), got in zip(seqs, lm.run(seqs)):
        assert_matches(got, oracle[None][PROMPTS.index(prompt)])
    assert lm.context.has_adapters is False
    plain = lm.run(seqs)
    calls = []
    counting = LoRAOps(lambda *args: calls.append(1) or lora_shrink_reference(*args), REFERENCE_LORA_OPS.expand)
    for layer in lm.applied.layers():
        layer.ops = counting
    lm.context.always_apply = True  # as under a CUDA graph: the LoRA ops run and add nothing
    assert all(torch.equal(a, b) for a, b in zip(lm.run(seqs), plain))
    assert len(calls) == 2 * 4 * lm.arch.num_layers  # two steps, four projections a layer


def test_lru_eviction_and_reload_give_the_same_logits(base_dir, adapters, oracle):
    lm = LoRAModel(base_dir, num_slots=2)
    a, b, c = "r4-qv", "r8-all", "r16-mlp-rslora"
    lm.store.load(adapters[a])
    lm.store.load(adapters[b])
    first = lm.run([(PROMPTS[0], a), (PROMPTS[1], b)])
    assignment = lm.store.load(adapters[c])  # full: `a` was used least recently
    assert assignment.evicted == a and lm.store.loaded() == [b, c]
    with pytest.raises(LoRAAdapterError) as e:
        lm.store.slot_of(a)
    assert e.value.kind is LoRAErrorKind.NOT_LOADED and e.value.status == 404
    got_c, got_b = lm.run([(PROMPTS[0], c), (PROMPTS[1], b)])
    assert_matches(got_c, oracle[c][0])
    assert_matches(got_b, oracle[b][1])
    assert lm.store.load(adapters[a], protected={b}).evicted == c  # `c` was used last, but `b` is protected
    again = lm.run([(PROMPTS[0], a), (PROMPTS[1], b)])
    torch.testing.assert_close(again[0], first[0], rtol=0, atol=1e-6)
    assert_matches(again[0], oracle[a][0])
    with pytest.raises(LoRAAdapterError) as e:  # every slot in use by the batch: nothing to evict
        lm.store.load(adapters[c], protected={a, b})
    assert e.value.kind is LoRAErrorKind.NO_FREE_SLOT and e.value.status == 503
    assert lm.store.loaded() == [a, b]


def test_unload_frees_and_zeroes_the_slot(base_dir, adapters, oracle):
    lm = LoRAModel(base_dir, num_slots=2)
    slot = lm.store.load(adapters["r8-all"]).slot
    lm.store.unload("r8-all")
    assert lm.store.loaded() == [] and float(lm.store.weights.scaling[slot]) == 0.0
    assert all(not w[:, slot].any() for w in [*lm.store.weights.a.values(), *lm.store.weights.b.values()])
    with pytest.raises(LoRAAdapterError, match="not loaded"):
        lm.store.unload("r8-all")
    assert lm.store.load(adapters["r4-qv"]).slot == slot  # the freed slot is handed out again


def test_remove_restores_the_original_layers(base_dir):
    lm = LoRAModel(base_dir, num_slots=1)
    assert len(lm.applied.layers()) == 4 * lm.arch.num_layers
    assert any(".base_layer." in n for n, _ in lm.model.named_parameters())
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(lm.model, lm.store, lm.context)
    lm.applied.remove()
    assert lm.applied.layers() == [] and not any(".base_layer." in n for n, _ in lm.model.named_parameters())


def test_an_fp8_model_takes_adapters_on_its_unquantized_activations(base_dir, adapters):
    """A wrapped FP8 layer quantizes its input itself (as the fused norm would have): the base
    model's rows equal FP8 without LoRA (to float32 rounding: the batch differs), and a wrapped
    layer adds exactly the reference delta to its FP8 base layer's output."""
    lm = LoRAModel(base_dir, num_slots=1, quantization="fp8")
    lm.store.load(adapters["r8-all"])
    plain = LoRAModel(base_dir, num_slots=1, quantization="fp8")
    plain.applied.remove()
    base_row, adapted = lm.run([(PROMPTS[0], None), (PROMPTS[0], "r8-all")])
    torch.testing.assert_close(base_row, plain.run([(PROMPTS[0], None)])[0], rtol=0, atol=1e-6)
    assert (adapted - base_row).abs().max() > 0.05
    layer = lm.model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, lm.arch.hidden_size)
    batch = make_lora_batch(torch.tensor([0, -1, 0]), 1)
    lm.context.set_token_slots([0, -1, 0])
    want = layer.base_layer(x)
    lora = layer.lora
    lora_expand_reference(want, lora_shrink_reference(x, lora.a, lora.scaling, batch), lora.b, lora.slice_offsets,
                          lora.max_slice_width, batch)  # fmt: skip
    torch.testing.assert_close(layer(x), want, rtol=0, atol=0)


# -- bad adapters ---------------------------------------------------------------------------


def _edit_config(**changes):
    def edit(folder: Path) -> None:
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))

    return edit


def _add_tensor(key: str):
    def edit(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "adapter_model.safetensors")
        save_file({**tensors, key: torch.zeros(8, 64)}, folder / "adapter_model.safetensors")
        _edit_config(target_modules="q_proj|lm_head")(folder)  # a regex: the tensors decide

    return edit


def _drop_b(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "lora_B" not in k}, folder / "adapter_model.safetensors")


BAD = {  # what is done to a copy of a good adapter (r8-all) -> the error's kind and words
    # an unusable path: one message for the client, the reason in `detail` (the server's log)
    "no folder": (lambda f: shutil.rmtree(f), LoRAErrorKind.UNUSABLE_PATH, "cannot be opened as a folder"),
    "a file": (lambda f: (shutil.rmtree(f), f.write_text("x")), LoRAErrorKind.UNUSABLE_PATH, "cannot be opened as a folder"),
    "no config": (lambda f: (f / "adapter_config.json").unlink(), LoRAErrorKind.UNUSABLE_PATH, "adapter_config.json is missing"),
    "no weights": (lambda f: (f / "adapter_model.safetensors").unlink(), LoRAErrorKind.UNUSABLE_PATH, "adapter_model.safetensors is missing"),
    "bin weights": (lambda f: (f / "adapter_model.safetensors").rename(f / "adapter_model.bin"), LoRAErrorKind.UNUSABLE_PATH, "only adapter_model.safetensors"),
    "config a folder": (lambda f: ((f / "adapter_config.json").unlink(), (f / "adapter_config.json").mkdir()), LoRAErrorKind.UNUSABLE_PATH, "not a regular file"),
    "bad json": (lambda f: (f / "adapter_config.json").write_text("{'r': 8,"), LoRAErrorKind.INVALID_CONFIG, "not valid JSON"),
    "json list": (lambda f: (f / "adapter_config.json").write_text("[8]"), LoRAErrorKind.INVALID_CONFIG, "JSON object"),
    "corrupt weights": (lambda f: (f / "adapter_model.safetensors").write_bytes(b"\x10" * 64), LoRAErrorKind.INVALID_WEIGHTS, "cannot be read"),
    "rank 32": (_edit_config(r=32), LoRAErrorKind.RANK_TOO_LARGE, "rank 32 is above the maximum LoRA rank 16"),
    "rank mismatch": (_edit_config(r=4), LoRAErrorKind.INVALID_WEIGHTS, "rank 8, but r is 4"),
    "negative rank": (_edit_config(r=-1), LoRAErrorKind.INVALID_CONFIG, "positive integer"),
    "lm_head target": (_edit_config(target_modules=["q_proj", "lm_head"]), LoRAErrorKind.UNSUPPORTED_MODULE, "lm_head"),
    "embedding tensor": (_add_tensor("base_model.model.model.embed_tokens.lora_embedding_A"), LoRAErrorKind.UNSUPPORTED_MODULE, "embed_tokens"),
    "lm_head tensor": (_add_tensor("base_model.model.lm_head.lora_A.weight"), LoRAErrorKind.UNSUPPORTED_MODULE, "lm_head"),
    "A without B": (_drop_b, LoRAErrorKind.INVALID_WEIGHTS, "lora_A and lora_B must both be present"),
    "DoRA": (_edit_config(use_dora=True), LoRAErrorKind.UNSUPPORTED_FEATURE, "DoRA"),
    "bias": (_edit_config(bias="lora_only"), LoRAErrorKind.UNSUPPORTED_FEATURE, "bias 'lora_only'"),
    "modules_to_save": (_edit_config(modules_to_save=["lm_head"]), LoRAErrorKind.UNSUPPORTED_FEATURE, "modules_to_save"),
    "rank_pattern": (_edit_config(rank_pattern={"q_proj": 4}), LoRAErrorKind.UNSUPPORTED_FEATURE, "rank_pattern"),
    "lora_bias": (_edit_config(lora_bias=True), LoRAErrorKind.UNSUPPORTED_FEATURE, "lora_bias"),
    "pissa": (_edit_config(init_lora_weights="pissa_niter_4"), LoRAErrorKind.UNSUPPORTED_FEATURE, "changed the base weights"),
    "LoHa": (_edit_config(peft_type="LOHA"), LoRAErrorKind.UNSUPPORTED_FEATURE, "only LORA"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_a_bad_adapter_is_refused_with_a_clear_error(case, base_dir, adapter_dirs, tmp_path):
    edit, kind, words = BAD[case]
    folder = tmp_path / "adapter"
    shutil.copytree(adapter_dirs["r8-all"], folder)
    edit(folder)
    with pytest.raises(LoRAAdapterError) as e:
        read_peft_adapter(folder, "bad", read_model_arch(Path(base_dir)), MAX_RANK)
    assert e.value.kind is kind and e.value.status == 400 and isinstance(e.value, ValueError)
    assert words in e.value.detail
    if kind is LoRAErrorKind.UNUSABLE_PATH:  # the client learns nothing of what is there
        assert str(e.value) == UNUSABLE_PATH_MESSAGE and str(folder) not in str(e.value)
    else:
        assert words in str(e.value)


def test_with_roots_the_folder_opened_is_the_one_checked_so_a_swapped_symlink_leads_nowhere(base_dir, adapter_dirs,
                                                                                              tmp_path):  # fmt: skip
    """A server checks the resolved path against --lora-roots, then the engine core reads it. A
    symlink swapped in between cannot redirect the read: the core opens the resolved folder and
    checks what it opened (a link now standing where the folder was reaches elsewhere: refused),
    and every file must lie inside the roots too. Without roots (an operator's own paths), links
    are followed as ever."""
    import os

    arch = read_model_arch(Path(base_dir))
    roots_dir, outside = tmp_path / "roots", tmp_path / "outside"
    shutil.copytree(adapter_dirs["r8-all"], roots_dir / "a")
    shutil.copytree(adapter_dirs["r4-qv"], outside / "b")  # a valid adapter outside the roots
    roots = (os.path.realpath(roots_dir),)
    (roots_dir / "link").symlink_to(roots_dir / "a")
    checked = os.path.realpath(roots_dir / "link")  # what the server checked and sends to the core
    (roots_dir / "link").unlink()
    (roots_dir / "link").symlink_to(outside / "b")  # swapped after the check
    assert read_peft_adapter(checked, "x", arch, MAX_RANK, roots=roots).rank == 8  # a's, not b's
    with pytest.raises(LoRAAdapterError) as e:  # a link given as is, with roots, is not what was checked
        read_peft_adapter(str(roots_dir / "link"), "x", arch, MAX_RANK, roots=roots)
    assert e.value.kind is LoRAErrorKind.UNUSABLE_PATH and "led to" in e.value.detail
    shutil.rmtree(roots_dir / "a")
    (roots_dir / "a").symlink_to(outside / "b")  # the checked folder itself swapped for a link out
    with pytest.raises(LoRAAdapterError) as e:
        read_peft_adapter(checked, "x", arch, MAX_RANK, roots=roots)
    assert e.value.kind is LoRAErrorKind.UNUSABLE_PATH and str(e.value) == UNUSABLE_PATH_MESSAGE
    shutil.copytree(adapter_dirs["r8-all"], roots_dir / "c")  # a file of the folder linking out of the roots
    (roots_dir / "c" / "adapter_model.safetensors").unlink()
    (roots_dir / "c" / "adapter_model.safetensors").symlink_to(outside / "b" / "adapter_model.safetensors")
    with pytest.raises(LoRAAdapterError, match="lora_path does not name") as e:
        read_peft_adapter(os.path.realpath(roots_dir / "c"), "x", arch, MAX_RANK, roots=roots)
    assert "inside --lora-roots" in e.value.detail
    assert read_peft_adapter(roots_dir / "link", "x", arch, MAX_RANK).rank == 4  # no roots: links followed


@pytest.mark.parametrize("shape, words", [(dict(hidden_size=32), "base model needs"),
                                          (dict(num_hidden_layers=3), "the base model has 2 layers")])  # fmt: skip
def test_an_adapter_of_another_base_shape_is_refused(shape, words, base_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512) | shape  # fmt: skip
    folder = make_adapter(LlamaForCausalLM(LlamaConfig(**config)), tmp_path / "other", 0, r=4, target_modules=ALL)
    with pytest.raises(LoRAAdapterError, match=words) as e:
        read_peft_adapter(folder, "other", read_model_arch(Path(base_dir)), MAX_RANK)
    assert e.value.kind is LoRAErrorKind.SHAPE_MISMATCH


def test_a_real_dora_adapter_is_refused(base_dir, tmp_path):
    folder = make_adapter(base_dir, tmp_path / "dora", 0, r=4, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(LoRAAdapterError, match="DoRA") as e:
        read_peft_adapter(folder, "dora", read_model_arch(Path(base_dir)), MAX_RANK)
    assert e.value.kind is LoRAErrorKind.UNSUPPORTED_FEATURE


def test_the_store_refuses_an_adapter_above_its_rank(base_dir, adapters):
    store = LoRASlotStore(read_model_arch(Path(base_dir)), num_slots=2, max_rank=8)
    with pytest.raises(LoRAAdapterError, match="rank 16 is above") as e:
        store.load(adapters["r16-mlp-rslora"])
    assert e.value.kind is LoRAErrorKind.RANK_TOO_LARGE and store.loaded() == []


# -- bookkeeping ----------------------------------------------------------------------------


def test_slot_table_hands_out_free_slots_then_evicts_the_least_recently_used():
    table = SlotTable(3)
    assert [table.assign(n).slot for n in "abc"] == [0, 1, 2]
    table.slot_of("a")  # used: b is now the least recently used
    assert table.assign("d").evicted == "b" and table.names() == ["c", "a", "d"]
    assert table.assign("a").evicted is None and table.names() == ["c", "d", "a"]  # already in: its slot
    assert table.release("c") == 2 and table.assign("e").slot == 2


def test_context_groups_tokens_by_slot_in_fixed_buffers():
    ctx = LoRAContext(max_num_tokens=8, num_slots=3)
    ctx.set_token_slots([2, -1, 0, 2, 0, -1])
    batch = ctx.batch(7)  # one padding token
    assert batch.token_slots.tolist() == [2, -1, 0, 2, 0, -1, -1]
    assert batch.slot_counts.tolist() == [2, 0, 2] and batch.slot_starts.tolist() == [2, 4, 4]
    assert batch.sorted_tokens[:6].tolist() == [1, 5, 2, 4, 0, 3] and batch.active
    assert batch.token_slots.data_ptr() == ctx.token_slots.data_ptr()  # the same buffer every step
    assert batch.row_blocks[:3].tolist() == [[0, 0], [2, 0], [-1, -1]]  # slot 1 has no block; then padding
    with pytest.raises(ValueError, match="must lie in"):
        ctx.set_token_slots([3])
    with pytest.raises(ValueError, match="got 5 tokens"):
        ctx.batch(5)


@pytest.mark.parametrize("num_tokens", [1, 7, 64, 65, 300])
def test_row_blocks_cover_every_adapter_token_once_within_the_grid(num_tokens):
    """The kernels' grid (max_row_blocks: token count and slots alone) holds every row block of
    any mix of slots, and the blocks take each adapter token exactly once."""
    from llmserve.lora_batch import max_row_blocks, row_block

    gen = torch.Generator().manual_seed(num_tokens)
    ctx = LoRAContext(max_num_tokens=512, num_slots=4)
    for mix in (torch.randint(-1, 4, (num_tokens,), generator=gen), torch.full((num_tokens,), 2),
                torch.tensor([0] * (num_tokens - num_tokens // 2) + [3] * (num_tokens // 2))):  # fmt: skip
        ctx.set_token_slots(mix)
        batch, block = ctx.batch(num_tokens), row_block(num_tokens)
        grid = max_row_blocks(num_tokens, 4)
        blocks = batch.row_blocks.tolist()
        assert len(blocks) >= grid and all(s == -1 for s, _ in blocks[grid:])
        taken = []
        for slot, first in blocks[:grid]:
            if slot >= 0:
                start, count = batch.slot_starts[slot].item(), batch.slot_counts[slot].item()
                taken += batch.sorted_tokens[start + first : start + min(first + block, count)].tolist()
        assert sorted(taken) == [i for i, s in enumerate(mix.tolist()) if s >= 0]

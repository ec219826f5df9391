"""4-bit weight-only checkpoints (GPTQ, AWQ): the packings against hand-made words, tiny
checkpoints written here (round to nearest per group: group sizes 32/64/128, symmetric and zero
points, act-order) loaded into the one layout and equal to the dequantized weights they encode,
the engine on them equal to the float model that holds those dequantized weights, the Triton
dequant-in-the-GEMM kernel (under the Triton interpreter) against the dequantize-then-multiply
reference, tensor-parallel shards, checkpoints that disagree with their config refused naming
the tensor, and load_format dummy on config-only folders (the drawn weights against the floats
they encode). (transformers loads GPTQ/AWQ folders only through optimum/gptqmodel/autoawq,
which are not installed: the dequantized reference is the oracle.)"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or llmserve.kernels is imported

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.config import ConfigError, EngineArgs  # noqa: E402
from llmserve.model.attention import AttentionMetadata, reference_paged_attention  # noqa: E402
from llmserve.model.loader import load_model  # noqa: E402
from llmserve.model.random_model import make_random_model  # noqa: E402
from llmserve.model.w4a16 import W4A16Linear, dequantize_w4a16, pack_rows, unpack_rows, w4a16_matmul_reference  # noqa: E402
from llmserve.model.w4a16_checkpoint import (  # noqa: E402
    act_order_importance,
    pack_awq,
    quantize_groups,
    unpack_awq,
    write_w4a16_checkpoint,
)

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 5 + i, 9, 33, 70 + i] * (1 + 3 * (i % 2))} for i in range(3)]
# (method, group size, symmetric, act-order)
VARIANTS = [("gptq", 32, True, False), ("gptq", 64, False, True), ("gptq", 128, True, True), ("awq", 32, False, False),
            ("awq", 128, False, False)]  # fmt: skip


def test_the_packings_against_hand_made_words():
    """GPTQ: input 8 j + i in nibble i of word j (low bits first); AWQ: output 8 j + (0, 2, 4, 6,
    1, 3, 5, 7)[i] in nibble i."""
    word = torch.tensor([[0x76543210, -0x1]], dtype=torch.int32)  # the second: all nibbles 15
    assert unpack_rows(word).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7] + [15] * 8]
    assert torch.equal(pack_rows(unpack_rows(word)), word)
    # AWQ's word 0x76543210 holds outputs 0, 2, 4, 6, 1, 3, 5, 7 as the values 0..7
    assert unpack_awq(torch.tensor([[0x76543210]], dtype=torch.int32)).tolist() == [[0, 4, 1, 5, 2, 6, 3, 7]]
    q = torch.randint(0, 16, (5, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_awq(pack_awq(q)), q) and torch.equal(unpack_rows(pack_rows(q)), q)


@pytest.mark.parametrize(("sym", "act_order"), [(True, False), (False, False), (False, True)])
def test_round_to_nearest_per_group(sym, act_order):
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1)) * torch.logspace(-2, 0, 128)
    q, scales, zeros, g_idx = quantize_groups(w, 32, sym, act_order)
    assert scales.shape == zeros.shape == (16, 4) and torch.bincount(g_idx.long()).tolist() == [32] * 4
    assert (g_idx.diff() < 0).any() == act_order  # act-order: groups scattered over the inputs
    deq = dequantize_w4a16(pack_rows(q), scales, zeros, g_idx)
    step = scales[:, g_idx.long()]
    # half a step; symmetric (GPTQ's grid, -8..7 steps around 8) clips the top of the positive side
    clipped = (w - 7 * step).clamp(min=0) if sym else torch.zeros_like(w)
    assert ((deq - w).abs() <= torch.maximum(step / 2, clipped) * (1 + 1e-3) + 1e-6).all()
    if sym:
        assert (zeros == 8).all() and clipped.max() > 0


def _float_with(model_dir: str, weights: dict[str, torch.Tensor], out: Path) -> str:
    """A copy of the float folder with some tensors replaced (the dequantized weights)."""
    shutil.copytree(model_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    tensors.update(weights)
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def _logits(model_dir: str, tokens: int = 20, **kwargs) -> torch.Tensor:
    cfg = EngineArgs(model=model_dir, max_model_len=128).create_engine_config()
    mc = cfg.model_config
    model = load_model(mc.model, mc.arch, mc.dtype, "cpu", reference_paged_attention, progress=False,
                       quantization=mc.quantization, **kwargs)  # fmt: skip
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, 2, 16, mc.arch.num_kv_heads, mc.arch.head_dim)
    meta = AttentionMetadata(torch.arange(tokens), torch.tensor([0, tokens], dtype=torch.int32),
                             torch.tensor([tokens], dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32),
                             tokens, tokens)  # fmt: skip
    with torch.inference_mode():
        return model.compute_logits(model(torch.arange(3, 3 + tokens), torch.arange(tokens), meta)), model


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> str:
    """Inputs of 128 and 256 (group size 128 divides them)."""
    return str(make_random_model(tmp_path_factory.mktemp("w4") / "llama", "llama", seed=5, hidden_size=128,
                                 intermediate_size=256))  # fmt: skip


@pytest.mark.parametrize(("method", "group", "sym", "act_order"), VARIANTS)
def test_a_checkpoint_loads_into_the_layout_and_runs_as_its_dequantized_weights(wide_llama, tmp_path, method, group,
                                                                              sym, act_order):  # fmt: skip
    """Write a GPTQ / AWQ folder, load it: every projection a W4A16Linear whose dequantized weight
    is what the quantizer encoded (q/k/v and gate/up fused), and the model's logits those of the
    float model holding the dequantized weights (float32: the same weights, the same products)."""
    path = write_w4a16_checkpoint(wide_llama, tmp_path / "q", method, group, sym, act_order)
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == method and qc["bits"] == 4 and qc["group_size"] == group
    source = load_file(str(Path(wide_llama) / "model.safetensors"))
    importance = act_order_importance(source)  # q/k/v (gate/up) share an input order
    fake = {}
    for name, w in source.items():
        if name.endswith("_proj.weight"):
            q, scales, zeros, g_idx = quantize_groups(w, group, sym, act_order, importance[name],
                                                      min_zero=int(method == "gptq"))  # fmt: skip
            fake[name] = (q.float() - zeros.float()[:, g_idx.long()]) * scales[:, g_idx.long()]
    got, model = _logits(str(path))
    layer = model.model.layers[1]
    assert isinstance(layer.self_attn.qkv_proj, W4A16Linear) and isinstance(layer.mlp.down_proj, W4A16Linear)
    assert layer.self_attn.qkv_proj.qweight.dtype == torch.int32 and layer.self_attn.qkv_proj.qweight.shape == (256, 16)
    qkv = torch.cat([fake[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.dequantized(), qkv)
    assert torch.equal(layer.mlp.down_proj.dequantized(), fake["model.layers.1.mlp.down_proj.weight"])
    want, _ = _logits(_float_with(wide_llama, fake, tmp_path / "fake"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("m", "k", "n", "group", "act_order"), [(1, 64, 96, 32, False), (5, 128, 40, 64, True),
                                                                 (16, 256, 72, 128, True), (20, 64, 8, -1, False)])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_kernel_equals_the_reference(m, k, n, group, act_order, dtype):
    from llmserve.kernels.w4a16_linear import w4a16_gemm_triton, w4a16_matmul_fast

    gen = torch.Generator().manual_seed(m + k)
    q, scales, zeros, g_idx = quantize_groups(torch.randn(n, k, generator=gen) * 0.05, group, False, act_order)
    qweight, scales = pack_rows(q), scales.to(torch.float16)
    x = torch.randn(m, k, generator=gen).to(dtype)
    want = w4a16_matmul_reference(x, qweight, scales, zeros, g_idx)
    got = w4a16_gemm_triton(x, qweight, scales, zeros, g_idx)
    # float32: the same products summed in another order; bfloat16: the weight rounded to bf16 by
    # the reference and not by the interpreter's float32 dot, and the output rounded once more
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(w4a16_gemm_triton(x, qweight, scales, zeros, g_idx, block_n=16, block_k=32), want, **tol)
    torch.testing.assert_close(w4a16_matmul_fast(x, qweight, scales, zeros, g_idx), want, **tol)


def test_the_model_on_the_kernel_gives_the_reference_logits(wide_llama, tmp_path):
    from llmserve.kernels.w4a16_linear import w4a16_matmul_fast
    from llmserve.model.layers import LayerOps

    path = str(write_w4a16_checkpoint(wide_llama, tmp_path / "q", "gptq", 64, False, True))
    ref, _ = _logits(path, tokens=12)
    fast, _ = _logits(path, tokens=12, ops=LayerOps(w4a16_matmul=w4a16_matmul_fast))
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)


def test_the_engine_serves_4_bit_checkpoints_over_two_ranks(wide_llama, tmp_path):
    """Tensor parallelism: column-parallel layers take their rows, row-parallel ones their inputs
    (and g_idx's slice, every group's scales kept: act-order groups span both ranks)."""
    for method, group, sym, act_order in (("gptq", 32, False, True), ("awq", 64, False, False)):
        path = str(write_w4a16_checkpoint(wide_llama, tmp_path / method, method, group, sym, act_order))
        with LLM(path, max_model_len=64) as one, LLM(path, max_model_len=64, tensor_parallel_size=2) as two:
            shard = two.core.runner.model.model.layers[0].mlp.down_proj
            assert (
                shard.qweight.shape == (128, 16)
                and shard.g_idx.shape == (128,)
                and shard.scales.shape == (128, 256 // group)
            )
            a = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
            assert a == [o.outputs[0].token_ids for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]
            assert one.core.runner.model.model.layers[0].self_attn.qkv_proj.scales.dtype == torch.float16


@pytest.fixture(scope="module")
def gptq_dir(wide_llama, tmp_path_factory) -> Path:
    return write_w4a16_checkpoint(wide_llama, tmp_path_factory.mktemp("g") / "gptq", "gptq", 32, True, True)


def _edited(src: Path, out: Path, change) -> str:
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def test_tensors_that_disagree_with_the_config_are_refused_naming_them(gptq_dir, tmp_path):
    def cut_scales(t):
        t["model.layers.1.mlp.up_proj.scales"] = t["model.layers.1.mlp.up_proj.scales"][:2]

    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.scales: checkpoint shape \(2, 256\)"):
        LLM(_edited(gptq_dir, tmp_path / "a", cut_scales), max_model_len=64)

    def other_order(t):  # k_proj's inputs in another order than q_proj's and v_proj's
        t["model.layers.0.self_attn.k_proj.g_idx"] = torch.arange(128, dtype=torch.int32) // 32

    with pytest.raises(ValueError, match=r"self_attn\.(k|q|v)_proj\.g_idx differs from the other parts"):
        LLM(_edited(gptq_dir, tmp_path / "b", other_order), max_model_len=64)

    def drop(t):
        del t["model.layers.0.mlp.down_proj.qzeros"]

    with pytest.raises(ValueError, match=r"lacks model\.layers\.0\.mlp\.down_proj\.qzeros"):
        LLM(_edited(gptq_dir, tmp_path / "c", drop), max_model_len=64)


@pytest.mark.parametrize(("change", "reason"), [
    ({"bits": 8}, "gptq with 8-bit weights"),
    ({"group_size": 48}, "group_size 48"),
    ({"group_size": 256}, "group_size 256 does not divide"),
    ({"lm_head": True}, "a 4-bit LM head"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "awq", "version": "gemv"}, "AWQ version 'gemv'"),
])  # fmt: skip
def test_unsupported_4_bit_configs_are_refused_at_start(gptq_dir, tmp_path, change, reason):
    model = tmp_path / "m"
    shutil.copytree(gptq_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"unsupported quantization_config: .*{reason}"):
        EngineArgs(model=str(model)).create_engine_config()


def test_the_quantization_flag_names_the_checkpoint_format(gptq_dir, llama_dir):
    assert EngineArgs(model=str(gptq_dir)).create_engine_config().model_config.quantization == "gptq"
    assert (
        EngineArgs(model=str(gptq_dir), quantization="gptq").create_engine_config().model_config.quantization == "gptq"
    )
    with pytest.raises(ConfigError, match=r"the checkpoint is GPTQ \(gptq, 4-bit, group 32, act-order\)"):
        EngineArgs(model=str(gptq_dir), quantization="int8").create_engine_config()
    with pytest.raises(ConfigError, match="gptq and awq name a checkpoint's own format"):
        EngineArgs(model=llama_dir, quantization="awq").create_engine_config()


def test_gptq_onto_4_bit_groups():
    """With an identity Hessian GPTQ is round-to-nearest; on correlated inputs it lowers the
    layer's output error against round-to-nearest, with and without act-order (whose groups then
    follow the inputs' energy)."""
    from llmserve.model.w4a16_gptq import dequantized, gptq_int4

    gen = torch.Generator().manual_seed(7)
    w = torch.randn(24, 128, generator=gen) * 0.05
    for sym in (True, False):
        got = gptq_int4(w, torch.eye(128, dtype=torch.float64), 32, sym, min_zero=1)
        want = quantize_groups(w, 32, sym, min_zero=1)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # correlated inputs (16 directions and a little noise), as a layer's activations are
    x = torch.randn(512, 16, generator=gen) @ torch.randn(16, 128, generator=gen) + 0.1 * torch.randn(
        512, 128, generator=gen
    )
    h = (x.t() @ x).double()
    rtn = dequantized(*quantize_groups(w, 32, False))
    err_rtn = (x @ (rtn - w).t()).norm()
    for act_order in (False, True):
        q, scales, zeros, g_idx = gptq_int4(w, h, 32, False, act_order)
        assert torch.bincount(g_idx.long()).tolist() == [32] * 4 and (g_idx.diff() < 0).any() == act_order
        err = (x @ (dequantized(q, scales, zeros, g_idx) - w).t()).norm()
        assert err < 0.5 * err_rtn, (act_order, err, err_rtn)  # (0.28 and 0.20 of it here)


def test_a_gptq_rounded_checkpoint_loads_and_runs(wide_llama, tmp_path):
    from llmserve.model.fp8_checkpoint import GptqCalibration

    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 97} token{i % 13}" for i in range(600)))
    path = write_w4a16_checkpoint(wide_llama, tmp_path / "g", "gptq", 64, False, True,
                                  GptqCalibration((str(text),), tokens=128, window=64))  # fmt: skip
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["llmserve_rounding"]["method"] == "gptq" and qc["desc_act"]
    with LLM(str(path), max_model_len=64) as llm:
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8
        layer = llm.core.runner.model.model.layers[0].self_attn.qkv_proj
        assert (layer.g_idx.diff() < 0).any()  # act-order by the Hessian: scattered groups, one order for q/k/v


# -- load_format dummy: 4-bit weights drawn, rounded and read through the checkpoint's loader ------

# config.json's quantization_config as checkpoints on the Hugging Face hub carry it
HUB_CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
}
# (method, the config's changes)
DUMMY_VARIANTS = [("gptq", {}), ("gptq", {"group_size": 32, "sym": False, "desc_act": True}),
                  ("gptq", {"group_size": -1, "checkpoint_format": "gptq_v2"}), ("awq", {}),
                  ("awq", {"group_size": 32})]  # fmt: skip


def _config_only(out: Path, method: str, change: dict) -> str:
    """A folder with config.json (inputs of 128 and 256) and a tokenizer, no weights."""
    path = make_random_model(out, "llama", hidden_size=128, intermediate_size=256, config_only=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {**HUB_CONFIGS[method], **change}
    (path / "config.json").write_text(json.dumps(cfg))
    assert not list(path.glob("*.safetensors"))
    return str(path)


def _w4a16_layers(model) -> list[tuple[str, W4A16Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, W4A16Linear)]


@pytest.mark.parametrize(("method", "change"), DUMMY_VARIANTS)
def test_dummy_4_bit_weights_run(tmp_path, method, change):
    """A config-only GPTQ / AWQ folder with load_format dummy: the engine runs as the checkpoint's
    format (int32 words, float16 scales, the groups and input order of its config), every weight
    dequantized within the drawn range uniform(-0.02, 0.02) (GPTQ's symmetric grid reaches 8 steps
    below zero: 16/15 of it), and the same seed draws the same tokens."""
    path = _config_only(tmp_path / "m", method, change)
    group = change.get("group_size", 128)
    args = dict(model=path, load_format="dummy", device="cpu", max_model_len=64)
    with LLM(**args) as llm:
        mc = llm.config.model_config
        assert mc.quantization == method and mc.checkpoint_quantization.group_size == group
        layers = _w4a16_layers(llm.core.runner.model)
        assert len(layers) == 2 * 4  # q/k/v, o, gate/up, down of 2 layers
        for name, layer in layers:
            k = layer.in_features
            assert layer.qweight.dtype == torch.int32 and layer.qweight.shape == (layer.out_features, k // 8)
            assert layer.scales.dtype == torch.float16 and layer.zeros.dtype == torch.uint8
            assert layer.scales.shape == (layer.out_features, 1 if group == -1 else k // group)
            assert (layer.scales > 0).all()
            counts = torch.bincount(layer.g_idx.long()).tolist()
            assert counts == [k if group == -1 else group] * layer.scales.shape[1], name
            assert (layer.g_idx.diff() < 0).any() == change.get("desc_act", False), name
            if method == "gptq" and change.get("sym", True):
                assert (layer.zeros == 8).all(), name
            w = dequantize_w4a16(layer.qweight, layer.scales, layer.zeros, layer.g_idx)
            assert w.abs().max() <= 0.02 * 16 / 15 * 1.002, name
            assert 0.0105 < w.std() < 0.0127 and w.max() > 0.018 and w.min() < -0.018, name  # uniform: 0.0115
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert all(len(t) == 8 for t in got)
    with LLM(**args) as again:
        assert [o.outputs[0].token_ids for o in again.generate(PROMPTS, GREEDY, use_tqdm=False)] == got


def test_dummy_4_bit_weights_the_config_cannot_hold_are_refused_at_start(tmp_path):
    """o_proj's input (heads * head_dim: 4 * 48) that group 128 does not divide: a config error
    (a 4xx), not a failure while drawing."""
    path = _config_only(tmp_path / "m", "gptq", {})
    cfg = json.loads((Path(path) / "config.json").read_text())
    (Path(path) / "config.json").write_text(json.dumps({**cfg, "head_dim": 48}))
    with pytest.raises(ConfigError, match="group_size 128 does not divide the projections' input width 192"):
        EngineArgs(model=path, load_format="dummy", device="cpu").create_engine_config()


@pytest.mark.parametrize(("method", "change"), DUMMY_VARIANTS)
def test_dummy_4_bit_weights_encode_the_floats_drawn(tmp_path, method, change):
    """The packing: with known floats in place of the random draw, every layer's dequantized rows
    (q/k/v and gate/up fused, each part's rows) are within half a step of them (GPTQ's symmetric
    grid clips the top 0.5 step, as GPTQ v1's zero points of at least 1 may): nibbles, zero points
    or scales in the wrong place are many steps off."""
    from llmserve.model.w4a16_checkpoint import W4A16Loader, draw_dummy_w4a16, read_w4a16_quantization

    path = _config_only(tmp_path / "m", method, change)
    cfg = EngineArgs(model=path, load_format="dummy", device="cpu").create_engine_config().model_config
    model = load_model(cfg.model, cfg.arch, cfg.dtype, "cpu", reference_paged_attention, load_format="dummy",
                       progress=False, quantization=cfg.quantization)  # fmt: skip
    floats = {}

    def draw(name, shape, device):
        gen = torch.Generator().manual_seed(len(floats))
        floats[name] = torch.randn(shape, generator=gen) * torch.logspace(-3, -1, shape[1])  # unlike groups
        return floats[name].to(device)

    loader = W4A16Loader(model, read_w4a16_quantization(json.loads((Path(path) / "config.json").read_text())))
    draw_dummy_w4a16(loader, torch.Generator().manual_seed(0), draw)
    assert len(floats) == 2 * 7
    sym = method == "gptq" and change.get("sym", True)
    for i in range(2):
        for fused, parts in (("self_attn.qkv_proj", "qkv"), ("self_attn.o_proj", "o"), ("mlp.gate_up_proj", "gu"),
                             ("mlp.down_proj", "d")):  # fmt: skip
            layer = model.get_submodule(f"model.layers.{i}.{fused}")
            names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
                     "g": "mlp.gate_proj", "u": "mlp.up_proj", "d": "mlp.down_proj"}  # fmt: skip
            want = torch.cat([floats[f"model.layers.{i}.{names[p]}"] for p in parts])
            g = layer.g_idx.long()
            step, zero = layer.scales.float()[:, g], layer.zeros.float()[:, g]
            # the grid's ends: -z and 15 - z steps (a weight beyond them is clipped: GPTQ's symmetric
            # grid tops at 7 steps, and v1 keeps z >= 1)
            clipped = (want - (15 - zero) * step).clamp(min=0) + (-zero * step - want).clamp(min=0)
            err = (layer.dequantized() - want).abs()
            # (the scales are float16, rounded after the zero point: up to 15 steps off by 2^-11 each)
            assert (err <= torch.maximum(step / 2, clipped) + step * 15 * 2**-11 + 1e-7).all(), (i, fused)
            assert sym == bool((layer.zeros == 8).all())

"""W8A8 INT8 (`--quantization int8`, compressed-tensors int8 checkpoints, `make-int8-checkpoint`):
the exact integer reference against dequantize-then-multiply, quantization error bounds, the
engine quantizing at load and staying close to the float model, tensor-parallel shards, a
checkpoint loaded as it is (bit-equal to quantizing at load), SmoothQuant keeping the float
model, and bad checkpoints refused at start. The Triton kernel and `torch._int_mm`:
tests/test_int8_kernels.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, EngineArgs
from llmserve.model.attention import AttentionMetadata, reference_paged_attention
from llmserve.model.int8 import (
    INT8_MAX,
    Int8Linear,
    dequantize_int8,
    int8_gemm_reference,
    int8_matmul_reference,
    quantize_rows_int8,
    quantize_tokens_int8,
)
from llmserve.model.int8_checkpoint import SmoothQuant, write_int8_checkpoint
from llmserve.model.loader import load_model

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 5 + i, 9, 33, 70 + i] * (1 + 3 * (i % 2))} for i in range(4)]


def test_the_integer_reference_is_the_dequantized_product():
    """The exact int32 product then the scales equals dequantize-then-multiply to float32
    rounding, and the rounding error of weights and tokens is half a step of their scale."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 200, generator=gen) * torch.logspace(-2, 1, 200)  # outlier channels
    w = torch.randn(48, 200, generator=gen) * 0.05
    wq, sw = quantize_rows_int8(w)
    xq, sx = quantize_tokens_int8(x)
    assert wq.dtype == xq.dtype == torch.int8 and sw.shape == (48, 1) and sx.shape == (9, 1)
    assert wq.abs().max() == INT8_MAX and xq.abs().amax(dim=1).eq(INT8_MAX).all()
    assert ((dequantize_int8(wq, sw) - w).abs() <= sw / 2 + 1e-7).all()
    assert ((dequantize_int8(xq, sx) - x).abs() <= sx / 2 * (1 + 1e-5)).all()
    got = int8_gemm_reference(xq, sx, wq, sw, torch.float32)
    want = dequantize_int8(xq, sx) @ dequantize_int8(wq, sw).t()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # against the float product: within the bound of both operands' rounding (half a step each)
    exact = x @ w.t()
    bound = sx / 2 * w.abs().sum(1) + x.abs() @ (sw / 2).expand(48, 200).t() + sx / 2 * sw.t() / 2 * 200
    assert ((got - exact).abs() <= bound * (1 + 1e-4) + 1e-6).all()
    assert (got - exact).abs().max() > 0.02 * bound.max()  # (a worst case; random errors partly cancel)
    assert torch.isfinite(quantize_tokens_int8(torch.zeros(2, 8))[1]).all()  # an all-zero token


def test_a_static_input_scale_saturates_at_127():
    x = torch.tensor([[0.5, -3.0, 10.0]])
    xq, sx = quantize_tokens_int8(x, torch.tensor(0.02))
    assert xq.tolist() == [[25, -127, 127]] and sx.item() == pytest.approx(0.02)
    layer = Int8Linear(3, 2, bias=False)
    layer.weight.data = torch.tensor([[1, 2, 3], [-4, 5, 6]], dtype=torch.int8)
    layer.weight_scale.data = torch.tensor([[0.5], [0.25]])
    layer.input_scale = torch.nn.Parameter(torch.tensor(0.02), requires_grad=False)
    want = (torch.tensor([[25.0, -127, 127]]) @ torch.tensor([[1.0, 2, 3], [-4, 5, 6]]).t()) * 0.02
    torch.testing.assert_close(layer(x), want * torch.tensor([[0.5, 0.25]]))


def _logits(model_dir: str, quantization: str | None, tokens: int = 24, **kwargs) -> torch.Tensor:
    cfg = EngineArgs(model=model_dir, quantization=quantization, max_model_len=128).create_engine_config()
    mc = cfg.model_config
    model = load_model(mc.model, mc.arch, mc.dtype, "cpu", reference_paged_attention, progress=False,
                       quantization=mc.quantization, quantization_ignore=mc.quantization_ignore, **kwargs)  # fmt: skip
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, 2, 16, mc.arch.num_kv_heads, mc.arch.head_dim)
    meta = AttentionMetadata(torch.arange(tokens), torch.tensor([0, tokens], dtype=torch.int32),
                             torch.tensor([tokens], dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32),
                             tokens, tokens)  # fmt: skip
    with torch.inference_mode():
        return model.compute_logits(model(torch.arange(3, 3 + tokens), torch.arange(tokens), meta))


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen2"])
def test_int8_logits_stay_close_to_the_float_model(model_dirs, family):
    """--quantization int8 on a float32 checkpoint: every projection an Int8Linear, the logits
    within a few percent of the float model's range, and the greedy choice mostly the same."""
    base = _logits(model_dirs[family], None)
    int8 = _logits(model_dirs[family], "int8")
    spread = base.abs().max()
    assert (int8 - base).abs().max() < 0.05 * spread
    assert (int8 - base).abs().mean() < 0.01 * spread
    assert (int8.argmax(-1) == base.argmax(-1)).float().mean() >= 0.8


def test_torch_int_mm_gives_the_reference_logits_bit_for_bit(llama_dir):
    """The model with `torch._int_mm` (under CUDA's padding rules; a GPU's path for more than 16
    tokens) and with the reference: the same int32 sums and the same epilogue, so the same
    logits exactly."""
    from llmserve.kernels.int8_linear import int8_gemm_int_mm
    from llmserve.model.layers import LayerOps

    def int_mm_matmul(x, weight, weight_scale, input_scale=None):
        xq, sx = quantize_tokens_int8(x, input_scale)
        return int8_gemm_int_mm(xq, sx, weight, weight_scale, x.dtype, cuda_rules=True)

    ref = _logits(llama_dir, "int8")
    fast = _logits(llama_dir, "int8", ops=LayerOps(int8_matmul=int_mm_matmul))
    assert torch.equal(ref, fast)


def test_the_engine_runs_int8_and_mostly_agrees_with_float(model_dirs):
    base = LLM(model_dirs["llama"], max_model_len=128)
    int8 = LLM(model_dirs["llama"], max_model_len=128, quantization="int8")
    layer = int8.core.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int8Linear) and isinstance(layer.mlp.down_proj, Int8Linear)
    assert (
        layer.mlp.gate_up_proj.weight.dtype == torch.int8 and layer.mlp.gate_up_proj.weight_scale.dtype == torch.float32
    )
    assert int8.core.runner.model.model.embed_tokens.weight.dtype == torch.float32  # embedding and LM head stay
    a = [o.outputs[0].token_ids for o in base.generate(PROMPTS, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in int8.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert sum(x[0] == y[0] for x, y in zip(a, b)) >= 3
    assert sum(p == q for x, y in zip(a, b) for p, q in zip(x, y)) >= 0.6 * sum(map(len, a))


def test_dummy_weights_and_projections_kept_in_16_bits(model_dirs):
    with LLM(model_dirs["llama"], load_format="dummy", quantization="int8", max_model_len=64) as llm:
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12
        assert llm.core.runner.model.model.layers[1].mlp.down_proj.weight.dtype == torch.int8
    with LLM(model_dirs["llama"], quantization="int8", max_model_len=64,
             quantization_ignore="model.layers.1.mlp.down_proj") as llm:  # fmt: skip
        layers = llm.core.runner.model.model.layers
        assert layers[1].mlp.down_proj.weight.dtype == torch.float32
        assert isinstance(layers[0].mlp.down_proj, Int8Linear)


def test_int8_shards_over_two_ranks(llama_dir):
    """Tensor parallelism: column-parallel layers split their rows and their scales; row-parallel
    ones their columns, each rank quantizing its slice (of the weight rows at load, of the
    tokens per step), so the sums differ from one rank's by rounding: the first tokens agree."""
    with LLM(llama_dir, max_model_len=64, quantization="int8") as one, \
            LLM(llama_dir, max_model_len=64, quantization="int8", tensor_parallel_size=2) as two:  # fmt: skip
        shard = two.core.runner.model.model.layers[0]
        assert shard.self_attn.qkv_proj.weight.shape == (64, 64) and shard.self_attn.qkv_proj.weight_scale.shape == (
            64,
            1,
        )
        assert shard.mlp.down_proj.weight.shape == (64, 64) and shard.mlp.down_proj.weight.dtype == torch.int8
        a = [o.outputs[0].token_ids[:4] for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert a == [o.outputs[0].token_ids[:4] for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def int8_checkpoint(llama_dir, tmp_path_factory):
    return write_int8_checkpoint(llama_dir, tmp_path_factory.mktemp("int8") / "w8a8")


def test_a_compressed_tensors_int8_checkpoint_loads_as_it_is(llama_dir, int8_checkpoint):
    """make-int8-checkpoint's folder: compressed-tensors `int-quantized` with int8 weights and
    channel scales; the engine runs it as int8 without flags, the same weights as quantizing the
    float checkpoint at load (bit for bit), and the same tokens, also over two ranks."""
    from safetensors import safe_open

    cfg = json.loads((int8_checkpoint / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "int-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["weights"] == {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "channel",
        "dynamic": False,
    }
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"]
    with safe_open(str(int8_checkpoint / "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.int8
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == (64, 1)
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    cfg = EngineArgs(model=str(int8_checkpoint)).create_engine_config()
    assert cfg.model_config.quantization == "int8" and cfg.model_config.checkpoint_quantization.weights == "channel"
    with LLM(str(int8_checkpoint), max_model_len=64) as from_file, \
            LLM(llama_dir, max_model_len=64, quantization="int8") as at_load:  # fmt: skip
        a, b = from_file.core.runner.model, at_load.core.runner.model
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            assert torch.equal(p, q), name
        want = [o.outputs[0].token_ids for o in at_load.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in from_file.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
    with LLM(str(int8_checkpoint), max_model_len=64, tensor_parallel_size=2) as two:  # whole rows' scales on each rank
        assert [o.outputs[0].token_ids[:4] for o in two.generate(PROMPTS, GREEDY, use_tqdm=False)] == [
            w[:4] for w in want
        ]


def test_static_activations_and_an_ignore_list(llama_dir, tmp_path):
    path = write_int8_checkpoint(llama_dir, tmp_path / "static", activations="static",
                                 ignore=("model.layers.0.self_attn.qkv_proj",))  # fmt: skip
    qc = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                            "model.layers.0.self_attn.v_proj"]  # fmt: skip
    with LLM(str(path), max_model_len=64) as llm:
        layers = llm.core.runner.model.model.layers
        assert layers[0].self_attn.qkv_proj.weight.dtype == torch.float32  # kept in 16 bits (here float32)
        assert layers[1].self_attn.qkv_proj.input_scale is not None  # q/k/v: the largest of their scales
        assert layers[1].mlp.down_proj.input_scale.item() > 0
        base = LLM(llama_dir, max_model_len=64)
        a = [o.outputs[0].token_ids[0] for o in base.generate(PROMPTS, GREEDY, use_tqdm=False)]
        b = [o.outputs[0].token_ids[0] for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert sum(x == y for x, y in zip(a, b)) >= 3


def test_smoothquant_keeps_the_float_model_and_helps_outlier_channels(llama_dir, tmp_path):
    """SmoothQuant's migration leaves the float product unchanged (the norm divides what the
    weights' columns multiply); on inputs with outlier channels it lowers the W8A8 error."""
    from llmserve.model.int8_checkpoint import smooth_tensors

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=gen) * torch.where(torch.arange(64) % 16 == 0, 30.0, 1.0)  # outliers
    norm = torch.rand(64, generator=gen) + 0.5
    w = {p: torch.randn(48, 64, generator=gen) * 0.05 for p in ("q", "k", "v")}
    tensors = {"model.layers.0.input_layernorm.weight": norm.clone(),
               **{f"model.layers.0.self_attn.{p}_proj.weight": t.clone() for p, t in w.items()}}  # fmt: skip
    amax = {"model.layers.0.self_attn.q_proj": (x * norm).abs().amax(dim=0)}
    smooth_tensors(tensors, amax, 0.5, num_layers=1)
    x_s = x * tensors["model.layers.0.input_layernorm.weight"]
    w_q = tensors["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(x_s @ w_q.t(), (x * norm) @ w["q"].t(), rtol=1e-4, atol=1e-4)
    exact = (x * norm) @ w["q"].t()
    plain = int8_matmul_reference(x * norm, *quantize_rows_int8(w["q"]))
    smoothed = int8_matmul_reference(x_s, *quantize_rows_int8(w_q))
    assert (smoothed - exact).abs().mean() < 0.7 * (plain - exact).abs().mean()
    # the writer: a checkpoint whose float model (before rounding) is the source's
    path = write_int8_checkpoint(llama_dir, tmp_path / "sq", smooth=SmoothQuant(0.5))
    assert json.loads((path / "config.json").read_text())["quantization_config"]["llmserve_smoothquant"]["alpha"] == 0.5
    with LLM(str(path), max_model_len=64) as llm:
        assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 12


@pytest.mark.parametrize(("group", "reason"), [
    ({"weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128}}, "int8 weight strategy 'group'"),
    ({"weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": False}}, "asymmetric int8 weights"),
    ({"weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
      "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": False}},
     "asymmetric int8 activations"),
    ({"weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
      "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}, "8-bit float"),
])  # fmt: skip
def test_unsupported_int8_configs_are_refused_at_start(llama_dir, tmp_path, group, reason):
    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": group}}
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ConfigError, match=f"unsupported quantization_config: .*{reason}"):
        EngineArgs(model=str(model)).create_engine_config()


def test_a_checkpoint_whose_scales_disagree_is_refused_naming_the_tensor(int8_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(int8_checkpoint, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.1.mlp.up_proj.weight_scale"] = tensors["model.layers.1.mlp.up_proj.weight_scale"][:5]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(Exception, match=r"model\.layers\.1\.mlp\.up_proj\.weight_scale"):
        LLM(str(bad), max_model_len=64)


def test_int8_flags_refused_where_they_cannot_apply(int8_checkpoint, model_dirs):
    with pytest.raises(ConfigError, match=r"the checkpoint is INT8 \(compressed-tensors\); quantization 'fp8'"):
        EngineArgs(model=str(int8_checkpoint), quantization="fp8").create_engine_config()
    with pytest.raises(ConfigError, match="quantization int8 is for dense models"):
        EngineArgs(model=_moe_dir(model_dirs), quantization="int8").create_engine_config()


def _moe_dir(model_dirs) -> str:
    from pathlib import Path

    from llmserve.model.random_model import make_random_model

    out = Path(model_dirs["llama"]).parent / "qwen3_moe_int8"
    return str(out if (out / "config.json").exists() else make_random_model(out, "qwen3_moe", seed=3))

"""LoRA adapters over quantized bases (issue 57): W8A8 INT8 (`--quantization int8`), 4-bit GPTQ and
AWQ checkpoints, and a GGUF file kept quantized. The base output comes from the quantized GEMM and
the adapter's delta from the input as it arrives (16/32-bit), as on an unquantized base.

The oracle for each base is its dequantized twin: a float model that loads the weights the
quantized layers hold, dequantized, with the same adapters. Two adapters and the base model in one
`generate` call, float32, greedy: the same tokens, each adapter's different from the base's.

W8A8 also rounds the activations, so INT8's twin rounds them too: its projections (all seven, the
row-parallel o and down included) round their input per token to int8 steps (amax / 127) and
multiply the dequantized weights in float32, which equals the integer product with its scales to
float32 rounding (tests/test_int8.py). Without that rounding the float model is another model
(log-probabilities 5e-4 apart on this one: near-tied greedy tokens of a random model change)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or llmserve.kernels is imported

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from llmserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from llmserve.lora.apply import LoRALinear  # noqa: E402
from llmserve.model.fp8 import DenseLinear  # noqa: E402
from llmserve.model.gguf.writer import write_gguf  # noqa: E402
from llmserve.model.gguf_linear import GGUFLinear  # noqa: E402
from llmserve.model.int8 import Int8Linear, dequantize_int8, quantize_tokens_int8  # noqa: E402
from llmserve.model.random_model import make_random_model  # noqa: E402
from llmserve.model.registry import family_of  # noqa: E402
from llmserve.model.tensor_parallel import RowParallelLinear  # noqa: E402
from llmserve.model.w4a16 import W4A16Linear  # noqa: E402
from llmserve.model.w4a16_checkpoint import write_w4a16_checkpoint  # noqa: E402

pytestmark = pytest.mark.integration

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv-mlp-r4": dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]),
}
PROMPTS = [[1, 5, 9, 33, 70, 2, 18], [3, 8, 200, 11, 7, 64, 90, 2, 41, 5, 6]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# a GGUF file of K-quants, Q8_0 and Q5_0 projections (and Q4_1, not kept: dense rows of a kept layer)
GGUF_TYPES = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q8_0", "gate_proj": "Q5_K",
              "up_proj": "Q4_1", "down_proj": "Q5_0"}  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Inputs of 256 and 512: whole K-quant super-blocks and 4-bit groups of 32 and 64."""
    return make_random_model(tmp_path_factory.mktemp("lq") / "llama", "llama", seed=11, hidden_size=256,
                             intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


@pytest.fixture(scope="module")
def adapters(base) -> dict[str, Path]:
    from test_lora import make_adapter

    return {n: make_adapter(str(base), base.parent / n, 20 + i, **cfg) for i, (n, cfg) in enumerate(ADAPTERS.items())}


def _greedy(llm: LLM, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """Every prompt with each adapter and with none, all in one generate call."""
    names = [None, *adapters]
    requests = {n: LoRARequest(n, i, str(adapters[n])) for i, n in enumerate(names) if n}
    outs = llm.generate([{"prompt_token_ids": p} for _ in names for p in PROMPTS], GREEDY, use_tqdm=False,
                        lora_request=[requests.get(n) for n in names for _ in PROMPTS])  # fmt: skip
    tokens = [o.outputs[0].token_ids for o in outs]
    return {n: tokens[i * len(PROMPTS) : (i + 1) * len(PROMPTS)] for i, n in enumerate(names)}


def _engine(model: str, **kwargs) -> LLM:
    return LLM(model, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=64, **kwargs)


def _dequantized_twin(llm: LLM, base: Path, out: Path) -> str:
    """A copy of the float folder holding the weights of `llm`'s quantized projections, dequantized."""
    model = llm.core.runner.model
    tensors = load_file(str(base / "model.safetensors"))
    for i, layer in enumerate(model.decoder_layers()):
        for spec in family_of(model.arch).linears(model.arch):
            proj = layer.get_submodule(spec.path)
            proj = proj.base_layer if isinstance(proj, LoRALinear) else proj
            if isinstance(proj, Int8Linear):
                w = dequantize_int8(proj.weight, proj.weight_scale)
            else:
                assert isinstance(proj, W4A16Linear | GGUFLinear), type(proj)
                w = proj.dequantized()
            for part, rows in zip(spec.parts, w.split(list(spec.widths))):
                tensors[f"model.layers.{i}.{spec.parent}.{part}.weight"] = rows.float().contiguous()
    shutil.copytree(base, out)
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def _int8_activations(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A float projection whose input is rounded as W8A8 rounds it (per token, amax / 127)."""
    xq, sx = quantize_tokens_int8(x)
    return F.linear(dequantize_int8(xq, sx).to(x.dtype), weight, bias)


def _check(quantized: dict, twin: dict) -> None:
    assert quantized == twin
    for name, tokens in quantized.items():  # each adapter changes the tokens of its requests
        assert name is None or tokens != quantized[None], name


def test_lora_on_int8_w8a8_gives_the_dequantized_twins_tokens(base, adapters, tmp_path):
    llm = _engine(str(base), quantization="int8")
    qkv = llm.core.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, LoRALinear) and isinstance(qkv.base_layer, Int8Linear)
    got = _greedy(llm, adapters)
    twin = _engine(_dequantized_twin(llm, base, tmp_path / "twin"))
    for m in twin.core.runner.model.modules():
        if isinstance(m, DenseLinear | RowParallelLinear):  # every projection (the LM head is an nn.Linear)
            m.linear = _int8_activations
    _check(got, _greedy(twin, adapters))


@pytest.mark.parametrize(("method", "group", "sym", "act_order"),
                         [("gptq", 32, False, True), ("awq", 64, False, False)])  # fmt: skip
def test_lora_on_4_bit_checkpoints_gives_the_dequantized_twins_tokens(base, adapters, tmp_path, method, group, sym,
                                                                     act_order):  # fmt: skip
    path = write_w4a16_checkpoint(str(base), tmp_path / method, method, group, sym, act_order)
    llm = _engine(str(path))
    assert isinstance(llm.core.runner.model.model.layers[1].mlp.down_proj.base_layer, W4A16Linear)
    got = _greedy(llm, adapters)
    _check(got, _greedy(_engine(_dequantized_twin(llm, base, tmp_path / "twin")), adapters))


def test_lora_on_a_gguf_kept_quantized_gives_the_dequantized_files_tokens(base, adapters, tmp_path):
    """The twin is the same file dequantized at load (--no-gguf-keep-quantized)."""
    path = write_gguf(base, tmp_path / "m.gguf", lambda hf: GGUF_TYPES.get(hf.split(".")[-2], "F16"))
    kept = _engine(str(path), gguf_keep_quantized=True)
    layer = kept.core.runner.model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj.base_layer, layer.mlp.gate_up_proj.base_layer
    assert isinstance(qkv, GGUFLinear) and [p.type_name for p in qkv.pieces] == ["Q4_K", "Q6_K"]
    assert [p.type_name for p in gate_up.pieces] == ["Q5_K", "dense"]
    got = _greedy(kept, adapters)
    _check(got, _greedy(_engine(str(path), gguf_keep_quantized=False), adapters))


def test_lora_on_a_4_bit_base_over_two_ranks_gives_one_processs_tokens(base, adapters, tmp_path):
    """Tensor parallelism: each rank its share of the 4-bit weights and of each adapter (the
    row-parallel layers' shrink outputs summed over the ranks, as on a 16-bit base)."""
    path = str(write_w4a16_checkpoint(str(base), tmp_path / "gptq", "gptq", 32, False, True))
    with _engine(path) as one, _engine(path, tensor_parallel_size=2) as two:
        assert _greedy(two, adapters) == _greedy(one, adapters)

"""GGUF kept quantized (model/gguf_linear.py, model/gguf_keep.py, kernels/gguf_linear.py): each
format's Triton kernel (under the interpreter) against the loader's dequantizer then a matmul, on
blocks the quantizers wrote and on random bytes; a layer of mixed pieces on the fast path against
the reference; the engine on a mixed-format GGUF (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0 kept; Q4_1, F16 not) kept quantized
on CPU gives the dequantize-at-load path's greedy tokens; the real Gemma 3 270M Q4_K_M too."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or llmserve.kernels is imported

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.config import ConfigError, EngineArgs  # noqa: E402
from llmserve.kernels.gguf_linear import gguf_gemm_triton, gguf_matmul_fast  # noqa: E402
from llmserve.model.gguf.dequant import dequantize  # noqa: E402
from llmserve.model.gguf.quantize import quantize  # noqa: E402
from llmserve.model.gguf.writer import write_gguf  # noqa: E402
from llmserve.model.gguf_linear import (  # noqa: E402
    KEPT_FORMATS,
    DenseRows,
    GGUFBlocks,
    GGUFLinear,
    gguf_matmul_reference,
    layer_bytes,
)
from llmserve.model.random_model import make_random_model  # noqa: E402

pytestmark = pytest.mark.integration

FORMATS = list(KEPT_FORMATS)  # Q8_0 Q5_0 Q4_K Q5_K Q6_K
K = 512  # two super-blocks a row
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _raw(type_name: str, rows: int, random_bytes: bool, seed: int = 0) -> torch.Tensor:
    """[rows, K / block * nbytes] bytes: floats quantized by the quantizers, or random bytes with
    finite fp16 scales (every bit of the packed values and 6-bit scales, negative Q6_K scales)."""
    gen = torch.Generator().manual_seed(seed)
    fmt = KEPT_FORMATS[type_name]
    if not random_bytes:
        w = torch.randn(rows, K, generator=gen)
        return torch.from_numpy(quantize(w.numpy(), type_name).view(np.uint8).reshape(rows, -1).copy())
    blocks = torch.randint(0, 256, (rows, K // fmt.block, fmt.nbytes), dtype=torch.uint8, generator=gen)
    for f in fmt.fields:
        if f.dtype == torch.float16:
            d = (torch.rand(rows, K // fmt.block, generator=gen) * 0.02).to(torch.float16)
            blocks[:, :, f.offset : f.offset + 2] = d.view(torch.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def _piece(type_name: str, rows: int, random_bytes: bool = False, seed: int = 0) -> GGUFBlocks:
    piece = GGUFBlocks(type_name, rows, K)
    piece.load_raw(_raw(type_name, rows, random_bytes, seed))
    return piece


@pytest.mark.parametrize("type_name", FORMATS)
def test_fields_join_back_into_the_files_bytes(type_name):
    raw = _raw(type_name, 3, random_bytes=True)
    piece = GGUFBlocks(type_name, 3, K)
    piece.load_raw(raw)
    assert torch.equal(piece.raw(), raw)
    assert torch.equal(piece.dequantized(), dequantize(raw, type_name, (3, K)))
    # the fp16 d of the first block is its own field, typed
    first = KEPT_FORMATS[type_name].fields
    d = next(f for f in first if f.name == "d")
    assert piece.d[0, 0].item() == raw[0, d.offset : d.offset + 2].view(torch.float16).item()


@pytest.mark.parametrize("random_bytes", [False, True], ids=["quantized", "random-bytes"])
@pytest.mark.parametrize("type_name", FORMATS)
def test_kernel_equals_dequantize_then_matmul(type_name, random_bytes):
    rows = 40  # not a multiple of the kernel's 64 columns: masked
    piece = _piece(type_name, rows, random_bytes)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(16 if random_bytes else 3, K, generator=gen)  # (rows past 3: masked)
    want = x @ dequantize(piece.raw(), type_name, (rows, K)).t()
    got = gguf_gemm_triton(x, type_name, piece.fields())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _mixed_layer() -> GGUFLinear:
    layer = GGUFLinear(K, [("Q4_K", 24), ("dense", 8), ("Q6_K", 16)], bias=True)
    layer.pieces[0].load_raw(_raw("Q4_K", 24, False, 2))
    layer.pieces[2].load_raw(_raw("Q6_K", 16, True, 3))
    with torch.no_grad():
        layer.pieces[1].weight.normal_(generator=torch.Generator().manual_seed(4))
        layer.bias.normal_(generator=torch.Generator().manual_seed(5))
    return layer


def test_a_layer_of_mixed_pieces_fast_path_equals_the_reference():
    layer = _mixed_layer()
    assert isinstance(layer.pieces[1], DenseRows) and layer.out_features == 48
    gen = torch.Generator().manual_seed(6)
    for m in (3, 20):  # the kernels (<= 16 tokens), dequantize + one GEMM (more)
        x = torch.randn(m, K, generator=gen)
        want = gguf_matmul_reference(x, list(layer.pieces), layer.bias)
        torch.testing.assert_close(x @ layer.dequantized().t() + layer.bias, want, rtol=1e-5, atol=1e-4)
        got = gguf_matmul_fast(x, list(layer.pieces), layer.bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


# -- a whole model: a mixed-format GGUF kept quantized == dequantized at load ------------------
# layer 0: the K-quants and Q8_0; layer 1: Q5_0, and Q4_1 and F16 (not kept: dense rows of a kept layer)
TYPES = {
    (0, "q_proj"): "Q4_K", (0, "k_proj"): "Q4_K", (0, "v_proj"): "Q6_K", (0, "o_proj"): "Q8_0",
    (0, "gate_proj"): "Q5_K", (0, "up_proj"): "Q5_K", (0, "down_proj"): "Q6_K",
    (1, "q_proj"): "Q4_1", (1, "k_proj"): "Q4_K", (1, "v_proj"): "Q8_0", (1, "o_proj"): "Q5_0",
    (1, "gate_proj"): "F16", (1, "up_proj"): "Q4_K", (1, "down_proj"): "Q4_K",
}  # fmt: skip


def _type_of(hf: str) -> str:
    parts = hf.split(".")
    if hf.startswith("model.layers."):
        return TYPES[(int(parts[2]), parts[4])]
    return "F16" if "embed" in hf else "Q6_K"  # the embedding, the LM head: dequantized either way


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory):
    folder = make_random_model(tmp_path_factory.mktemp("mixed") / "llama", "llama", seed=3, hidden_size=256,
                               intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    return write_gguf(folder, folder.parent / "mixed.gguf", _type_of)


def _greedy(path, keep: bool):
    prompts = [[1, 5, 9, 33, 70], [3, 8, 200, 11, 7, 64, 90, 2]]
    llm = LLM(str(path), max_model_len=128, dtype="float32", gguf_keep_quantized=keep)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_a_mixed_gguf_kept_quantized_on_cpu_gives_the_dequantized_tokens(mixed_gguf):
    kept, kept_tokens = _greedy(mixed_gguf, True)
    layers = kept.core.runner.model.model.layers
    kinds = lambda m: [p.type_name for p in m.pieces]  # noqa: E731
    assert kinds(layers[0].self_attn.qkv_proj) == ["Q4_K", "Q6_K"]  # q and k share a piece
    assert kinds(layers[0].self_attn.o_proj) == ["Q8_0"] and kinds(layers[0].mlp.gate_up_proj) == ["Q5_K"]
    assert kinds(layers[1].self_attn.qkv_proj) == ["dense", "Q4_K", "Q8_0"]
    assert kinds(layers[1].mlp.gate_up_proj) == ["dense", "Q4_K"]
    assert kinds(layers[1].self_attn.o_proj) == ["Q5_0"]
    kept_bytes = layer_bytes(kept.core.runner.model)
    _, plain_tokens = _greedy(mixed_gguf, False)
    assert kept_tokens == plain_tokens
    assert 0 < kept_bytes["kept"] < kept_bytes["total"]


def test_keeping_is_refused_where_it_cannot_run(mixed_gguf, tmp_path):
    auto = EngineArgs(model=str(mixed_gguf), device="cpu").create_engine_config()
    assert auto.model_config.quantization is None  # a CPU dequantizes at load unless asked
    forced = EngineArgs(model=str(mixed_gguf), device="cpu", gguf_keep_quantized=True).create_engine_config()
    assert forced.model_config.quantization == "gguf"
    with pytest.raises(ConfigError, match="quantization fp8"):
        EngineArgs(model=str(mixed_gguf), gguf_keep_quantized=True, quantization="fp8").create_engine_config()
    folder = make_random_model(tmp_path / "hf", "llama", seed=1)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        EngineArgs(model=str(folder), gguf_keep_quantized=True).create_engine_config()


def test_a_gguf_kept_quantized_over_two_ranks_gives_one_processs_tokens(tmp_path, caplog):
    """Tensor parallelism: q/k/v and gate/up ranks take their rows of each part (q and k after
    llama's row permutation), o and down their whole blocks of every row; layer 1's o_proj in
    Q4_K has 256 inputs, 128 a rank, half a block: dequantized at load (logged), each rank its
    columns. Layer 0's down_proj (Q6_K, 512 inputs: one block a rank) stays kept."""
    folder = make_random_model(tmp_path / "llama", "llama", seed=4, hidden_size=256, intermediate_size=512,
                               num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    types = {**TYPES, (1, "o_proj"): "Q4_K"}
    path = write_gguf(folder, tmp_path / "tp.gguf",
                      lambda hf: types[(int(hf.split(".")[2]), hf.split(".")[4])] if hf.startswith("model.layers.")
                      else _type_of(hf))  # fmt: skip
    prompts = [{"prompt_token_ids": p} for p in ([1, 5, 9, 33, 70], [3, 8, 200, 11, 7, 64, 90, 2])]
    with caplog.at_level("INFO", logger="llmserve.model.gguf_keep"):
        two = LLM(str(path), max_model_len=128, dtype="float32", gguf_keep_quantized=True, tensor_parallel_size=2)
    with two, LLM(str(path), max_model_len=128, dtype="float32", gguf_keep_quantized=True) as one:
        layers = two.core.runner.model.model.layers  # rank 0's share
        kinds = lambda m: [(p.type_name, p.rows, p.in_features) for p in m.pieces]  # noqa: E731
        assert kinds(layers[0].self_attn.qkv_proj) == [("Q4_K", 192, 256), ("Q6_K", 64, 256)]  # q 128 + k 64; v 64
        assert kinds(layers[0].self_attn.o_proj) == [("Q8_0", 256, 128)] and layers[0].self_attn.o_proj.tp is not None
        assert kinds(layers[0].mlp.down_proj) == [("Q6_K", 256, 256)]
        assert kinds(layers[1].mlp.gate_up_proj) == [("dense", 256, 256), ("Q4_K", 256, 256)]
        assert type(layers[1].self_attn.o_proj).__name__ == "RowParallelLinear"  # no kept part left
        assert layers[1].self_attn.o_proj.weight.shape == (256, 128)
        assert kinds(one.core.runner.model.model.layers[1].self_attn.o_proj) == [("Q4_K", 256, 256)]
        assert "2 ranks would split their rows inside a block (row-parallel inputs): Q4_K (1 tensors)" in caplog.text
        got = [o.outputs[0].token_ids for o in two.generate(prompts, GREEDY, use_tqdm=False)]
        assert got == [o.outputs[0].token_ids for o in one.generate(prompts, GREEDY, use_tqdm=False)]


def test_gemma3_270m_q4_k_m_kept_quantized_reads_as_dequantized():
    """The real Q4_K_M file (Q4_K, Q6_K, Q8_0 and Q5_0, every projection kept): each position's greedy token
    and log-likelihood over a short text, teacher-forced (the engine twice took 90 s here)."""
    from gemma3_oracle import gemma3_gguf

    from llmserve.bench.accuracy import read_text
    from llmserve.model.attention import reference_paged_attention
    from llmserve.model.loader import load_model

    path = gemma3_gguf()
    ids = [2, 818, 5279, 529, 7001, 563, 9079, 236761, 669, 5279, 529, 9405, 563, 9079, 236761, 669]
    readings = []
    for keep in (True, False):
        mc = EngineArgs(model=str(path), device="cpu", dtype="float32", max_model_len=64,
                        gguf_keep_quantized=keep).create_engine_config().model_config  # fmt: skip
        assert mc.quantization == ("gguf" if keep else None)
        model = load_model(mc.model, mc.arch, mc.dtype, "cpu", reference_paged_attention, progress=False,
                           max_positions=64, quantization=mc.quantization)  # fmt: skip
        if keep:
            kinds = {p.type_name for m in model.modules() if isinstance(m, GGUFLinear) for p in m.pieces}
            assert kinds == {"Q4_K", "Q6_K", "Q8_0", "Q5_0"}  # o/down; down; half the v; q/k/v/gate/up
        readings.append(read_text(model, ids, 64, torch.device("cpu"), torch.float32))
        del model
    kept, plain = readings
    assert kept.top1 == plain.top1
    assert kept.nll == plain.nll  # the same weights, the same products

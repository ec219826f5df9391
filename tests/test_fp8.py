"""FP8 weights and activations (`--quantization fp8`): the `torch._scaled_mm` path against the
dequantize-and-multiply reference (exact on a CPU), quantization error bounds, the engine
quantizing a checkpoint at load, and bad settings refused."""

from __future__ import annotations

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config import TINY_MODEL_DIR, ConfigError, EngineArgs
from llmserve.model.fp8 import (
    FP8,
    Fp8Linear,
    dequantize,
    fp8_gemm_reference,
    fp8_matmul_reference,
    fp8_matmul_scaled_mm,
    quantize_rows,
    quantize_tokens,
)
from llmserve.model.loader import load_model

pytestmark = pytest.mark.integration

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "n"), [(1, 64, 96), (37, 256, 512), (5, 72, 100)])
def test_scaled_mm_equals_the_reference(dtype, tokens, k, n):
    gen = torch.Generator().manual_seed(tokens + k)
    x = (torch.randn(tokens, k, generator=gen) * 3).to(dtype)
    weight, scale = quantize_rows(torch.randn(n, k, generator=gen) * 0.05)
    want = fp8_matmul_reference(x, weight, scale)
    got = fp8_matmul_scaled_mm(x, weight, scale)
    # the same products, summed in another order (one token takes a matrix-vector path)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **tol)
    static = torch.tensor(0.02)  # a checkpoint's static activation scale
    torch.testing.assert_close(fp8_matmul_scaled_mm(x, weight, scale, static),
                               fp8_matmul_reference(x, weight, scale, static), **tol)  # fmt: skip


def test_quantization_error_is_within_e4m3_precision():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 0, 64)[:, None]
    q, scale = quantize_rows(w)
    assert q.dtype == FP8 and scale.shape == (64, 1)
    rel = (dequantize(q, scale) - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert rel.max() <= 2**-4  # 3 mantissa bits: half a step of 1/8, relative to the row's largest
    # one scale for the tensor: rows far below the largest lose precision (why rows get their own)
    q1, s1 = quantize_rows(w, per_channel=False)
    assert torch.unique(s1).numel() == 1
    assert (dequantize(q1, s1) - w).abs()[:8].max() > (dequantize(q, scale) - w).abs()[:8].max()
    xq, sx = quantize_tokens(torch.zeros(3, 8))  # an all-zero token keeps a finite scale
    assert torch.isfinite(sx).all() and (xq.float() == 0).all()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_engine_quantizes_at_load_and_stays_close(model_dirs, family):
    base = LLM(model_dirs[family], max_model_len=128)
    fp8 = LLM(model_dirs[family], max_model_len=128, quantization="fp8")
    layer = fp8.core.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Fp8Linear) and layer.self_attn.qkv_proj.weight.dtype == FP8
    assert isinstance(layer.mlp.down_proj, Fp8Linear)
    assert fp8.core.runner.model.model.embed_tokens.weight.dtype == torch.float32  # embedding and LM head stay
    # (past Gemma 3's window of 16 too)
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 33, 70 + i] * (1 + 4 * (i % 2))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    a, b = base.generate(prompts, params, use_tqdm=False), fp8.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        lx, ly = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        for token in lx.keys() & ly.keys():
            assert abs(lx[token].logprob - ly[token].logprob) < 0.05


@pytest.mark.parametrize("tokens", [20, 5])
def test_fast_path_is_token_exact_against_the_reference_on_cpu(llama_dir, tokens):
    """The model built with the reference ops and with `torch._scaled_mm`: the same logits
    to float32 rounding and the same greedy token at every position (the fused kernels: in
    tests/test_kernels.py, under the Triton interpreter)."""
    from llmserve.model.attention import AttentionMetadata, reference_paged_attention
    from llmserve.model.fp8 import fp8_gemm_scaled_mm
    from llmserve.model.layers import LayerOps

    cfg = EngineArgs(model=llama_dir, quantization="fp8", max_model_len=128).create_engine_config()
    mc = cfg.model_config
    logits = []
    for ops in (LayerOps(), LayerOps(fp8_matmul=fp8_matmul_scaled_mm, fp8_gemm=fp8_gemm_scaled_mm)):
        model = load_model(mc.model, mc.arch, mc.dtype, "cpu", reference_paged_attention, progress=False,
                           quantization="fp8", ops=ops)  # fmt: skip
        for layer in model.attention_layers():
            layer.kv_cache = torch.zeros(2, 2, 16, mc.arch.num_kv_heads, mc.arch.head_dim)
        n = tokens
        meta = AttentionMetadata(torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                                 torch.tensor([n], dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32), n, n)  # fmt: skip
        with torch.inference_mode():
            logits.append(model.compute_logits(model(torch.arange(3, 3 + n), torch.arange(n), meta)))
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_dummy_weights_and_biases_in_fp8(model_dirs):
    """Random FP8 weights (benchmarks) and a model with q/k/v biases (Qwen2)."""
    with LLM(model_dirs["llama"], load_format="dummy", quantization="fp8", max_model_len=64) as llm:
        assert (
            len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16
        )
    with LLM(model_dirs["qwen2"], quantization="fp8", max_model_len=64) as llm:
        assert llm.core.runner.model.model.layers[0].self_attn.qkv_proj.bias is not None
        assert (
            len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16
        )


def test_the_tiny_model_in_fp8_mostly_agrees_with_float32():
    prompts = ["The json module", "A list is", "To open a file,", "Dictionaries map keys"]
    a = LLM(str(TINY_MODEL_DIR), max_model_len=256).generate(prompts, GREEDY, use_tqdm=False)
    b = LLM(str(TINY_MODEL_DIR), max_model_len=256, quantization="fp8").generate(prompts, GREEDY, use_tqdm=False)
    first = [x.outputs[0].token_ids[0] == y.outputs[0].token_ids[0] for x, y in zip(a, b)]
    assert sum(first) >= 3


@pytest.mark.parametrize("bad", ["int4", "awq", "FP8 "])
def test_unknown_quantization_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="quantization must be one of fp8"):
        EngineArgs(model=str(TINY_MODEL_DIR), quantization=bad).create_engine_config()


def test_projections_kept_unquantized_load_as_they_are(llama_dir):
    """`quantization_ignore`: the projections it names stay plain layers in the model's dtype
    (the others FP8); ignoring every projection gives the unquantized model's weights exactly;
    the engine runs a model that mixes both and records what it kept."""
    from pathlib import Path

    from llmserve.model.arch import read_model_arch
    from llmserve.model.attention import reference_paged_attention

    arch = read_model_arch(Path(llama_dir))
    last = f"model.layers.{arch.num_layers - 1}.mlp.down_proj"

    def build(quantization, ignore=()):
        return load_model(str(llama_dir), arch, torch.float32, "cpu", reference_paged_attention, progress=False,
                          quantization=quantization, quantization_ignore=ignore)  # fmt: skip

    mixed = dict(build("fp8", (last,)).named_modules())
    assert not isinstance(mixed[last], Fp8Linear) and mixed[last].weight.dtype == torch.float32
    fp8_names = [n for n, m in mixed.items() if isinstance(m, Fp8Linear)]
    assert len(fp8_names) == 4 * arch.num_layers - 1 and last not in fp8_names
    everything, plain = build("fp8", ("re:.*",)), build(None)
    assert not any(isinstance(m, Fp8Linear) for m in everything.modules())
    want = plain.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in everything.state_dict().items()) and len(want) == len(
        everything.state_dict()
    )
    llm = LLM(
        llama_dir, max_model_len=128, quantization="fp8", quantization_ignore=f"{last}, re:model\\.layers\\.0\\..*"
    )
    assert llm.config.model_config.quantization_ignore == (last, "re:model\\.layers\\.0\\..*")
    layers = llm.core.runner.model.model.layers
    assert not isinstance(layers[0].self_attn.qkv_proj, Fp8Linear) and isinstance(
        layers[1].self_attn.qkv_proj, Fp8Linear
    )
    assert (
        len(llm.generate([{"prompt_token_ids": [1, 5, 9, 33]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 16
    )


def test_projections_kept_unquantized_split_over_two_ranks(llama_dir):
    """A row-parallel (o) and a column-parallel (qkv) projection kept in the model's dtype: two
    ranks give one rank's tokens."""
    ignore = "model.layers.0.self_attn.o_proj,model.layers.1.self_attn.qkv_proj"
    prompts = [{"prompt_token_ids": [1, 5, 9, 33, 70]}]
    with (
        LLM(llama_dir, max_model_len=64, quantization="fp8", quantization_ignore=ignore) as one,
        LLM(llama_dir, max_model_len=64, quantization="fp8", quantization_ignore=ignore, tensor_parallel_size=2) as two,
    ):
        assert (
            one.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0].token_ids[:4]
            == two.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0].token_ids[:4]
        )


def test_weight_bytes_count_projections_kept_unquantized_in_the_model_dtype(llama_dir):
    """`bench latency`'s weight bandwidth: a projection kept out of FP8 reads 2 bytes a weight."""
    from pathlib import Path

    from llmserve.bench.latency import weight_bytes_per_step
    from llmserve.model.arch import read_model_arch

    arch = read_model_arch(Path(llama_dir))
    bf16, fp8 = weight_bytes_per_step(arch, torch.bfloat16), weight_bytes_per_step(arch, torch.bfloat16, "fp8")
    down = arch.intermediate_size * arch.hidden_size
    assert weight_bytes_per_step(arch, torch.bfloat16, "fp8", ("model.layers.0.mlp.down_proj",)) == fp8 + down
    assert weight_bytes_per_step(arch, torch.bfloat16, "fp8", ("re:.*",)) == bf16 > fp8


@pytest.mark.parametrize(("ignore", "quantization", "message"), [
    ("model.layers.99.mlp.down_proj", "fp8", "names no projection of this model"),
    ("model.layers.0.mlp.down", "fp8", "names no projection"),  # a full name, or re: and a pattern
    ("re:(", "fp8", "a bad regular expression"),
    ("model.layers.0.mlp.down_proj", None, "applies to --quantization fp8"),
])  # fmt: skip
def test_a_bad_quantization_ignore_is_a_clear_error(llama_dir, ignore, quantization, message):
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model=str(llama_dir), quantization=quantization, quantization_ignore=ignore).create_engine_config()


def test_an_fp8_checkpoint_takes_no_quantization_ignore(fp8_checkpoints):
    path = fp8_checkpoints[("fp8", "tensor", "dynamic")]
    with pytest.raises(ConfigError, match="an FP8 checkpoint lists its own"):
        EngineArgs(model=str(path), quantization_ignore="model.layers.0.mlp.down_proj").create_engine_config()


# -- FP8 checkpoints as published ----------------------------------------------------------
VARIANTS = [("fp8", "tensor", "dynamic"), ("fp8", "tensor", "static"), ("compressed-tensors", "tensor", "dynamic"),
            ("compressed-tensors", "channel", "dynamic"), ("compressed-tensors", "channel", "static")]  # fmt: skip


@pytest.fixture(scope="module")
def fp8_checkpoints(llama_dir, tmp_path_factory):
    from llmserve.model.fp8_checkpoint import write_fp8_checkpoint

    root = tmp_path_factory.mktemp("fp8ckpt")
    return {v: write_fp8_checkpoint(llama_dir, root / "-".join(v), *v) for v in VARIANTS}


def test_every_published_variant_loads_as_fp8_close_to_float32(llama_dir, fp8_checkpoints):
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 33, 70 + i]} for i in range(3)]
    base = LLM(llama_dir, max_model_len=64).generate(prompts, params, use_tqdm=False)
    for (fmt, weights, activations), path in fp8_checkpoints.items():
        llm = LLM(str(path), max_model_len=64)  # no --quantization: the config says FP8
        mc = llm.config.model_config
        assert mc.quantization == "fp8" and mc.checkpoint_quantization.format == fmt
        qkv = llm.core.runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == FP8 and (qkv.input_scale is not None) == (activations == "static")
        for a, b in zip(base, llm.generate(prompts, params, use_tqdm=False)):
            la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
            assert max(abs(la[t].logprob - lb[t].logprob) for t in la.keys() & lb.keys()) < 0.05, (fmt, weights)
        llm.shutdown()


def test_a_channel_wise_dynamic_checkpoint_equals_quantizing_at_load(llama_dir, fp8_checkpoints):
    """Scales per output channel, activations per token: what `--quantization fp8` does to the
    original weights, so the same weights, the same scales and the same tokens."""
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 33, 70 + i]} for i in range(4)]
    at_load = LLM(llama_dir, quantization="fp8", max_model_len=64)
    from_file = LLM(str(fp8_checkpoints[("compressed-tensors", "channel", "dynamic")]), max_model_len=64)
    a = at_load.core.runner.model.model.layers[1].mlp.gate_up_proj
    b = from_file.core.runner.model.model.layers[1].mlp.gate_up_proj
    assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)) and torch.equal(
        a.weight_scale, b.weight_scale
    )
    assert [o.outputs[0].token_ids for o in at_load.generate(prompts, GREEDY, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in from_file.generate(prompts, GREEDY, use_tqdm=False)
    ]


def test_an_fp8_checkpoint_splits_over_two_ranks(fp8_checkpoints):
    path = str(fp8_checkpoints[("fp8", "tensor", "static")])
    prompts = [{"prompt_token_ids": [1, 5, 9, 33, 70]}]
    with LLM(path, max_model_len=64) as one, LLM(path, max_model_len=64, tensor_parallel_size=2) as two:
        # per-tensor scales and a static input scale: the ranks' slices quantize alike
        assert (
            one.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0].token_ids[:4]
            == two.generate(prompts, GREEDY, use_tqdm=False)[0].outputs[0].token_ids[:4]
        )


@pytest.mark.parametrize(("qc", "reason"), [
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise FP8 scales"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "ignored_layers": ["model.layers.0.mlp.gate_proj"]}, "gate_proj left unquantized without"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "format 'pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "4-bit int"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}}, "weight strategy 'block'"),
])  # fmt: skip
def test_an_unsupported_quantization_config_is_refused_at_start(llama_dir, tmp_path, qc, reason):
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ConfigError, match=f"unsupported quantization_config: .*{reason}"):
        EngineArgs(model=str(model)).create_engine_config()


# -- the KV cache in FP8 -------------------------------------------------------------------
def test_an_fp8_kv_cache_holds_twice_the_tokens_and_stays_close(llama_dir):
    """`kv_cache_dtype="fp8"`: the same bytes hold twice the tokens of a bfloat16 cache, and
    the outputs stay close (keys and values rounded to E4M3 as they are stored)."""
    budget = dict(dtype="bfloat16", kv_cache_memory_bytes=1 << 20, max_model_len=128)
    bf16 = LLM(llama_dir, **budget)
    fp8 = LLM(llama_dir, kv_cache_dtype="fp8", **budget)
    assert fp8.core.kv.pool.num_blocks == 2 * bf16.core.kv.pool.num_blocks
    assert fp8.stats().kv_cache_tokens == 2 * bf16.stats().kv_cache_tokens  # /metrics: llmserve:kv_cache_tokens
    assert fp8.core.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 33, 70 + i, 11, 12, 13] * 3} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    for a, b in zip(bf16.generate(prompts, params, use_tqdm=False), fp8.generate(prompts, params, use_tqdm=False)):
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert max(abs(la[t].logprob - lb[t].logprob) for t in la.keys() & lb.keys()) < 0.1
    # FP8 weights and an FP8 cache together, preempting by swap (the CPU copy is FP8 too)
    with LLM(llama_dir, quantization="fp8", kv_cache_dtype="fp8", num_gpu_blocks_override=16, block_size=8,
             swap_space=0.01, max_model_len=128, admission_reserve_tokens=0) as both:  # fmt: skip
        outs = both.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        assert both.core.runner.cpu_caches[0].dtype == torch.float8_e4m3fn and both.stats().num_preemptions > 0


@pytest.mark.parametrize("bad", ["fp8_e5m2", "int8", "float16"])
def test_an_unknown_kv_cache_dtype_is_a_clear_error(bad):
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto or fp8"):
        EngineArgs(model=str(TINY_MODEL_DIR), kv_cache_dtype=bad).create_engine_config()


def test_cli_errors_name_the_problem(tmp_path):
    import subprocess
    import sys

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for cmd, message in (
        (["make-fp8-checkpoint", str(tmp_path / "nothing"), str(tmp_path / "out")], "is not a Hugging Face model folder"),
        (["bench", "accuracy", "--model", str(TINY_MODEL_DIR), "--quantization", "fp8", "--text", str(tmp_path / "no.txt")],
         "No such file"),
        (["bench", "accuracy", "--model", str(TINY_MODEL_DIR), "--quantization", "fp8", "--text", str(empty)],
         "nothing to predict"),
    ):  # fmt: skip
        proc = subprocess.run([sys.executable, "-m", "llmserve", *cmd], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-500:]


def test_bench_accuracy_over_several_texts(tmp_path):
    """`bench accuracy --text A B`: FP8 against bf16 on the tiny model over two texts, each read
    up to --max-positions; the whole result is over all their positions (not a mean of the
    texts' perplexities), and each text's own result is kept."""
    import json
    import math

    from llmserve.cli import main

    texts = [tmp_path / "a.txt", tmp_path / "b.txt"]
    texts[0].write_text("The engine keeps a paged KV cache and schedules requests step by step. " * 20)
    texts[1].write_text("A gateway in front checks keys, limits and priorities, then routes the call. " * 20)
    out = tmp_path / "acc.json"
    main(["bench", "accuracy", "--model", str(TINY_MODEL_DIR), "--quantization", "fp8", "--text", *map(str, texts),
          "--max-positions", "100", "--window", "64", "--output-json", str(out)])  # fmt: skip
    r = json.loads(out.read_text())
    a, b = r["per_text"]
    assert a["text"] == str(texts[0]) and a["positions"] == b["positions"] == 100 and r["positions"] == 200
    for key in ("perplexity_baseline", "perplexity_candidate"):  # all positions' mean log-likelihood
        assert r[key] == pytest.approx(math.exp((math.log(a[key]) + math.log(b[key])) / 2), rel=1e-3)
    assert r["perplexity_baseline"] != r["perplexity_candidate"]  # the FP8 model is another model
    assert 0.5 < r["top1_agreement"] <= 1
    assert r["top1_agreement"] == pytest.approx((a["top1_agreement"] + b["top1_agreement"]) / 2, abs=1e-3)
    assert "quantization fp8" in r["candidate"] and "quantization none" in r["baseline"]


# -- an FP8 KV cache's scales ----------------------------------------------------------------
def _logprob_error(ref, outs) -> float:
    """Summed |logprob difference| of the first token's top choices, against `ref`."""
    total = 0.0
    for a, b in zip(ref, outs):
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        total += sum(abs(la[t].logprob - lb[t].logprob) for t in la.keys() & lb.keys())
    return total


@pytest.fixture(scope="module")
def small_values_dir(llama_dir, tmp_path_factory):
    """The tiny model with its values 100x smaller and o_proj 100x larger: the same function,
    but values around 2^-8, where E4M3 with scale 1 has only subnormals (as SmolLM2's first
    layer has values under 0.6)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("small-values") / "m"
    shutil.copytree(llama_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    for name in tensors:
        if name.endswith(("v_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] * (0.01 if "v_proj" in name else 100.0)
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def test_an_fp8_kv_cache_calibrates_per_layer_scales_at_start(small_values_dir):
    """Each layer's key and value scales come from one forward pass over random tokens
    (largest |value| x 2 -> 448), before graph capture; they bring the outputs closer to an
    unquantized cache than scale 1 (`--no-calculate-kv-scales`) where the values are small."""
    from llmserve.model.kv_scales import HEADROOM, calibration_token_ids, record_amax

    llama_dir = small_values_dir
    budget = dict(dtype="float32", kv_cache_memory_bytes=1 << 20, max_model_len=128)
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 33, 70 + i, 11, 12, 13] * 3} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    with LLM(llama_dir, **budget) as exact, LLM(llama_dir, kv_cache_dtype="fp8", **budget) as cal, \
            LLM(llama_dir, kv_cache_dtype="fp8", calculate_kv_scales=False, **budget) as one:  # fmt: skip
        scales = cal.core.runner.kv_scales
        layers = cal.core.runner.model.attention_layers()
        assert scales.source == "calibrated" and len(scales.scales) == len(layers)
        assert [layer.kv_scales for layer in layers] == list(scales.scales)
        # the numbers: the largest |key| / |value| of each layer over the calibration prompt, x 2 / 448
        runner = exact.core.runner
        ids = calibration_token_ids(runner.config.model_config.arch.vocab_size, 128)  # max_model_len's
        amax = record_amax(runner.model, lambda: runner._dummy_forward(1, len(ids), ids))
        for (k, v), (ak, av) in zip(scales.scales, amax):  # (calibration attends over unquantized keys and values)
            assert k == pytest.approx(ak * HEADROOM / 448, rel=1e-6) and v == pytest.approx(
                av * HEADROOM / 448, rel=1e-6
            )
            assert v < 1e-4  # values under 2^-6: subnormal with scale 1
        assert one.core.runner.kv_scales.source == "one" and set(one.core.runner.kv_scales.scales) == {(1.0, 1.0)}
        assert exact.core.runner.kv_scales.scales == ()  # not an FP8 cache: no scales
        ref = exact.generate(prompts, params, use_tqdm=False)
        err_cal = _logprob_error(ref, cal.generate(prompts, params, use_tqdm=False))
        err_one = _logprob_error(ref, one.generate(prompts, params, use_tqdm=False))
        print(f"first-token logprob error against float32: calibrated {err_cal:.4f}, scale 1 {err_one:.4f}")
        assert err_cal < err_one / 4, (err_cal, err_one)


def test_calculate_kv_scales_needs_an_fp8_cache():
    with pytest.raises(ConfigError, match="calculate_kv_scales needs kv_cache_dtype fp8"):
        EngineArgs(model=str(TINY_MODEL_DIR), calculate_kv_scales=True).create_engine_config()


def test_a_checkpoint_s_kv_scales_are_used_as_they_are(llama_dir, tmp_path):
    """`kv_cache_scheme` with `self_attn.k_scale` / `v_scale` (written by make-fp8-checkpoint
    --kv-scales): the engine takes the checkpoint's numbers unless asked to calibrate; the
    legacy single `kv_scale` and compressed-tensors' `k_proj.output_scale` names load too."""
    import json

    from safetensors.torch import load_file, save_file

    from llmserve.model.fp8_checkpoint import write_fp8_checkpoint

    path = write_fp8_checkpoint(llama_dir, tmp_path / "kv", "compressed-tensors", "channel", "dynamic", kv_scales=True)
    assert json.loads((path / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    tensors = load_file(str(path / "model.safetensors"))
    want = [(float(tensors[f"model.layers.{i}.self_attn.k_scale"]), float(tensors[f"model.layers.{i}.self_attn.v_scale"]))
            for i in range(2)]  # fmt: skip
    budget = dict(max_model_len=64, kv_cache_memory_bytes=1 << 20)
    with LLM(str(path), kv_cache_dtype="fp8", **budget) as llm:
        got = llm.core.runner.kv_scales
        assert got.source == "checkpoint" and [tuple(round(x, 6) for x in p) for p in got.scales[:2]] == [
            tuple(round(x, 6) for x in p) for p in want
        ]
        out = llm.generate([{"prompt_token_ids": [1, 5, 9, 33, 70]}], GREEDY, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 16
    with LLM(str(path), kv_cache_dtype="fp8", calculate_kv_scales=True, **budget) as llm:
        calibrated = llm.core.runner.kv_scales
        assert calibrated.source == "calibrated" and calibrated.scales[:2] != got.scales[:2]
        llm.sleep(2)  # a wake reads the checkpoint again: the calibrated scales stay in use
        llm.wake_up()
        assert [a.kv_scales for a in llm.core.runner.model.attention_layers()] == list(calibrated.scales)
    with LLM(str(path), **budget) as llm:  # a bfloat16 cache: the scales are read, and unused
        assert llm.core.runner.kv_scales.scales == ()
    # the other names: one kv_scale for both, and compressed-tensors' output scales
    renamed = {}
    for name, t in tensors.items():
        if name == "model.layers.0.self_attn.k_scale":
            renamed["model.layers.0.self_attn.kv_scale"] = torch.tensor(0.25)
        elif name.endswith((".k_scale", ".v_scale")) and ".layers.1." in name:
            renamed[name.replace(".k_scale", ".k_proj.output_scale").replace(".v_scale", ".v_proj.output_scale")] = t
        elif name != "model.layers.0.self_attn.v_scale":
            renamed[name] = t
    save_file(renamed, str(path / "model.safetensors"))
    with LLM(str(path), kv_cache_dtype="fp8", **budget) as llm:
        assert llm.core.runner.kv_scales.scales[0] == (0.25, 0.25)
        assert [round(x, 6) for x in llm.core.runner.kv_scales.scales[1]] == [round(x, 6) for x in want[1]]


@pytest.mark.parametrize(("tensor", "reason"), [
    (torch.tensor([0.1, 0.2]), r"\(2,\) KV cache scales \(one per layer is read, not per head\)"),
    (torch.tensor(-1.0), "KV cache scale -1.0 .must be positive"),
    (torch.tensor(1e-38), r"KV cache scale 9.99.*e-39 .must be positive and finite, at least 1e-30"),
    (None, "the checkpoint gives KV cache scales for some layers but not model.layers.0.self_attn.k_scale"),
])  # fmt: skip
def test_a_bad_kv_scale_in_a_checkpoint_is_a_clear_error(llama_dir, tmp_path, tensor, reason):
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    tensors = load_file(str(model / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_scale"] = torch.tensor(0.1) if tensor is None else tensor  # None: only this one
    save_file(tensors, str(model / "model.safetensors"))
    with pytest.raises(ValueError, match=reason if tensor is None else f"model.layers.1.self_attn.k_scale: {reason}"):
        LLM(str(model), kv_cache_dtype="fp8", max_model_len=64)


@pytest.mark.parametrize(("kv", "reason"), [
    ({"num_bits": 8, "type": "int"}, "a KV cache of 8-bit int"),
    ({"num_bits": 8, "type": "float", "strategy": "attn_head"}, "KV cache scales 'attn_head'"),
    ({"num_bits": 8, "type": "float", "dynamic": True}, "KV cache scales 'dynamic'"),
])  # fmt: skip
def test_an_unsupported_kv_cache_scheme_is_refused_at_start(llama_dir, tmp_path, kv, reason):
    import json
    import shutil

    model = tmp_path / "m"
    shutil.copytree(llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "kv_cache_scheme": kv}
    (model / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    with pytest.raises(ConfigError, match=f"unsupported quantization_config: {reason}"):
        EngineArgs(model=str(model)).create_engine_config()


def test_each_rank_calibrates_the_kv_scales_of_its_own_heads(small_values_dir):
    """Under tensor parallelism every rank holds its own heads' keys and values, and calibrates
    their scales (at most the whole model's: a maximum over fewer heads); the output stays close."""
    budget = dict(dtype="float32", kv_cache_memory_bytes=1 << 20, max_model_len=128, kv_cache_dtype="fp8")
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 33, 70 + i, 11, 12, 13] * 3} for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    with LLM(small_values_dir, **budget) as one, LLM(small_values_dir, tensor_parallel_size=2, **budget) as two:
        whole, rank0 = one.core.runner.kv_scales.scales, two.core.runner.kv_scales.scales
        assert two.core.runner.kv_scales.source == "calibrated" and len(rank0) == len(whole)
        assert all(a <= b * (1 + 1e-6) for pa, pb in zip(rank0, whole) for a, b in zip(pa, pb))
        assert _logprob_error(one.generate(prompts, params, use_tqdm=False),
                              two.generate(prompts, params, use_tqdm=False)) < 0.05  # fmt: skip


def test_bench_accuracy_reads_an_fp8_kv_cache_with_the_engine_s_scales(tmp_path, small_values_dir):
    """`bench accuracy --kv-cache-dtype fp8` calibrates the scales as the engine does (the label
    says so) and is closer to the unquantized cache than with scale 1 where values are small;
    `--calculate-kv-scales` spelled out leaves the baseline unquantized."""
    import json

    from llmserve.cli import main

    text = tmp_path / "a.txt"
    text.write_text("The engine keeps a paged KV cache and schedules requests step by step. " * 20)
    results = {}
    for name, flags in (("calibrated", ["--calculate-kv-scales", "--max-model-len", "256"]),  # calibrates on 256 tokens
                        ("one", ["--no-calculate-kv-scales"])):  # fmt: skip
        out = tmp_path / f"{name}.json"
        main(["bench", "accuracy", "--model", small_values_dir, "--dtype", "float32", "--kv-cache-dtype", "fp8", *flags,
              "--text", str(text), "--max-positions", "100", "--window", "64", "--output-json", str(out)])  # fmt: skip
        results[name] = json.loads(out.read_text())
    cal, one = results["calibrated"], results["one"]
    assert "scales calibrated: k " in cal["candidate"] and "scales one" in one["candidate"]
    assert "KV auto" in cal["baseline"] and cal["perplexity_baseline"] == one["perplexity_baseline"]
    assert abs(cal["perplexity_change_pct"]) < abs(one["perplexity_change_pct"]) / 3, (
        cal,
        one,
    )  # 0.015 against 0.072 %


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_written_kv_scales_are_those_of_the_keys_and_values_the_cache_holds(model_dirs, tmp_path, family):
    """make-fp8-checkpoint --kv-scales measures keys after the q/k norm (Qwen3) and the rotary
    embedding, as the cache stores them: the same numbers as the engine's own maxima over the
    same prompts, x 2 / 448."""
    from safetensors.torch import load_file

    from llmserve.bench.accuracy import load_for_reading, read_text
    from llmserve.model.fp8_checkpoint import write_fp8_checkpoint
    from llmserve.model.kv_scales import record_amax, scales_from_amax

    prompts = [[1, *range(5 + i, 60 + 7 * i)] for i in range(3)]
    out = write_fp8_checkpoint(model_dirs[family], tmp_path / "out", "compressed-tensors", "channel", "dynamic",
                               calibration=prompts, kv_scales=True)  # fmt: skip
    written = load_file(str(out / "model.safetensors"))
    model, _, _ = load_for_reading(EngineArgs(model=model_dirs[family], dtype="float32", device="cpu"))
    cpu = torch.device("cpu")
    ours = scales_from_amax(record_amax(model, lambda: [read_text(model, [*ids, 0], len(ids), cpu, torch.float32)
                                                         for ids in prompts]))  # fmt: skip
    for i, (k, v) in enumerate(ours):
        assert float(written[f"model.layers.{i}.self_attn.k_scale"]) == pytest.approx(k, rel=1e-4)
        assert float(written[f"model.layers.{i}.self_attn.v_scale"]) == pytest.approx(v, rel=1e-4)


def test_fp8_fast_accumulation_threshold_is_configured_and_checked(llama_dir):
    """--fp8-fast-accum-tokens reaches the fused ops' FP8 GEMMs; a negative value is a clear error;
    on a CPU the GEMM is the exact one whatever the threshold (torch ignores nothing: we pass False)."""
    from llmserve.kernels.fp8_linear import FAST_ACCUM_TOKENS, fp8_gemm_fast
    from llmserve.model.layers import triton_ops

    config = EngineArgs(model=str(llama_dir), quantization="fp8", fp8_fast_accum_tokens=0).create_engine_config()
    assert config.model_config.fp8_fast_accum_tokens == 0
    assert (
        EngineArgs(model=str(llama_dir)).create_engine_config().model_config.fp8_fast_accum_tokens == FAST_ACCUM_TOKENS
    )
    with pytest.raises(ConfigError, match="fp8_fast_accum_tokens must be >= 0"):
        EngineArgs(model=str(llama_dir), fp8_fast_accum_tokens=-1).create_engine_config()
    ops = triton_ops(4096)
    assert ops.fp8_gemm.keywords == {"fast_accum_tokens": 4096} == ops.fp8_matmul.keywords
    assert triton_ops().fp8_gemm.keywords == {"fast_accum_tokens": FAST_ACCUM_TOKENS}
    torch.manual_seed(0)
    x, w = torch.randn(80, 64), torch.randn(48, 64)
    xq, sx = quantize_tokens(x)
    wq, sw = quantize_rows(w)
    want = fp8_gemm_reference(xq, sx, wq, sw, torch.float32)
    for threshold in (0, 1, 80, 81):  # 80 rows: past the split-K kernel's 64, so torch._scaled_mm
        got = fp8_gemm_fast(xq, sx, wq, sw, torch.float32, fast_accum_tokens=threshold)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)

"""AWQ's activation-aware scales (model/w4a16_awq.py) on a tiny random Llama whose embedding has a
few large columns (activation outliers): folding scales leaves the float model's logits as they
were (GQA: o_proj's scales folded into v_proj's rows), the searched scales give a smaller output
error than round to nearest on the calibration text, and the folder they write loads in the
engine, runs as the float model holding its dequantized weights and folded norms, and
generates. (transformers loads AWQ folders only through autoawq, not installed: the dequantized
reference is the oracle.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.config import EngineArgs, read_arch
from llmserve.model.attention import AttentionMetadata, reference_paged_attention
from llmserve.model.fp8 import projection_parts
from llmserve.model.loader import load_model
from llmserve.model.random_model import make_random_model
from llmserve.model.w4a16_awq import AwqCalibration, awq_scales, fold_scales
from llmserve.model.w4a16_checkpoint import unpack_awq, write_w4a16_checkpoint

pytestmark = pytest.mark.integration

GROUP = 32
OUTLIERS = [3, 17, 40]  # embedding columns made large


@pytest.fixture(scope="module")
def outlier_llama(tmp_path_factory) -> Path:
    """A tiny GQA Llama (4 query heads, 2 KV heads) whose embedding has three columns 25 times larger."""
    path = make_random_model(tmp_path_factory.mktemp("awq") / "llama", "llama", seed=11)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.embed_tokens.weight"][:, OUTLIERS] *= 25
    save_file(tensors, str(path / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> AwqCalibration:
    text = tmp_path_factory.mktemp("text") / "calib.txt"
    text.write_text(" ".join(f"word{i % 89} token{i % 11} x{i % 7}" for i in range(500)))
    return AwqCalibration((str(text),), tokens=256, window=64)


def _logits(model_dir: Path | str, ids: list[int]) -> torch.Tensor:
    cfg = EngineArgs(model=str(model_dir), max_model_len=128).create_engine_config()
    mc = cfg.model_config
    model = load_model(mc.model, mc.arch, mc.dtype, "cpu", reference_paged_attention, progress=False,
                       quantization=mc.quantization)  # fmt: skip
    n = len(ids)
    blocks = -(-n // 16)
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, blocks, 16, mc.arch.num_kv_heads, mc.arch.head_dim)
    meta = AttentionMetadata(torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), torch.arange(blocks, dtype=torch.int32)[None], n,
                             n)  # fmt: skip
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta))


def _with_tensors(src: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(src, out)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _calibration_ids(model_dir: Path, calib: AwqCalibration) -> list[int]:
    from llmserve.tokenizer import load_tokenizer

    text = Path(calib.texts[0]).read_text()
    return load_tokenizer(str(model_dir)).encode(text, add_special_tokens=False)[:120]


@pytest.fixture(scope="module")
def searched(outlier_llama, calibration) -> dict:
    return awq_scales(outlier_llama, read_arch(outlier_llama), calibration, GROUP)


def test_folding_scales_keeps_the_float_function(outlier_llama, tmp_path):
    """Random scales over every projection's inputs (o_proj's tied per KV-head channel, as the
    search makes them) folded into the norms, up_proj's and v_proj's rows: the same logits."""
    arch = read_arch(outlier_llama)
    gen = torch.Generator().manual_seed(0)
    scales = {}
    for name in projection_parts(arch):
        k = load_file(str(outlier_llama / "model.safetensors"))[projection_parts(arch)[name][0] + ".weight"].shape[1]
        if name.endswith("o_proj"):
            per_kv = torch.rand(arch.num_kv_heads, 1, arch.head_dim, generator=gen) * 4.8 + 0.2
            s = per_kv.expand(arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim).reshape(-1)
        else:
            s = torch.rand(k, generator=gen) * 4.8 + 0.2
        scales[name] = s
    assert arch.num_heads > arch.num_kv_heads  # GQA: v's rows serve two query heads each
    tensors = load_file(str(outlier_llama / "model.safetensors"))
    folded = dict(tensors)
    fold_scales(folded, scales, arch)
    changed = [n for n in tensors if not torch.equal(tensors[n], folded[n])]
    assert any("input_layernorm" in n for n in changed) and any("post_attention_layernorm" in n for n in changed)
    assert any("v_proj" in n for n in changed) and any("up_proj" in n for n in changed)
    ids = list(range(5, 45))
    want = _logits(outlier_llama, ids)
    got = _logits(_with_tensors(outlier_llama, tmp_path / "folded", folded), ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_scales_that_split_a_kv_group_are_refused(outlier_llama):
    arch = read_arch(outlier_llama)
    tensors = load_file(str(outlier_llama / "model.safetensors"))
    with pytest.raises(ValueError, match="KV group"):
        fold_scales(tensors, {"model.layers.0.self_attn.o_proj": torch.rand(arch.num_heads * arch.head_dim) + 0.5},
                    arch)  # fmt: skip


def test_searched_scales_beat_round_to_nearest(outlier_llama, calibration, searched, tmp_path, monkeypatch):
    """Each projection's output error on the calibration inputs is at most round to nearest's (alpha 0
    is in the grid) and below it somewhere; the whole 4-bit model's logits on calibration text are
    closer to the float model's than the round-to-nearest AWQ folder's."""
    arch = read_arch(outlier_llama)
    assert set(searched) == set(projection_parts(arch))
    assert all(s.error <= s.error_rtn for s in searched.values())
    assert any(s.alpha > 0 and s.error < 0.9 * s.error_rtn for s in searched.values())
    import llmserve.model.w4a16_awq as awq_module

    monkeypatch.setattr(awq_module, "awq_scales", lambda *_args: searched)  # (the search once per module)
    rtn = write_w4a16_checkpoint(outlier_llama, tmp_path / "rtn", "awq", GROUP, False)
    aware = write_w4a16_checkpoint(outlier_llama, tmp_path / "aa", "awq", GROUP, False, awq=calibration)
    rounding = json.loads((aware / "config.json").read_text())["quantization_config"]["llmserve_rounding"]
    assert rounding["method"].startswith("awq") and len(rounding["alphas"]) == len(searched)
    ids = _calibration_ids(outlier_llama, calibration)
    want = _logits(outlier_llama, ids)
    err_rtn = (_logits(rtn, ids) - want).norm()
    err_aware = (_logits(aware, ids) - want).norm()
    assert err_aware < err_rtn, (float(err_aware), float(err_rtn))


def test_the_checkpoint_runs_as_its_dequantized_weights_and_generates(outlier_llama, calibration, searched, tmp_path,
                                                                      monkeypatch):  # fmt: skip
    """The engine on the AWQ-scaled folder equals the float model holding its dequantized
    projections and its folded norms; it generates."""
    import llmserve.model.w4a16_awq as awq_module

    monkeypatch.setattr(awq_module, "awq_scales", lambda *_args: searched)
    path = write_w4a16_checkpoint(outlier_llama, tmp_path / "aa", "awq", GROUP, False, awq=calibration)
    tensors = load_file(str(path / "model.safetensors"))
    source = load_file(str(outlier_llama / "model.safetensors"))
    float_tensors = {}
    for name, t in tensors.items():
        module, _, kind = name.rpartition(".")
        if kind == "qweight":
            q = unpack_awq(t).t().float()  # [N, K]
            zeros = unpack_awq(tensors[f"{module}.qzeros"]).t().float()
            scales = tensors[f"{module}.scales"].t().float()
            g = torch.arange(q.shape[1]) // GROUP
            float_tensors[f"{module}.weight"] = ((q - zeros[:, g]) * scales[:, g]).contiguous()
        elif kind not in ("qzeros", "scales"):
            float_tensors[name] = t
    assert set(float_tensors) == set(source)
    assert not torch.equal(float_tensors["model.layers.0.input_layernorm.weight"],
                           source["model.layers.0.input_layernorm.weight"])  # the scales are folded in  # fmt: skip
    ids = list(range(5, 45))
    reference = _with_tensors(outlier_llama, tmp_path / "dequantized", float_tensors)
    torch.testing.assert_close(_logits(path, ids), _logits(reference, ids), rtol=1e-5, atol=1e-5)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), max_model_len=64, device="cpu") as llm:
        out = llm.generate([{"prompt_token_ids": [1, 5, 9, 33, 70]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(str(reference), max_model_len=64, device="cpu") as llm:
        want = llm.generate([{"prompt_token_ids": [1, 5, 9, 33, 70]}], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 8 and list(out) == list(want)

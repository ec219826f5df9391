"""FP8 mixture-of-experts checkpoints loaded as they are (issue 52): `quant_method: fp8` with
`weight_block_size` (experts' `weight_scale_inv` per block, as Qwen3-30B-A3B-FP8 publishes) and
compressed-tensors (`weight_scale` per channel), written here from a tiny random Qwen3-MoE folder;
their tokens and logprobs against the float32 model, on the PyTorch reference and on the fused FP8
kernels (interpreter); bad scales refused at start, named; each TP / EP rank's share of the scales;
`--quantization fp8` on a 16-bit MoE through the fused FP8 kernels."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import LLM, SamplingParams
from llmserve.config import ConfigError, EngineArgs
from llmserve.model.arch import UnsupportedModelError
from llmserve.model.fp8_blocks import dequantize_blocks
from llmserve.model.fp8_checkpoint import write_fp8_checkpoint
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.unit

BLOCK = (16, 16)  # the tiny model's 64-wide hidden size and 32-wide experts in several blocks each
EXPERT = "model.layers.0.mlp.experts.3"


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[1] + [rng.randrange(3, 500) for _ in range(n - 1)] for n in (5, 17, 30)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_fp8")
    source = make_random_model(root / "bf16", "qwen3_moe", seed=21, num_hidden_layers=2)
    return {
        "float": source,
        "block": write_fp8_checkpoint(source, root / "block", "fp8", "block", block_shape=BLOCK),
        "channel": write_fp8_checkpoint(source, root / "channel", "compressed-tensors", "channel"),
        "tensor": write_fp8_checkpoint(source, root / "tensor", "fp8", "tensor"),
    }


def _tokens(folder: Path, **kwargs) -> list[list[int]]:
    """Two prompts' greedy tokens (a prefill of several tokens per expert, decodes of one)."""
    prompts = [{"prompt_token_ids": p} for p in _prompts()[:2]]
    with LLM(str(folder), max_model_len=64, **kwargs) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _logits(folder: Path, quantization: str | None = None, tokens: int = 24) -> torch.Tensor:
    """One prompt's logits at every position (the PyTorch reference path)."""
    from llmserve.model.attention import AttentionMetadata, reference_paged_attention
    from llmserve.model.loader import load_model

    mc = EngineArgs(model=str(folder), quantization=quantization, max_model_len=64).create_engine_config().model_config
    model = load_model(mc.model, mc.arch, mc.dtype, "cpu", reference_paged_attention, progress=False,
                       quantization=mc.quantization, quantization_ignore=mc.quantization_ignore)  # fmt: skip
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, 2, 16, mc.arch.num_kv_heads, mc.arch.head_dim)
    meta = AttentionMetadata(torch.arange(tokens), torch.tensor([0, tokens], dtype=torch.int32),
                             torch.tensor([tokens], dtype=torch.int32), torch.tensor([[0, 1]], dtype=torch.int32),
                             tokens, tokens)  # fmt: skip
    with torch.inference_mode():
        return model.compute_logits(model(torch.arange(3, 3 + tokens), torch.arange(tokens), meta))


def test_the_block_checkpoint_is_written_as_published(folders):
    cfg = json.loads((folders["block"] / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": list(BLOCK), "ignored_layers": ["lm_head"]}  # fmt: skip
    tensors = load_file(str(folders["block"] / "model.safetensors"))
    assert tensors[f"{EXPERT}.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors[f"{EXPERT}.gate_proj.weight_scale_inv"].shape == (2, 4)  # [32, 64] in 16 x 16 blocks
    assert tensors[f"{EXPERT}.down_proj.weight_scale_inv"].shape == (4, 2)
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (4, 4)
    assert tensors["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router stays
    whole = load_file(str(folders["float"] / "model.safetensors"))[f"{EXPERT}.gate_proj.weight"]
    back = dequantize_blocks(
        tensors[f"{EXPERT}.gate_proj.weight"], tensors[f"{EXPERT}.gate_proj.weight_scale_inv"], BLOCK
    )
    assert (back - whole).norm() / whole.norm() < 0.04


@pytest.fixture(scope="module")
def exact(folders) -> torch.Tensor:
    return _logits(folders["float"])


@pytest.mark.parametrize("kind", ["block", "channel", "tensor"])
def test_fp8_moe_checkpoints_load_as_they_are_and_stay_close(folders, exact, kind):
    """The experts keep the checkpoint's FP8 bytes and scales (block scales as their grid). The
    logits (tiny random model: nearly flat, so compared centred, by their relative distance) stay
    within FP8's rounding of the float32 model's: every weight, token and SiLU-and-mul row rounded
    to E4M3 over two layers gives about 0.26 (the same as `--quantization fp8`'s); a model whose
    scales were misread, or misplaced, is nowhere near (about 1.4, uncorrelated)."""
    logits = _logits(folders[kind])
    centred = exact - exact.mean(-1, keepdim=True)
    distance = ((logits - logits.mean(-1, keepdim=True)) - centred).norm() / centred.norm()
    assert distance < 0.35, distance
    assert (logits.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.75
    model_dir = folders[kind]
    from llmserve.config import read_arch
    from llmserve.model.attention import reference_paged_attention
    from llmserve.model.loader import load_model

    model = load_model(str(model_dir), read_arch(model_dir), torch.float32, "cpu", reference_paged_attention,
                       progress=False, quantization="fp8")  # fmt: skip
    experts = model.model.layers[0].mlp.experts
    tensors = load_file(str(model_dir / "model.safetensors"))
    assert torch.equal(
        experts.gate_up_proj[3, :32].view(torch.uint8), tensors[f"{EXPERT}.gate_proj.weight"].view(torch.uint8)
    )
    if kind == "block":
        assert experts.block_shape == BLOCK and experts.gate_up_proj_scale.shape == (8, 4, 4)
        assert torch.equal(experts.gate_up_proj_scale[3, 2:], tensors[f"{EXPERT}.up_proj.weight_scale_inv"])
    else:
        assert experts.gate_up_proj_scale.shape == (8, 64, 1)


def test_a_channel_checkpoint_is_quantization_fp8_exactly(folders):
    """compressed-tensors with a scale per channel holds what `--quantization fp8` computes as the
    16-bit checkpoint loads (the same rounding): the same logits, bit for bit."""
    assert torch.equal(_logits(folders["channel"]), _logits(folders["float"], "fp8"))


def test_the_fused_fp8_kernels_run_a_block_checkpoint(folders, monkeypatch):
    """attention_backend triton (the interpreter): the experts go through kernels/fused_moe.py with
    their block scales, and give the reference path's tokens."""
    from llmserve.kernels import fused_moe as fm

    calls = []
    fused = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda *a, **kw: calls.append(kw.get("block_shape")) or fused(*a, **kw))
    fused = _tokens(folders["block"], attention_backend="triton", block_size=8)
    assert fused == _tokens(folders["block"])
    assert calls and set(calls) == {BLOCK}


def test_quantization_fp8_on_a_16_bit_moe_runs_the_fused_fp8_kernels(folders, monkeypatch):
    """The fused kernels on scales per channel give the reference path's tokens."""
    from llmserve.kernels import fused_moe as fm

    calls = []
    fused = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda *a, **kw: calls.append(kw["w13_scale"].dtype) or fused(*a, **kw))
    fused = _tokens(folders["float"], quantization="fp8", attention_backend="triton", block_size=8)
    assert calls and set(calls) == {torch.float32}
    assert fused == _tokens(folders["float"], quantization="fp8")


def _edited(folder: Path, out: Path, edit) -> Path:
    out = Path(shutil.copytree(folder, out))
    path = out / "model.safetensors"
    save_file(edit(load_file(str(path))), str(path), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(
    "kind, name, edit, error",
    [
        ("block", f"{EXPERT}.up_proj.weight_scale_inv", lambda t: t[:1], r"shape \(1, 4\).*\(32, 64\).*\(2, 4\) scales"),
        ("block", f"{EXPERT}.down_proj.weight_scale_inv", lambda t: t.t(), r"shape \(2, 4\).*\(64, 32\).*\(4, 2\)"),
        ("block", "model.layers.1.self_attn.o_proj.weight_scale_inv", lambda t: t[:, :3], r"shape \(4, 3\)"),
        ("channel", f"{EXPERT}.down_proj.weight_scale", lambda t: t[:40], r"shape \(40, 1\).*\(64, 1\)"),
        ("block", f"{EXPERT}.gate_proj.weight_scale_inv", None, r"lacks.*experts.gate_up_proj_scale#3.0"),
    ],
)  # fmt: skip
def test_bad_expert_scales_are_refused_at_start_by_name(folders, tmp_path, kind, name, edit, error):
    def change(tensors):
        if edit is None:
            del tensors[name]
        else:
            tensors[name] = edit(tensors[name]).contiguous()
        return tensors

    bad = _edited(folders[kind], tmp_path / "bad", change)
    with pytest.raises(ValueError, match=(re_name(name) if edit else "") + error):
        LLM(str(bad), max_model_len=64)


def re_name(name: str) -> str:
    return name.replace(".", r"\.") + ".*"


def test_a_scale_of_the_other_layout_and_bad_configs_are_refused(folders, tmp_path):
    """A per-channel scale in a block checkpoint; block scales on a dense model, with static
    activations, or of a width the experts' is not a multiple of; fmt e5m2."""
    name = f"{EXPERT}.up_proj"
    swapped = _edited(folders["block"], tmp_path / "swapped",
                      lambda t: {**{k: v for k, v in t.items() if k != f"{name}.weight_scale_inv"},
                                 f"{name}.weight_scale": torch.ones(32, 1)})  # fmt: skip
    with pytest.raises(ValueError, match=rf"{re_name(name)}weight_block_size \[16, 16\] asks for block scales"):
        LLM(str(swapped), max_model_len=64)

    def with_config(folder: Path, out: Path, **quant) -> Path:
        out = Path(shutil.copytree(folder, out))
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = {**cfg["quantization_config"], **quant}
        (out / "config.json").write_text(json.dumps(cfg))
        return out

    cases = [
        (with_config(folders["block"], tmp_path / "static", activation_scheme="static"), "static activation scales"),
        (with_config(folders["block"], tmp_path / "wide", weight_block_size=[24, 16]), r"32 .*not a multiple of the FP8 "
         r"scale blocks \[24, 16\]"),
        (with_config(folders["block"], tmp_path / "e5m2", fmt="e5m2"), "fmt 'e5m2'"),
    ]  # fmt: skip
    dense = make_random_model(tmp_path / "dense", "qwen3", config_only=True)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    (dense / "config.json").write_text(json.dumps(cfg))
    cases.append((dense, "block-wise FP8 scales .* on a dense model"))
    for folder, message in cases:
        with pytest.raises((ConfigError, UnsupportedModelError), match=message):  # the arch's refusal: read_arch's
            EngineArgs(model=str(folder), load_format="dummy").create_engine_config()


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_each_rank_loads_its_share_of_the_block_scales(folders, expert_parallel):
    """TP=2: a rank's experts hold half of each gate and up (16 rows: one block row each) and half
    of down's columns (one block column); EP=2: half the experts whole. Each rank's dequantized
    experts, put together, are the whole checkpoint's."""
    from llmserve.config import read_arch
    from llmserve.model.attention import reference_paged_attention
    from llmserve.model.loader import load_model
    from llmserve.model.tensor_parallel import TPGroup

    folder = folders["block"]
    arch = read_arch(folder)
    shares = []
    for rank in (0, 1):
        model = load_model(str(folder), arch, torch.float32, "cpu", reference_paged_attention, progress=False,
                           tp=TPGroup(rank, 2, None, expert_parallel), quantization="fp8")  # fmt: skip
        e = model.model.layers[1].mlp.experts
        shares.append((dequantize_blocks(e.gate_up_proj, e.gate_up_proj_scale, BLOCK),
                       dequantize_blocks(e.down_proj, e.down_proj_scale, BLOCK)))  # fmt: skip
    whole = load_model(str(folder), arch, torch.float32, "cpu", reference_paged_attention, progress=False,
                       quantization="fp8").model.layers[1].mlp.experts  # fmt: skip
    gate_up = dequantize_blocks(whole.gate_up_proj, whole.gate_up_proj_scale, BLOCK)
    down = dequantize_blocks(whole.down_proj, whole.down_proj_scale, BLOCK)
    (gu0, d0), (gu1, d1) = shares
    if expert_parallel:
        assert torch.equal(torch.cat([gu0, gu1]), gate_up) and torch.equal(torch.cat([d0, d1]), down)
    else:
        assert gu0.shape == (8, 32, 64)
        assert torch.equal(torch.cat([gu0[:, :16], gu1[:, :16], gu0[:, 16:], gu1[:, 16:]], dim=1), gate_up)
        assert torch.equal(torch.cat([d0, d1], dim=2), down)


def test_dummy_weights_with_a_block_config(folders):
    """`--load-format dummy` on a block checkpoint's config (benchmarks): the experts drawn in FP8,
    their block scales finite, and it generates."""
    with LLM(str(folders["block"]), load_format="dummy", max_model_len=64) as llm:
        experts = llm.core.runner.model.model.layers[0].mlp.experts
        assert experts.gate_up_proj_scale.dtype == torch.float32
        assert torch.isfinite(experts.down_proj_scale).all() and (experts.down_proj_scale > 0).all()
        out = llm.generate([{"prompt_token_ids": [1, 5, 9]}], SamplingParams(max_tokens=3, temperature=0.0),
                           use_tqdm=False)  # fmt: skip
        assert len(out[0].outputs[0].token_ids) == 3

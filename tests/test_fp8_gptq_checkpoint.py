"""`make-fp8-checkpoint --gptq` and `--ignore`: GPTQ over a whole model (model/gptq_calibration.py),
written as a compressed-tensors FP8 checkpoint with an ignore list, from a Hugging Face folder or
a GGUF file; the engine loading it as it is; `bench accuracy --baseline-model`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.bench.accuracy import load_for_reading
from llmserve.config import TINY_MODEL_DIR, ConfigError, EngineArgs
from llmserve.model.fp8 import Fp8Linear, quantize_rows
from llmserve.model.fp8_checkpoint import GptqCalibration, read_checkpoint_quantization, write_fp8_checkpoint
from llmserve.model.gptq_calibration import calibration_windows, gptq_model, projections, read_calibration_texts

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
CALIBRATION = (str(ROOT / "README.md"), str(ROOT / "docs" / "models.md"))  # none of the texts read below
KEPT = "model.layers.5.mlp.down_proj"  # the tiny model's last down_proj
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory) -> Path:
    return write_fp8_checkpoint(TINY_MODEL_DIR, tmp_path_factory.mktemp("gptq") / "tiny-fp8", "compressed-tensors",
                                "channel", ignore=(KEPT,), gptq=GptqCalibration(CALIBRATION, tokens=1024, device="cpu"))  # fmt: skip


def _reading_model(path, **kwargs):
    model, tokenizer, _ = load_for_reading(EngineArgs(model=str(path), dtype="float32", device="cpu", **kwargs))
    return model, tokenizer


def test_calibration_windows_take_every_text_in_turn():
    texts = [list(range(100)), list(range(1000, 1030)), list(range(2000, 2100))]
    windows = calibration_windows(texts, 20, 200)
    assert [w[0] for w in windows[:5]] == [0, 1000, 2000, 20, 2020]  # round robin, the short text once
    assert len(windows) == 10 and all(len(w) == 20 for w in windows)
    assert [w[0] for w in calibration_windows(texts, 20, 200, mix=False)[:6]] == [0, 20, 40, 60, 80, 1000]
    with pytest.raises(ValueError, match="no calibration text is 500 tokens long"):
        calibration_windows(texts, 500, 1000)
    with pytest.raises(ValueError, match="at least one window"):
        calibration_windows(texts, 20, 10)


def test_the_checkpoint_holds_what_gptq_rounds_and_keeps_the_ignored_projection(gptq_dir):
    """The fused projections' GPTQ rows, split into q/k/v and gate/up on writing, load back into
    the same fused FP8 weights; the ignored projection is the source's weight, unquantized."""
    cfg = json.loads((gptq_dir / "config.json").read_text())
    assert cfg["quantization_config"]["ignore"] == ["lm_head", KEPT]
    assert cfg["quantization_config"]["llmserve_rounding"]["method"] == "gptq"
    source, tokenizer = _reading_model(TINY_MODEL_DIR)
    windows = calibration_windows(read_calibration_texts(list(CALIBRATION), tokenizer), 512, 1024)
    want = gptq_model(source, windows, {KEPT})
    loaded, _ = _reading_model(gptq_dir)
    modules = dict(loaded.named_modules())
    assert not isinstance(modules[KEPT], Fp8Linear) and modules[KEPT].weight.dtype == torch.float32
    torch.testing.assert_close(modules[KEPT].weight, dict(source.named_modules())[KEPT].weight, rtol=0, atol=0)
    differs = 0
    for name, (q, scale) in want.items():
        assert isinstance(modules[name], Fp8Linear), name
        assert torch.equal(modules[name].weight.view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(modules[name].weight_scale, scale), name
        rtn, rtn_scale = quantize_rows(dict(source.named_modules())[name].weight)
        assert torch.equal(rtn_scale, scale)  # the same grid as round to nearest...
        differs += int((rtn.view(torch.uint8) != q.view(torch.uint8)).sum())
    assert differs > 0  # ...with other choices on it
    assert set(want) == {n for n, m in modules.items() if isinstance(m, Fp8Linear)}


def test_gptq_lowers_every_layer_s_output_error_on_its_calibration_inputs():
    model, tokenizer = _reading_model(TINY_MODEL_DIR)
    windows = calibration_windows(read_calibration_texts(list(CALIBRATION), tokenizer), 256, 1024)
    weights = {n: m.weight.detach().clone() for n, m in projections(model).items()}
    ratios = []

    def error(w, q, h):
        d = (w - q).double()
        return float(((d @ h) * d).sum())

    def check(report, done):
        for name, (q, scale) in done.items():
            rtn, rtn_scale = quantize_rows(weights[name])
            ratios.append(error(weights[name], q.float() * scale, report.hessians[name])
                          / error(weights[name], rtn.float() * rtn_scale, report.hessians[name]))  # fmt: skip

    gptq_model(model, windows, on_layer=check)
    assert len(ratios) == 6 * 4 and max(ratios) < 1.0, ratios
    for name, w in weights.items():  # the model is left as it was
        assert torch.equal(dict(model.named_modules())[name].weight, w)


def test_the_engine_runs_the_checkpoint_close_to_the_source(gptq_dir):
    prompts = [[1, 5, 9, 200, 31], [1, 77, 300, 12, 8, 1000, 64]]
    base = LLM(str(TINY_MODEL_DIR), max_model_len=128)
    fp8 = LLM(str(gptq_dir), max_model_len=128)
    assert fp8.config.model_config.quantization == "fp8"
    assert fp8.config.model_config.quantization_ignore == (KEPT,)
    want = [o.outputs[0].token_ids for o in base.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    got = [o.outputs[0].token_ids for o in fp8.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert sum(a == b for w, g in zip(want, got) for a, b in zip(w, g)) >= 0.6 * sum(map(len, want)), (want, got)
    with pytest.raises(ConfigError, match="an FP8 checkpoint lists its own unquantized layers"):
        EngineArgs(model=str(gptq_dir), quantization_ignore=KEPT).create_engine_config()


def _cfg(ignore: list, method: str = "compressed-tensors") -> dict:
    if method == "fp8":
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ignore}
    else:
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore,
              "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8, "strategy": "channel"}}}}  # fmt: skip
    # the family's declarations say which projections the names map onto (model/interface.py)
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_attention_heads": 4, "num_hidden_layers": 2, "quantization_config": qc}  # fmt: skip


@pytest.mark.parametrize("method", ["compressed-tensors", "fp8"])
def test_ignore_lists_map_onto_the_fused_projections(method):
    read = read_checkpoint_quantization
    assert read(_cfg(["lm_head"], method)).ignore == ()
    assert read(_cfg(["lm_head", "re:.*mlp\\.gate$"], method)).ignore == ()  # an MoE router this model lacks
    got = read(_cfg(["re:model\\.layers\\.0\\.self_attn\\.[qkv]_proj", "model.layers.1.mlp.gate_proj",
                     "model.layers.1.mlp.up_proj", "model.layers.1.self_attn.o_proj"], method)).ignore  # fmt: skip
    assert got == (
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.1.mlp.gate_up_proj",
    )
    assert read(_cfg(["re:.*down_proj"], method)).ignore == (
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
    )
    for bad, message in (
        (["model.layers.0.self_attn.q_proj"], "q_proj left unquantized without model.layers.0.self_attn.k_proj"),
        (["model.layers.1.mlp.up_proj"], "runs them as one projection, gate_up_proj"),
        (["re:("], "a bad regular expression"),
        ("lm_head", "is not a list of module names"),
    ):
        with pytest.raises(Exception, match=message):
            read(_cfg(bad, method))
    # compressed-tensors' reading: a pattern matches from the name's start
    assert read(_cfg(["re:.*layers\\.1\\.self_attn"], method)).ignore == (
        "model.layers.1.self_attn.qkv_proj",
        "model.layers.1.self_attn.o_proj",
    )
    with pytest.raises(Exception, match="without num_hidden_layers"):
        read({"quantization_config": _cfg(["re:.*down_proj"], method)["quantization_config"]})


def test_a_gguf_file_becomes_a_folder_the_engine_reads_as_the_file(tmp_path):
    """From a GGUF: config, tokenizer and bfloat16 weights as Hugging Face files. With every
    projection ignored the folder is the GGUF's model in bfloat16: the same logits."""
    from llmserve.model.gguf.writer import write_gguf

    gguf = write_gguf(TINY_MODEL_DIR, tmp_path / "tiny.gguf", "F32")
    out = write_fp8_checkpoint(gguf, tmp_path / "from-gguf", "compressed-tensors", "channel", ignore=("re:.*",))
    text = "The scheduler picks work under a token budget; prefill may be chunked."
    file_model, file_tok = _reading_bf16(gguf)
    dir_model, dir_tok = _reading_bf16(out)
    ids = file_tok.encode(text, add_special_tokens=False)
    assert dir_tok.encode(text, add_special_tokens=False) == ids
    assert dir_tok.chat_template == file_tok.chat_template
    from llmserve.bench.accuracy import read_text

    a = read_text(file_model, ids, 64, torch.device("cpu"), torch.bfloat16)
    b = read_text(dir_model, ids, 64, torch.device("cpu"), torch.bfloat16)
    assert a.nll == b.nll and a.top1 == b.top1
    rtn = write_fp8_checkpoint(gguf, tmp_path / "rtn", "compressed-tensors", "channel")
    assert read_checkpoint_quantization(json.loads((rtn / "config.json").read_text())).ignore == ()


def _reading_bf16(path):
    model, tokenizer, _ = load_for_reading(EngineArgs(model=str(path), dtype="bfloat16", device="cpu"))
    return model, tokenizer


def test_an_fp8_source_and_an_fp8_weight_where_a_kept_projection_loads_are_refused(gptq_dir, tmp_path):
    with pytest.raises(ValueError, match="is already an FP8 checkpoint"):
        write_fp8_checkpoint(gptq_dir, tmp_path / "again", "compressed-tensors", "channel")
    with pytest.raises(ValueError, match="not one string"):
        write_fp8_checkpoint(TINY_MODEL_DIR, tmp_path / "s", "compressed-tensors", "channel", ignore=KEPT)
    # a config whose ignore list names a projection the weights hold in FP8: a clear error at load
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in gptq_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((broken / "config.json").read_text())
    cfg["quantization_config"]["ignore"].append("model.layers.0.self_attn.o_proj")
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="o_proj.weight' is FP8 but its projection runs unquantized"):
        _reading_model(broken)


def test_cli_refuses_bad_gptq_settings(tmp_path, capsys):
    from llmserve.cli import main

    short = tmp_path / "short.txt"
    short.write_text("too short to make one window")
    out = str(tmp_path / "out")
    for args, message in (
        (["--gptq"], "--gptq needs --calibration-text"),
        (["--calibration-text", str(short)], "--calibration-text is read by --gptq"),
        (["--gptq", "--calibration-text", str(tmp_path / "none.txt")], "is not a file"),
        (["--gptq", "--calibration-text", str(short)], "no calibration text is 512 tokens long"),
        (["--gptq", "--calibration-text", str(short), "--weights", "tensor"], "a scale per output channel"),
        (["--ignore", "model.layers.9.mlp.down_proj"], "names no projection of this model"),
        (["--ignore", "re:("], "a bad regular expression"),
    ):
        with pytest.raises(SystemExit) as exited:
            main(["make-fp8-checkpoint", str(TINY_MODEL_DIR), out, *args])
        assert exited.value.code == 2 and message in capsys.readouterr().err, args
    assert not (tmp_path / "out").exists()  # nothing half written


def test_bench_accuracy_compares_a_checkpoint_with_its_source(gptq_dir, tmp_path, capsys):
    from llmserve.cli import main

    text = ROOT / "docs" / "architecture.md"
    main(["bench", "accuracy", "--model", str(gptq_dir), "--baseline-model", str(TINY_MODEL_DIR), "--text", str(text),
          "--max-positions", "256", "--device", "cpu", "--output-json", str(tmp_path / "acc.json")])  # fmt: skip
    result = json.loads((tmp_path / "acc.json").read_text())
    assert result["baseline"].startswith("tiny_model, ") and "quantization none" in result["baseline"]
    assert result["candidate"].startswith("tiny-fp8, ") and f"kept: {KEPT}" in result["candidate"]
    assert abs(result["perplexity_change_pct"]) < 3 and result["top1_agreement"] > 0.85
    # a model with another tokenizer reads other tokens: refused, not compared position by position
    other = tmp_path / "other"
    other.mkdir()
    for f in TINY_MODEL_DIR.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tok = json.loads((other / "tokenizer.json").read_text())
    tok["normalizer"] = {"type": "Lowercase"}
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(SystemExit) as exited:
        main(["bench", "accuracy", "--model", str(gptq_dir), "--baseline-model", str(other), "--text", str(text),
              "--max-positions", "64", "--device", "cpu"])  # fmt: skip
    assert exited.value.code == 2 and "tokenizers give different tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # an FP8 checkpoint against itself would read 0 %: its source is asked for
        main(["bench", "accuracy", "--model", str(gptq_dir), "--text", str(text), "--device", "cpu"])
    assert "compare it with its source (--baseline-model)" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_calibration_sees_the_inputs_the_model_s_own_forward_gives(family, tmp_path):
    """The Hessians gptq_model sums are X^T X of the inputs each projection gets when the model
    itself reads the windows (bench accuracy's read): for Gemma 3 that needs its embedding step,
    the rows scaled by sqrt(hidden_size), not the bare table."""
    from llmserve.bench.accuracy import read_text
    from llmserve.model.fp8_gptq import input_hessian
    from llmserve.model.random_model import make_random_model

    path = make_random_model(tmp_path / family, family, seed=3)
    model, _ = _reading_model(path)
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(1, 500, (40,), generator=g).tolist() for _ in range(2)]  # past gemma3's window of 16
    mods = projections(model)
    want = {n: torch.zeros(m.weight.shape[1], m.weight.shape[1], dtype=torch.float64) for n, m in mods.items()}

    def hook(name):
        def pre(_m, args):
            want[name] += input_hessian(args[0])

        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in mods.items()]
    for ids in windows:
        read_text(model, ids + [0], len(ids), torch.device("cpu"), torch.float32)
    for h in handles:
        h.remove()
    got = {}
    gptq_model(model, windows, on_layer=lambda report, _done: got.update(report.hessians),
               round_weight=lambda w, _h: (None, w))  # fmt: skip  # weights unrounded: the same inputs throughout
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6 * float(want[name].abs().max()))

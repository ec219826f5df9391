"""Per-card kernel settings (kernels/tuning.py) and `llmserve tune`'s search (kernels/tune.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llmserve.kernels import fp8_linear, split_k_gemm, tune, tuning

pytestmark = pytest.mark.unit

SPLIT_K = "llmserve.kernels.split_k_gemm"


@pytest.fixture(autouse=True)
def user_settings(tmp_path, monkeypatch):
    """A fresh folder of user settings; the defaults again after each test."""
    monkeypatch.setenv("LLMSERVE_TUNED_DIR", str(tmp_path / "tuned"))
    yield tmp_path / "tuned"
    tuning.set_values({})


def test_card_without_a_file_runs_the_defaults():
    settings = tuning.apply("cpu")
    assert settings.card == "cpu" and settings.source is None and "defaults" in settings.summary()
    assert split_k_gemm.SMALL_M_PROGRAMS == tuning.defaults()[SPLIT_K]["SMALL_M_PROGRAMS"]


def test_a_card_file_sets_the_kernels_and_a_later_apply_restores_them(user_settings):
    default = tuning.defaults()[SPLIT_K]["SMALL_M_PROGRAMS"]
    path = tuning.write_settings("cpu", {SPLIT_K: {"SMALL_M_PROGRAMS": default // 2}}, "test")
    settings = tuning.apply(torch.device("cpu"))
    assert settings.source == str(path) and settings.changed == {SPLIT_K: {"SMALL_M_PROGRAMS": default // 2}}
    assert split_k_gemm.SMALL_M_PROGRAMS == default // 2
    # the kernel's choice follows: a 4,096-deep K over 32 tiles splits for half the programs
    assert split_k_gemm.split_k_for(1, 4096, 128, 32) == max(1, (default // 2) // 32)
    path.unlink()
    assert tuning.apply("cpu").source is None and split_k_gemm.SMALL_M_PROGRAMS == default


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"llmserve.kernels.nope": {"X": 1}}, "unknown kernel module"),
        ({SPLIT_K: {"NOT_A_SETTING": 1}}, "no tunable setting 'NOT_A_SETTING'"),
        ({SPLIT_K: {"PROGRAMS": "many"}}, "must be a non-negative integer"),
        ({SPLIT_K: {"PROGRAMS": -1}}, "must be a non-negative integer"),
    ],
)
def test_a_broken_settings_file_is_refused_by_name(user_settings, settings, message):
    user_settings.mkdir(parents=True)
    (user_settings / "cpu.json").write_text(json.dumps({"settings": settings}))
    with pytest.raises(ValueError, match=message) as err:
        tuning.apply("cpu")
    assert "cpu.json" in str(err.value)
    assert split_k_gemm.PROGRAMS == tuning.defaults()[SPLIT_K]["PROGRAMS"]  # nothing half-applied


def test_the_engine_starts_with_its_card_s_settings(user_settings, llama_dir):
    from llmserve import LLM

    tuning.write_settings("cpu", {"llmserve.kernels.fp8_linear": {"SMALL_M_ROWS": 16}}, "test")
    llm = LLM(llama_dir, max_model_len=64)
    assert llm.core.runner.card_settings.source == str(user_settings / "cpu.json")
    assert fp8_linear.SMALL_M_ROWS == 16


def _fake_calls(seen: list[dict]):
    """Calls whose cost is a function of the settings in force; one gives a wrong answer when
    PROGRAMS is 1,024 (the search must skip that value even though it is the cheapest)."""

    def fast():
        seen.append({"small": split_k_gemm.SMALL_M_PROGRAMS, "programs": split_k_gemm.PROGRAMS})
        return torch.ones(2) * (2.0 if split_k_gemm.PROGRAMS == 1024 else 1.0)

    return [("gemm", fast, lambda: torch.ones(2))]


def test_search_picks_the_fastest_correct_value_of_each_setting():
    seen: list[dict] = []

    def timer(fn):
        fn()
        s = seen[-1]
        return abs(s["small"] - 384) + (0 if s["programs"] == 1024 else abs(s["programs"] - 768)) + 1

    settings = [tune.Setting(SPLIT_K, "SMALL_M_PROGRAMS", (128, 256, 384, 512)),
                tune.Setting(SPLIT_K, "PROGRAMS", (256, 512, 768, 1024))]  # fmt: skip
    chosen = tune.search({"gemm": _fake_calls(seen)}, timer, settings, progress=lambda _: None)
    assert chosen == {SPLIT_K: {"SMALL_M_PROGRAMS": 384, "PROGRAMS": 768}}
    assert any(s["programs"] == 1024 for s in seen)  # tried, found wrong, not chosen
    assert split_k_gemm.PROGRAMS == tuning.defaults()[SPLIT_K]["PROGRAMS"]  # defaults again after


def test_search_omits_values_equal_to_the_defaults():
    default = tuning.defaults()[SPLIT_K]["BF16_STAGES"]
    chosen = tune.search({"gemm": [("x", lambda: torch.ones(1), lambda: torch.ones(1))]},
                         lambda fn: abs(split_k_gemm.BF16_STAGES - default) + 1.0,
                         [tune.Setting(SPLIT_K, "BF16_STAGES", (2, 3, 4, 5))], progress=lambda _: None)  # fmt: skip
    assert chosen == {}


def test_the_projection_shapes_of_a_decoder_layer():
    assert tune.projection_shapes(4096, 14336, 4096, 1024) == [(6144, 4096), (4096, 4096), (28672, 4096),
                                                               (4096, 14336)]  # fmt: skip


def test_tune_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "-m", "llmserve", "tune"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "CUDA device" in proc.stderr


def test_a_launch_config_setting_reads_from_its_fields(user_settings):
    from llmserve.kernels import paged_attention

    tile = {"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 4}
    tuning.write_settings("cpu", {"llmserve.kernels.paged_attention": {"_DECODE_GPU": tile}}, "test")
    tuning.apply("cpu")
    assert paged_attention._DECODE_GPU == paged_attention.AttnLaunchConfig(**tile)
    (user_settings / "cpu.json").write_text(json.dumps(
        {"settings": {"llmserve.kernels.paged_attention": {"_DECODE_GPU": {"block_m": 16}}}}))  # fmt: skip
    with pytest.raises(ValueError, match="block_n"):
        tuning.apply("cpu")


def test_split_counts_follow_the_card_s_settings():
    from llmserve.kernels import paged_attention

    base = paged_attention.choose_num_splits(1, 8, 8192, num_sms=132)
    tuning.set_values({"llmserve.kernels.paged_attention": {"PROGRAMS_PER_SM_TARGET": 1}})
    assert paged_attention.choose_num_splits(1, 8, 8192, num_sms=132) == base // 2


def test_a_value_no_file_names_is_left_as_it_is(monkeypatch):
    """A value set by hand (a test's or a script's monkeypatch) survives an engine's start on a card
    whose file does not name it."""
    from llmserve.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "SDPA_CHUNK_MIN_TOKENS", 16)
    tuning.apply("cpu")
    assert paged_attention.SDPA_CHUNK_MIN_TOKENS == 16


# the fused MoE's tile tables: per-card settings keyed by experts' shape "E,H,I"
MOE = "llmserve.kernels.fused_moe"
TILE = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3)
DECODE = dict(max_tokens=4, BLOCK_N=16, BLOCK_K=64, DOWN_BLOCK_N=64, num_warps=4, num_stages=2)


def test_moe_tables_round_trip_through_a_card_file(user_settings):
    from llmserve.kernels import fused_moe as fm

    big = dict(TILE, BLOCK_M=64, BLOCK_N=128)
    tables = {"TUNED_TILES": {"4,64,32": {16: TILE, 16384: big}}, "TUNED_DECODE": {"4,64,32": DECODE}}
    path = tuning.write_settings("cpu", {MOE: tables}, "test")
    on_disk = json.loads(path.read_text())["settings"][MOE]
    assert set(on_disk["TUNED_TILES"]["4,64,32"]) == {"16", "16384"}  # JSON's string keys
    assert tuning.read_settings(path) == {MOE: tables}  # read back as ints
    settings = tuning.apply("cpu")
    assert settings.changed == {MOE: tables}
    assert fm.tile_config(8, 4, 64, 32) == TILE and fm.tile_config(17, 4, 64, 32) == big
    assert fm.tile_config(10**6, 4, 64, 32) == big  # past the last bucket: the last
    assert fm.decode_config(4, 64, 32) == DECODE and fm.use_decode(4, 4, 64, 32) and not fm.use_decode(5, 4, 64, 32)
    # another shape: the defaults
    assert fm.tile_config(8, 8, 64, 32) == fm.DEFAULT_TILES[32] and fm.decode_config(8, 64, 32) == fm.DEFAULT_DECODE
    path.unlink()  # a card without a file: the defaults back
    assert tuning.apply("cpu").source is None
    assert fm.TUNED_TILES == {} and fm.TUNED_DECODE == {} and fm.tile_config(8, 4, 64, 32) == fm.DEFAULT_TILES[32]


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("TUNED_TILES", {"4,64,32": {"16": {k: v for k, v in TILE.items() if k != "num_stages"}}}, "num_stages"),
        ("TUNED_TILES", {"4,64,32": {"16": dict(TILE, num_warps=-4)}}, "non-negative integers"),
        ("TUNED_TILES", {"4,64,32": {"16": dict(TILE, BLOCK_N=48)}}, "BLOCK_N must be a power of two"),
        ("TUNED_TILES", {"4,64,32": {"16": dict(TILE, BLOCK_K="64")}}, "non-negative integers"),
        ("TUNED_TILES", {"4,64,32": {"sixteen": TILE}}, "batch bucket"),
        ("TUNED_TILES", {"4,64,32": [TILE]}, "batch buckets"),
        ("TUNED_TILES", {"cpu,4,64,32": {"16": TILE}}, "experts' shape"),
        ("TUNED_TILES", [1, 2], "experts' shape"),
        ("TUNED_DECODE", {"4,64,32": dict(DECODE, extra=1)}, "max_tokens"),
        ("TUNED_DECODE", {"4,64,32": dict(DECODE, DOWN_BLOCK_N=24)}, "DOWN_BLOCK_N must be a power of two"),
        ("TUNED_DECODE", {"4,64,32": dict(DECODE, max_tokens=1.5)}, "non-negative integers"),
    ],
)
def test_a_malformed_moe_table_is_refused_by_name(user_settings, name, value, message):
    from llmserve.kernels import fused_moe as fm

    user_settings.mkdir(parents=True)
    (user_settings / "cpu.json").write_text(json.dumps({"settings": {MOE: {name: value}}}))
    with pytest.raises(ValueError, match=message) as err:
        tuning.apply("cpu")
    assert "cpu.json" in str(err.value) and f"{MOE}.{name}" in str(err.value)
    assert fm.TUNED_TILES == {} and fm.TUNED_DECODE == {}


def test_moe_tables_merge_by_shape_and_a_dense_run_replaces_the_dense_settings():
    old = {MOE: {"TUNED_TILES": {"4,64,32": {16: TILE}}, "TUNED_DECODE": {"4,64,32": DECODE}},
           SPLIT_K: {"PROGRAMS": 512}}  # fmt: skip
    new_moe = {MOE: {"TUNED_TILES": {"8,64,32": {16: TILE}}, "TUNED_DECODE": {"8,64,32": DECODE}}}
    merged = tune.merge_settings(old, new_moe, dense=False)
    assert set(merged[MOE]["TUNED_TILES"]) == {"4,64,32", "8,64,32"} and merged[SPLIT_K] == {"PROGRAMS": 512}
    merged = tune.merge_settings(old, {SPLIT_K: {"BF16_STAGES": 3}}, dense=True)
    assert merged[SPLIT_K] == {"BF16_STAGES": 3} and merged[MOE] == old[MOE]


def test_tune_moe_picks_the_fastest_correct_tiles_and_the_decode_limit(monkeypatch):
    """A fake timer (a function of the tiles of the call it times) on a tiny shape under the
    interpreter: the cheapest correct tiles per bucket win, a candidate with a wrong output (the
    cheapest of all) is skipped, and max_tokens is the largest count from 1 the variant wins at."""
    from llmserve.kernels import fused_moe as fm

    real = fm.fused_moe
    calls: list[dict] = []
    broken = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=8, num_stages=3)

    def fused_moe(x, *args, tiles=None, decode=None, **kw):
        calls.append(dict(tokens=x.shape[0], tiles=tiles, decode=decode, cfg=fm.decode_config(4, 64, 32)))
        out = real(x, *args, tiles=tiles, decode=decode, **kw)
        return out * 2 if tiles == broken else out

    def timer(fn):
        fn()
        c = calls[-1]
        if c["decode"]:  # the decode variant: BLOCK_N 32 cheapest; beats the grouped path below 3 tokens
            return 1.0 + abs(c["cfg"]["BLOCK_N"] - 32) + c["cfg"]["DOWN_BLOCK_N"] / 100 + c["tokens"]
        t = c["tiles"]
        if t == broken:
            return 0.0
        want_m = 16 if c["tokens"] <= 8 else 32
        return 3.5 + abs(t["BLOCK_M"] - want_m) + t["BLOCK_N"] / 100 + t["num_warps"] / 1000

    monkeypatch.setattr(fm, "fused_moe", fused_moe)
    out = tune.tune_moe(4, 64, 32, 2, "cpu", timer, progress=lambda _: None, tokens=(8, 32),
                        block_m=(16, 32), block_nk=((16, 16), (32, 16)), warps=(4, 8), stages=(3,),
                        decode_block_n=(16, 32), decode_block_k=(32,), decode_tokens=(1, 2, 4),
                        dtype=torch.float32)  # fmt: skip
    assert any(c["tiles"] == broken for c in calls)  # tried, wrong, never chosen
    table = out["TUNED_TILES"]["4,64,32"]
    assert table == {8: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=3),
                     32: dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=3)}  # fmt: skip
    # decode at 1 token: 2 + 0.16 < grouped 3.66; at 2: 3.16 < 3.66; at 4: 5.16 > 3.66
    assert out["TUNED_DECODE"]["4,64,32"] == dict(max_tokens=2, BLOCK_N=32, BLOCK_K=32, DOWN_BLOCK_N=16,
                                                  num_warps=4, num_stages=2)  # fmt: skip
    assert fm.TUNED_TILES == {} and fm.TUNED_DECODE == {}  # the module's tables as before
    # a file with these tables is accepted as it was measured
    tuning.write_settings("cpu", {MOE: out}, "test")
    assert tuning.apply("cpu").changed == {MOE: out}
    assert fm.tile_config(32, 4, 64, 32) == table[32]


def test_tune_moe_writes_max_tokens_0_when_the_variant_never_wins(monkeypatch):
    from llmserve.kernels import fused_moe as fm

    out = tune.tune_moe(4, 64, 32, 2, "cpu", lambda fn: 1.0, progress=lambda _: None, tokens=(16,),
                        block_m=(16,), block_nk=((16, 16),), warps=(4,), stages=(3,), decode_block_n=(16,),
                        decode_block_k=(32,), decode_tokens=(1, 2), dtype=torch.float32)  # fmt: skip
    assert out["TUNED_DECODE"]["4,64,32"]["max_tokens"] == 0  # a tie: the grouped path
    monkeypatch.setattr(fm, "TUNED_DECODE", out["TUNED_DECODE"])
    assert not any(fm.use_decode(t, 4, 64, 32) for t in range(0, 9))


def test_tune_reads_a_moe_model_s_shapes(tmp_path, monkeypatch):
    from llmserve import cli
    from llmserve.model.random_model import make_random_model

    model = tmp_path / "moe"
    make_random_model(model, "qwen3_moe", config_only=True)
    cfg = json.loads((model / "config.json").read_text())
    seen = {}
    monkeypatch.setattr(tune, "run", lambda *a, **kw: seen.update(args=a, kw=kw) or ("path", {}))
    cli.main(["tune", "--model", str(model), "--only", "moe", "--num-heads", "2", "--moe-tokens", "1,128,16384"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads, experts = cfg["num_key_value_heads"], cfg.get("num_experts") or cfg["num_local_experts"]
    assert seen["args"] == (cfg["hidden_size"], cfg["intermediate_size"], 2, kv_heads, head_dim, "cuda")
    assert seen["kw"] == dict(num_experts=experts, moe_intermediate=cfg["moe_intermediate_size"],
                              top_k=cfg["num_experts_per_tok"], only="moe", moe_tokens=(1, 128, 16384))  # fmt: skip
    monkeypatch.undo()
    if torch.cuda.is_available():
        return
    with pytest.raises(SystemExit, match="CUDA device"):
        cli.main(["tune", "--model", str(model), "--only", "moe"])
    with pytest.raises(SystemExit):  # a dense model has no experts to tune alone
        cli.main(["tune", "--only", "moe"])


def test_every_shipped_card_file_reads():
    """The settings files shipped in llmserve/kernels/tuned/ (measured on a card) pass the same checks a
    user's file does, name their card as their file, and are package data (pyproject.toml)."""
    files = sorted(tuning.SHIPPED_DIR.glob("*.json"))
    assert files, "no shipped card file"
    for path in files:
        values = tuning.read_settings(path)
        assert json.loads(path.read_text())["card"] == path.stem
        assert values, path
    assert "kernels/tuned/*.json" in (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()

"""Per-card kernel settings (kernels/tuning.py) and `llmserve tune`'s search (kernels/tune.py)."""

from __future__ import annotations

import json
import subprocess
import sys

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

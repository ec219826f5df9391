"""Write a Triton model repository: `<model>/config.pbtxt` plus `<model>/<version>/model.py`
(and `server_path.py` beside it: PYTHONPATH for the stub, which does not read it)."""

from __future__ import annotations

import shutil
from pathlib import Path

from llmserve.triton.repo_config import ModelConfig, platform_models

MODELS_DIR = Path(__file__).parent / "models"


def load_platform_yaml(path: str | None) -> dict | None:
    if path is None:
        return None
    import yaml

    with open(path) as f:
        spec = yaml.safe_load(f) or {}
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: expected a mapping with a 'models' key")
    return spec


def write_model(repo: Path, model: ModelConfig, version: int = 1) -> Path:
    """Write (or overwrite) one model's config.pbtxt and its `version` folder."""
    folder = repo / model.name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(model.render())
    shutil.copyfile(MODELS_DIR / f"{model.kind}.py", folder / str(version) / "model.py")
    shutil.copyfile(
        MODELS_DIR / "server_path.py", folder / str(version) / "server_path.py"
    )  # model.py imports it first
    return folder


def build_repo(out: str | Path, models: list[ModelConfig] | None = None) -> Path:
    """Write every model into `out` (created if needed); returns the repository path."""
    repo = Path(out)
    repo.mkdir(parents=True, exist_ok=True)
    for model in models if models is not None else platform_models():
        write_model(repo, model)
    return repo

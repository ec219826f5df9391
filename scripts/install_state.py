"""What scripts/install.sh needs to know about the llmserve it installed (stdlib and
`packaging` only; run by .venv/bin/python from the project's root).

    install_state.py current              exit 0: llmserve is installed editable from this
                                          folder exactly as pyproject.toml declares it now
                                          (version, scripts, requirements); else exit 1
    install_state.py requirements EXTRAS  pyproject.toml's requirements (its dependencies and
                                          those of EXTRAS, comma-separated), one a line

A second install then asks pip only for the requirements (nothing to do when they are met)
instead of installing llmserve again: reinstalling it removes it for a moment, and any
process starting then (a test's server, a Triton model) could not import it.
"""

from __future__ import annotations

import json
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def requirements(extras: list[str]) -> list[str]:
    project = _project()
    optional = project.get("optional-dependencies", {})
    return [*project.get("dependencies", []), *(r for extra in extras for r in optional[extra])]


def _key(text: str) -> tuple:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    req = Requirement(text)
    return canonicalize_name(req.name), frozenset(req.extras), req.specifier, req.url, str(req.marker or "")


def current() -> bool:
    try:
        dist = metadata.distribution("llmserve")
    except metadata.PackageNotFoundError:
        return False
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    if origin.get("url") != ROOT.as_uri() or not origin.get("dir_info", {}).get("editable"):
        return False
    project = _project()
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    declared = list(project.get("dependencies", []))
    for extra, reqs in project.get("optional-dependencies", {}).items():
        declared += [f'{r}; extra == "{extra}"' for r in reqs]  # as the built metadata writes them
    return (dist.version == project["version"] and scripts == project.get("scripts", {})
            and sorted(map(_key, dist.requires or []), key=repr) == sorted(map(_key, declared), key=repr))  # fmt: skip


def main(argv: list[str]) -> int:
    command = argv[1] if len(argv) > 1 else ""
    if command == "current":
        return 0 if current() else 1
    if command == "requirements" and len(argv) == 3:
        print("\n".join(requirements([e for e in argv[2].split(",") if e])))
        return 0
    raise SystemExit(f"install_state.py: unknown command {command!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv))

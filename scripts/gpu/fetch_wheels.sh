#!/usr/bin/env bash
# Wheels the GPU image lacks, for Python 3.12 on x86-64 Linux, into .whl/ (git-ignored; the
# device call carries it: carry [".whl"], then `setup_env` from lib.sh installs them).
# The image has torch, triton and transformers, but not the engine's IPC (pyzmq) nor the
# server's stack (`llmserve serve` failed there on `import fastapi`).
set -euo pipefail
cd "$(dirname "$0")/../.."
PKGS=(pyzmq fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection
      prometheus_client httpx httpcore h11 anyio sniffio idna certifi uvloop httptools
      aiohttp aiosignal aiohappyeyeballs frozenlist multidict yarl propcache attrs
      opentelemetry-api annotated-doc  # fastapi 0.165 imports opentelemetry (its telemetry module)
      pytest pluggy iniconfig pytest-xdist execnet pytest-timeout  # the GPU tier: `pytest -m gpu`
      gguf pyyaml)  # GGUF files (the GPU tier quantizes its GGUF kernels' test weights with it)
# the versions of the project's own venv (known to work together) where it has them
if [ -x .venv/bin/python ]; then
  mapfile -t PKGS < <(.venv/bin/python - "${PKGS[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for name in sys.argv[1:]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        print(name)
PY
)
fi
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${PKGS[@]}"
ls .whl

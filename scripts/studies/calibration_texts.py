"""Write calibration texts from what this machine already has, none of them this project's own:
the long descriptions (READMEs) of installed Python packages and two licence texts. GPTQ
(`llmserve make-fp8-checkpoint --gptq --calibration-text ...`) and scripts/studies/fp8_gptq.py
calibrate on them; the accuracy is then measured on this project's docs, text from elsewhere.

    python scripts/studies/calibration_texts.py /tmp/calib
"""

from __future__ import annotations

import argparse
import shutil
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "transformers", "openai", "fastapi", "pydantic", "redis")
LICENCES = {"gpl3": "/usr/share/common-licenses/GPL-3", "apache2": "/usr/share/common-licenses/Apache-2.0"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    opts = ap.parse_args()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        body = metadata.metadata(name).get_payload()
        if not body:
            raise SystemExit(f"{name}: its metadata has no description")
        (out / f"{name}.txt").write_text(body, encoding="utf-8")
    for name, path in LICENCES.items():
        shutil.copy(path, out / f"{name}.txt")
    for f in sorted(out.glob("*.txt")):
        print(f"{f} ({f.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

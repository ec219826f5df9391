"""Imported first by every model of the repository (copied beside each model.py).

The Python backend's stub runs an embedded interpreter that does not read PYTHONPATH: it
sees the Python environment of the first `python3` on PATH, the model's folder and its
working folder. Packages installed elsewhere and named in PYTHONPATH (`pip install
--target`, a source checkout, numpy 1.x put ahead of an image's numpy 2) go in front of
`sys.path` here, in PYTHONPATH's order, before the model imports anything else.
"""

import os
import sys

_entries = list(dict.fromkeys(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p))
sys.path[:] = _entries + [p for p in sys.path if p not in _entries]

# LLMSERVE_TRITON_HIDE_MODULES="sklearn,...": modules the stub treats as not installed. On an
# image whose scipy needs numpy 2 while the stub needs numpy 1.x (docs/triton.md), transformers
# imports sklearn, and so scipy, when it finds it; hidden, transformers leaves it alone.
# (a module the stub imported already stays as it is)
for _name in filter(None, (n.strip() for n in os.environ.get("LLMSERVE_TRITON_HIDE_MODULES", "").split(","))):
    sys.modules.setdefault(_name, None)

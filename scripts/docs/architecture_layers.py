"""The picture of llmserve's layers in docs/architecture.md, drawn from the code as it is:

    .venv/bin/python scripts/docs/architecture_layers.py [docs/architecture_layers.png]

Each box is a package of llmserve (or a group of top-level modules), placed in its layer; each arrow
is a module-level import between two boxes, read from the source with `ast` (imports inside functions,
made lazily, are not drawn). An arrow that points up a layer, against the layering, is red. A module
that no box claims stops the script, so the map cannot silently fall behind the code.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "llmserve"

# box: (layer, x, what it holds): layer 5 is the front door, 0 the leaf modules everything reads
BOXES = {
    "gateway/": (5, 0, "keys, limits, admission, routing"),
    "up": (5, 1, "llmserve up: Triton + gateway"),
    "triton/": (5, 2, "Triton models and server"),
    "serve/": (5, 3, "llmserve serve (FastAPI)"),
    "cli": (5, 4, "the llmserve command"),
    "placement/": (4, 0, "many models on one GPU"),
    "http": (4, 1, "HTTP limits and errors"),
    "openai/": (4, 2, "the OpenAI API, no web framework"),
    "metrics": (4, 3, "vLLM-named metrics"),
    "bench/": (4, 4, "llmserve bench"),
    "config": (3, 0, "typed configs, flags, tokenizer"),
    "llm": (3, 1.1, "LLM: offline API"),
    "engine/": (3, 2.5, "scheduler, KV blocks, runner, sampler"),
    "pooling": (3, 4, "embeddings, rerank"),
    "lora/": (2, 1.5, "adapters, slots"),
    "model/": (2, 3, "families, layers, loading"),
    "kernels/": (1, 2.25, "Triton-language GPU kernels"),
    "leaves": (0, 2.25, "sampling params, outputs, attention metadata, errors, ..."),
}
# top-level modules grouped into a box; any other top-level module is a leaf
GROUPS = {
    "up": ("up", "up_workdir"),
    "cli": ("cli", "__main__", "quant_cli"),
    "llm": ("llm",),
    "config": ("config", "cli_args", "tokenizer"),
    "metrics": ("metrics",),
    "pooling": ("pooling",),
    "http": ("http_errors", "http_limits", "http_head_limit", "http_protocol", "http_connection_table"),
}
LEAVES = {"attention_metadata", "chat_template", "errors", "fp8_tokens", "heap", "host_copy", "lora_batch", "lora_request",
          "net", "outputs", "processes", "sampling_params", "__init__"}  # fmt: skip


def box_of(module: str) -> str:
    """The box of a dotted module name under llmserve."""
    parts = module.split(".")
    if len(parts) == 1:
        return "leaves"  # `import llmserve`, `from llmserve import X`: the package's own __init__
    head = parts[1]
    if (PACKAGE / head).is_dir():
        box = head + "/"
    else:
        box = next((name for name, members in GROUPS.items() if head in members), "leaves" if head in LEAVES else "")
    if box not in BOXES:
        sys.exit(f"{module}: no box in scripts/docs/architecture_layers.py holds it; add it to BOXES, GROUPS or LEAVES")
    return box


def imports() -> Counter:
    """(importing box, imported box) -> count of module-level imports between them."""
    edges: Counter = Counter()
    for path in PACKAGE.rglob("*.py"):
        if "assets" in path.parts:
            continue
        src = box_of(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for node in ast.parse(path.read_text()).body:
            found = []
            for sub in ast.walk(node) if isinstance(node, (ast.Try, ast.If)) else [node]:
                if isinstance(sub, ast.Import):
                    found += [a.name for a in sub.names]
                elif isinstance(sub, ast.ImportFrom) and sub.module and sub.level == 0:
                    found.append(sub.module)
            for name in found:
                if name == "llmserve" or name.startswith("llmserve."):
                    dst = box_of(name)
                    if dst != src:
                        edges[src, dst] += 1
    return edges


def draw(out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    fig = Figure(figsize=(13, 8.5))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.7, 5.1)
    ax.set_ylim(-0.6, 5.75)
    ax.axis("off")
    w, h = 0.86, 0.5
    centre = {name: (x, layer) for name, (layer, x, _) in BOXES.items()}
    for layer, label in enumerate(["leaf modules", "kernels", "model", "engine", "API layer", "front doors"]):
        ax.text(-0.62, layer, label, fontsize=9, color="0.45", va="center", rotation=90)
    for (src, dst), count in sorted(imports().items()):
        (x0, y0), (x1, y1) = centre[src], centre[dst]
        upward = y1 > y0
        colour = "tab:red" if upward else ("0.75" if dst == "leaves" else "0.35")
        if y1 == y0:  # within a layer: an arc over the boxes, from top edge to top edge
            start, end, rad = (x0, y0 + h / 2), (x1, y1 + h / 2), (-0.35 if x1 > x0 else 0.35)
        else:
            sign = 1 if upward else -1
            start, end, rad = (x0, y0 + sign * h / 2), (x1, y1 - sign * h / 2), 0.08
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10, color=colour,
                                     lw=0.6 + 0.25 * min(count, 8), connectionstyle=f"arc3,rad={rad}", zorder=1))  # fmt: skip
    for name, (layer, x, what) in BOXES.items():
        ax.add_patch(FancyBboxPatch((x - w / 2, layer - h / 2), w, h, boxstyle="round,pad=0.02", fc="#e8f0fb", ec="#33598c",
                                    zorder=2))  # fmt: skip
        ax.text(x, layer + 0.08, name, ha="center", va="center", fontsize=11, weight="bold", zorder=3)
        ax.text(x, layer - 0.12, what, ha="center", va="center", fontsize=7, zorder=3, wrap=True)
    ax.text(2.2, 5.55, "llmserve's layers: arrows are module-level imports (grey to the leaf modules; red: up a layer)",
            ha="center", fontsize=11)  # fmt: skip
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    draw(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs" / "architecture_layers.png")

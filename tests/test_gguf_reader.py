"""llmserve's GGUF reader (model/gguf/reader.py, behind `open_gguf`) against its reference, the
`gguf` package's GGUFReader (model/gguf/reference.py): every metadata key and value (Python
types included), every tensor's name, type, shape and bytes, on the default model's GGUF, the
real Gemma 3 270M GGUF (skipped when its packages are missing), small GGUFs of each tensor type
written by gguf/writer.py, and files made here byte by byte with every value type, nested and
empty arrays, version 2, big-endian and a wider alignment. A truncated or damaged file is a
clear error, never a struct or numpy exception."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from llmserve.config import ConfigError, default_model_path
from llmserve.model.gguf.checkpoint import GGUFCheckpoint, GGUFError, open_gguf
from llmserve.model.gguf.dequant import BLOCKS
from llmserve.model.gguf.reader import GGML_TYPES, GGUFFormatError, map_file, read_header, tensor_data
from llmserve.model.gguf.reference import gguf_package_reader, open_gguf_reference
from llmserve.model.gguf.split_parts import PartMissingError, assemble
from llmserve.model.gguf.writer import write_gguf
from llmserve.model.random_model import make_random_model

pytestmark = pytest.mark.unit

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q",
            F64: "d"}  # fmt: skip


# -- comparing with the reference ------------------------------------------------------------
def typed(value: Any) -> Any:
    """A value with its Python type spelled out (1 == 1.0 == True), floats by their bits (NaN == NaN)."""
    if isinstance(value, list):
        return ["list", [typed(v) for v in value]]
    if isinstance(value, float):
        return ["float", value.hex()]
    return [type(value).__name__, value]


def flat(value: Any) -> Any:
    """An array of arrays as the gguf package gives it: flattened (its reader's FIXME)."""
    if not isinstance(value, list) or not any(isinstance(v, list) for v in value):
        return value
    return [leaf for v in value for leaf in (flat(v) if isinstance(v, list) else [v])]


def assert_same_data(ours: np.ndarray, theirs: np.ndarray, name: str) -> None:
    assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), name
    assert np.array_equal(ours.reshape(-1).view(np.uint8), theirs.reshape(-1).view(np.uint8)), name


def assert_header_equals_the_reference(path: Path, reader: Any) -> None:
    """The whole header, no array skipped, against the gguf package's reader of the same file."""
    buf = map_file(path)
    header = read_header(buf)
    assert list(header.metadata) == list(reader.fields)
    for key, field in reader.fields.items():
        assert typed(flat(header.metadata[key])) == typed(field.contents()), key
        if key in header.array_lengths and not any(isinstance(v, list) for v in header.metadata[key]):
            assert header.array_lengths[key] == len(field.data), key
    assert (header.alignment, header.data_offset) == (reader.alignment, reader.data_offset)
    assert header.byte_order == {"I": "<", "S": ">"}[reader.byte_order]
    assert [t.name for t in header.tensors] == [t.name for t in reader.tensors]
    for ours, theirs in zip(header.tensors, reader.tensors, strict=True):
        assert ours.type_name == theirs.tensor_type.name, ours.name
        assert ours.dims == tuple(theirs.shape.tolist()), ours.name
        assert (ours.offset, ours.n_bytes, ours.n_elements) == (theirs.data_offset, theirs.n_bytes, theirs.n_elements)
        assert_same_data(tensor_data(buf, header, ours), theirs.data, ours.name)


def assert_same_checkpoint(ours: GGUFCheckpoint, theirs: GGUFCheckpoint) -> None:
    assert (ours.path, ours.vocab_size) == (theirs.path, theirs.vocab_size)
    assert list(ours.metadata) == list(theirs.metadata)
    assert typed([flat(v) for v in ours.metadata.values()]) == typed(list(theirs.metadata.values()))
    assert list(ours.tensors) == list(theirs.tensors)
    for name, t in ours.tensors.items():
        ref = theirs.tensors[name]
        assert (t.name, t.type_name, t.shape) == (ref.name, ref.type_name, ref.shape), name
        assert_same_data(t.data, ref.data, name)


def assert_equals_the_reference(path: Path) -> None:
    reader = gguf_package_reader(path)  # one reader for both comparisons: Gemma 3's takes ~20 s
    assert_header_equals_the_reference(path, reader)
    assert_same_checkpoint(open_gguf(path), open_gguf_reference(path, reader))


# -- real files -------------------------------------------------------------------------------
def _real_file(which: str) -> Path:
    try:
        return default_model_path() if which == "smollm2" else assemble()
    except (ConfigError, PartMissingError) as exc:
        pytest.skip(f"{which} is not installed ({exc})")


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_real_ggufs_equal_the_reference(which):
    path = _real_file(which)
    assert_equals_the_reference(path)
    ckpt = open_gguf(path)
    assert ckpt.vocab_size == {"smollm2": 49_152, "gemma3": 262_144}[which]
    assert "tokenizer.ggml.tokens" not in ckpt.metadata and "tokenizer.ggml.model" in ckpt.metadata


# -- files written by gguf/writer.py, every tensor type ------------------------------------------
@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("gguf") / "llama", "llama", seed=3, hidden_size=256,
                             intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


@pytest.mark.parametrize("type_name", list(BLOCKS))
def test_written_ggufs_of_each_type_equal_the_reference(small_llama, tmp_path, type_name):
    assert_equals_the_reference(write_gguf(small_llama, tmp_path / f"{type_name}.gguf", type_name))


def test_the_type_table_agrees_with_ggml_and_llmserve():
    import gguf

    for type_id, (name, per_block, block_bytes) in GGML_TYPES.items():
        assert gguf.GGMLQuantizationType(type_id).name == name
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)] == (per_block, block_bytes)
        assert BLOCKS.get(name, (per_block, block_bytes)) == (per_block, block_bytes)
    assert set(BLOCKS) <= {name for name, _, _ in GGML_TYPES.values()}


# -- files made byte by byte --------------------------------------------------------------------
def _value(vtype: int, value: Any, order: str) -> bytes:
    """A value of `vtype`; an array is (element type, [elements])."""
    if vtype == STR:
        raw = value.encode() if isinstance(value, str) else value
        return struct.pack(order + "Q", len(raw)) + raw
    if vtype == ARR:
        itype, items = value
        return struct.pack(order + "IQ", itype, len(items)) + b"".join(_value(itype, v, order) for v in items)
    if vtype not in _FORMATS:  # a type GGUF does not define: 8 bytes of anything
        return bytes(8)
    return struct.pack(order + _FORMATS[vtype], value)


def gguf_bytes(kvs: list[tuple[str, int, Any]], tensors: list[tuple[str, str | int, tuple[int, ...], bytes]],
               order: str = "<", version: int = 3, alignment: int = 32) -> bytes:  # fmt: skip
    """A GGUF file: key-values (key, value type, value) and tensors (name, type name or id, GGUF
    dims, data), each tensor's data at a multiple of `alignment` (which the caller also states as
    general.alignment when not 32), nothing after the last tensor."""
    type_ids = {name: i for i, (name, _, _) in GGML_TYPES.items()}
    out = bytearray(b"GGUF" + struct.pack(order + "IQQ", version, len(tensors), len(kvs)))
    for key, vtype, value in kvs:
        out += _value(STR, key, order) + struct.pack(order + "I", vtype) + _value(vtype, value, order)
    data = bytearray()
    for name, type_name, dims, raw in tensors:
        data += bytes(-len(data) % alignment)
        type_id = type_ids.get(type_name, type_name)
        out += _value(STR, name, order) + struct.pack(order + f"I{len(dims)}QIQ", len(dims), *dims, type_id, len(data))
        data += raw
    return bytes(out + bytes(-len(out) % alignment) + data)


def every_value_kvs(alignment: int = 64) -> list[tuple[str, int, Any]]:
    kvs = [("general.architecture", STR, "llama"), ("general.alignment", U32, alignment)]
    scalars = {U8: [0, 255], I8: [-128, 127], U16: [65535], I16: [-32768], U32: [2**32 - 1], I32: [-(2**31)],
               F32: [1.5, float("nan"), -0.0], BOOL: [True, False], U64: [2**64 - 1], I64: [-(2**63)],
               F64: [0.1, float("inf")]}  # fmt: skip
    for vtype, values in scalars.items():
        kvs += [(f"test.scalar.{vtype}.{i}", vtype, v) for i, v in enumerate(values)]
        kvs.append((f"test.array.{vtype}", ARR, (vtype, values)))
    kvs += [("test.string", STR, "héllo ✓ 🦙"), ("test.empty_string", STR, ""),
            ("test.strings", ARR, (STR, ["a", "", "ünï", "<0x0A>"])), ("test.empty_array", ARR, (I32, [])),
            ("test.empty_strings", ARR, (STR, [])),
            ("test.nested", ARR, (ARR, [(I32, [1, 2]), (I32, []), (I32, [3])])),
            ("test.nested_strings", ARR, (ARR, [(STR, ["x", "y"]), (STR, ["z"])])),
            ("test.nested3", ARR, (ARR, [(ARR, [(F32, [0.5]), (F32, [1.0, 2.0])]), (ARR, [(F32, [4.0])])])),
            ("tokenizer.ggml.tokens", ARR, (STR, ["<unk>", "a", "b"])), ("tokenizer.ggml.model", STR, "gpt2")]  # fmt: skip
    return kvs


def _tensors(order: str = "<") -> list[tuple[str, str, tuple[int, ...], bytes]]:
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 5)).astype(order + "f4")
    q8 = rng.integers(0, 256, size=2 * 2 * 34, dtype=np.uint8)  # 2 rows of 64 values: 2 Q8_0 blocks each
    return [("a.weight", "F32", (5, 3), f32.tobytes()), ("b.weight", "F16", (7,), f32.reshape(-1)[:7].astype(order + "f2").tobytes()),
            ("c.weight", "Q8_0", (64, 2), q8.tobytes()), ("d.weight", "BF16", (4, 1, 2), bytes(range(16))),
            ("e.weight", "Q4_K", (256,), bytes(range(144)))]  # fmt: skip


CASES = {
    "every value type": dict(kvs=every_value_kvs(), tensors=_tensors(), alignment=64),
    "version 2": dict(kvs=every_value_kvs(32), tensors=_tensors(), version=2),
    "big-endian": dict(kvs=every_value_kvs(), tensors=_tensors(">"), alignment=64, order=">"),
    "no tensors": dict(kvs=every_value_kvs(32), tensors=[]),
    "element types": dict(kvs=[], tensors=[("i8", "I8", (3,), b"\x01\x02\xff"), ("i32", "I32", (2,), bytes(8)),
                                           ("f64", "F64", (1, 2), bytes(16)), ("i64", "I64", (), bytes(8)),
                                           ("q2k", "Q2_K", (256,), bytes(84)), ("empty", "F32", (0, 4), b"")]),
}  # fmt: skip


@pytest.fixture(params=list(CASES))
def made_file(request, tmp_path) -> Path:
    path = tmp_path / f"{request.param.replace(' ', '_')}.gguf"
    path.write_bytes(gguf_bytes(**CASES[request.param]))
    return path


def test_made_files_equal_the_reference(made_file):
    assert_header_equals_the_reference(made_file, gguf_package_reader(made_file))
    if made_file.stem in ("every_value_type", "version_2", "no_tensors"):  # tensors of types llmserve loads
        assert_same_checkpoint(open_gguf(made_file), open_gguf_reference(made_file))


def test_arrays_of_arrays_stay_nested_and_big_endian_files_are_refused(tmp_path):
    path = tmp_path / "every.gguf"
    path.write_bytes(gguf_bytes(**CASES["every value type"]))
    meta = open_gguf(path).metadata
    assert meta["test.nested"] == [[1, 2], [], [3]] and meta["test.nested_strings"] == [["x", "y"], ["z"]]
    assert meta["test.nested3"] == [[[0.5], [1.0, 2.0]], [[4.0]]]
    assert open_gguf(path).vocab_size == 3 and meta["GGUF.version"] == 3
    big = tmp_path / "big.gguf"
    big.write_bytes(gguf_bytes(**CASES["big-endian"]))
    with pytest.raises(GGUFError, match="is a big-endian GGUF file; llmserve reads little-endian ones"):
        open_gguf(big)


def test_unsupported_tensor_types_are_named_as_the_reference_names_them(tmp_path):
    path = tmp_path / "types.gguf"
    path.write_bytes(gguf_bytes(**CASES["element types"]))
    for opener in (open_gguf, open_gguf_reference):
        with pytest.raises(GGUFError, match="tensor i8 is of type I8, which llmserve does not read"):
            opener(path)


# -- truncated and damaged files ----------------------------------------------------------------
def test_every_truncation_is_a_format_error():
    whole = gguf_bytes(**CASES["every value type"])
    for size in range(len(whole)):
        with pytest.raises(GGUFFormatError):
            read_header(whole[:size])


def test_truncated_files_are_the_clear_error_of_the_reference(small_llama, tmp_path):
    whole = write_gguf(small_llama, tmp_path / "whole.gguf", "Q4_K").read_bytes()
    in_tokens = whole.index(b"tokenizer.ggml.tokens") + 100
    for size in [5, 8, 20, 24, 40, in_tokens, len(whole) // 2, len(whole) - 1]:
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(whole[:size])
        for opener in (open_gguf, open_gguf_reference):
            with pytest.raises(GGUFError, match=r"is not a readable GGUF file \(truncated or damaged: "):
                opener(cut)
    with pytest.raises(GGUFError, match="the file ends inside key 'tokenizer.ggml.tokens'"):
        open_gguf(tmp_path / f"cut{in_tokens}.gguf")


def test_damaged_bytes_are_format_errors_or_parse():
    """Every byte of a header set to values that break lengths, counts and types: the reader
    parses it or says what is wrong; it never raises anything else nor reads past the file."""
    whole = gguf_bytes(**CASES["every value type"])
    header_size = read_header(whole).data_offset
    for pos in range(header_size):
        for byte in (0x00, 0x01, 0x7F, 0xFF, whole[pos] ^ 0x20):
            damaged = whole[:pos] + bytes([byte]) + whole[pos + 1 :]
            try:
                header = read_header(damaged)
            except GGUFFormatError:
                continue
            for t in header.tensors:
                assert tensor_data(damaged, header, t).nbytes == t.n_bytes


def test_files_the_reader_refuses(tmp_path):
    one_f32 = [("t", "F32", (1,), bytes(4))]
    deep = (U8, [1])
    for _ in range(8):
        deep = (ARR, [deep])
    cases = {
        "not GGUF": (b"GGML" + bytes(20), "starts with b'GGML', not b'GGUF'"),
        "version 1": (gguf_bytes([], [], version=1), "GGUF version 1 is not one llmserve reads"),
        "unknown value type": (gguf_bytes([("k", 13, None)], []), "key 'k' has value type 13"),
        "unknown array type": (gguf_bytes([("k", ARR, (13, []))], []), "key 'k' is an array of value type 13"),
        "alignment not uint32": (gguf_bytes([("general.alignment", U64, 64)], []), "not uint32"),
        "alignment not a power of two": (gguf_bytes([("general.alignment", U32, 48)], []), "48, not a power of two"),
        "duplicate key": (gguf_bytes([("k", U8, 1), ("k", U8, 2)], []), "key 'k' appears twice"),
        "duplicate tensor": (gguf_bytes([], one_f32 * 2), "tensor 't' appears twice"),
        "unknown tensor type": (gguf_bytes([], [("t", 99, (1,), bytes(4))]), "ggml type 99"),
        "five dimensions": (gguf_bytes([], [("t", "F32", (1,) * 5, bytes(4))]), "5 dimensions; GGUF allows at most 4"),
        "too many elements": (gguf_bytes([], [("t", "F32", (2**40, 2**30, 0), b"")]), "too many elements"),
        "partial block": (gguf_bytes([], [("t", "Q8_0", (16,), bytes(17))]), "rows of 16 values, not whole blocks"),
        "data past the end": (gguf_bytes([], one_f32)[:-1], "past the end of the file"),
        "bad UTF-8": (gguf_bytes([("k", STR, b"\xff\xfe")], []), "key 'k' holds text that is not UTF-8"),
        "deep arrays": (gguf_bytes([("k", ARR, deep)], []), "nests arrays deeper than 8"),
    }  # fmt: skip
    for name, (raw, message) in cases.items():
        with pytest.raises(GGUFFormatError, match=message):
            read_header(raw)
        path = tmp_path / f"{name.replace(' ', '_')}.gguf"
        path.write_bytes(raw)
        with pytest.raises(GGUFError, match="is not a GGUF file" if name == "not GGUF" else "truncated or damaged"):
            open_gguf(path)

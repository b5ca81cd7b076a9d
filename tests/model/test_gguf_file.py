"""jaxinfer.gguf_file reads what gguf.GGUFReader (the gguf package's own reader, the reference) reads: every
metadata value, every tensor's name, type, shape and bytes; in files written by gguf.GGUFWriter with every value
type, plain and quantized tensors and a custom alignment, and in the default model's file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from jaxinfer.gguf_file import read_gguf
from jaxinfer.model_files import smollm2_gguf
from jaxinfer.tokenizer import Tokenizer, UnsupportedTokenizerError

Q = gguf.GGMLQuantizationType


def _write(path: Path, alignment: int | None, endianess=gguf.GGUFEndian.LITTLE) -> Path:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    V = gguf.GGUFValueType
    scalars = {V.UINT8: 200, V.INT8: -7, V.UINT16: 60000, V.INT16: -300, V.UINT32: 4_000_000_000, V.INT32: -5,
               V.FLOAT32: 0.25, V.BOOL: True, V.UINT64: 2**40, V.INT64: -(2**40), V.FLOAT64: 1e-300,
               V.STRING: "héllo ✓"}  # fmt: skip
    for vtype, value in scalars.items():
        w.add_key_value(f"test.{vtype.name.lower()}", value, vtype)
    w.add_key_value("test.ints", [1, -2, 3], V.ARRAY, sub_type=V.INT32)
    w.add_key_value("test.floats", [0.5, -1.5], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("test.flags", [True, False], V.ARRAY, sub_type=V.BOOL)
    w.add_key_value("tokenizer.ggml.tokens", ["a", "", "日本", "<|x|>"] * 50, V.ARRAY, sub_type=V.STRING)
    w.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("plain.f16", rng.standard_normal(7).astype(np.float16))
    w.add_tensor("plain.i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for qtype in (Q.Q8_0, Q.Q4_0, Q.BF16):
        rows = rng.standard_normal((4, 64)).astype(np.float32)
        q = gguf.quants.quantize(rows, qtype)
        w.add_tensor(f"quant.{qtype.name.lower()}", q, raw_shape=q.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_same_as_reader(path: Path, dequantize: bool = True) -> None:
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ours.metadata == expected
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        got = ours.tensors[t.name]
        assert (got.tensor_type, got.shape) == (t.tensor_type, tuple(int(n) for n in t.shape)), t.name
        assert got.data.dtype == t.data.dtype and got.data.shape == t.data.shape, t.name
        assert np.array_equal(got.data, t.data), t.name
        if dequantize and t.tensor_type != Q.I32:  # the weights' types dequantize from the views as they are
            np.testing.assert_array_equal(gguf.quants.dequantize(got.data, Q(got.tensor_type)),
                                          gguf.quants.dequantize(t.data, t.tensor_type))  # fmt: skip


@pytest.mark.parametrize("alignment", [None, 64, 256], ids=["default", "align64", "align256"])
def test_written_file_reads_as_the_gguf_reader_does(tmp_path, alignment):
    _assert_same_as_reader(_write(tmp_path / "t.gguf", alignment))


def test_big_endian_file_reads_through_the_gguf_reader(tmp_path):
    path = _write(tmp_path / "be.gguf", None, gguf.GGUFEndian.BIG)
    f = read_gguf(path)
    assert f.metadata["test.int32"] == -5 and f.metadata["test.string"] == "héllo ✓"
    assert set(f.tensors) >= {"plain.f32", "quant.q8_0"}


def test_default_model_file_reads_as_the_gguf_reader_does():
    _assert_same_as_reader(smollm2_gguf(), dequantize=False)  # equal bytes: the loader's tests do the rest


def test_metadata_only_reads_no_tensors(tmp_path):
    f = read_gguf(_write(tmp_path / "t.gguf", None), tensors=False)
    assert f.tensors == {} and f.metadata["tokenizer.ggml.tokens"][:4] == ["a", "", "日本", "<|x|>"]


@pytest.mark.parametrize(
    "damage",
    [lambda b: b"", lambda b: b"GGUX" + b[4:], lambda b: b[:4] + (99).to_bytes(4, "little") + b[8:],
     lambda b: b[:200], lambda b: b[:-100]],
    ids=["empty", "bad-magic", "unknown-version", "cut-in-header", "cut-in-tensors"],
)  # fmt: skip
def test_damaged_files_raise_value_errors_naming_the_file(tmp_path, damage):
    good = _write(tmp_path / "good.gguf", None).read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good))
    with pytest.raises(ValueError, match=r"bad\.gguf is not a readable GGUF file"):
        read_gguf(bad)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")


def test_tokenizer_reports_a_damaged_file_as_unsupported(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + bytes(64))
    with pytest.raises(UnsupportedTokenizerError, match="not a readable GGUF"):
        Tokenizer.from_gguf(bad)

"""Our GGUF container reader against the gguf package's GGUFReader, and on damaged files."""

from __future__ import annotations

import numpy as np
import pytest

from tokenmill.models.gguf_format import GGUFContents, GGUFFormatError, StringArray
from tokenmill.models.model_files import default_model_path


def _write(path, with_tensors=True):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_bool("general.flag", True)
    writer.add_int64("general.big", -(2**40))
    writer.add_string("general.name", "tiny ✓")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bé", "", "<|im_end|>"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0, 3.5])
    writer.add_array("general.nested", [[1, 2], [3]])
    if with_tensors:
        rng = np.random.default_rng(0)
        writer.add_tensor("a.weight", rng.standard_normal((3, 64)).astype(np.float32))
        writer.add_tensor("b.weight", rng.standard_normal((2, 5, 32)).astype(np.float16))
        writer.add_tensor("c.weight", rng.standard_normal(96).astype(np.float32))
        q = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
        writer.add_tensor("d.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _assert_same_as_gguf_reader(path):
    import gguf

    ours, theirs = GGUFContents(path), gguf.GGUFReader(str(path))
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    for key, field in fields.items():
        if key == "general.nested":  # GGUFReader's contents() flattens arrays of arrays
            assert ours.metadata[key] == [[1, 2], [3]]
            continue
        value = ours.metadata[key]
        assert (value.decode() if isinstance(value, StringArray) else value) == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors)
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.shape) == (b.name, b.tensor_type, tuple(int(d) for d in b.shape))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data)
    return ours


def test_matches_gguf_reader_on_every_value_kind(tmp_path):
    ours = _assert_same_as_gguf_reader(_write(tmp_path / "t.gguf"))
    tokens = ours.metadata["tokenizer.ggml.tokens"]
    assert isinstance(tokens, StringArray) and len(tokens) == 4 and tokens.decode()[1] == "bé"
    assert ours.metadata["general.name"] == "tiny ✓" and ours.metadata["general.big"] == -(2**40)


@pytest.mark.slow
def test_matches_gguf_reader_on_the_default_model():
    ours = _assert_same_as_gguf_reader(default_model_path())
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152


@pytest.mark.parametrize("damage", ["empty", "magic", "version", "truncated_header", "truncated_data"])
def test_damaged_files_are_format_errors(tmp_path, damage):
    raw = bytearray(_write(tmp_path / "t.gguf").read_bytes())
    if damage == "empty":
        raw = bytearray()
    elif damage == "magic":
        raw[:4] = b"GGML"
    elif damage == "version":
        raw[4:8] = (7).to_bytes(4, "little")
    elif damage == "truncated_header":
        raw = raw[:200]
    else:
        raw = raw[:-10]
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(raw))
    with pytest.raises(GGUFFormatError):
        GGUFContents(path)

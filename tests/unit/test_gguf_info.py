"""engine.gguf_info reads a GGUF header itself (the server does at start-up); the gguf package's
GGUFReader, which maps the whole file, is the reference."""
import gguf
import pytest

from engine.gguf_info import gguf_facts, read_header
from tests.server_proc import SMOLLM2


def test_the_header_holds_what_the_gguf_package_reads():
    reference, header = gguf.GGUFReader(str(SMOLLM2)), read_header(SMOLLM2)
    assert [(t.name, t.tensor_type.name, int(t.n_elements), len(t.shape), int(t.n_bytes))
            for t in reference.tensors] == [
        (t.name, t.type_name, t.n_elements, t.n_dims, t.n_bytes) for t in header.tensors]
    fields = {k: f for k, f in reference.fields.items() if not k.startswith("GGUF.")}
    assert list(fields) == list(header.metadata)
    for key, value in header.metadata.items():
        if value is None:   # arrays other than short numeric ones are stepped over
            assert isinstance(fields[key].contents(), list), key
        else:
            assert fields[key].contents() == value, key
    assert len(fields["tokenizer.ggml.tokens"].contents()) == 49152   # a string array skipped


def test_facts_of_the_default_model():
    facts = gguf_facts(SMOLLM2)
    assert (facts["architecture"], facts["quantization"], facts["chat_template"]) == (
        "llama", "Q4_1", True)
    assert facts["parameters"] == 134515008 and facts["tensor_types"]["Q4_1"] == 210


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(path)


def _every_kind_of_field(path):
    """A small GGUF with every scalar type, a string, arrays of numbers, of strings and of
    arrays, and tensors of three types."""
    import numpy as np
    w = gguf.GGUFWriter(str(path), "llama")
    for i, add in enumerate((w.add_uint8, w.add_int8, w.add_uint16, w.add_int16, w.add_uint32,
                             w.add_int32, w.add_uint64, w.add_int64)):
        add(f"t.int{i}", i + 1)
    w.add_float32("t.f32", 0.5)
    w.add_float64("t.f64", 0.25)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "ünïcode ✓")
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.strs", ["a", "bc", ""])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.after", "read past every array")
    w.add_tensor("a", np.zeros((4, 64), dtype=np.float32))
    w.add_tensor("b", np.zeros(32, dtype=np.float16))
    w.add_tensor("c", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_value_type_and_nested_arrays_read_as_the_gguf_package_reads_them(tmp_path):
    path = tmp_path / "kinds.gguf"
    _every_kind_of_field(path)
    reference, header = gguf.GGUFReader(str(path)), read_header(path)
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        numbers = field.types[0] == gguf.GGUFValueType.ARRAY and field.types[1] not in (
            gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)
        # short numeric arrays (per-layer values) are read; other arrays are stepped over
        assert header.metadata[key] == (expected if numbers or not isinstance(expected, list)
                                        else None), key
    assert header.metadata["t.ints"] == [1, 2, 3] and header.metadata["t.strs"] is None
    assert header.metadata["t.after"] == "read past every array"
    assert [(t.name, t.type_name, t.n_elements, t.n_dims, t.n_bytes) for t in header.tensors] == [
        (t.name, t.tensor_type.name, int(t.n_elements), len(t.shape), int(t.n_bytes))
        for t in reference.tensors] == [("a", "F32", 256, 2, 1024), ("b", "F16", 32, 1, 64),
                                        ("c", "Q8_0", 64, 2, 68)]


def test_a_header_cut_short_is_refused(tmp_path):
    path = tmp_path / "kinds.gguf"
    _every_kind_of_field(path)
    data = path.read_bytes()
    for cut in (6, 30, 200, data.index(b"read past") + 3):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match="ends early|runs past"):
            read_header(tmp_path / "cut.gguf")

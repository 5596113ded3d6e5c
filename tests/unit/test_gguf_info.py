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
        if value is None:   # arrays are stepped over
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

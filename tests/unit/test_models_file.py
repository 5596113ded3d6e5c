"""A models file's per-model sampling defaults are checked at start-up like a request's fields."""
import pytest

from server.config import sampling_defaults


def test_valid_defaults_are_kept_and_null_means_none():
    assert sampling_defaults({"temperature": 0, "top_k": None, "top_p": 0.9}, "d") == {
        "temperature": 0, "top_p": 0.9}


@pytest.mark.parametrize("raw,match", [
    ({"temperatur": 0}, r"not per-model sampling defaults \['temperatur'\]"),
    ({"n": 3}, "not per-model sampling defaults"),           # not a sampling default
    ({"temperature": "0.5"}, r"d\.temperature: Input should be a valid number"),
    ({"temperature": 5}, r"d\.temperature: Input should be less than or equal to 2"),
    ({"top_p": 0}, r"d\.top_p"),
    ([1, 2], "must be a mapping"),
])
def test_a_bad_default_stops_the_server_at_start_up(raw, match):
    with pytest.raises(ValueError, match=match):
        sampling_defaults(raw, "d")


# ---- chat_template: a Jinja file instead of the GGUF's template ----------------------------------
def models_file(tmp_path, entry: str):
    from engine import EngineConfig
    from server.config import _models_from_file

    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - name: m\n    path: m.gguf\n" + entry)
    return _models_from_file(path, EngineConfig())


def test_a_chat_template_path_is_read_from_the_models_files_folder(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    (spec,) = models_file(tmp_path, "    chat_template: t.jinja\n")
    assert spec.chat_template == tmp_path / "t.jinja"


def test_a_missing_chat_template_file_stops_the_server_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"models\[0\]\.chat_template: no file .*nope\.jinja"):
        models_file(tmp_path, "    chat_template: nope.jinja\n")

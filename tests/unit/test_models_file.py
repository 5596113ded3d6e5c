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


def test_the_tunable_values_are_one_table_the_body_the_defaults_and_the_engine_share():
    from dataclasses import fields

    from engine.sampling import SamplingParams
    from server.config import SAMPLING_DEFAULTS
    from server.openai.bodies import SamplingFields
    from server.sampling import TUNABLE
    from server.service.request import SERVICE_SET, Sampling

    assert SAMPLING_DEFAULTS == tuple(TUNABLE)
    engine = {f.name for f in fields(SamplingParams)}
    assert {f.name for f in fields(Sampling)} == engine - SERVICE_SET
    for name, (_, limits) in TUNABLE.items():
        metadata = SamplingFields.model_fields[name].metadata
        assert name in engine and SamplingFields.model_fields[name].default is None
        assert {k: getattr(m, k) for m in metadata for k in limits if hasattr(m, k)} == limits


# ---- chat_template: a Jinja file instead of the GGUF's template ----------------------------------
def models_file(tmp_path, entry: str):
    from engine import EngineConfig
    from server.config import _models_from_file

    path = tmp_path / "models.yaml"
    (tmp_path / "m.gguf").touch()
    path.write_text("models:\n  - name: m\n    path: m.gguf\n" + entry)
    return _models_from_file(path, EngineConfig())


def test_a_chat_template_path_is_read_from_the_models_files_folder(tmp_path):
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    (spec,) = models_file(tmp_path, "    chat_template: t.jinja\n")
    assert spec.chat_template == tmp_path / "t.jinja"


def test_a_missing_chat_template_file_stops_the_server_naming_it(tmp_path):
    with pytest.raises(ValueError, match=r"models\[0\]\.chat_template: no file .*nope\.jinja"):
        models_file(tmp_path, "    chat_template: nope.jinja\n")


# ---- the catalogue: pin, keep_alive, the models folder, the memory budget --------------------------
def test_pin_and_keep_alive_are_read_per_model_and_checked(tmp_path):
    (spec,) = models_file(tmp_path, "    pin: true\n    keep_alive: 10m\n")
    assert spec.pin is True and spec.keep_alive == 600
    (spec,) = models_file(tmp_path, "    keep_alive: -1\n")
    assert spec.pin is False and spec.keep_alive == -1
    with pytest.raises(ValueError, match=r"models\[0\]\.pin must be true or false"):
        models_file(tmp_path, "    pin: 'yes'\n")
    with pytest.raises(ValueError, match=r"models\[0\]\.keep_alive: 'soon'"):
        models_file(tmp_path, "    keep_alive: soon\n")


def test_a_missing_model_file_stops_the_server_naming_it(tmp_path):
    from engine import EngineConfig
    from server.config import _models_from_file

    path = tmp_path / "models.yaml"
    path.write_text("models:\n  - name: m\n    path: gone.gguf\n")
    with pytest.raises(ValueError, match=r"models\[0\]\.path: no file .*gone\.gguf"):
        _models_from_file(path, EngineConfig())


@pytest.mark.parametrize("text,seconds", [
    (300, 300.0), (1.5, 1.5), ("45", 45.0), ("45s", 45.0), ("5m", 300.0), ("1h30m", 5400.0),
    ("500ms", 0.5), ("-1", -1.0), (-5, -1.0), ("-1m", -1.0), (0, 0.0)])
def test_keep_alive_takes_seconds_or_ollamas_durations(text, seconds):
    from server.durations import parse_keep_alive
    assert parse_keep_alive(text, "k") == seconds


@pytest.mark.parametrize("bad", ["soon", "5 minutes", "5m3", "1h-30m", "", True, None, [5],
                                 float("nan"), 10**400, "inf"])
def test_a_keep_alive_that_is_not_a_duration_is_refused(bad):
    from server.durations import parse_keep_alive
    with pytest.raises(ValueError, match="^k: "):
        parse_keep_alive(bad, "k")


@pytest.mark.parametrize("text,size", [
    ("1073741824", 2**30), ("8GiB", 8 * 2**30), ("512 MiB", 512 * 2**20), ("1.5G", 3 * 2**29),
    ("2GB", 2 * 10**9), ("100kb", 100_000), ("64K", 65536)])
def test_a_memory_budget_takes_bytes_with_a_unit(text, size, monkeypatch):
    from server.config import memory_budget_from_env
    monkeypatch.setenv("PAGEDLLAMA_MEMORY_BUDGET", text)
    assert memory_budget_from_env() == (size, "PAGEDLLAMA_MEMORY_BUDGET")


@pytest.mark.parametrize("bad", ["lots", "8 GiBs", "-1GiB", "0", "150%", "0%", "x%"])
def test_a_bad_memory_budget_stops_the_server(bad, monkeypatch):
    from server.config import memory_budget_from_env
    monkeypatch.setenv("PAGEDLLAMA_MEMORY_BUDGET", bad)
    with pytest.raises(ValueError, match="PAGEDLLAMA_MEMORY_BUDGET"):
        memory_budget_from_env()


def test_the_default_budget_is_a_share_of_the_available_memory(monkeypatch):
    from server import config
    monkeypatch.delenv("PAGEDLLAMA_MEMORY_BUDGET", raising=False)
    monkeypatch.setattr(config, "available_memory", lambda: 8 * 2**30)
    assert config.memory_budget_from_env() == (6 * 2**30, "75% of the available memory")
    monkeypatch.setenv("PAGEDLLAMA_MEMORY_BUDGET", "50%")
    assert config.memory_budget_from_env()[0] == 4 * 2**30


def test_a_models_folder_serves_every_gguf_named_by_its_file(tmp_path, monkeypatch):
    from server.config import load_settings
    for name in ("chat.gguf", "code-00001-of-00002.gguf", "code-00002-of-00002.gguf",
                 "mmproj-vision.gguf", "notes.txt", "listed.gguf"):
        (tmp_path / name).touch()
    (tmp_path / "models.yaml").write_text("models:\n  - name: mine\n    path: listed.gguf\n"
                                          "    pin: true\n")
    monkeypatch.setenv("PAGEDLLAMA_MODELS_DIR", str(tmp_path))
    monkeypatch.delenv("PAGEDLLAMA_MODELS_FILE", raising=False)
    monkeypatch.setenv("PAGEDLLAMA_KEEP_ALIVE", "2m")
    monkeypatch.setenv("PAGEDLLAMA_MEMORY_BUDGET", "1GiB")
    specs = {s.name: s for s in load_settings().models}
    assert sorted(specs) == ["chat", "code", "listed"]
    assert specs["code"].path.name == "code-00001-of-00002.gguf"
    assert not any(s.pin for s in specs.values()) and specs["chat"].keep_alive == 120
    monkeypatch.setenv("PAGEDLLAMA_MODELS_FILE", str(tmp_path / "models.yaml"))
    specs = {s.name: s for s in load_settings().models}   # the file's entry wins for its file
    assert sorted(specs) == ["chat", "code", "mine"] and specs["mine"].pin


def test_a_single_model_without_a_catalogue_is_pinned_as_it_always_loaded_at_start(monkeypatch):
    from server.config import load_settings
    for var in ("MODELS_FILE", "MODELS_DIR", "MEMORY_BUDGET"):
        monkeypatch.delenv(f"PAGEDLLAMA_{var}", raising=False)
    (spec,) = load_settings().models
    assert spec.pin and spec.keep_alive == -1

"""Sealed reasoning (server/openai/sealing.py): what this server seals only it opens, an altered
or foreign token does not, and the key comes from the environment or a file kept across
restarts."""
import base64
import os
import stat

import pytest

from server.openai import sealing


@pytest.fixture(autouse=True)
def fresh_key(tmp_path, monkeypatch):
    """Each test its own state dir and no key given, the loaded key forgotten."""
    sealing.configure(None, tmp_path)
    yield
    sealing.configure(None, None)


def test_a_sealed_text_opens_to_the_same_text():
    text = "The user wants the files listed; ls will do. ü ✓"
    assert sealing.unseal(sealing.seal(text)) == text


def test_sealing_the_same_text_twice_gives_different_tokens():
    assert sealing.seal("same") != sealing.seal("same")


def test_a_token_does_not_show_its_text():
    assert "secret plan" not in base64.urlsafe_b64decode(sealing.seal("secret plan")).decode(
        "latin-1")


@pytest.mark.parametrize("change", [
    lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]),     # a flipped bit of the tag
    lambda raw: raw[:20] + bytes([raw[20] ^ 1]) + raw[21:],   # of the ciphertext
    lambda raw: raw[:-4],                            # cut short
    lambda raw: b"\x02" + raw[1:],                   # another version
])
def test_an_altered_token_does_not_open(change):
    raw = base64.urlsafe_b64decode(sealing.seal("reasoning text"))
    with pytest.raises(sealing.SealError):
        sealing.unseal(base64.urlsafe_b64encode(change(raw)).decode())


@pytest.mark.parametrize("token", ["", "not base64 at all!", "gAAAAABlZ2VuZA==",
                                   base64.urlsafe_b64encode(b"\x01" + b"x" * 40).decode()])
def test_something_that_is_not_a_token_does_not_open(token):
    with pytest.raises(sealing.SealError):
        sealing.unseal(token)


def test_a_token_sealed_under_another_key_does_not_open(tmp_path):
    sealing.configure("one server's key", tmp_path)
    token = sealing.seal("reasoning")
    sealing.configure("another server's key", tmp_path)
    with pytest.raises(sealing.SealError):
        sealing.unseal(token)


def test_the_key_given_opens_tokens_after_a_restart(tmp_path):
    sealing.configure("any string at all", tmp_path)
    token = sealing.seal("reasoning")
    sealing.reset()   # a restart: the key is read again
    assert sealing.unseal(token) == "reasoning"
    assert not (tmp_path / sealing.KEY_FILE).exists()   # no file is written then


def test_without_a_key_given_a_key_file_is_created_once_readable_only_by_its_owner(tmp_path):
    token = sealing.seal("reasoning")
    path = tmp_path / sealing.KEY_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first = path.read_bytes()
    sealing.reset()   # a restart: the same file, the same key
    assert sealing.unseal(token) == "reasoning" and path.read_bytes() == first
    assert [p.name for p in tmp_path.iterdir()] == [sealing.KEY_FILE]   # no leftovers


def test_the_key_files_directory_is_created_when_missing(tmp_path):
    state = tmp_path / "a" / "b"
    sealing.configure(None, state)
    assert sealing.unseal(sealing.seal("x")) == "x" and (state / sealing.KEY_FILE).exists()


def test_the_state_dir_defaults_to_the_users_cache(monkeypatch):
    from server.config import load_settings
    monkeypatch.delenv("PAGEDLLAMA_STATE_DIR", raising=False)
    monkeypatch.setenv("PAGEDLLAMA_REASONING_KEY", "k")
    settings = load_settings()
    assert settings.state_dir == sealing.Path.home() / ".cache" / "pagedllama"
    assert settings.reasoning_key == "k" and settings.batch.state_dir == settings.state_dir


def test_without_configuration_a_key_holds_for_the_process_only(tmp_path):
    sealing.configure(None, None)
    token = sealing.seal("reasoning")
    assert sealing.unseal(token) == "reasoning" and list(tmp_path.iterdir()) == []
    sealing.reset()
    with pytest.raises(sealing.SealError):
        sealing.unseal(token)

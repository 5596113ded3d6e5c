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
    """Each test its own state dir and no key from the environment, the loaded key forgotten."""
    monkeypatch.setenv(sealing.STATE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(sealing.KEY_ENV, raising=False)
    sealing.reset()
    yield
    sealing.reset()


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


def test_a_token_sealed_under_another_key_does_not_open(monkeypatch):
    monkeypatch.setenv(sealing.KEY_ENV, "one server's key")
    sealing.reset()
    token = sealing.seal("reasoning")
    monkeypatch.setenv(sealing.KEY_ENV, "another server's key")
    sealing.reset()
    with pytest.raises(sealing.SealError):
        sealing.unseal(token)


def test_the_key_from_the_environment_opens_tokens_after_a_restart(monkeypatch, tmp_path):
    monkeypatch.setenv(sealing.KEY_ENV, "any string at all")
    sealing.reset()
    token = sealing.seal("reasoning")
    sealing.reset()   # a restart: the key is read again
    assert sealing.unseal(token) == "reasoning"
    assert not (tmp_path / sealing.KEY_FILE).exists()   # no file is written then


def test_without_the_environment_a_key_file_is_created_once_readable_only_by_its_owner(tmp_path):
    token = sealing.seal("reasoning")
    path = tmp_path / sealing.KEY_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first = path.read_bytes()
    sealing.reset()   # a restart: the same file, the same key
    assert sealing.unseal(token) == "reasoning" and path.read_bytes() == first
    assert [p.name for p in tmp_path.iterdir()] == [sealing.KEY_FILE]   # no leftovers


def test_the_key_files_directory_is_created_when_missing(monkeypatch, tmp_path):
    state = tmp_path / "a" / "b"
    monkeypatch.setenv(sealing.STATE_DIR_ENV, str(state))
    sealing.reset()
    assert sealing.unseal(sealing.seal("x")) == "x" and (state / sealing.KEY_FILE).exists()


def test_the_state_dir_defaults_to_the_users_cache(monkeypatch):
    monkeypatch.delenv(sealing.STATE_DIR_ENV)
    assert sealing.state_dir() == sealing.Path.home() / ".cache" / "pagedllama"

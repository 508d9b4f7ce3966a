"""API keys and who a client is (cosyvoice/gateway/apikeys.py): the keys file, its hashes, keys
and signed tokens side by side, and a file changed while the gateway runs."""

from __future__ import annotations

import os

import pytest

from cosyvoice.gateway import apikeys, tokens
from cosyvoice.settings import Settings
from cosyvoice.wire.errors import Unauthorized

pytestmark = [pytest.mark.unit, pytest.mark.fast]


def test_a_new_key_is_kept_only_as_its_hash(tmp_path):
    path = tmp_path / "keys"
    key = apikeys.add(path, "team-a")
    assert key.startswith(apikeys.PREFIX) and key not in path.read_text()
    assert apikeys.parse(path.read_text()) == {apikeys.digest(key): "team-a"}
    with pytest.raises(apikeys.KeyFileError, match="already has a key named"):
        apikeys.add(path, "team-a")
    with pytest.raises(apikeys.KeyFileError, match="a key name is"):
        apikeys.add(path, "no spaces")


def test_a_bad_line_names_its_number():
    with pytest.raises(apikeys.KeyFileError, match="line 3"):
        apikeys.parse("# keys\n\nteam-a abc\n")


def test_keys_and_tokens_both_name_the_client(tmp_path):
    path = tmp_path / "keys"
    key = apikeys.add(path, "team-a")
    auth = apikeys.Authenticator(Settings(api_keys_file=str(path), auth_secret="s"))
    assert auth.check(key) == "team-a"
    assert auth.check(tokens.issue("s", "kiosk")) == "kiosk"
    for bad in (None, "", apikeys.PREFIX + "unknown", "not-a-token"):
        with pytest.raises(Unauthorized):
            auth.check(bad)
    # neither keys nor a secret: nobody is asked
    assert apikeys.Authenticator(Settings()).check(None) == apikeys.ANONYMOUS


def test_a_key_added_or_removed_counts_without_a_restart(tmp_path):
    path = tmp_path / "keys"
    first = apikeys.add(path, "team-a")
    auth = apikeys.Authenticator(Settings(api_keys_file=str(path)))
    assert auth.check(first) == "team-a"
    second = apikeys.add(path, "team-b")
    os.utime(path, (1, 1))  # a change the stamp sees even within one clock tick
    assert auth.check(second) == "team-b"
    path.write_text(f"team-b {apikeys.digest(second)}\n")
    with pytest.raises(Unauthorized):
        auth.check(first)


def test_a_missing_keys_file_stops_the_gateway_at_start(tmp_path):
    with pytest.raises(apikeys.KeyFileError, match="no such file"):
        apikeys.Authenticator(Settings(api_keys_file=str(tmp_path / "none")))

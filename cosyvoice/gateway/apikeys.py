"""Who a client is: an API key from the keys file, or a signed token.

One deployment can serve several teams: each gets a named API key (``cosyvoice key new
NAME`` writes it to ``COSYVOICE_API_KEYS_FILE`` as ``NAME SHA256`` and prints the key once;
only its hash is kept), sent as ``auth.token`` on Socket.IO or ``Authorization: Bearer`` on
the OpenAI faces. The signed, expiring tokens of ``COSYVOICE_AUTH_SECRET`` (``cosyvoice
token``) still work beside them. Where either is configured every connection must bring
one; where neither is, nobody is asked and every client counts as ``anonymous``.

The name (a key's, or a token's subject) is what the gateway counts audio against
(``cosyvoice_audio_seconds_by_key_total``, and per day in Redis for ``cosyvoice usage``).
The file is read again when it changes, so a key added or removed takes effect without a
restart.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import threading
from pathlib import Path

from ..settings import Settings
from ..wire.errors import Unauthorized
from . import tokens

ANONYMOUS = "anonymous"
PREFIX = "cv_"  # every key starts so: a token never does
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HASH = re.compile(r"^[0-9a-f]{64}$")


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return PREFIX + secrets.token_urlsafe(24)


class KeyFileError(ValueError):
    """The keys file cannot be used; the message says which line and why."""


def parse(text: str, source: str = "the keys file") -> dict[str, str]:
    """hash -> name of every ``NAME SHA256`` line (``#`` comments and blank lines aside)."""
    table: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not NAME.match(parts[0]) or not _HASH.match(parts[1]):
            raise KeyFileError(f"{source}, line {number}: expected NAME SHA256 (a name of "
                               f"letters, digits, '.', '_' or '-', and 64 hex digits)")
        table[parts[1]] = parts[0]
    return table


def add(path: str | Path, name: str) -> str:
    """A new key named ``name``, its hash appended to the file at ``path``; the key."""
    if not NAME.match(name):
        raise KeyFileError(f"a key name is letters, digits, '.', '_' or '-' (at most 64), "
                           f"not {name!r}")
    path = Path(path)
    existing = parse(path.read_text(), str(path)) if path.exists() else {}
    if name in existing.values():
        raise KeyFileError(f"{path} already has a key named {name!r}")
    key = new_key()
    with path.open("a") as f:
        f.write(f"{name} {digest(key)}\n")
    return key


class Authenticator:
    """The gateway's check of a client's credential (``check``)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.path = settings.api_keys_file
        self._lock = threading.Lock()
        self._stamp: tuple[float, int] | None = None
        self._table: dict[str, str] = {}
        if self.path:
            self._reload()  # a bad file stops the gateway at start, not at a client

    @property
    def required(self) -> bool:
        return bool(self.settings.auth_secret or self.path)

    def _reload(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            raise KeyFileError(f"{self.path}: no such file (COSYVOICE_API_KEYS_FILE)") from None
        stamp = (st.st_mtime, st.st_size)
        if stamp != self._stamp:
            self._table = parse(Path(self.path).read_text(), self.path)
            self._stamp = stamp

    def _key_name(self, credential: str) -> str | None:
        with self._lock:
            try:
                self._reload()
            except (KeyFileError, OSError):
                pass  # keep the keys last read: a file being edited is not an outage
            # a lookup by the key's hash: what it compares is a digest, never the key
            return self._table.get(digest(credential))

    def check(self, credential: str | None) -> str:
        """The client's name; raises ``Unauthorized`` where one is required and this is
        neither a known key nor a valid token."""
        if not self.required:
            return ANONYMOUS
        if not credential:
            raise Unauthorized("a key or token is required")
        if self.path and credential.startswith(PREFIX):
            name = self._key_name(credential)
            if name is not None:
                return name
            raise Unauthorized("the key is not valid")
        if self.settings.auth_secret:
            return tokens.verify(self.settings.auth_secret, credential,
                                 self.settings.token_ttl_s)
        raise Unauthorized("the key is not valid")

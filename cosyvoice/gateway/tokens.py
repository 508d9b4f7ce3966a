"""Signed, expiring client tokens (``cosyvoice token``), checked by the gateway at connect."""

from __future__ import annotations

from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer

from ..wire.errors import Unauthorized

_SALT = "cosyvoice-client-token"


def issue(secret: str, subject: str = "client") -> str:
    return URLSafeTimedSerializer(secret, salt=_SALT).dumps({"sub": subject})


def verify(secret: str, token: str | None, max_age_s: int) -> str:
    """The token's subject; raises ``Unauthorized`` when missing, forged or expired."""
    if not token:
        raise Unauthorized("a token is required")
    try:
        data = URLSafeTimedSerializer(secret, salt=_SALT).loads(token, max_age=max_age_s)
    except SignatureExpired as exc:
        raise Unauthorized("the token has expired") from exc
    except BadSignature as exc:
        raise Unauthorized("the token is not valid") from exc
    return str(data.get("sub", "client"))

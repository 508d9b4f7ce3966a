"""Why a service cannot be reached or refuses a client: the errors ``cosyvoice transcribe``
reports (``TranscribeError`` and its kinds), an address checked before use, and what a
failed connection's address answers (``diagnose``)."""

from __future__ import annotations

import http.client
import socket
import ssl
from urllib.parse import urlsplit


class TranscribeError(Exception):
    """The stream did not reach its end: the subclass says why."""

    def __init__(self, code: str, msg: str):
        super().__init__(f"{code}: {msg}")
        self.code = code
        self.msg = msg


class Unreachable(TranscribeError):
    """No cosyvoice service could be reached at the URL, or the connection was lost."""

    def __init__(self, msg: str):
        super().__init__("unavailable", msg)


class Refused(TranscribeError):
    """The service answered and refused the session (``code`` is its wire error)."""


def check_url(url: str) -> str:
    """``url`` if a client can connect to it, else ValueError saying what is wrong."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    return url


def diagnose(url: str, ssl_verify: bool = True, timeout: float = 5.0) -> str | None:
    """Why no Socket.IO session opens at ``url``, in one line; None when the server
    looks like a Socket.IO server (the cause is then elsewhere)."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    host, port = parts.hostname or "", parts.port or (443 if tls else 80)
    where = f"{host}:{port}"
    if tls:
        context = ssl.create_default_context()
        if not ssl_verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            host, port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
    path = parts.path.rstrip("/") + "/socket.io/?EIO=4&transport=polling"
    try:
        conn.request("GET", path)
        status = conn.getresponse().status
    except socket.gaierror:
        return f"cannot resolve the host name {host!r}"
    except ConnectionRefusedError:
        return f"nothing listens on {where} (connection refused)"
    except (TimeoutError, socket.timeout):
        return f"{where} did not answer within {timeout:g} s"
    except ssl.SSLCertVerificationError as exc:
        return (f"the TLS certificate of {where} is not trusted ({exc.verify_message}); "
                "--insecure skips the check")
    except ssl.SSLError as exc:
        return f"TLS with {where} failed ({exc.reason}); does it serve https?"
    except (http.client.HTTPException, ConnectionError) as exc:
        return f"{where} does not answer HTTP ({type(exc).__name__}); is this the service's URL?"
    except OSError as exc:
        return f"cannot reach {where}: {exc.strerror or exc}"
    finally:
        conn.close()
    if status == 404:
        return f"{url} is not a cosyvoice service (HTTP 404 for /socket.io/)"
    if status >= 500 or (status >= 300 and status != 400):
        return f"{url} answered HTTP {status} for /socket.io/ (a proxy with no service behind it?)"
    return None

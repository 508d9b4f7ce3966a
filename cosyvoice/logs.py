"""Process-wide logging: one JSON object per line on stderr.

Every record carries its time, level, logger, process id and message, plus whatever the
caller passed in ``extra`` — by convention ``session`` (the session id) and ``event``
(``connect``, ``claim``, ``finish``, …), so a log pipeline can follow one session across
gateways and workers. Records never carry audio, and transcript text is never logged at
INFO or above: a session's words belong to its user, not to the operator's log store.
"""

from __future__ import annotations

import json
import logging
import logging.config
import time

# Attributes every LogRecord has; anything else on a record came from ``extra``.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON; tracebacks go in ``exc`` (still one line)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": _utc(record.created),
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def _utc(created: float) -> str:
    millis = int(created % 1 * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


def is_level(level: str) -> bool:
    """Whether ``level`` names a logging level (any case, spaces around allowed)."""
    return isinstance(logging.getLevelName(level.strip().upper()), int)


def level_name(level: str) -> str:
    """A logging level name from COSYVOICE_LOG_LEVEL; INFO when it names none."""
    return level.strip().upper() if is_level(level) else "INFO"


def dict_config(level: str = "INFO") -> dict:
    """A ``logging.config.dictConfig`` that sends every logger, gunicorn's included, to
    stderr as JSON lines (gunicorn.conf.py passes it as ``logconfig_dict``)."""
    level = level_name(level)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": f"{__name__}.JsonFormatter"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json",
                                "stream": "ext://sys.stderr"}},
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": {
            # gunicorn attaches its own plain-text handlers; these replace them.
            "gunicorn.error": {"level": level, "handlers": [], "propagate": True},
            "gunicorn.access": {"level": "INFO", "handlers": [], "propagate": True},
            # Engine.IO and Socket.IO add a plain-text handler to a logger whose level is
            # unset; with one set they log through ours (at their default, ERROR).
            "engineio.server": {"level": "ERROR", "handlers": [], "propagate": True},
            "socketio.server": {"level": "ERROR", "handlers": [], "propagate": True},
        },
    }


def setup(level: str = "INFO") -> None:
    """JSON logs at ``level`` (COSYVOICE_LOG_LEVEL); Python warnings become log records."""
    logging.config.dictConfig(dict_config(level))
    logging.captureWarnings(True)

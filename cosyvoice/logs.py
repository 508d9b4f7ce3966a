"""Process-wide logging set-up."""

from __future__ import annotations

import logging
import sys


def setup(level: str = "INFO") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s", force=True)

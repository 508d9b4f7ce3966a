"""The smart-formatting text stage (``auth.format: true``): numbers, dates, times and money
written as digits in ``zh``, ``en`` and ``ja`` finals.

WeText's inverse text normalisation does it, with the rules its wheel ships compiled for
those three languages (no download, no pynini): ``一千二百五十万元`` → ``1250万元``,
``three thirty pm`` → ``03:30 p.m.``, ``one hundred twenty five dollars`` → ``$125``. Off by
default, so the raw text stays comparable (word error rates are measured on it). Finals
only: a partial keeps the words its ``stable`` prefix is made of, and the final that follows
it is formatted. The final's ``words`` stay as spoken (their times are the speech's); a
subtitle file shares a formatted text's times out over its characters where the words no
longer spell it (cosyvoice/text/subtitles.py).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any, cast

from ..wire.languages import ENGLISH, MANDARIN
from ..wire.messages import Result, TextRule

LANGUAGES = (MANDARIN, ENGLISH, "ja")
# CPU seconds per audio second of a real-time session (about 2 ms a final; docs/languages.md)
COST = 0.001
# WeText leaves a space before the punctuation after a number it wrote ("10:00 .")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([.,!?;:])")


@functools.lru_cache(maxsize=None)
def normalizer(language: str) -> Any:
    """WeText's inverse normaliser of ``language``, built once per process."""
    from wetext import Normalizer

    return Normalizer(lang=language, operator="itn")


def format_text(text: str, language: str) -> str:
    if not text or language not in LANGUAGES:
        return text
    return _SPACE_BEFORE_PUNCT.sub(r"\1", cast(str, normalizer(language).normalize(text)))


def wanted(session: Mapping[str, str]) -> bool:
    return session.get("format") == "1"


def rule(session: Mapping[str, str]) -> TextRule:
    def formatted(result: Result) -> Result:
        if result["type"] != "final":
            return result
        language = result.get("language") or ""
        text = format_text(result["text"], language)
        return result if text == result["text"] else cast(Result, {**result, "text": text})
    return formatted

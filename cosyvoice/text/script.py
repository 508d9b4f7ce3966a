"""The Chinese-script text stage: ``zh`` partials and finals in Simplified characters
(``auth.script: hans``, the default) or Traditional ones (``hant``).

Whisper writes Mandarin mostly in Traditional characters (8 of 10 test sentences with the
packaged base), while mainland readers read Simplified. OpenCC converts, with the
dictionaries its wheel ships (no download): ``t2s`` to Simplified, ``s2t`` to Traditional
(so a session that asked for Traditional gets it even where Whisper wrote Simplified). The
text, the ``stable`` prefix of a partial and each word of a final are converted alike
(conversion maps characters and phrases to as many characters, so word times still fit).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, cast

from ..wire.languages import AUTO, HANS, HANT, MANDARIN
from ..wire.messages import Result, TextRule

CONFIGS = {HANS: "t2s", HANT: "s2t"}
# CPU seconds per audio second of a real-time session (a few conversions of a short text a
# second: under a millisecond each; docs/languages.md)
COST = 0.001


@functools.lru_cache(maxsize=None)
def converter(script: str) -> Any:
    """The OpenCC converter to ``script``, built once per process."""
    import opencc

    return opencc.OpenCC(CONFIGS[script])


def convert(text: str, script: str) -> str:
    return cast(str, converter(script).convert(text)) if text else text


def wanted(session: Mapping[str, str]) -> bool:
    """Sessions whose results may be in Mandarin."""
    return (session.get("language") or "") in (MANDARIN, AUTO)


def rule(session: Mapping[str, str]) -> TextRule:
    script = session.get("script") or HANS
    if script not in CONFIGS:
        script = HANS

    def to_script(result: Result) -> Result:
        if result.get("language") != MANDARIN:
            return result
        out = cast(Result, {**result, "text": convert(result["text"], script)})
        if "stable" in result:
            out["stable"] = convert(result["stable"], script)
        if "words" in result:
            out["words"] = [{**w, "word": convert(w["word"], script)} for w in result["words"]]
        return out
    return to_script

"""The languages a session may ask for (``auth.language``), pure: no model is loaded here.

``auto`` (the default where the engine offers more than English) lets the engine detect the
language of each utterance; any other value is a language code of Whisper's multilingual
models (the 99 the packaged Whisper base knows, in Whisper's own order: English first,
Mandarin second). An engine declares the languages it offers (``EngineSpec.languages``); the
gateway refuses any other with ``unsupported_language``.
"""

from __future__ import annotations

AUTO = "auto"
ENGLISH = "en"
MANDARIN = "zh"

# Whisper's language codes and names (openai-whisper's tokenizer.LANGUAGES, without "yue",
# which only large-v3 knows).
WHISPER_LANGUAGES: dict[str, str] = {
    "en": "english", "zh": "chinese", "de": "german", "es": "spanish", "ru": "russian",
    "ko": "korean", "fr": "french", "ja": "japanese", "pt": "portuguese", "tr": "turkish",
    "pl": "polish", "ca": "catalan", "nl": "dutch", "ar": "arabic", "sv": "swedish",
    "it": "italian", "id": "indonesian", "hi": "hindi", "fi": "finnish", "vi": "vietnamese",
    "he": "hebrew", "uk": "ukrainian", "el": "greek", "ms": "malay", "cs": "czech",
    "ro": "romanian", "da": "danish", "hu": "hungarian", "ta": "tamil", "no": "norwegian",
    "th": "thai", "ur": "urdu", "hr": "croatian", "bg": "bulgarian", "lt": "lithuanian",
    "la": "latin", "mi": "maori", "ml": "malayalam", "cy": "welsh", "sk": "slovak",
    "te": "telugu", "fa": "persian", "lv": "latvian", "bn": "bengali", "sr": "serbian",
    "az": "azerbaijani", "sl": "slovenian", "kn": "kannada", "et": "estonian",
    "mk": "macedonian", "br": "breton", "eu": "basque", "is": "icelandic", "hy": "armenian",
    "ne": "nepali", "mn": "mongolian", "bs": "bosnian", "kk": "kazakh", "sq": "albanian",
    "sw": "swahili", "gl": "galician", "mr": "marathi", "pa": "punjabi", "si": "sinhala",
    "km": "khmer", "sn": "shona", "yo": "yoruba", "so": "somali", "af": "afrikaans",
    "oc": "occitan", "ka": "georgian", "be": "belarusian", "tg": "tajik", "sd": "sindhi",
    "gu": "gujarati", "am": "amharic", "yi": "yiddish", "lo": "lao", "uz": "uzbek",
    "fo": "faroese", "ht": "haitian creole", "ps": "pashto", "tk": "turkmen", "nn": "nynorsk",
    "mt": "maltese", "sa": "sanskrit", "lb": "luxembourgish", "my": "myanmar", "bo": "tibetan",
    "tl": "tagalog", "mg": "malagasy", "as": "assamese", "tt": "tatar", "haw": "hawaiian",
    "ln": "lingala", "ha": "hausa", "ba": "bashkir", "jw": "javanese", "su": "sundanese",
}

# Chinese scripts a session may ask for (``auth.script``): Simplified, the default, or
# Traditional.
HANS, HANT = "hans", "hant"
SCRIPTS = (HANS, HANT)

# Written without spaces between words: finals are joined without one, subtitle lines are
# cut shorter, and a word is a character or a token.
UNSPACED = frozenset({"zh", "ja", "th", "lo", "my"})


def unspaced(language: str | None) -> bool:
    """Whether text in ``language`` is written without spaces between words."""
    return (language or "") in UNSPACED


def join_texts(texts: list[str], languages: list[str | None]) -> str:
    """Finals joined into one transcript: a space between two of them, except where both
    sides are in a language written without spaces."""
    out = ""
    prev: str | None = None
    for text, lang in zip(texts, languages, strict=True):
        if text:
            out += joined_piece(out, prev, text, lang)
            prev = lang
    return out


def joined_piece(so_far: str, previous: str | None, text: str, language: str | None) -> str:
    """What a final of ``text`` in ``language`` adds to the transcript ``so_far``, whose
    last final was in ``previous``: the text, after a space unless the transcript is empty
    or both sides are written without spaces (nothing for an empty final). A transcript
    that grows by these pieces is ``join_texts`` of its finals."""
    if not text:
        return ""
    space = so_far and not (unspaced(previous) and unspaced(language))
    return (" " if space else "") + text

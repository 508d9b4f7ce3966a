"""Languages: what a session may ask for, the Mandarin path of the whisper-live engine on
real Mandarin speech (tests/fixtures/zh), ``auto`` on Mandarin and English, and the text
stages (Chinese script, smart formatting)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cosyvoice.asr import ENGINES, live_engine, load_model, model_data
from cosyvoice.gateway.limits import parse_auth
from cosyvoice.settings import Settings, SettingsError
from cosyvoice.text import formatting, script, stages, subtitles
from cosyvoice.wire.errors import Unauthorized, UnsupportedLanguage
from cosyvoice.wire.languages import AUTO, WHISPER_LANGUAGES, join_texts

from ..helpers import cer, finals, joined, read_pcm, run_stream, zh_texts

pytestmark = pytest.mark.unit

ZH = zh_texts()
LIVE = ENGINES["whisper-live"].languages


# ---- what a session may ask for --------------------------------------------------------


@pytest.mark.fast
def test_a_session_asks_for_auto_or_a_whisper_language_and_nothing_else():
    assert LIVE[0] == AUTO and set(LIVE[1:]) == set(WHISPER_LANGUAGES)
    assert ENGINES["pocketsphinx"].languages == ("en",)
    req = parse_auth({"language": "zh", "script": "hant", "format": True}, languages=LIVE)
    assert (req.language, req.script, req.format) == ("zh", "hant", True)
    assert parse_auth({}, languages=LIVE).language is None  # the gateway's default: auto
    for refused in ({"language": "klingon"}, {"language": "zh-CN"}, {"script": "latin"}):
        with pytest.raises(UnsupportedLanguage):
            parse_auth(refused, languages=LIVE)
    with pytest.raises(UnsupportedLanguage, match="'zh' is not offered"):
        parse_auth({"language": "zh"})  # an English-only engine
    for bad in ({"language": 7}, {"format": "yes"}, {"prompt": 3}, {"prompt": "x" * 501}):
        with pytest.raises(Unauthorized):
            parse_auth(bad, languages=LIVE)
    assert parse_auth({"prompt": "Kubernetes, gRPC."}).prompt == "Kubernetes, gRPC."


@pytest.mark.fast
def test_the_language_table_is_the_packaged_models_own():
    """Whisper's 99 codes, in the order of the packaged base's language tokens."""
    config = json.loads((model_data.install_ct2() / "config.json").read_text())
    assert len(config["lang_ids"]) == len(WHISPER_LANGUAGES) == 99
    from faster_whisper.tokenizer import _LANGUAGE_CODES

    assert set(WHISPER_LANGUAGES) == set(_LANGUAGE_CODES) - {"yue"}


@pytest.mark.fast
def test_a_multilingual_model_directory_must_hold_a_model(tmp_path):
    with pytest.raises(SettingsError, match="MULTILINGUAL_MODEL"):
        Settings.from_env({"COSYVOICE_MULTILINGUAL_MODEL": str(tmp_path)})
    (tmp_path / "model.bin").write_bytes(b"")
    assert Settings.from_env({"COSYVOICE_MULTILINGUAL_MODEL": str(tmp_path)}
                             ).multilingual_model == str(tmp_path)


# ---- text stages ---------------------------------------------------------------------------


def _run(session: dict, result: Any) -> Any:
    (out,) = stages.apply(stages.text_rules(session), [result])
    assert isinstance(out, dict)
    return out


@pytest.mark.fast
def test_mandarin_is_written_in_the_sessions_script_and_nothing_else_is_touched():
    final = {"type": "final", "text": "請問國車站怎麼走", "utterance": 0, "start": 0.0,
             "end": 1.0, "language": "zh",
             "words": [{"word": "請問", "start": 0.1, "end": 0.3, "conf": 0.9}]}
    hans = _run({"language": "zh"}, final)
    assert hans["text"] == "请问国车站怎么走" and hans["words"][0]["word"] == "请问"
    partial = {"type": "partial", "text": "北京是中国", "stable": "北京", "utterance": 0,
               "start": 0.0, "end": 1.0, "language": "zh"}
    hant = _run({"language": "auto", "script": "hant"}, partial)
    assert (hant["text"], hant["stable"]) == ("北京是中國", "北京")
    english = {**final, "text": "The weather is nice today.", "language": "en"}
    assert _run({"language": "auto"}, english) == english
    # an English-only engine's results are labelled with the session's language
    assert _run({"language": "en"}, {**english, "language": ""})["language"] == "en"
    assert _run({}, {k: v for k, v in english.items() if k != "language"})["language"] == "en"


@pytest.mark.fast
def test_formatting_writes_digits_in_finals_of_sessions_that_ask():
    assert formatting.format_text("这件衣服一共三百五十元。", "zh") == "这件衣服一共¥350。"
    assert formatting.format_text("It costs twenty three dollars.", "en") == "It costs $23."
    assert formatting.format_text("二千二十六年十二月六日", "ja") == "2026年12月6日"
    assert formatting.format_text("dwa tysiące", "pl") == "dwa tysiące"  # no rules: as is
    final = {"type": "final", "text": "会议将在下午三点开始，一共二十个人。", "utterance": 0,
             "start": 0.0, "end": 1.0, "language": "zh"}
    assert "20" in _run({"language": "zh", "format": "1"}, final)["text"]
    assert _run({"language": "zh", "format": "0"}, final) == final
    partial = {**final, "type": "partial"}
    assert _run({"language": "zh", "format": "1"}, partial)["text"] == final["text"]
    assert script.COST + formatting.COST == stages.text_cost(
        {"language": "zh", "format": "1"})


@pytest.mark.fast
def test_unspaced_languages_join_without_a_space_and_json_says_the_language():
    assert join_texts(["北京", "上海", "Hello", "world"], ["zh", "zh", "en", None]) == \
        "北京上海 Hello world"
    finals_ = [{"type": "final", "text": t, "start": i, "end": i + 1, "language": "zh",
                "words": []} for i, t in enumerate(["北京是中国的首都。", "请问火车站怎么走？"])]
    doc = json.loads(subtitles.to_json(finals_))
    assert doc["text"] == "北京是中国的首都。请问火车站怎么走？" and doc["language"] == "zh"


# ---- the whisper-live engine in Mandarin ----------------------------------------------------


@pytest.fixture(scope="module")
def live():
    return load_model("whisper-live", Settings())


def _transcribe(model, names: list[str], language: str):
    results, _ = run_stream(model, joined(names), language=language)
    return finals(results)


def test_mandarin_sessions_are_recognised_in_mandarin(live):
    names = sorted(ZH)
    got = [" ".join(f["text"] for f in _transcribe(live, [n], "zh")) for n in names]
    rate = cer([ZH[n] for n in names], got)
    assert rate <= 0.08, list(zip(got, names, strict=True))


def test_auto_detects_mandarin_and_english_and_follows_a_change(live):
    """English, Mandarin, English, Mandarin in one session: each final in its language,
    the English ones by tiny.en exactly as an ``en`` session decodes them."""
    names = ["weather", "zh/zh01", "coffee", "zh/zh06"]
    got = _transcribe(live, names, AUTO)
    assert [f["language"] for f in got] == ["en", "zh", "en", "zh"]
    assert all(f["language_prob"] >= 0.9 for f in got)
    english = [f["text"] for f in _transcribe(live, ["weather"], "en")]
    assert got[0]["text"] == english[0]
    assert cer([ZH["zh/zh01"]], [got[1]["text"]]) <= 0.2
    assert got[2]["text"].lower().startswith("i would like a cup of coffee")
    assert cer([ZH["zh/zh06"]], [got[3]["text"]]) <= 0.1


def test_auto_english_stays_on_tiny_en_without_asking_again(live, monkeypatch):
    """A partial surely English makes the session English, and from then on the
    multilingual model is asked again only where tiny.en reads as lost: English finals
    cost what an ``en`` session's do."""
    names = ["weather", "coffee", "door", "call"]
    calls: list[str] = []
    for name in ("encode_clip", "decode_partials"):
        real = getattr(live.multi, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(live.multi, name, counted)
    got = _transcribe(live, names, AUTO)
    assert [f["language"] for f in got] == ["en"] * 4
    # the first partial's detection made the session English: nothing more of it
    assert calls == ["decode_partials"]
    assert got[0]["language_prob"] >= 0.9 and "language_prob" not in got[1]
    want = [f["text"] for f in _transcribe(live, names, "en")]
    assert [f["text"] for f in got] == want


@pytest.mark.parametrize("language", ["zh", AUTO])
@pytest.mark.parametrize("name", ["silence", "noise", "tone"])
def test_no_words_from_no_speech_in_any_language_mode(live, language, name):
    results, _ = run_stream(live, read_pcm(name), language=language)
    assert results == []


def test_a_mandarin_stream_rebuilt_from_a_checkpoint_continues_exactly(live):
    pcm = joined(["zh/zh01", "zh/zh03", "weather", "zh/zh09"])
    results, checkpoints = run_stream(live, pcm, language=AUTO)
    assert len(finals(results)) == 4 and len(checkpoints) >= 2
    for position, cp in checkpoints.items():
        assert cp["language"] == AUTO and cp["current"] in ("zh", "en")
        resumed, _ = run_stream(live, pcm, checkpoint=cp, start=position)
        assert finals(resumed) == finals(results)[cp["utterance"]:]


def test_a_prompt_steers_the_decode_until_the_sessions_own_finals_take_over(live):
    """Whisper base writes Mandarin mostly in Traditional characters; after a prompt in
    Simplified it writes Simplified (before the script stage, which the engine knows
    nothing of). The prompt is the stream's starting context: its checkpoint carries it on,
    followed by the session's finals."""
    names = sorted(ZH)
    prompt = "以下是普通话的句子。"

    def simplified(got: list) -> int:
        return sum(script.convert(f["text"], "hans") == f["text"]
                   and script.convert(f["text"], "hant") != f["text"] for f in got)

    plain, prompted = [], []
    for name in names:
        plain += _transcribe(live, [name], "zh")
        stream = live.stream(16000, language="zh", prompt=prompt)
        start = stream.checkpoint
        stream.close()
        assert start["prompt"] == prompt
        results, checkpoints = run_stream(live, read_pcm(name), checkpoint=start)
        prompted += finals(results)
        last = checkpoints[max(checkpoints)]
        assert last["prompt"].startswith(prompt) and len(last["prompt"]) > len(prompt)
    assert simplified(plain) <= len(plain) // 4, [f["text"] for f in plain]
    assert simplified(prompted) >= len(prompted) * 3 // 4, [f["text"] for f in prompted]
    assert cer(["".join(ZH[n] for n in names)], ["".join(f["text"] for f in prompted)]) <= 0.1


def test_the_multilingual_model_is_the_packaged_base_unless_set(live):
    assert live_engine.multilingual_dir(Settings()) == model_data.install_ct2()
    assert live.multi.multilingual and not live.decoder.multilingual

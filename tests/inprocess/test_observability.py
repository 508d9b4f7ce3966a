"""Logs, metrics and the memory dumper in-process; tests/e2e/test_deploy.py runs them for real."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tracemalloc

import pytest
from prometheus_client import REGISTRY

from cosyvoice import debug_mem, logs, metrics, metrics_dir


def _format(record: logging.LogRecord) -> dict:
    return json.loads(logs.JsonFormatter().format(record))


pytestmark = [pytest.mark.fast, pytest.mark.inprocess]


def test_log_records_are_one_json_line_with_session_and_event():
    logger = logging.getLogger("cosyvoice.test")
    record = logger.makeRecord("cosyvoice.test", logging.INFO, __file__, 1, "session %s opened",
                               ("abc",), None, extra={"session": "abc", "event": "connect"})
    entry = _format(record)
    assert entry["msg"] == "session abc opened" and entry["level"] == "INFO"
    assert entry["session"] == "abc" and entry["event"] == "connect"
    assert entry["logger"] == "cosyvoice.test" and entry["pid"] == os.getpid()
    assert entry["time"].endswith("Z")


def test_a_traceback_stays_on_one_line():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.getLogger("x").makeRecord("x", logging.ERROR, __file__, 1, "failed",
                                                   (), sys.exc_info())
    line = logs.JsonFormatter().format(record)
    assert "\n" not in line
    assert "ValueError: boom" in json.loads(line)["exc"]


def test_log_level_comes_from_the_setting_and_gunicorn_logs_as_json():
    config = logs.dict_config("warning")
    assert config["root"]["level"] == "WARNING"
    assert config["loggers"]["gunicorn.error"]["handlers"] == []  # through root: JSON
    assert logs.dict_config("nonsense")["root"]["level"] == "INFO"


def test_setup_in_a_process_writes_json_lines_at_the_configured_level():
    code = ("import logging, warnings; from cosyvoice import logs; logs.setup('WARNING');"
            "log = logging.getLogger('cosyvoice.gateway');"
            "log.info('hidden'); log.warning('shown', extra={'session': 's1', 'event': 'x'});"
            "warnings.warn('careful')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = [json.loads(line) for line in proc.stderr.splitlines()]
    assert [line["msg"] for line in lines][0] == "shown"
    assert lines[0]["session"] == "s1"
    assert "careful" in lines[1]["msg"] and lines[1]["logger"] == "py.warnings"


def _sample(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_chunk_counter_reads_the_ack():
    handler = metrics.counts_chunks(lambda ack: ack)
    stored = _sample("cosyvoice_chunks_accepted_total", {"result": "stored"})
    duplicate = _sample("cosyvoice_chunks_accepted_total", {"result": "duplicate"})
    gap = _sample("cosyvoice_chunks_rejected_total", {"code": "seq_gap"})
    timed = _sample("cosyvoice_chunk_ack_seconds_count")
    handler({"seq": 1})
    handler({"seq": 1, "duplicate": True})
    handler({"error": "seq_gap", "seq": 5})
    assert _sample("cosyvoice_chunks_accepted_total", {"result": "stored"}) == stored + 1
    assert _sample("cosyvoice_chunks_accepted_total", {"result": "duplicate"}) == duplicate + 1
    assert _sample("cosyvoice_chunks_rejected_total", {"code": "seq_gap"}) == gap + 1
    assert _sample("cosyvoice_chunk_ack_seconds_count") == timed + 2


def test_a_handler_that_raises_counts_as_internal():
    def broken(_):
        raise RuntimeError("bug")

    before = _sample("cosyvoice_chunks_rejected_total", {"code": "internal"})
    with pytest.raises(RuntimeError):
        metrics.counts_chunks(broken)(None)
    assert _sample("cosyvoice_chunks_rejected_total", {"code": "internal"}) == before + 1


def test_decode_lag_uses_the_stream_entry_time():
    import time

    before = _sample("cosyvoice_decode_lag_seconds_count")
    total = _sample("cosyvoice_decode_lag_seconds_sum")
    entry_ms = int(time.time() * 1000) - 1500
    metrics.observe_decode_lag(f"{entry_ms}-0", [{"type": "partial"}])
    metrics.observe_decode_lag(f"{entry_ms}-1", [])  # no result published: nothing to time
    assert _sample("cosyvoice_decode_lag_seconds_count") == before + 1
    assert _sample("cosyvoice_decode_lag_seconds_sum") - total >= 1.5


def test_gateway_scrape_shows_only_gateway_metrics():
    body = metrics.exposition()[0].decode()
    assert "cosyvoice_chunks_accepted_total" in body and "cosyvoice_redis_errors_total" in body
    assert "cosyvoice_decode_lag_seconds" not in body and "cosyvoice_worker_capacity" not in body


def test_dead_processes_lose_their_live_gauges(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, os.getpid()):
        (tmp_path / f"gauge_livesum_{pid}.db").write_bytes(b"")
    (tmp_path / f"counter_{dead.pid}.db").write_bytes(b"")
    metrics_dir.prune_dead(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"gauge_livesum_{os.getpid()}.db", f"counter_{dead.pid}.db"])


def test_memory_dumper_logs_top_allocations_and_rss(caplog):
    was_tracing = tracemalloc.is_tracing()
    try:
        dumper = debug_mem.MemoryDumper("test")
        hoard = [bytearray(1000) for _ in range(2000)]
        with caplog.at_level(logging.INFO, logger="cosyvoice.debug_mem"):
            top = dumper.dump()
        assert 0 < len(top) <= debug_mem.TOP
        assert top[0]["size_diff"] >= 1000 * 2000 * 0.9
        assert __file__ in top[0]["where"]
        record = caplog.records[-1]
        assert record.event == "debug_mem" and record.rss > 0 and record.top == top
        del hoard
    finally:
        if not was_tracing:
            tracemalloc.stop()


def test_debug_mem_is_off_unless_asked():
    assert not debug_mem.enabled({})
    assert not debug_mem.enabled({"DEBUG_MEM": "0"})
    assert debug_mem.enabled({"DEBUG_MEM": "1"})

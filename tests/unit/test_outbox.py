"""A session's outbox and its text stages, without Redis or processes: what may be
published now, in which order, with which checkpoint, whatever order the deferred decodes
finish in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cosyvoice.text import stages
from cosyvoice.wire.messages import Checkpoint, End, Result, Scheduled
from cosyvoice.worker.outbox import Outbox

pytestmark = [pytest.mark.fast, pytest.mark.unit]


@dataclass
class Job:
    """A deferred decode finished by the test (a ``messages.Deferred``)."""
    text: str = ""
    done: bool = False
    failed: bool = False
    dropped: bool = False
    result: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)

    def finish(self, prompt: str | None = None) -> None:
        self.result = {"text": self.text}
        if prompt is not None:
            self.after = {"prompt": prompt}
        self.done = True


def result(kind: str, text: str = "", utterance: int = 0) -> Result:
    out: Any = {"type": kind, "text": text, "utterance": utterance, "start": 0.0, "end": 1.0}
    return out


def deferred(kind: str, job: Job, utterance: int = 0) -> Scheduled:
    return Scheduled(result(kind, "", utterance), job)


END: End = {"type": "end", "session": "s", "seq": 9}


def texts(ready) -> list[str]:
    return [r.get("text", r["type"]) for r in ready.results]


def test_with_nothing_deferred_an_entry_goes_out_whole_with_its_checkpoint():
    box = Outbox()
    cp = Checkpoint("1-0", 0, {"utterance": 1})
    ready = box.push("1-0", [result("partial", "a"), result("final", "a b")], cp, False)
    assert texts(ready) == ["a", "a b"] and ready.checkpoint == cp and not ready.done
    assert not box.waiting and box.ready() == []


def test_a_deferred_final_holds_what_follows_it_but_not_a_partial_decoded_now():
    box = Outbox()
    job = Job("hello there")
    first = box.push("1-0", [deferred("final", job)], Checkpoint("1-0", 3, {"prompt": ""}),
                     False)
    assert first.results == [] and first.checkpoint is None  # nothing, no checkpoint yet
    # the next utterance's partial goes out at once; its final waits for the one before
    now = box.push("2-0", [result("partial", "next", 1)], None, False)
    assert texts(now) == ["next"]
    later = box.push("3-0", [result("final", "next one", 1), END], Checkpoint.finished(), True)
    assert later.results == [] and box.waiting and box.ready() == []
    job.finish(prompt="hello there")
    out = box.ready()
    assert [texts(r) for r in out] == [["hello there"], ["next one", "end"]]
    # each entry's checkpoint goes out with it, updated by what its final decoded says
    assert out[0].checkpoint == Checkpoint("1-0", 3, {"prompt": "hello there"})
    assert out[1].checkpoint == Checkpoint.finished() and out[1].done
    assert not box.waiting


def test_a_dropped_partial_is_skipped_and_a_failed_decode_ends_the_session():
    box = Outbox()
    gone, fails, after = Job(), Job(), Job("never")
    box.push("1-0", [deferred("partial", gone)], None, False)
    box.push("2-0", [deferred("final", fails)], Checkpoint("2-0", 1, {}), False)
    box.push("3-0", [deferred("final", after, 1)], Checkpoint("3-0", 2, {}), False)
    gone.dropped = gone.done = True
    assert [texts(r) for r in box.ready()] == [[]]  # the entry is passed, nothing in it
    fails.failed = fails.done = True
    after.finish()
    out = box.ready()
    assert len(out) == 1 and out[0].failed and out[0].results == []
    assert not box.waiting  # nothing after a failure is published


def test_text_rules_run_on_a_result_decoded_now_and_on_a_deferred_one_once_decoded():
    def upper(r: Result) -> Result:
        return {**r, "text": r["text"].upper()}

    job = Job("late")
    items = stages.apply((upper,), [result("partial", "now"), deferred("final", job), END])
    box = Outbox()
    now = box.push("1-0", items, Checkpoint.finished(), True)
    assert texts(now) == ["NOW"]
    job.finish()
    [ready] = box.ready()
    assert texts(ready) == ["LATE", "end"]


def test_a_text_stage_runs_only_for_the_sessions_that_want_it():
    shout = stages.TextStage("shout", wanted=lambda s: s.get("shout") == "yes",
                             rule=lambda s: lambda r: {**r, "text": r["text"] + "!"},
                             cost=0.002)
    assert stages.text_rules({"mode": "x"}, [shout]) == ()
    [rule] = stages.text_rules({"shout": "yes"}, [shout])
    assert rule(result("final", "hi"))["text"] == "hi!"
    assert stages.text_cost({"shout": "yes"}, [shout]) == 0.002
    assert stages.text_cost({}, [shout]) == 0.0


# Any number of entries, each with a partial decoded now or deferred and, now and then, a
# deferred final; the deferred decodes finish in any order.
ENTRIES = st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=12)


# An example costs about 3.5 ms (a dozen entries pushed and drained): the full run's
# 10 000 took 36 s of the suite's budget, so it searches 3 000, as the connect fuzzer does.
@settings(max_examples=min(settings().max_examples, 3_000))
@given(ENTRIES, st.randoms(use_true_random=False))
def test_finals_go_out_once_each_in_order_whatever_order_decodes_finish_in(entries, rnd):
    box = Outbox()
    jobs: list[Job] = []
    published: list[Result] = []
    checkpoints: list[Checkpoint] = []
    for i, (partial_deferred, has_final) in enumerate(entries):
        items: list[Any] = []
        job = Job(f"p{i}")
        items.append(deferred("partial", job, i) if partial_deferred
                     else result("partial", f"p{i}", i))
        if partial_deferred:
            jobs.append(job)
        cp = None
        if has_final:
            final = Job(f"f{i}")
            jobs.append(final)
            items.append(deferred("final", final, i))
            cp = Checkpoint(f"{i}-0", i, {})
        ready = box.push(f"{i}-0", items, cp, False)
        published += ready.results  # type: ignore[arg-type]
        # some decodes finish meanwhile, in any order
        for j in rnd.sample(jobs, k=rnd.randint(0, len(jobs))):
            if not j.done:
                j.finish()
        for r in box.ready():
            published += r.results  # type: ignore[arg-type]
            checkpoints += [r.checkpoint] if r.checkpoint else []
    for j in jobs:
        j.finish()
    for r in box.ready():
        published += r.results  # type: ignore[arg-type]
        checkpoints += [r.checkpoint] if r.checkpoint else []
    finals = [r["text"] for r in published if r["type"] == "final"]
    assert finals == [f"f{i}" for i, (_, has) in enumerate(entries) if has]
    assert sorted(r["text"] for r in published if r["type"] == "partial") == \
        sorted(f"p{i}" for i in range(len(entries)))
    # a deferred partial never goes out after a later entry's final
    for k, out in enumerate(published):
        if out["type"] == "final":
            later = [p for p in published[k:] if p["type"] == "partial"]
            assert all(p["utterance"] >= out["utterance"] or not entries[p["utterance"]][0]
                       for p in later)
    assert [c.seq for c in checkpoints] == sorted(c.seq for c in checkpoints)
    assert not box.waiting

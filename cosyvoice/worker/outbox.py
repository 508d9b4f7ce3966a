"""A session's outbox: what of its results may be published now, and with which checkpoint.

A worker decodes a session's audio entry by entry. Each entry yields results (partials,
finals, the session's ``end`` after its ``last`` chunk), some decoded at once and some
``Scheduled``: handed to a deferred stage (the 2-pass finals process, whisper-live's decode
scheduler, later a speaker embedder) and done later. The outbox keeps them in the order the
audio produced them:

- a partial decoded at once goes out at once (a partial is a preview; holding it behind a
  final being decoded would only make it late);
- everything else (deferred results, finals, ``end``) goes out in entry order, an entry
  only once every deferred result of it and of every entry before it is done, together
  with that entry's checkpoint (updated by what its deferred finals say, ``after``);
- nothing of a session is ever published twice, and a checkpoint never passes a final not
  yet published (a worker that dies with finals in hand stored no checkpoint past them,
  so whoever takes the session over decodes them again).

Pure: no Redis, no clock. The worker publishes each ``Ready`` it is given, in order
(cosyvoice/worker/loop.py); tests/unit/test_outbox.py drives it with hand-made jobs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, cast

from ..wire.messages import (
    Checkpoint,
    Decoded,
    Deferred,
    End,
    Outgoing,
    Published,
    Relabel,
    Result,
    Scheduled,
    kind,
    with_seq,
)


def entry_results(session: str, entry_id: str, seq: int, last: bool,
                  results: Sequence[Decoded], checkpoint_of: Callable[[], dict[str, Any]],
                  ) -> tuple[list[Decoded | End], Checkpoint | None]:
    """What one decoded audio entry publishes, and the checkpoint stored with it.

    Every result carries its chunk's ``seq``. After ``last`` the session's ``end``
    follows and the checkpoint says ``done`` (the session is finished; a worker that
    finds it never decodes it again). After a final, the checkpoint is the stream's state
    at this entry, so a worker taking over replays from here and sends the same finals.
    Otherwise None: the stored checkpoint stays. Pure: ``checkpoint_of`` reads the
    stream's state only when a checkpoint is due.
    """
    out: list[Decoded | End] = [with_seq(r, seq) for r in results]
    if last:
        return out + [End(type="end", session=session, seq=seq)], Checkpoint.finished()
    if any(kind(r) == "final" for r in out):
        return out, Checkpoint(entry_id, seq, checkpoint_of())
    return out, None


def split_ordered(results: Sequence[Outgoing]) -> tuple[list[Result], list[Outgoing]]:
    """An entry's results as (published at once, published in order): partials decoded
    now go out as soon as they are; deferred results, finals and ``end`` keep their order
    and carry the checkpoint."""
    now = [r for r in results if not isinstance(r, Scheduled) and r["type"] == "partial"]
    return now, [r for r in results
                 if isinstance(r, Scheduled) or r["type"] != "partial"]


def with_relabel(result: Outgoing) -> list[Published]:
    """A result, and after it the ``relabel`` messages it carries: earlier finals it
    moved to another speaker (cosyvoice/text/speakers/)."""
    if not isinstance(result, dict) or "relabel" not in result:
        return [result]  # type: ignore[list-item]
    out: Any = dict(result)
    changes = out.pop("relabel")
    return [out, *(cast(Relabel, {"type": "relabel", **change}) for change in changes)]


@dataclass
class Pending:
    """What an audio entry publishes in order: its results, some still being decoded
    (``Scheduled``), and what follows them (``end``), with the checkpoint of that entry.
    Ready when every job it holds is done."""
    entry_id: str
    results: list[Outgoing]
    checkpoint: Checkpoint | None
    done: bool

    @property
    def jobs(self) -> list[Deferred]:
        return [r.job for r in self.results if isinstance(r, Scheduled)]

    def ready(self) -> bool:
        return all(r.done for r in self.results if isinstance(r, Scheduled))

    def failed(self) -> bool:
        return any(r.failed for r in self.results if isinstance(r, Scheduled))

    def publishable(self) -> list[Published]:
        """The results as decoded, leaving out those whose job was dropped (no speech,
        a partial overtaken); a final that moves the one before it to another speaker is
        followed by that ``relabel``."""
        out: list[Published] = []
        for r in self.results:
            decoded = r.decoded() if isinstance(r, Scheduled) else r
            if decoded is not None:
                out += with_relabel(decoded)
        return out

    def final_checkpoint(self) -> Checkpoint | None:
        """The stored checkpoint: the entry's, with what its last decoded final says."""
        if self.checkpoint is None or self.checkpoint.done:
            return self.checkpoint
        after = [j.after for j in self.jobs if j.after]
        return self.checkpoint.updated(after[-1]) if after else self.checkpoint


@dataclass
class Ready:
    """Results to publish now, in this order: the ``checkpoint`` to store with them (None:
    the stored one stays), whether they end the session (``done``), or ``failed`` (a
    deferred decode of this entry failed: the session ends with an error instead)."""
    entry_id: str
    results: list[Published]
    checkpoint: Checkpoint | None = None
    done: bool = False
    failed: bool = False


class Outbox:
    """The results of one session on their way out (see the module's docstring)."""

    def __init__(self, state: Callable[[], dict[str, Any]] | None = None) -> None:
        self._queue: deque[Pending] = deque()
        # the session's stages' part of a checkpoint, read as the results the checkpoint
        # goes with are published (the speakers met so far, cosyvoice/text/speakers/)
        self._state = state

    def _checkpoint(self, checkpoint: Checkpoint | None) -> Checkpoint | None:
        if checkpoint is None or checkpoint.done or self._state is None:
            return checkpoint
        return checkpoint.updated(self._state())

    @property
    def waiting(self) -> bool:
        """Some results wait for a deferred decode."""
        return bool(self._queue)

    def push(self, entry_id: str, results: Sequence[Outgoing], checkpoint: Checkpoint | None,
             last: bool) -> Ready:
        """One entry's results: what goes out now (perhaps nothing; the worker publishes
        it anyway, which also tells it whether the session still exists). The rest waits
        for ``ready``."""
        deferred = any(isinstance(r, Scheduled) for r in results)
        if not deferred and not self._queue:
            out = [m for r in results for m in with_relabel(r)]
            return Ready(entry_id, out, self._checkpoint(checkpoint), done=last)
        now, ordered = split_ordered(results)
        if ordered or checkpoint is not None:
            self._queue.append(Pending(entry_id, ordered, checkpoint, last))
        return Ready(entry_id, list(now))

    def ready(self) -> list[Ready]:
        """Every waiting entry whose turn has come, in order; a failed one is the last
        (the session ends with it)."""
        out: list[Ready] = []
        while self._queue and self._queue[0].ready():
            item = self._queue.popleft()
            if item.failed():
                out.append(Ready(item.entry_id, [], failed=True))
                self._queue.clear()
                break
            results = item.publishable()  # runs the rules: the stages' state is theirs now
            out.append(Ready(item.entry_id, results,
                             self._checkpoint(item.final_checkpoint()), done=item.done))
        return out

    def clear(self) -> None:
        """The session is no longer this worker's: what waits is never published here."""
        self._queue.clear()

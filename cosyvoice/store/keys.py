"""Every Redis key name cosyvoice uses, in one place.

All keys of one session share the hash tag ``{SID}`` (the part Redis Cluster hashes), so
a session's keys live in one slot and its scripts run unchanged on a cluster. The
control keys (the announcement stream, the live workers and their capacities) are
shared by every session; on a cluster they share the hash tag ``{cosyvoice}`` instead
(``CLUSTER_CONTROL``), so the admission and placement scripts, which read all three, run
on the one node that holds them. The layout as a whole is in docs/architecture.md, "Redis layout and
session ownership".
"""

from __future__ import annotations

from dataclasses import dataclass

SESSIONS = "sessions"
# The consumer group of SESSIONS that every worker process reads announcements in (a
# group, not a key: it shares its name with the WORKERS key by history only)
WORKER_GROUP = "workers"
WORKERS = "workers"
WORKER_CAPACITY = "worker_capacity"
# When the last sessions ended (a sorted set by time): the drain rate a refusal's
# retry_after_ms comes from, and GET /load's
ENDED = "ended"
# Each live worker's decode queue, as JSON (GET /load)
WORKER_LOAD = "worker_load"
# A live worker's entry in WORKERS is dropped this long after its heartbeat lapsed.
WORKER_FORGET_MS = 60_000
# The announcement stream keeps this many entries (each is a few dozen bytes).
SESSIONS_MAXLEN = 10000


@dataclass(frozen=True)
class Control:
    """The names of the control keys on one deployment's Redis."""
    sessions: str
    workers: str
    worker_capacity: str
    ended: str
    worker_load: str

    @property
    def all(self) -> list[str]:
        """The keys the admission and placement scripts read, in their order."""
        return [self.sessions, self.workers, self.worker_capacity]


CONTROL = Control(SESSIONS, WORKERS, WORKER_CAPACITY, ENDED, WORKER_LOAD)
CLUSTER_CONTROL = Control("{cosyvoice}:sessions", "{cosyvoice}:workers",
                          "{cosyvoice}:worker_capacity", "{cosyvoice}:ended",
                          "{cosyvoice}:worker_load")


def face_key(face: str, cid: str) -> str:
    """A raw-WebSocket face's connection state, for the client that resumes it: ``realtime``
    (cosyvoice/faces/openai/realtime.py) or ``listen`` (cosyvoice/faces/deepgram/listen.py)."""
    return f"{face}:{{{cid}}}"


def usage_key(day: str) -> str:
    """Audio seconds each client name sent on one day (``YYYY-MM-DD``, UTC)."""
    return f"usage:{{{day}}}"


# Days a day's usage is kept.
USAGE_TTL_S = 400 * 86400


def audio_key(sid: str) -> str:
    return f"audio:{{{sid}}}"


def text_key(sid: str) -> str:
    """Both the result stream (replay) and the pub/sub channel (live)."""
    return f"text:{{{sid}}}"


def session_key(sid: str) -> str:
    return f"session:{{{sid}}}"


def lease_key(sid: str) -> str:
    return f"lease:{{{sid}}}"


def client_key(address: str) -> str:
    """Sorted set of one client address's sessions (score: when the slot lapses)."""
    return f"client:{address}"


def session_keys(sid: str) -> list[str]:
    return [session_key(sid), audio_key(sid), text_key(sid), lease_key(sid)]


def sid_from_channel(channel: str) -> str:
    return channel[channel.index("{") + 1:channel.rindex("}")]

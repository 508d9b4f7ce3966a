"""The Lua scripts of the Redis layer, each in its own file under ``cosyvoice/store/lua/``.

Each file says what its script does, which KEYS and ARGV it takes and what it returns.
They are read once, at import; ``Bus`` registers them with its client (redis-py sends
each by its SHA and loads it again where a server lacks it). The control plane's scripts
(live workers, admission, placement) run after two shared parts: ``rules.lua``, the pure
decisions that tests/unit/test_rules.py runs in Lua 5.1 without Redis, and ``workers.lua``,
the live workers and their loads.
"""

from __future__ import annotations

import json
from importlib.resources import files

from .keys import WORKER_GROUP


def source(name: str) -> str:
    """The text of ``cosyvoice/store/lua/<name>.lua``."""
    return (files("cosyvoice.store") / "lua" / f"{name}.lua").read_text(encoding="utf-8")


# a session's data
APPEND = source("append")
PUBLISH = source("publish")
# On a Redis Cluster, the same with sharded pub/sub: SPUBLISH reaches the subscribers on
# the channel's shard only, where a plain PUBLISH is copied to every node.
SPUBLISH = PUBLISH.replace("redis.call('PUBLISH',", "redis.call('SPUBLISH',")
assert SPUBLISH.count("SPUBLISH") == 1
RESUME = source("resume")
NOTE_ANNOUNCEMENT = source("note_announcement")
RELEASE_CONN = source("release_conn")
TOUCH = source("touch")
SLOT = source("slot")
# leases
RENEW = source("renew")
RELEASE = source("release")
# The consumer group's name, for the scripts that read it (one name, keys.WORKER_GROUP)
_GROUP = f"local GROUP = {json.dumps(WORKER_GROUP)}\n"
# the control plane
RULES = source("rules")
_PRELUDE = RULES + _GROUP + source("workers")
LIVE_WORKERS = _PRELUDE + source("live_workers")
ADMIT = _PRELUDE + source("admit")
PLACE = _PRELUDE + source("place")
HEARTBEAT = source("heartbeat")
FORGET_CONSUMERS = _GROUP + source("forget_consumers")

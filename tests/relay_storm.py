"""A gateway's result subscriber under a storm of subscriber kills, as its own gevent
process (monkey-patched as the gateway is): ``python -m tests.relay_storm URL [cluster]``.

Twelve sessions stay subscribed throughout; two greenlets subscribe and unsubscribe forty
more as connections coming and going do, while every node's subscriber connections are
killed (``CLIENT KILL TYPE pubsub``) forty times. Then each of the twelve must get a result
published live again (published until it arrives, for at most 15 s: a subscriber backing
off after the storm reconnects within that). Prints one JSON line: the sessions that got
nothing, and the errors that ended a greenlet of the relay's (a dead reader delivers no
result again on its connection).
"""

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import gevent  # noqa: E402
import redis  # noqa: E402

from cosyvoice.gateway.relay import ResultRelay  # noqa: E402
from cosyvoice.store import bus as busmod  # noqa: E402
from cosyvoice.store import keys  # noqa: E402

KILLS = 40
STEADY = [f"steady{i}" for i in range(12)]


class Recorded:
    id = "storm"

    def __init__(self):
        self.ids: list[str] = []

    def send(self, _session, result_id, _message):
        self.ids.append(result_id)


def main(url: str, cluster: bool) -> dict:
    errors: list[str] = []
    hub = gevent.get_hub()
    report = hub.handle_error

    def handle_error(context, kind, value, tb):
        errors.append(repr(value))
        return report(context, kind, value, tb)

    hub.handle_error = handle_error
    client = busmod.connect(url, cluster=cluster)
    relay = ResultRelay(client, busmod.Bus(client))
    outputs = {s: Recorded() for s in STEADY}
    for session, output in outputs.items():
        relay.subscribe(session, output)
    primaries: Any = client.get_primaries() if cluster else []  # type: ignore[attr-defined]
    nodes = [redis.Redis(host=n.host, port=n.port) for n in primaries] or [client]
    storming = True

    def churn(seed: int) -> None:
        rnd = random.Random(seed)
        i = 0
        while storming:
            session = f"churn{seed}-{i % 20}"
            try:  # a handler whose subscribe failed answers its client with an error
                if session in relay.routes:
                    relay.unsubscribe(session)
                else:
                    relay.subscribe(session, Recorded())
            except redis.RedisError:
                pass
            i += 1
            gevent.sleep(rnd.random() * 0.01)

    churners = [gevent.spawn(churn, seed) for seed in (1, 2)]
    rnd = random.Random(0)
    for _ in range(KILLS):
        gevent.sleep(0.05 + rnd.random() * 0.2)
        for node in nodes:
            node.client_kill_filter(_type="pubsub")
    storming = False
    gevent.joinall(churners)
    publisher = busmod.connect(url, cluster=cluster)
    publish = publisher.spublish if cluster else publisher.publish
    waiting = set(STEADY)
    for _ in range(30):
        for session in waiting:
            publish(keys.text_key(session), '9999999999999-0 {"type": "partial"}')
        gevent.sleep(0.5)
        waiting = {s for s in waiting if not outputs[s].ids}
        if not waiting:
            break
    return {"missing": sorted(waiting), "errors": errors}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2:] == ["cluster"])))

"""The test levels and tiers, and the hypothesis profile each tier runs with.

Levels: each test module is marked with one (``pytestmark``), by what its tests start:
``unit`` (nothing), ``inprocess`` (the gateway's test client or a worker's rounds in the
test's own process, with a real redis-server), ``system`` (real gateway and worker
processes) and ``e2e`` (nginx, gunicorn, Chromium, fresh installs, Locust). ``conftest``
refuses a test with none or two, so ``python -m pytest -m LEVEL`` runs one level.

Tiers: ``python -m pytest -m fast`` (unit, in-process and single-command tests, under two
minutes; ``make fast``) and the full run (``make test``). ``conftest.pytest_configure``
sets ``FAST`` before any test module is imported and loads the tier's profile, unless
``--hypothesis-profile`` names one:

- ``full``: 10 000 examples a fuzzer (in the full run they search);
- ``fast``: 300 (in the fast tier they guard against regressions).

A fuzzer whose every example is expensive caps the count below its profile's (the
connect handler: 3 000 examples of a whole connect and disconnect, 12 ms each).
"""

from __future__ import annotations

from hypothesis import settings

FAST = False

LEVELS = {"unit", "inprocess", "system", "e2e"}

settings.register_profile("full", max_examples=10_000, deadline=None)
settings.register_profile("fast", max_examples=300, deadline=None)


def choose(fast: bool, asked: str | None) -> None:
    """The tier, and the profile asked for on the command line or else the tier's."""
    global FAST
    FAST = fast
    settings.load_profile(asked or ("fast" if fast else "full"))

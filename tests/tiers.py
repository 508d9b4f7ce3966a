"""The test tiers: ``python -m pytest -m fast`` (unit and in-process tests) and the full run.

``conftest.pytest_configure`` sets ``FAST`` before any test module is imported, so a
module may size its work by tier: the fuzzers run 10 000 examples in the full run (3 000
for the connect handler, whose every example is a whole connect and disconnect, 12 ms) and
a few hundred in the fast tier, where they guard against regressions rather than search.
"""

FAST = False


def fuzz_examples(full: int = 10_000) -> int:
    return 300 if FAST else full

"""What the benchmarks print and write: their markdown tables (the form docs/benchmarks.md
quotes them in), percentile pairs, and the JSON report of a run."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


def markdown(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: the header's cells, then one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def pair(stats: dict, first: str = "p50", second: str = "p95", missing: object = None) -> str:
    """Two of a distribution's percentiles as a table cell: ``"P50 / P95"``."""
    return f"{stats.get(first, missing)} / {stats.get(second, missing)}"


def save_json(path: str | Path, report: Any, indent: int = 2) -> None:
    """A run's full report, for the record beside the printed table."""
    Path(path).write_text(json.dumps(report, indent=indent))

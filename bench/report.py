"""Goals and the figures compared with them, the same way in every benchmark and in the summary
table of ``python -m bench``; the machine a run was made on.

A ``Goal`` row carries the compared figure (``measured``), the limit and its direction, and a
human-readable ``value`` with the raw figures behind it (both rates of a ratio, or the absolute
figure and its unit). Its ``ratio`` is the compared figure itself for a ratio goal, and the
figure divided by the limit for an absolute one (``0.4`` = at 40% of the allowed maximum).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from stack.machine import describe, revision


@dataclass(frozen=True)
class Goal:
    source: str  # the benchmark that measured it
    metric: str
    value: str  # the raw figures: "<emails> / <no-ops> per s", or "<p99.9> ms"
    measured: float  # the figure compared with the limit
    op: str  # ">=" or "<="
    limit: float
    unit: str = ""  # "" for a ratio, else the unit of ``measured`` and ``limit``

    @property
    def passed(self) -> bool:
        if math.isnan(self.measured):
            return False
        return self.measured >= self.limit if self.op == ">=" else self.measured <= self.limit

    @property
    def ratio(self) -> float:
        if not self.unit:
            return self.measured
        return self.measured / self.limit if self.limit else math.nan

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else "MISS"

    def goal_text(self) -> str:
        sign = "≥" if self.op == ">=" else "≤"
        unit = f" {self.unit}" if self.unit else ""
        return f"{sign} {self.limit:g}{unit}"

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "goal": self.goal_text(),
            "ratio": self.ratio,
            "verdict": self.verdict,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Goal:
        fields = ("source", "metric", "value", "measured", "op", "limit", "unit")
        return cls(**{name: data[name] for name in fields})

    def line(self) -> str:
        """One line for a benchmark's own report: ``PASS  metric: value (goal ...)``."""
        return f"{self.verdict}  {self.metric}: {self.value} (goal {self.goal_text()})"


def ratio_text(goal: Goal) -> str:
    """Two decimals; three when two would round a miss onto its limit (0.898 against 0.9)."""
    if math.isnan(goal.ratio):
        return "-"
    text = f"{goal.ratio:.2f}"
    if not goal.unit and float(text) == goal.limit and not goal.passed:
        text = f"{goal.ratio:.3f}"
    return text


def table(goals: Iterable[Goal]) -> str:
    """The goals as a fixed-width table: metric, value, goal, ratio, verdict."""
    rows = [
        (goal.metric, goal.value, goal.goal_text(), ratio_text(goal), goal.verdict)
        for goal in goals
    ]
    header = ("metric", "value", "goal", "ratio", "")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.rjust(width) if i == 3 else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if row is header:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def machine(*, postgres_url: str | None = None, redis_url: str | None = None) -> dict[str, Any]:
    """The machine, as ``stack.machine`` describes it for every result file."""
    return describe(postgres_url=postgres_url, redis_url=redis_url)


def utc(timestamp: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(timestamp))

    return None


def results_write(
    output: Path,
    *,
    benchmark: str,
    started: float,
    config: Mapping[str, Any],
    results: dict[str, Any],
    host: dict[str, Any],
) -> None:
    """Write a benchmark's JSON document: what ran, where (``host``, taken with ``machine()``
    before the run, so its load average is the neighbours', not the run's), when, with which
    configuration."""
    document = {
        "benchmark": benchmark,
        "started_at": utc(started),
        "finished_at": utc(time.time()),
        "revision": revision(),
        "machine": host,
        "config": config,
        **results,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")

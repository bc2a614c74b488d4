"""The tables of docs/performance.md, docs/chaos.md and docs/design.md, from the result files.

A figure copied into prose by hand goes stale the day the code changes; a table generated
from the result file of a run carries that run's date and machine and changes only with a new
run. ``python -m bench`` writes ``bench/results/<benchmark>.json``, ``python -m chaos`` writes
``chaos/results/<profile>.json``; this module renders them between the docs' marker comments
(``<!-- results:bench:begin -->`` ... ``<!-- results:bench:end -->``, the same for chaos) and
leaves the prose around them alone. ``tests/test_docs.py`` fails when the docs and the files
disagree.

    .venv/bin/python -m scripts.docs_tables          # rewrite the tables
    .venv/bin/python -m scripts.docs_tables --check  # exit 1 if a doc is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench.report import Goal, ratio_text
from stack.machine import summary as machine_summary
from stack.process import ROOT

BENCH_RESULTS = ROOT / "bench" / "results"
CHAOS_RESULTS = ROOT / "chaos" / "results"
# The order of the tables: python -m bench's, then any other benchmark by name.
BENCHMARKS = (
    "webhook_ingest",
    "pipeline",
    "e2e_latency",
    "ack_latency",
    "ingest_load",
    "worker_rss",
)
CHAOS_PROFILES = (
    "full",
    "short",
    "broker-stall",
    "full-rabbitmq",
    "short-rabbitmq",
    "hosts",
    "hosts-short",
    "hosts-short-rabbitmq",
)


def bench_files(key: str = "summary") -> list[Path]:
    """The benchmark result files holding ``key`` (goal rows by default)."""
    files = [p for p in BENCH_RESULTS.glob("*.json") if key in _load(p)]
    order = {name: i for i, name in enumerate(BENCHMARKS)}
    return sorted(files, key=lambda p: (order.get(p.stem, len(order)), p.name))


def chaos_files() -> list[Path]:
    return [p for name in CHAOS_PROFILES if (p := CHAOS_RESULTS / f"{name}.json").exists()]


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def _when(stamp: str) -> str:
    return stamp.replace("T", " ")[:16] + " UTC"  # "2026-11-30T18:17:21Z" -> minutes, UTC


def _caption(path: Path, document: dict[str, Any], what: str) -> str:
    source = path.relative_to(ROOT)
    commit = document.get("revision")
    at = f" at revision `{commit[:7]}`" if commit else ""
    return (
        f"{what}: `{source}`, {_when(document['started_at'])}{at}; "
        f"{machine_summary(document['machine'])}."
    )


def _table(header: Iterable[str], rows: Iterable[Iterable[str]], align: str) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _number(value: float) -> str:
    return f"{value:,}"


def bench_section(path: Path) -> list[str]:
    document = _load(path)
    config = ", ".join(
        f"{key} {value}"
        for key, value in document["config"].items()
        if isinstance(value, str | int | float)
    )
    checks = document.get("checks", {}).get("ok")
    state = {True: "stored state as expected", False: "stored state WRONG", None: ""}[checks]
    incidents = len(document.get("incidents", []))
    lines = [
        _caption(path, document, f"`python -m bench.{document['benchmark']}`"),
        f"Configuration: {config}; {state}; {incidents} broker incident(s).",
        "",
    ]
    goals = [Goal.from_dict(goal) for goal in document["summary"]]
    rows = [
        (
            goal.metric,
            goal.value,
            goal.goal_text(),
            ratio_text(goal),
            goal.verdict if goal.passed else f"**{goal.verdict}**",
        )
        for goal in goals
    ]
    return [*lines, *_table(("metric", "value", "goal", "ratio", ""), rows, "lllrl")]


def dashboard_section(path: Path) -> list[str]:
    """What one render of the operator's dashboard cost, and each probe in it (ms)."""
    document = _load(path)
    rows = document["rows"]
    lines = [
        _caption(path, document, "`python -m bench.dashboard_cost`"),
        f"{_number(rows['invoices'])} invoices, {_number(rows['email_deliveries'])} emails, "
        f"{_number(rows['outbox_messages'])} outbox rows, {_number(rows['dead_letters'])} dead "
        f"letters; {document['config']['renders']} renders.",
        "",
    ]
    measured = [
        ("whole render (HTTP)", document["render_ms"]),
        ("probes, in all", document["probes_ms"]),
        *((f"probe: {name}", figures) for name, figures in document["per_probe_ms"].items()),
    ]
    table = [(label, *(f"{f[q]:.1f}" for q in ("median", "p95", "max"))) for label, f in measured]
    return [*lines, *_table(("ms", "median", "p95", "max"), table, "lrrr")]


def _responses(load: dict[str, Any]) -> str:
    statuses = load["responses_by_status"].items()
    return ", ".join(f"{status} x {_number(n)}" for status, n in statuses)


def _recovery(faults: list[dict[str, Any]]) -> str:
    by_kind: dict[str, list[str]] = {}
    for fault in faults:
        if "skipped" in fault:
            by_kind.setdefault(fault["kind"], []).append("skipped")
        else:
            seconds = fault.get("recovery_seconds")
            by_kind.setdefault(fault["kind"], []).append(
                "not recovered" if seconds is None else f"{seconds}"
            )

    def said(values: list[str]) -> str:
        if len(values) > 1 and len(set(values)) == 1:
            return f"{values[0]} ({len(values)})"
        return ", ".join(values)

    return "; ".join(f"{kind} {said(values)}" for kind, values in by_kind.items())


def _flow(faults: list[dict[str, Any]]) -> str:
    resumed = [f.get("email_flow_resumed") for f in faults if "skipped" not in f]
    seconds = [value for value in resumed if value is not None]
    if not resumed:
        return "-"
    if len(seconds) < len(resumed):
        return "not after every fault"
    return f"within {max(seconds)} s of every fault"


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def chaos_rows(arm: dict[str, Any]) -> list[tuple[str, str]]:
    """One arm's column of the chaos table: (label, figure) per row."""
    load, r = arm["load"], arm["results"]
    kills, dup, letters = r["kills"], r["duplicates"], r["dead_letters"]
    exits = r["unexpected_process_exits"]
    died = ", ".join(f"{e['process']} (exit {e['exit_code']})" for e in exits)
    missed = [name for name, ok in arm["goals"].items() if not ok]
    stalls = r["workers_stalled_with_work_waiting"]
    stalled = ", ".join(f"{s['worker']} for {s['seconds']} s" for s in stalls) or "none"
    acks = sum(r["worker_failed_acks"].values())
    return [
        ("invoices, seed", f"{load['invoices']}, seed {arm['seed']}"),
        ("seconds", f"{arm['duration_seconds']}"),
        (
            "invoices paid (refused recipient)",
            f"{r['invoices_paid']} ({r['invoices_paid_refused_recipient']})",
        ),
        (
            "deliveries (duplicate share), senders",
            f"{_number(load['deliveries'])} ({load['duplicate_share']:.0%}), {load['senders']}; "
            f"{load['invoices_with_both_event_types']} invoices with both event types",
        ),
        ("webhook responses", _responses(load)),
        (
            "emails delivered: invoices / messages",
            f"{r['emails_delivered']['invoices']} / {r['emails_delivered']['messages']}",
        ),
        ("**lost**", f"**{r['lost']}**"),
        (
            "duplicates: extra messages (same Message-ID; all cut by a kill)",
            f"{dup['extra_messages']} ({_yes(dup['all_same_message_id'])}; "
            f"{_yes(dup['all_cut_by_a_kill'])})",
        ),
        (
            "worker kills / inside the window / sends cut",
            f"{kills['worker_kills']} / {kills['worker_kills_inside_crash_window']} / "
            f"{kills['sends_cut_in_window_by_kills']}",
        ),
        (
            "relay kills between publish and mark (rows left unmarked)",
            f"{kills['relay_kills_between_publish_and_mark']} "
            f"({kills['relay_rows_published_unmarked']})",
        ),
        (
            "dead letters (all permanent refusals; refused recipients without one)",
            f"{letters['total']} ({_yes(letters['all_permanent_refusals'])}; "
            f"{len(letters['refused_without_dead_letter'])})",
        ),
        *_hosts_rows(arm),
        ("workers stalled with emails waiting; failed acks", f"{stalled}; {acks}"),
        ("processes that died by themselves", died or "none"),
        ("recovery, seconds", _recovery(arm["faults"])),
        ("email flowing again", _flow(arm["faults"])),
        ("goals", f"all met ({', '.join(arm['goals'])})" if not missed else f"missed: {missed}"),
    ]


def _hosts_rows(arm: dict[str, Any]) -> list[tuple[str, str]]:
    """Across hosts (``chaos --hosts``): the partitions' cut sends, the zombie's, the beats."""
    hosts = arm["results"].get("hosts")
    if hosts is None:
        return []
    cut = sum(len(f.get("sends_cut", [])) for f in arm["faults"] if f["kind"] != "worker_kill")
    zombie = sum(z["sends_after_lease_lapsed"] for z in hosts["zombie_sends"])
    beats = hosts["beats"]
    cuts = beats["beat_host_cuts"]
    takeover = ", ".join(str(c["standby_took_over_after_seconds"]) for c in cuts) or "-"
    after = sum(c["old_leader_dispatches_after_takeover"] for c in cuts)
    return [
        (
            "sends cut by partitions / a cut worker's sends after its lease lapsed",
            f"{cut} / {zombie}",
        ),
        (
            "beat takeover, s / old leader's dispatches after it / slots dispatched twice",
            f"{takeover} / {after} / {len(beats['slots_dispatched_twice'])}",
        ),
    ]


def chaos_section(path: Path) -> list[str]:
    document = _load(path)
    arms = document["arms"]
    lines = [_caption(path, document, f"Profile `{document['profile']}`"), ""]
    columns = [chaos_rows(arm) for arm in arms.values()]
    labels = [label for label, _ in columns[0]]
    rows = [(label, *(column[i][1] for column in columns)) for i, label in enumerate(labels)]
    return [*lines, *_table(("", *arms), rows, "l" * (1 + len(arms)))]


# The reference arms of webhook_ingest and pipeline, in the order of their columns: the version
# a Django team writes from the tutorials, and the floor. A result file without one (a run made
# before the arm existed) leaves its column out, or shows "-" where the other file has it.
REFERENCES = ("tutorial", "floor")
# Per benchmark: the application's arm, its rate as the table calls it (and its decimals), one
# item, and the CPU groups of the stack that item runs through, as the table calls them.
REFERENCE_ROWS = {
    "webhook_ingest": (
        "unique",
        ("webhooks/s", 0),
        "webhook",
        {"gunicorn": "gunicorn", "postgres": "PostgreSQL", "redis": "Redis"},
    ),
    "pipeline": (
        "emails",
        ("emails/s end to end", 1),
        "email",
        {"celery": "worker", "gunicorn": "gunicorn", "postgres": "PostgreSQL", "redis": "Redis"},
    ),
}


def _reference_rows(name: str, document: dict[str, Any]) -> list[tuple[str, int, dict[str, float]]]:
    """(figure, decimals, {column: value}) for the application and each reference arm of one
    run: the rate, the CPU the stack's own processes spent per item (the neighbours' and the
    load generator's left out: the steadier figure on a shared machine), and per group."""
    app, (rate, digits), per, groups = REFERENCE_ROWS[name]
    arms = {"application": app, **{arm: arm for arm in REFERENCES if arm in document["arms"]}}
    figures = {column: document["arms"][arm] for column, arm in arms.items()}
    cpu = {
        column: arm.get("cpu_ms_per_delivery") or arm["cpu_ms_per_item"]
        for column, arm in figures.items()
    }
    return [
        (rate, digits, {column: arm["rate"] for column, arm in figures.items()}),
        (
            f"CPU ms of the stack per {per}",
            2,
            {column: sum(ms[group] for group in groups) for column, ms in cpu.items()},
        ),
        *(
            (f"CPU ms per {per}, {label}", 2, {column: ms[group] for column, ms in cpu.items()})
            for group, label in groups.items()
        ),
    ]


def reference_section() -> list[str]:
    """The application beside its reference arms, from the current runs of ``webhook_ingest``
    and ``pipeline``: each arm's figure, and the application's ÷ each reference arm's (for a
    rate, above 1 is faster; for CPU, below 1 is cheaper)."""
    paths = [p for name in REFERENCE_ROWS if (p := BENCH_RESULTS / f"{name}.json").exists()]
    documents = {path: _load(path) for path in paths}
    rows = [row for path, doc in documents.items() for row in _reference_rows(path.stem, doc)]
    if not rows:
        return []
    references = [arm for arm in REFERENCES if any(arm in values for *_, values in rows)]
    columns = ["application", *references]
    table = [
        (
            label,
            *(f"{values[c]:.{digits}f}" if c in values else "-" for c in columns),
            *(
                f"{values['application'] / values[arm]:.2f}" if arm in values else "-"
                for arm in references
            ),
        )
        for label, digits, values in rows
    ]
    header = ("figure", *columns, *(f"application ÷ {arm}" for arm in references))
    captions = [
        "- " + _caption(path, document, f"`python -m bench.{document['benchmark']}`")
        for path, document in documents.items()
    ]
    return [*captions, "", *_table(header, table, "l" + "r" * (len(header) - 1))]


def brokers_section(path: Path) -> list[str]:
    """Redis and RabbitMQ as the broker, from one run of ``python -m bench.brokers``."""
    document = _load(path)
    arms = document["arms"]
    config = document["config"]
    checks = document["checks"]["ok"]
    lines = [
        _caption(path, document, "`python -m bench.brokers`"),
        f"gunicorn {config['gunicorn']}; {config['workers']}; {config['senders']} HTTP senders; "
        f"{config['rounds']} round(s) of {config['emails_per_arm']} emails per broker, "
        f"interleaved; {'stored state as expected' if checks else 'stored state WRONG'}.",
        "",
    ]
    groups = (
        ("gunicorn", "gunicorn"),
        ("celery", "worker"),
        ("postgres", "PostgreSQL"),
        ("redis", "Redis"),
        ("rabbitmq", "RabbitMQ"),
    )
    rows = [
        (
            broker,
            f"{arm['rate']:.1f}",
            f"{arm['submit_rate']:.1f}",
            *(f"{arm['cpu_ms_per_item'][group]:.2f}" for group, _ in groups),
        )
        for broker, arm in arms.items()
    ]
    redis, rabbit = arms["redis"], arms["rabbitmq"]
    rows.append(
        (
            "RabbitMQ ÷ Redis",
            f"{rabbit['rate'] / redis['rate']:.2f}",
            f"{rabbit['submit_rate'] / redis['submit_rate']:.2f}",
            *(
                f"{rabbit['cpu_ms_per_item'][g] / redis['cpu_ms_per_item'][g]:.2f}"
                if g not in ("redis", "rabbitmq")
                else ""
                for g, _ in groups
            ),
        )
    )
    header = ("broker", "emails/s", "webhooks/s", *(f"CPU ms/email: {name}" for _, name in groups))
    return [*lines, *_table(header, rows, "lrrrrrrr")]


def brokers_files() -> list[Path]:
    return [p for p in [BENCH_RESULTS / "brokers.json"] if p.exists()]


GENERATED = "<!-- generated by `python -m scripts.docs_tables` from the result files -->"


def block(sections: list[list[str]]) -> str:
    body = "\n\n".join("\n".join(section) for section in sections)
    return f"{GENERATED}\n\n{body or '(no result file yet)'}\n"


PERFORMANCE, CHAOS = ROOT / "docs" / "performance.md", ROOT / "docs" / "chaos.md"
DESIGN = ROOT / "docs" / "design.md"
# Each doc's blocks: the name in its markers, and what renders it.
DOCS: dict[Path, dict[str, Callable[[], str]]] = {
    PERFORMANCE: {
        "bench": lambda: block([bench_section(p) for p in bench_files()]),
        "dashboard": lambda: block([dashboard_section(p) for p in bench_files("render_ms")]),
        # The application beside its reference arms (the tutorial's, the floor).
        "floor": lambda: block([reference_section()]),
    },
    CHAOS: {"chaos": lambda: block([chaos_section(p) for p in chaos_files()])},
    DESIGN: {"brokers": lambda: block([brokers_section(p) for p in brokers_files()])},
}


def rendered(text: str, blocks: dict[str, Callable[[], str]]) -> str:
    """``text`` with each block between its markers generated anew."""
    for name, render in blocks.items():
        pattern = re.compile(
            rf"(<!-- results:{name}:begin -->\n).*?(<!-- results:{name}:end -->)", re.DOTALL
        )
        found = pattern.search(text)
        if found is None:
            raise ValueError(f"no <!-- results:{name}:begin/end --> markers")
        text = text[: found.end(1)] + render() + text[found.start(2) :]
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.docs_tables")
    parser.add_argument("--check", action="store_true", help="exit 1 if a doc is out of date")
    args = parser.parse_args(argv)
    stale = []
    for doc, blocks in DOCS.items():
        text = doc.read_text()
        new = rendered(text, blocks)
        if new != text:
            stale.append(str(doc.relative_to(ROOT)))
            if not args.check:
                doc.write_text(new)
    verb = "out of date" if args.check else "rewritten"
    print(f"{verb}: {', '.join(stale)}" if stale else "docs in sync with the result files")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

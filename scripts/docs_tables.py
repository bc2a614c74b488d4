"""The tables and plots of the docs (docs/explanation/performance.md, docs/explanation/chaos.md,
docs/explanation/choosing-a-broker.md), from the result files.

A figure copied into prose by hand goes stale the day the code changes; a table generated
from the result file of a run carries that run's date and machine and changes only with a new
run. ``python -m bench`` writes ``bench/results/<benchmark>.json``, ``python -m chaos`` writes
``chaos/results/<profile>.json``; this module renders them between the docs' marker comments
(``<!-- results:bench:begin -->`` ... ``<!-- results:bench:end -->``, the same for chaos) and
leaves the prose around them alone. ``tests/test_docs.py`` fails when the docs and the files
disagree.

The same files are drawn as the plots in ``docs/plots/`` (matplotlib, Agg backend): the
webhook acknowledgement's latency, the worker's memory over 10,000 emails, the two brokers
side by side, the same django.tasks work on every backend, and the full chaos runs as
timelines.

    .venv/bin/python -m scripts.docs_tables          # rewrite the tables, redraw the plots
    .venv/bin/python -m scripts.docs_tables --check  # exit 1 if a doc is out of date
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
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
    "peers",
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


# The process groups of bench.brokers' CPU figures, and how the docs name them.
BROKER_CPU_GROUPS = (
    ("gunicorn", "gunicorn"),
    ("celery", "worker"),
    ("postgres", "PostgreSQL"),
    ("redis", "Redis"),
    ("rabbitmq", "RabbitMQ"),
)


def bench_files(key: str = "summary") -> list[Path]:
    """The benchmark result files holding ``key`` (goal rows by default)."""
    files = [p for p in BENCH_RESULTS.glob("*.json") if _load(p).get(key)]
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
    groups = BROKER_CPU_GROUPS
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


# The process groups of bench.peers' CPU figures, and how the docs name them.
PEERS_CPU_GROUPS = (
    ("workers", "workers"),
    ("postgres", "PostgreSQL"),
    ("redis", "Redis"),
    ("rabbitmq", "RabbitMQ"),
)


def peers_section(path: Path) -> list[str]:
    """Every backend's figures from one run of ``python -m bench.peers`` (the medians of its
    rounds; lost and run twice summed over them)."""
    document = _load(path)
    config = document["config"]
    versions = ", ".join(f"{name} {version}" for name, version in document["versions"].items())
    lines = [
        _caption(path, document, "`python -m bench.peers`"),
        f"{config['rounds']} round(s), arms interleaved; {config['tasks']:,} no-op tasks and "
        f"{config['emails']:,} emails per burn-down; latency paced at half each arm's drain "
        f"rate for {config['latency_seconds']:g} s; kill -9 halfway through "
        f"{config['kill_seconds']:g} s of {config['kill_hold_seconds'] * 1000:g} ms tasks, "
        f"lost: not run {_settles(config['settle_seconds'])} after it; {config['celery_worker']}, "
        f"{config['db_worker']}, {config['procrastinate']}. Versions: {versions}.",
        "",
    ]
    rows = [
        (
            name,
            "yes" if name not in ("fennel", "tutorial") else "no",
            f"{arm['enqueue_rate']:.0f}",
            f"{arm['drain_rate']:.0f}",
            f"{arm['drain_rate_per_core']:.0f}",
            f"{arm['email_rate']:.1f}",
            f"{arm['p50_ms']:.0f}",
            f"{arm['p99_ms']:.0f}",
            f"{arm['lost']}",
            f"{arm['twice']}",
            _slowest(arm),
            *(f"{arm['cpu_ms_per_task'][group]:.2f}" for group, _ in PEERS_CPU_GROUPS),
            f"{arm['transactions_per_task']:.1f}",
        )
        for name, arm in document["arms"].items()
    ]
    header = (
        "arm",
        "enqueue in the transaction",
        "enqueues/s",
        "drained/s",
        "drained/s per core",
        "emails/s",
        "p50 ms",
        "p99 ms",
        "lost",
        "run twice",
        "slowest start after the kill",
        *(f"CPU ms/task: {label}" for _, label in PEERS_CPU_GROUPS),
        "transactions/task",
    )
    enqueue_groups = (("client", "client"), *PEERS_CPU_GROUPS[1:])
    enqueue_rows = [
        (
            name,
            *(f"{arm['enqueue_cpu_ms_per_task'][group]:.2f}" for group, _ in enqueue_groups),
            f"{arm['enqueue_transactions_per_task']:.1f}",
        )
        for name, arm in document["arms"].items()
    ]
    enqueue_header = (
        "arm",
        *(f"CPU ms/enqueue: {label}" for _, label in enqueue_groups),
        "transactions/enqueue",
    )
    return [
        *lines,
        *_table(header, rows, "ll" + "r" * (len(header) - 2)),
        "",
        "What one enqueue (its transaction included) costs, from the same runs:",
        "",
        *_table(enqueue_header, enqueue_rows, "l" + "r" * (len(enqueue_header) - 1)),
    ]


def _slowest(arm: dict[str, Any]) -> str:
    """The longest a task of the kill's load waited to start (a result file without it: "-")."""
    return f"{arm['slowest_start_s']:.1f} s" if "slowest_start_s" in arm else "-"


# The figures of a lever against the arm as configured (bench.peers --levers): higher is better
# for the rates, lower for the latency.
LEVER_RATIOS = (
    ("drain_rate", "drained/s"),
    ("email_rate", "emails/s"),
    ("enqueue_rate", "enqueues/s"),
    ("p99_ms", "p99 ms"),
)


def levers_section(path: Path) -> list[str]:
    """Each plain lever against asyncwork on Redis as configured, from one run of
    ``python -m bench.peers --levers``: its figures and their ratio to the reference arm's."""
    document = _load(path)
    arms = document["arms"]
    reference = arms["asyncwork-redis"]
    rows = []
    for name, arm in arms.items():
        cells = [name]
        for key, _ in LEVER_RATIOS:
            figure = f"{arm[key]:.0f}"
            cells.append(
                figure if arm is reference else f"{figure} ({arm[key] / reference[key]:.2f}x)"
            )
        cells += [
            f"{arm['cpu_ms_per_task']['workers']:.2f}",
            f"{arm['cpu_ms_per_task']['postgres']:.2f}",
            f"{arm['transactions_per_task']:.1f}",
            f"{arm['lost']}",
            f"{arm['twice']}",
            _slowest(arm),
        ]
        rows.append(cells)
    header = (
        "arm",
        *(label for _, label in LEVER_RATIOS),
        "CPU ms/task: workers",
        "CPU ms/task: PostgreSQL",
        "transactions/task",
        "lost",
        "run twice",
        "slowest start after the kill",
    )
    caption = _caption(path, document, "`python -m bench.peers --levers`")
    config = document["config"]
    return [
        caption,
        f"{config['rounds']} round(s), arms interleaved; {config['tasks']:,} no-op tasks and "
        f"{config['emails']:,} emails per burn-down; ratios to `asyncwork-redis` of the same run "
        "(better: above 1 for a rate, below 1 for p99).",
        "",
        *_table(header, rows, "l" + "r" * (len(header) - 1)),
    ]


def levers_files() -> list[Path]:
    return [p for p in [BENCH_RESULTS / "peers_levers.json"] if p.exists()]


def _settles(seconds: dict[str, float]) -> str:
    """ "300 s (asyncwork-redis), 30 s (the others)": each arm's wait after the kill."""
    by_wait: dict[float, list[str]] = {}
    for arm, wait in seconds.items():
        by_wait.setdefault(wait, []).append(arm)
    common = max(by_wait, key=lambda wait: len(by_wait[wait]))
    parts = [f"{wait:g} s ({', '.join(arms)})" for wait, arms in by_wait.items() if wait != common]
    return ", ".join([*parts, f"{common:g} s ({'the others' if parts else 'every arm'})"])


def peers_sentence(path: Path) -> list[str]:
    """The package README's line of the same run: each backend's figures in words."""
    document = _load(path)
    config, arms = document["config"], document["arms"]

    def figures(key: str, unit: str = "", digits: int = 0) -> str:
        def of(name: str) -> str:
            return f"{arms[name][key]:,.{digits}f}{unit}"

        return (
            f"asyncwork {of('asyncwork-redis')} (Redis) and {of('asyncwork-rabbitmq')} (RabbitMQ), "
            f"django-tasks-db {of('django-tasks-db')}, procrastinate {of('procrastinate')} "
            f"({of('procrastinate-unprepared')} without prepared statements), "
            f"django-tasks-fennel {of('fennel')}, `delay_on_commit` {of('tutorial')}"
        )

    slowest = max(arms[n]["slowest_start_s"] for n in ("asyncwork-redis", "asyncwork-rabbitmq"))
    text = (
        f"Measured here, the same task bodies through Django's task API on each (the repository's "
        f"`bench/peers.py`: the median of {config['rounds']} interleaved rounds of "
        f"{config['tasks']:,} no-op tasks and {config['emails']:,} emails on "
        f"{document['machine']['nproc']} vCPUs, whose rates move by tens of percent from round "
        f"to round; the run's date and machine in its `docs/explanation/performance.md`): "
        f"drained per second, {figures('drain_rate')}; emails per second, "
        f"{figures('email_rate')}; enqueues per second inside a transaction (asyncwork's: the job "
        f"row, then the publish and its published mark), {figures('enqueue_rate')}; "
        f"enqueue-to-start p99 at half each one's drain rate, {figures('p99_ms', ' ms')}; tasks "
        f"a worker's `kill -9` left unrun over the rounds (not run "
        f"{_settles(config['settle_seconds'])} after it), {figures('lost')}; asyncwork ran the "
        f"killed worker's tasks within {slowest:.1f} s."
    )
    return textwrap.wrap(text, width=99, break_long_words=False, break_on_hyphens=False)


def peers_files() -> list[Path]:
    return [p for p in [BENCH_RESULTS / "peers.json"] if p.exists()]


PLOTS = ROOT / "docs" / "plots"
# Recovery is timed from the fault's start for these kinds, from its end for the others
# (each result file's "definitions" say so).
RECOVERY_FROM_START = {"worker_kill", "relay_kill", "worker_host_cut", "worker_db_cut"}
RECOVERY_FROM_START |= {"beat_host_cut"}


def _figure(width: float = 7.5, height: float = 3.6) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    pyplot.rcParams.update({"font.size": 9, "axes.spines.top": False, "axes.spines.right": False})
    return pyplot.figure(figsize=(width, height), dpi=100)


def _save(figure: Any, name: str, source: str) -> Path:
    figure.text(0.99, 0.01, source, ha="right", va="bottom", fontsize=7, color="0.4")
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    PLOTS.mkdir(exist_ok=True)
    path = PLOTS / name
    figure.savefig(path, format="png", metadata={"Software": None})
    from matplotlib import pyplot

    pyplot.close(figure)
    return path


def _source(path: Path, document: dict[str, Any]) -> str:
    commit = document.get("revision")
    at = f" at {commit[:7]}" if commit else ""
    return f"{path.relative_to(ROOT)}, {_when(document['started_at'])}{at}"


def plot_ack_latency(path: Path) -> Path:
    """The webhook's acknowledgement latency by percentile, an instant and a 5 s SMTP server.
    The result file keeps percentiles, not every request, so the curve is drawn through them."""
    document = _load(path)
    points = (("p50", "p50_ms"), ("p99", "p99_ms"), ("p99.9", "p99_9_ms"), ("max", "max_ms"))
    figure = _figure()
    axes = figure.add_subplot()
    for i, (arm, figures) in enumerate(document["arms"].items()):
        label = f"{arm} SMTP ({figures['requests']:,} requests)"
        values = [figures[key] for _, key in points]
        axes.plot([p for p, _ in points], values, "o-", label=label)
        for x, value in enumerate(values):
            offset = (6, 4) if i else (6, -11)
            axes.annotate(f"{value:.1f}", (x, value), textcoords="offset points", xytext=offset)
    axes.set_ylim(bottom=0)
    axes.set_ylabel("ms from due to 200")
    config = document["config"]
    axes.set_title(
        f"Webhook acknowledgement latency at {config['rate']}/s, "
        f"SMTP instant vs {config['slow_smtp_delay_s']:g} s per message"
    )
    axes.legend()
    axes.grid(axis="y", alpha=0.3)
    return _save(figure, "ack_latency.png", _source(path, document))


def plot_worker_rss(path: Path) -> Path:
    """The worker's memory (main process and pool, summed) against the emails it has sent."""
    document = _load(path)
    trace = document["trace"]
    emails = [point["emails"] for point in trace]
    figure = _figure()
    axes = figure.add_subplot()
    axes.plot(emails, [point["rss_kib"] / 1024 for point in trace], label="RSS, summed")
    axes.plot(emails, [point["pss_kib"] / 1024 for point in trace], label="PSS, summed")
    baseline = document["config"]["baseline"]
    axes.axvline(baseline, color="0.5", linestyle=":", label=f"{baseline:,} emails")
    axes.set_xlabel("emails sent")
    axes.set_ylabel("MiB")
    axes.set_ylim(bottom=0)
    axes.set_title(f"Celery worker memory over {document['config']['emails']:,} emails")
    axes.legend(loc="lower right")
    axes.grid(alpha=0.3)
    return _save(figure, "worker_rss.png", _source(path, document))


def plot_brokers(path: Path) -> Path:
    """Redis and RabbitMQ from one run: rates, and CPU per email by process kind."""
    document = _load(path)
    arms = document["arms"]
    figure = _figure(height=3.4)
    rates, cpu = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    brokers = list(arms)
    for i, (key, label) in enumerate((("rate", "emails/s"), ("submit_rate", "webhooks/s"))):
        xs = [b + i * 0.4 for b in range(len(brokers))]
        bars = rates.bar(xs, [arms[b][key] for b in brokers], width=0.4, label=label)
        rates.bar_label(bars, fmt="%.0f", fontsize=8)
    rates.set_xticks([b + 0.2 for b in range(len(brokers))], brokers)
    rates.set_title("throughput, one run, interleaved")
    rates.set_ylim(top=rates.get_ylim()[1] * 1.3)
    rates.legend(loc="upper right", ncols=2)
    groups = BROKER_CPU_GROUPS
    bottoms = [0.0] * len(brokers)
    for group, label in groups:
        values = [arms[b]["cpu_ms_per_item"][group] for b in brokers]
        cpu.bar(brokers, values, bottom=bottoms, label=label, width=0.5)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    cpu.set_ylabel("CPU ms per email")
    cpu.set_title("where the CPU goes")
    cpu.set_xlim(-0.5, len(brokers) + 0.6)
    cpu.legend(fontsize=7, loc="center right")
    return _save(figure, "brokers.png", _source(path, document))


def plot_peers(path: Path) -> Path:
    """Every backend from one run: tasks and emails drained per second, and p99 latency."""
    document = _load(path)
    arms = document["arms"]
    names = list(arms)
    figure = _figure(width=9.0, height=3.6)
    rates, tails = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    for i, (key, label) in enumerate((("drain_rate", "no-ops/s"), ("email_rate", "emails/s"))):
        xs = [a + i * 0.4 for a in range(len(names))]
        bars = rates.bar(xs, [arms[a][key] for a in names], width=0.4, label=label)
        rates.bar_label(bars, fmt="%.0f", fontsize=7)
    rates.set_xticks([a + 0.2 for a in range(len(names))], names, rotation=30, ha="right")
    rates.set_title("drained per second (burn-down)")
    rates.legend(fontsize=8)
    bars = tails.bar(names, [arms[a]["p99_ms"] for a in names], width=0.5, color="C2")
    tails.bar_label(bars, fmt="%.0f", fontsize=7)
    tails.set_xticks(range(len(names)), names, rotation=30, ha="right")
    tails.set_ylabel("ms")
    tails.set_title("p99 enqueue to start, at half each drain rate")
    return _save(figure, "peers.png", _source(path, document))


def plot_chaos(path: Path) -> Path:
    """One chaos run's safe arm as a timeline: above, the emails waiting each second; below,
    each fault (its span), its recovery, when email flowed again, and the load's span."""
    document = _load(path)
    arm = document["arms"]["safe"]
    faults = [f for f in arm["faults"] if "skipped" not in f]
    figure = _figure(height=0.32 * len(faults) + 3.2)
    waiting, axes = figure.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [1.8, 0.32 * len(faults) + 0.6]}
    )
    end = arm["duration_seconds"]
    series = arm["series"]
    waiting.plot(series["seconds"], series["emails_waiting"], color="tab:blue", linewidth=1)
    waiting.set_ylabel("emails waiting")
    for fault in faults:
        waiting.axvspan(fault["at"], max(fault["ended"], fault["at"] + 0.6), color="tab:red")
    axes.axvspan(0, arm["load"]["seconds"], color="0.93", zorder=0)
    axes.text(1, len(faults) - 0.4, "load running", fontsize=7, color="0.4", va="top")
    for row, fault in enumerate(faults):
        y = len(faults) - 1 - row
        start, stop = fault["at"], max(fault["ended"], fault["at"] + 0.6)
        axes.barh(y, stop - start, left=start, height=0.6, color="tab:red")
        origin = fault["at"] if fault["kind"] in RECOVERY_FROM_START else fault["ended"]
        seconds = fault.get("recovery_seconds")
        if seconds is None:
            axes.barh(y, end - origin, left=origin, height=0.25, color="0.6", hatch="//")
            axes.text(end, y, " not recovered", va="center", fontsize=7)
        else:
            axes.barh(y, seconds, left=origin, height=0.25, color="tab:green")
            axes.text(origin + seconds, y, f" {seconds:g} s", va="center", fontsize=7)
        resumed = fault.get("email_flow_resumed")
        if resumed is not None:
            axes.plot(fault["ended"] + resumed, y, "|", color="black", markersize=8)
    axes.set_yticks(range(len(faults)), [f["kind"] for f in reversed(faults)])
    axes.set_xlim(0, end)
    axes.set_xlabel("seconds from the start of the arm")
    waiting.set_title(
        f"Chaos profile {document['profile']} on {arm['broker']}, safe arm: "
        f"lost {arm['results']['lost']}\n"
        "red: the fault; green: until recovered; |: email flowing again",
        fontsize=9,
    )
    return _save(figure, f"chaos_{document['profile']}.png", _source(path, document))


# Each plot: the result file it is drawn from, and what draws it.
PLOT_SOURCES: tuple[tuple[Path, Callable[[Path], Path]], ...] = (
    (BENCH_RESULTS / "ack_latency.json", plot_ack_latency),
    (BENCH_RESULTS / "worker_rss.json", plot_worker_rss),
    (BENCH_RESULTS / "brokers.json", plot_brokers),
    (BENCH_RESULTS / "peers.json", plot_peers),
    (CHAOS_RESULTS / "full.json", plot_chaos),
    (CHAOS_RESULTS / "full-rabbitmq.json", plot_chaos),
)


def plots_draw() -> list[Path]:
    return [draw(source) for source, draw in PLOT_SOURCES if source.exists()]


GENERATED = "<!-- generated by `python -m scripts.docs_tables` from the result files -->"


def block(sections: list[list[str]]) -> str:
    body = "\n\n".join("\n".join(section) for section in sections)
    return f"{GENERATED}\n\n{body or '(no result file yet)'}\n"


EXPLANATION = ROOT / "docs" / "explanation"
PERFORMANCE, CHAOS = EXPLANATION / "performance.md", EXPLANATION / "chaos.md"
BROKERS = EXPLANATION / "choosing-a-broker.md"
PACKAGE_README = ROOT / "packages" / "asyncwork" / "README.md"
# Each doc's blocks: the name in its markers, and what renders it.
DOCS: dict[Path, dict[str, Callable[[], str]]] = {
    PERFORMANCE: {
        "bench": lambda: block([bench_section(p) for p in bench_files()]),
        "dashboard": lambda: block([dashboard_section(p) for p in bench_files("render_ms")]),
        # The application beside its reference arms (the tutorial's, the floor).
        "floor": lambda: block([reference_section()]),
        "peers": lambda: block([peers_section(p) for p in peers_files()]),
        "peers-levers": lambda: block([levers_section(p) for p in levers_files()]),
    },
    CHAOS: {"chaos": lambda: block([chaos_section(p) for p in chaos_files()])},
    BROKERS: {"brokers": lambda: block([brokers_section(p) for p in brokers_files()])},
    PACKAGE_README: {"peers": lambda: block([peers_sentence(p) for p in peers_files()])},
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
    if not args.check:
        drawn = plots_draw()
        print(f"drew {len(drawn)} plot(s) in {PLOTS.relative_to(ROOT)}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())

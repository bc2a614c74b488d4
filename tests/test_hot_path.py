"""The hot path as docs/explanation/hot-path.md shows it is what one paid invoice runs: the
measurement of ``scripts.hot_path`` (two paid invoices through gunicorn, a Celery worker and a
real SMTP server, the second one's lines) against the doc's generated table, module by module
and each module's lines in each process, with no tolerance: the counts are the same from run to
run. One paid invoice runs at most 15 first-party modules.

Also here: the one Celery task name every job's message carries is declared once, and no task
is named by a string."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts import hot_path

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def measured() -> hot_path.Measurement:
    return hot_path.measure()


def documented() -> dict[str, dict[str, int]]:
    """The doc's table: module -> process -> lines run there."""
    found: dict[str, dict[str, int]] = {}
    for row in hot_path.block(hot_path.DOC.read_text()).splitlines():
        if not row.startswith("| `"):
            continue
        module, *cells = (cell.strip() for cell in row.strip("|").split("|"))
        counts = zip(hot_path.PROCESSES, cells[: len(hot_path.PROCESSES)], strict=True)
        found[module.strip("`")] = {process: int(cell) for process, cell in counts if cell}
    return found


@pytest.mark.slow
def test_the_doc_lists_each_module_and_its_lines_one_paid_invoice_runs_in_each_process(
    measured: hot_path.Measurement,
) -> None:
    # A module imported on the way would be one the first invoice did not warm.
    assert measured.imported == []
    assert documented() == measured.counts(), "python -m scripts.hot_path rewrites the doc"
    assert list(documented()) == measured.modules()


@pytest.mark.slow
def test_one_paid_invoice_runs_at_most_fifteen_first_party_modules(
    measured: hot_path.Measurement,
) -> None:
    assert len(measured.modules()) <= hot_path.LIMIT, measured.modules()


def test_the_one_name_on_the_wire_is_declared_once_and_no_task_is_named_by_a_string() -> None:
    """Pass the thing, not its name: a task is enqueued as the object (its module path is its
    name), and the one Celery task name every job's message carries is a constant of its own."""
    apps = ("core", "packages/asyncwork/asyncwork", "invoicing", "webhooks")
    sources = {
        str(path.relative_to(ROOT)): path.read_text()
        for app in apps
        for path in (ROOT / app).rglob("*.py")
        if "migrations" not in path.parts
    }
    assert [path for path, text in sources.items() if '"asyncwork.run"' in text] == [
        "packages/asyncwork/asyncwork/backend.py"
    ]
    assert [path for path, text in sources.items() if '"invoicing.tasks.' in text] == []

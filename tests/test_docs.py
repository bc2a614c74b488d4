"""The docs stay true: every variable the settings or the edge read is in
docs/configuration.md, and every variable documented there is read by one of them; the
benchmark and chaos tables are what the result files of real runs say, with their date and
machine."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from stack.nginx import setting_names
from stack.process import ROOT

# Read by a library rather than by our settings (prometheus-client's multiprocess mode).
READ_BY_LIBRARIES = {"PROMETHEUS_MULTIPROC_DIR"}


def settings_variables() -> set[str]:
    text = (ROOT / "core" / "settings.py").read_text()
    read = re.findall(r"env(?:\.\w+)?\(\s*\"([A-Z][A-Z0-9_]+)\"", text)
    secrets = re.findall(r"_secret\(\s*\"([A-Z][A-Z0-9_]+)\"", text)
    return set(read) | set(secrets)


def edge_variables() -> set[str]:
    return set(setting_names())  # what deploy/nginx/render.sh reads


def documented_variables() -> set[str]:
    text = (ROOT / "docs" / "configuration.md").read_text()
    first_cells = re.findall(r"^\| ([^|]+) \|", text, re.MULTILINE)
    return {name for cell in first_cells for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", cell)}


def test_every_variable_read_is_documented_and_every_documented_one_is_read() -> None:
    read = settings_variables() | edge_variables() | READ_BY_LIBRARIES
    documented = documented_variables()
    assert {"DJANGO_SECRET_KEY", "STRIPE_WEBHOOK_SECRET", "WEBHOOK_ALLOWED_SOURCES"} <= read
    assert sorted(read - documented) == [], "read but not in docs/configuration.md"
    assert sorted(documented - read) == [], "in docs/configuration.md but read by nothing"


# The tables of docs/performance.md and docs/chaos.md are generated from the result files of
# real runs by scripts/docs_tables.py, run here as a user runs it.
CHAOS = [ROOT / "chaos" / "results" / f"{name}.json" for name in ("full", "short", "broker-stall")]
RESULT_FILES = [*(ROOT / "bench" / "results").glob("*.json"), *(p for p in CHAOS if p.exists())]
PERFORMANCE, CHAOS_DOC = ROOT / "docs" / "performance.md", ROOT / "docs" / "chaos.md"
BLOCKS = {"bench": PERFORMANCE, "dashboard": PERFORMANCE, "floor": PERFORMANCE, "chaos": CHAOS_DOC}


def test_generated_tables_in_the_docs_are_what_the_result_files_make() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "scripts.docs_tables", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # "out of date: <doc>": regenerate with python -m scripts.docs_tables
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_result_file_names_its_date_and_machine() -> None:
    assert RESULT_FILES, "no result file: the docs' tables would be empty"
    for path in RESULT_FILES:
        document = json.loads(path.read_text())
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", document["started_at"]), path
        machine = document["machine"]
        for part in ("nproc", "cpu_model", "memory_gib", "python", "postgres", "redis"):
            assert machine.get(part) not in (None, "", "unknown"), (path, part)


def test_each_generated_block_has_one_pair_of_markers() -> None:
    for name, doc in BLOCKS.items():
        text = doc.read_text()
        assert text.count(f"<!-- results:{name}:begin -->") == 1, doc
        assert text.count(f"<!-- results:{name}:end -->") == 1, doc

"""The docs stay true: the benchmark and chaos tables are what the result files of real runs
say, with their date and machine (docs/configuration.md: tests/core/test_configuration_doc.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from stack.process import ROOT

# The tables of docs/performance.md and docs/chaos.md are generated from the result files of
# real runs by scripts/docs_tables.py, run here as a user runs it.
CHAOS = [ROOT / "chaos" / "results" / f"{name}.json" for name in ("full", "short", "broker-stall")]
RESULT_FILES = [*(ROOT / "bench" / "results").glob("*.json"), *(p for p in CHAOS if p.exists())]
PERFORMANCE, CHAOS_DOC = ROOT / "docs" / "performance.md", ROOT / "docs" / "chaos.md"
BLOCKS = {
    "bench": PERFORMANCE,
    "dashboard": PERFORMANCE,
    "floor": PERFORMANCE,
    "peers": PERFORMANCE,
    "chaos": CHAOS_DOC,
}


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

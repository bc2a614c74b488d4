"""The docs stay true: the benchmark and chaos tables are what the result files of real runs
say, with their date and machine (docs/reference/settings.md:
tests/core/test_configuration_doc.py); every relative link resolves, to a file and a heading;
docs/ holds the four kinds of page (Diataxis) and nothing else; the README says how many
test processes `make test` runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from stack.process import ROOT

# The tables of docs/explanation/performance.md and docs/explanation/chaos.md are generated
# from the result files of real runs by scripts/docs_tables.py, run here as a user runs it.
CHAOS = [ROOT / "chaos" / "results" / f"{name}.json" for name in ("full", "short", "broker-stall")]
RESULT_FILES = [*(ROOT / "bench" / "results").glob("*.json"), *(p for p in CHAOS if p.exists())]
PERFORMANCE = ROOT / "docs" / "explanation" / "performance.md"
CHAOS_DOC = ROOT / "docs" / "explanation" / "chaos.md"
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


# The Markdown a reader follows links through.
LINKED = [
    ROOT / "README.md",
    ROOT / "SECURITY.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    ROOT / "chaos" / "README.md",
    ROOT / "bench" / "README.md",
    ROOT / "packages" / "asyncwork" / "README.md",
]
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^ *(```|~~~).*?^ *\1", re.M | re.S)  # a fence, indented in a list too
CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
# docs/ holds a tutorial, how-to guides, reference and explanation, and the generated images.
DOCS_ENTRIES = {
    "README.md",
    "tutorial.md",
    "how-to",
    "reference",
    "explanation",
    "plots",
    "screenshots",
}


def prose(text: str) -> str:
    """``text`` without its code blocks and code spans, where a link is only text."""
    return CODE.sub("", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives ``path``'s headings: lower case, punctuation dropped (hyphens and
    underscores kept), spaces as hyphens; a repeated one gets ``-1``, ``-2`` ..."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(f"{slug}-{count}" if count else slug)
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no such heading")
    return broken


def test_every_relative_link_in_the_docs_resolves_to_a_file_and_heading() -> None:
    broken = {
        str(path.relative_to(ROOT)): found for path in LINKED if (found := broken_links(path))
    }
    assert not broken


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## A `code` heading, with punctuation!\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-code-heading-with-punctuation) [self](#page)\n"
        "[gone](missing.md) [no heading](other.md#nothing) [web](https://example.com/x.md)\n"
        "```\n[in code](missing-too.md)\n```\n"
        "- a list:\n\n  ```\n  [indented](gone-too.md)\n  ```\n"
    )
    assert broken_links(page) == ["missing.md: no such file", "other.md#nothing: no such heading"]


def test_docs_holds_only_the_four_kinds_of_page() -> None:
    entries = {entry.name for entry in (ROOT / "docs").iterdir()}
    assert entries <= DOCS_ENTRIES, sorted(entries - DOCS_ENTRIES)


def test_the_readme_says_how_many_test_processes_make_test_runs() -> None:
    (said,) = re.findall(r"the tests \(pytest, (\d+) processes\)", (ROOT / "README.md").read_text())
    makefile = (ROOT / "Makefile").read_text()
    (run,) = re.findall(r"^PYTEST_PROCESSES := -n (\d+) ", makefile, re.M)
    assert said == run

"""The code blocks of a Markdown page, and what a test does with each (tests/test_docs_run.py).

A block says what it is with an HTML comment on the line before its fence (not rendered):

* ``<!-- from: PATH -->``: an excerpt of the project file PATH. Its lines appear in that file
  one after the other, the same after both are dedented (``quoted``).
* ``<!-- example: PATH -->``: a Python file to copy, at PATH of the application (a new module,
  or the end of an existing one: the file as it is, then the block). Written into a tree laid
  over the application's packages (``tests/helpers/docs_overlay.py``) and imported.
* ``<!-- test: PATH -->``: a test module to copy, run with pytest against a database of its
  own, with the page's examples in place.

A ``console`` block is commands, each after ``$ `` (a line ending in ``\\`` goes on), each
followed by the output it shows, if any. A shown line matches a line of the output after both
are ``normalised``; ``...`` in it stands for any text.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from stack.process import ROOT

_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>[\w-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>from|example|test):\s*(?P<target>\S+)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence, from 1
    language: str
    kind: str  # "from", "example", "test", or "" (a console block, or unmarked)
    target: str  # the PATH the marker names
    text: str  # dedented to the fence

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """Every fenced block of ``doc``, in order."""
    lines = doc.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent = opening["indent"]
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        body = [line.removeprefix(indent) for line in lines[i + 1 : end]]
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(previous)
        found.append(
            Block(
                doc=doc,
                line=i + 1,
                language=opening["language"],
                kind=marker["kind"] if marker else "",
                target=marker["target"] if marker else "",
                text="\n".join(body) + "\n",
            )
        )
        i = end + 1
    return found


def quoted(block: Block) -> bool:
    """Whether the block's lines appear, one after the other, in the file it names, the same
    once both are dedented (an excerpt may start inside a function)."""
    wanted = textwrap.dedent(block.text).rstrip("\n").split("\n")
    source = (ROOT / block.target).read_text().split("\n")
    for start in range(len(source) - len(wanted) + 1):
        window = "\n".join(source[start : start + len(wanted)])
        if textwrap.dedent(window).split("\n") == wanted:
            return True
    return False


@dataclass
class Command:
    line: int  # in the page
    text: str  # as a shell reads it (continuation lines joined)
    shown: list[str] = field(default_factory=list)


def commands(block: Block) -> list[Command]:
    """The commands of a ``console`` block, with the output each shows."""
    assert block.language == "console", f"{block.where}: a block of commands is `console`"
    found: list[Command] = []
    going_on = False
    for offset, line in enumerate(block.text.splitlines(), start=1):
        if going_on:
            found[-1].text += "\n" + line
        elif line.startswith("$ "):
            found.append(Command(line=block.line + offset, text=line[2:]))
        elif line.strip():
            assert found, f"{block.where}: output before any command"
            found[-1].shown.append(line)
        going_on = line.endswith("\\")
    return found


def normalised(line: str) -> str:
    """What varies from run to run made alike: every word holding a digit (an id, an age, a
    date, an invoice number) is ``#``, and each run of spaces one space (the columns a table
    sizes to its values)."""
    return " ".join("#" if re.search(r"\d", word) else word for word in line.split())


def shown(expected: str, output: str) -> bool:
    """Whether the shown line ``expected`` is a line of ``output`` (both normalised; ``...`` is
    any text)."""
    parts = [re.escape(normalised(part)) for part in expected.split("...")]
    pattern = r".*".join(parts)
    return any(re.fullmatch(pattern, normalised(line)) for line in output.splitlines())

"""The dependency lock: requirements/base.txt (runtime, what the image installs) and
requirements/dev.txt (runtime + dev, what `make` installs) pin every package with the hashes of
its files, agree with pyproject.toml, and are what this environment was installed from."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from stack.process import ROOT

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", re.MULTILINE)


def pins(name: str) -> dict[str, str]:
    """``package -> version`` of a lock file, each entry checked to carry a sha256 hash."""
    text = (ROOT / "requirements" / name).read_text()
    entries = re.split(r"\n(?=[A-Za-z0-9])", text[text.index("\n", text.index("pip-compile")) :])
    found: dict[str, str] = {}
    for entry in entries:
        match = PIN.match(entry.strip())
        if match is None:
            continue
        assert "--hash=sha256:" in entry, f"{name}: {match.group(1)} has no hash"
        found[canonicalize_name(match.group(1))] = match.group(2)
    return found


MACHINERY = "packages/asyncwork/pyproject.toml"


def declared(extra: str | None = None, pyproject: str = "pyproject.toml") -> list[Requirement]:
    project = tomllib.loads((ROOT / pyproject).read_text())["project"]
    listed = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return [Requirement(line) for line in listed]


@pytest.mark.parametrize(
    ("lock", "extras"), [("base.txt", [None]), ("dev.txt", [None, "dev"])], ids=["base", "dev"]
)
def test_every_declared_dependency_is_pinned_within_its_range(
    lock: str, extras: list[str | None]
) -> None:
    pinned = pins(lock)
    for extra in extras:
        for requirement in declared(extra):
            version = pinned.get(canonicalize_name(requirement.name))
            assert version is not None, f"{requirement.name} is not in {lock}: run `make lock`"
            assert requirement.specifier.contains(version, prereleases=True), (
                f"{lock} pins {requirement.name}=={version}, outside {requirement.specifier}"
            )
    # Built without fetching anything unpinned: the build backend is locked too.
    assert "setuptools" in pinned


def test_the_machinerys_dependencies_are_pinned_within_its_ranges() -> None:
    """The machinery's distribution is installed beside the project with ``--no-deps``: the
    runtime lock holds what it needs, within the ranges its own pyproject.toml declares."""
    pinned = pins("base.txt")
    for requirement in declared(pyproject=MACHINERY):
        version = pinned.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not in base.txt"
        assert requirement.specifier.contains(version), (requirement.name, version)


def test_the_runtime_lock_is_the_dev_locks_runtime_part() -> None:
    base, dev = pins("base.txt"), pins("dev.txt")
    assert {name: dev.get(name) for name in base} == base


def test_this_environment_was_installed_from_the_dev_lock() -> None:
    for name, version in pins("dev.txt").items():
        if name in {"pip", "setuptools"}:
            continue  # the venv's own tools may be upgraded in place
        assert metadata.version(name) == version, name


def test_every_install_path_goes_through_the_lock_with_hashes() -> None:
    makefile = (ROOT / "Makefile").read_text().replace("\\\n\t\t", "")
    assert re.search(r"pip install [^\n]*--require-hashes -r requirements/dev\.txt", makefile)
    assert "--no-deps --no-build-isolation -e packages/asyncwork -e ." in makefile
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "pip install --require-hashes -r requirements/base.txt" in dockerfile
    assert "pip install --no-deps --no-build-isolation ./packages/asyncwork ." in dockerfile
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_lower_bounds_stay_above_known_advisories() -> None:
    floors = {"django": "5.2.8", "djangorestframework": "3.15.2", "gunicorn": "23"}
    bounds: dict[str, list[Version]] = {
        canonicalize_name(r.name): [Version(s.version) for s in r.specifier if s.operator == ">="]
        for r in declared()
    }
    for name, floor in floors.items():
        assert bounds[name], f"{name} has no lower bound"
        assert min(bounds[name]) >= Version(floor), name

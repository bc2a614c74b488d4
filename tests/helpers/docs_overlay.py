"""A pytest plugin (``-p tests.helpers.docs_overlay``) that lays the tree named by
``DOCS_OVERLAY`` over the application's packages before Django loads them: its
``invoicing/receipts.py`` is imported as ``invoicing.receipts``, and its ``invoicing/tasks.py``,
where a page's example adds to that file, replaces the checkout's. The checkout is not written
to. Then every module of the tree is imported, as ``AppConfig.ready()`` imports the modules that
declare."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

_TREE = Path(os.environ["DOCS_OVERLAY"])


def _modules() -> list[str]:
    return [
        ".".join(path.relative_to(_TREE).with_suffix("").parts)
        for path in sorted(_TREE.rglob("*.py"))
        if not path.name.startswith("test_") and path.name not in ("__init__.py", "conftest.py")
    ]


# Now, at the plugin's import, before pytest-django sets Django up (and the apps' ready()
# import the modules that may be replaced).
for _package in {name.rpartition(".")[0] for name in _modules()}:
    importlib.import_module(_package).__path__.insert(0, str(_TREE.joinpath(*_package.split("."))))


@pytest.fixture(autouse=True, scope="session")
def _examples_imported() -> None:
    for name in _modules():
        importlib.import_module(name)

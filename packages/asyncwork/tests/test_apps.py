"""``INSTALLED_APPS += ["asyncwork"]`` brings no admin: the machinery's pages are the opt-in app
``asyncwork.contrib.admin``. This project installs Django's admin and not that app: the admin
shows none of the machinery's rows, and no module of the core imports Django's admin."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from django.contrib import admin
from django.test import Client
from django_celery_beat.models import PeriodicTask

import asyncwork
from asyncwork.models import DeadLetter, Job


def test_the_admin_registers_none_of_the_machinerys_rows() -> None:
    assert admin.site.is_registered(PeriodicTask)  # the admin's autodiscovery ran
    assert not admin.site.is_registered(DeadLetter)
    assert not admin.site.is_registered(Job)
    assert admin.site.index_template is None


@pytest.mark.django_db
def test_the_admins_index_is_djangos_own(admin_client: Client) -> None:
    index = admin_client.get("/admin/")

    assert index.status_code == 200
    assert index.templates[0].name == "admin/index.html"
    assert b"Dead letters" not in index.content
    assert b"operator-dashboard" not in index.content


def imports(source: Path) -> set[str]:
    """Every module an import statement of ``source`` names (``from a import b``: a and a.b)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text(), str(source))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)])
    return names


def of_the_admin(names: set[str]) -> list[str]:
    return sorted(
        name
        for name in names
        if name == "django.contrib.admin" or name.startswith("django.contrib.admin.")
    )


# Read from the source, not from sys.modules: on Django 5.2 the django-tasks backport loads
# Django's admin modules itself as it is imported (django_stubs_ext.monkeypatch), registering
# nothing.
def test_no_module_of_the_core_imports_djangos_admin() -> None:
    package = Path(asyncwork.__file__).parent
    core = {
        str(source.relative_to(package)): imports(source)
        for source in package.rglob("*.py")
        if source.relative_to(package).parts[0] not in ("contrib", "migrations")
    }

    assert of_the_admin(imports(package / "contrib" / "admin" / "admin.py"))  # as the app does
    assert "backend.py" in core
    assert {module: of_the_admin(names) for module, names in core.items()} == {
        module: [] for module in core
    }

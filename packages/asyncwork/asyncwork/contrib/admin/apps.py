from typing import Any

from django.apps import AppConfig, apps
from django.core.checks import CheckMessage, Error, register


class AsyncWorkAdminConfig(AppConfig):
    """The machinery's pages in Django's admin (``admin.py``): the dead letters, with their
    replay, resolve and unresolve actions, and the jobs, with republish; needs
    ``django.contrib.admin`` installed too (``asyncwork.E009`` says so)."""

    name = "asyncwork.contrib.admin"
    # Not "admin", Django's own admin's label.
    label = "asyncwork_admin"
    verbose_name = "Async machinery: admin"

    def ready(self) -> None:
        register(admin_installed_check)


def admin_installed_check(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    if apps.is_installed("django.contrib.admin"):
        return []
    return [
        Error(
            "asyncwork.contrib.admin is installed without django.contrib.admin: its pages have "
            "no admin site to be shown on.",
            hint='INSTALLED_APPS += ["django.contrib.admin"], or remove asyncwork.contrib.admin.',
            id="asyncwork.E009",
        )
    ]

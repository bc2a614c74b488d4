from django.apps import AppConfig


class AdminConfig(AppConfig):
    """The machinery's pages in Django's admin (``admin.py``): the dead letters, with their
    replay, resolve and unresolve actions, and the jobs, with republish; needs
    ``django.contrib.admin`` installed too."""

    name = "asyncwork.contrib.admin"
    # Not "admin", Django's own admin's label.
    label = "asyncwork_admin"
    verbose_name = "Async machinery: admin"

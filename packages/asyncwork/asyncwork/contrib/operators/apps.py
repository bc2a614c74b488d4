from django.apps import AppConfig


class OperatorsConfig(AppConfig):
    """The people who operate the machinery (needs ``asyncwork.contrib.admin`` and the ``api``
    extra's Django REST framework, with django-rest-knox): an audit trail of what they did,
    written from ``asyncwork.audit``'s announcements and shown on the pages of the rows acted on;
    the "operators" and "viewers" groups (``manage.py setup_groups``); API tokens issued from the
    command line (``manage.py api_token``)."""

    name = "asyncwork.contrib.operators"
    # The label its tables and migrations have always had.
    label = "operators"
    verbose_name = "Operators"

    def ready(self) -> None:
        from asyncwork.audit import operator_acted
        from asyncwork.contrib.operators.audit import operator_action_keep

        operator_acted.connect(operator_action_keep, dispatch_uid="operators.audit")

from django.apps import AppConfig


class OperatorsConfig(AppConfig):
    name = "operators"
    verbose_name = "Operators"

    def ready(self) -> None:
        from asyncwork.audit import operator_acted
        from operators.audit import operator_action_keep

        operator_acted.connect(operator_action_keep, dispatch_uid="operators.audit")

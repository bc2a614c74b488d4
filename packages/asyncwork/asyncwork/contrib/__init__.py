"""The opt-in parts of asyncwork: what a project adds when it wants it, none of which the
guarantees of ``asyncwork`` itself need.

* ``asyncwork.contrib.admin`` (an app; needs ``django.contrib.admin``): the dead letters and
  jobs in Django's admin, with their actions; ``options`` for an application's own admin.
* ``asyncwork.contrib.periodic`` (an app; needs django-celery-beat): scheduled jobs under a
  PostgreSQL lock with one leader beat, retention, the dead-letter alert mail.
* ``asyncwork.contrib.monitoring`` (an app): ``/health/``, ``/metrics``, the operator's
  dashboard and ``manage.py pipeline_status``, from probes an app declares.
* ``asyncwork.contrib.breaker``: a circuit breaker shared by every worker, on Redis.
* ``asyncwork.contrib.backpressure``: refuse work while the backlog is past a mark.
* ``asyncwork.contrib.api``: the dead letters over Django REST framework.
* ``asyncwork.contrib.idempotency``: HTTP ``Idempotency-Key`` for an API's actions.
* ``asyncwork.contrib.http``: the client address behind trusted proxies.
* ``asyncwork.contrib.logging``: log formatters that mask email addresses.
"""

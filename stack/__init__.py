"""The stack kit: how the tests, the benchmarks, the chaos suite and the demo start the
application's real processes and the services around them, one way each.

* ``stack.net``: ``free_port`` and ``wait_until``;
* ``stack.process``: ``Process``, one child in a process group of its own, with its log,
  readiness and stop;
* ``stack.launch``: gunicorn, a Celery worker (or one in this process), Celery beat and the
  nginx edge, each one function returning a ``Process``;
* ``stack.nginx``: the edge's configuration, rendered from ``deploy/nginx`` as compose does;
* ``stack.smtp``: one SMTP server with one fault model, recording every message;
* ``stack.machine``: the machine, servers and revision a benchmark or chaos result was made on;
* ``stack.stripe_events``: realistic Stripe events, signed as Stripe signs them, and
  ``stack.stripe_trigger``, the offline twin of ``stripe trigger`` that POSTs one to the
  receiver (``python -m stack.stripe_trigger EVENT_TYPE``).

Not shipped with the application (``pyproject.toml`` packages only the apps): run from the
checkout, as the README's "Try it by hand" does.
"""

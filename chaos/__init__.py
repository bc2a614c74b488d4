"""The chaos suite: the whole system, real processes, real faults, and a count of every email.

``python -m chaos`` starts gunicorn, several Celery workers, beat and a fault-injecting SMTP
server (the kit's, ``stack``) on a PostgreSQL and a Redis of the suite's own (``chaos.stack``
explains why they are its own), sends paid-invoice webhooks duplicated, shuffled and concurrent
(``chaos.load``), injects faults while it does and after (``chaos.faults``: worker SIGKILLs
inside SMTP conversations, a relay killed between publishing and marking, a broker stall, a
Redis restart that drops every queued message, a PostgreSQL restart; the SMTP server defers,
delays and refuses throughout, ``chaos.config.smtp_faults``), waits for quiescence and reports
what the customers got against what the provider paid (``chaos.report``).

Two arms: ``safe`` runs the application as configured; ``control`` turns its at-least-once
machinery off (early acknowledgement, ``chaos.unsafe_settings``; workers whose poll only
relays, with no rescue nor republish of what the broker lost, ``chaos.unsafe_celery``) and
must show a loss, which is what proves the suite can see one.
"""

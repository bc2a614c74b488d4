"""The whole flow in one command: ``make demo`` (or ``.venv/bin/python scripts/demo.py``).

Starts (through the kit, ``stack``) an SMTP sink, a Celery worker, Celery beat and the web app
(gunicorn, serving the static files ``collectstatic`` gathers into .demo/static) on the local
PostgreSQL and Redis, then plays what a payment provider and an operator would.

The worker alone holds the pipeline's guarantees: its poll publishes what a failed publish
left behind and what came due (a retry), and gives back the jobs of a worker that died. Celery
beat runs the scheduled jobs (the Stripe events reconcile, the dead-letter alert, retention)
under its leader lock. Then:

1. a paid-invoice event delivered twice (a provider retry): one invoice, one email;
2. a paid invoice whose recipient the mail server refuses: one dead letter, with its reason;
3. the operator corrects the recipient (recorded, and kept apart from what the provider sent)
   and replays the dead letter: the email goes out.

It prints what happened at each step and stops everything it started, on an error too. The
broker and cache keys carry a prefix of this run's own, so messages and circuit-breaker state
of anything else on the same Redis (a local stack, a test run) are neither read nor changed,
and nothing is left behind.

The demo writes to a database of its own, ``invoicing_demo`` on the local PostgreSQL (the one
``DATABASE_URL`` names, if set): it creates it and marks it as its own (a comment on the
database), uses it again on the next run, and refuses, in one line and before starting anything,
a database of that name it did not create. It ends with a line naming the database and how to
drop it.

When the configured PostgreSQL or Redis does not answer, the demo runs an embedded one in its
place and says so (``scripts/embedded.py``). Deciding that comes first, in this process; the
flow then runs in a child process whose environment points at what answered, so it and
everything it starts read one set of settings.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from email.message import EmailMessage
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The kit, importable once the repository is on the path.
from stack import launch  # noqa: E402
from stack.net import HOST, wait_until  # noqa: E402
from stack.process import ProcessError  # noqa: E402
from stack.smtp import Faults, SmtpServer  # noqa: E402

RUN = secrets.token_hex(4)
# The demo's own database, unless DATABASE_URL names another: never the application's default
# ("invoicing"), which on a developer's machine holds someone's data.
DATABASE_URL = "postgres://postgres@127.0.0.1:5432/invoicing_demo"
# The comment the demo puts on a database it created: only such a database is written to.
DATABASE_MARK = "created by the invoice demo (scripts/demo.py)"
EMBEDDED = "DEMO_EMBEDDED_POSTGRES"  # set in the flow's environment when PostgreSQL is embedded
LOGS = Path(os.environ.get("DEMO_LOGS") or tempfile.mkdtemp(prefix="invoice-demo-"))
FLOW = "DEMO_FLOW"  # set in the child process that runs the flow
# A recipient the demo's mail server refuses, like a real one refusing a mistyped address.
MISTYPED = "jenny@exmaple.com"

T = TypeVar("T")


def say(text: str = "") -> None:
    print(text, flush=True)


def expect(what: str, predicate: Callable[[], T | None], timeout: float) -> T:
    """What ``predicate`` returns once it is true; the demo stops if it is not in time."""
    value = wait_until(predicate, timeout, interval=0.2)
    if not value:
        raise SystemExit(f"demo: timed out after {timeout:.0f} s waiting for {what} (logs: {LOGS})")
    return value


def post(url: str, body: bytes, signature: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        url,
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Stripe-Signature": signature},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def database_url(environ: Mapping[str, str]) -> str:
    """The database the demo writes to: ``DATABASE_URL`` if set, else its own."""
    return environ.get("DATABASE_URL") or DATABASE_URL


def ensure_database() -> str:
    """Create the configured database, marked as the demo's, if it does not exist; refuse (exit
    status 1, one line) one that exists without the mark. Returns the line that says where the
    demo writes and how to drop it."""
    import environ
    import psycopg
    from psycopg import sql

    # Read as the settings read it; before Django is set up, which the flow does after this.
    db = environ.Env.db_url_config(os.environ["DATABASE_URL"])
    host = db["HOST"] or db.get("OPTIONS", {}).get("host")  # a socket directory: an option
    name, port, user = db["NAME"], db["PORT"] or 5432, db["USER"]
    try:
        with psycopg.connect(
            host=host,
            port=port,
            user=user,
            password=db.get("PASSWORD"),
            dbname="postgres",
            connect_timeout=3,
            autocommit=True,
        ) as conn:
            found = conn.execute(
                "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s",
                [name],
            ).fetchone()
            if found is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                conn.execute(
                    sql.SQL("COMMENT ON DATABASE {} IS {}").format(
                        sql.Identifier(name), sql.Literal(DATABASE_MARK)
                    )
                )
                say(f"created database {name}")
            elif found[0] != DATABASE_MARK:
                raise SystemExit(
                    f"demo: database {name} exists and was not created by the demo: it is left "
                    f"alone (unset DATABASE_URL for the demo's own, invoicing_demo, or name "
                    f"another in DATABASE_URL)"
                )
    except psycopg.OperationalError as exc:
        raise SystemExit(f"demo: PostgreSQL is not reachable: {exc}".strip()) from exc
    if os.environ.get(EMBEDDED):
        return f"demo database: {name} on an embedded PostgreSQL, deleted as the demo ends"
    where = f"-h {host or '127.0.0.1'}" + (f" -p {port}" if int(port) != 5432 else "")
    return f"demo database: {name}; to drop it: dropdb {where} -U {user} {name}"


def show_email(message: EmailMessage) -> None:
    body = message.get_body(("plain",))
    say(f"    To:         {message['To']}")
    say(f"    Subject:    {message['Subject']}")
    say(f"    Message-ID: {message['Message-ID']}")
    for line in (body.get_content() if body else "").strip().splitlines():
        say(f"    | {line}")


def production_env() -> dict[str, str]:
    """How the demo runs the application: as production does (``DJANGO_DEBUG`` off, the
    default), with secrets made up for this run, over plain HTTP on loopback.

    Not ``DJANGO_DEBUG=1``: the demo shows what gets deployed, and DEBUG changes it (every
    process records its SQL queries in memory, an error answers with a debug page). And
    DEBUG's development secrets are public: while the demo ran, any process on the machine
    could sign events its web app would act on. A fresh secret is known only to the demo,
    which signs its own events with it. Set, not defaulted, so that what the shell exported
    does not change the run."""
    return {
        "DJANGO_SETTINGS_MODULE": "core.settings",
        "DJANGO_DEBUG": "0",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "STRIPE_WEBHOOK_SECRET": f"whsec_demo_{secrets.token_hex(24)}",
        # No redirect to HTTPS, no Secure-only cookies: the web app is on http://127.0.0.1.
        "DJANGO_SECURE_SSL_REDIRECT": "0",
        # The demo's events are test-mode events, as `stripe trigger` sends; production acts
        # on live ones only.
        "STRIPE_LIVEMODE": "test",
    }


def main() -> None:
    if os.environ.get(FLOW):
        flow()
        return
    # Before anything reads the settings: the fallback decision below does, in this process.
    os.environ.update(production_env())
    os.environ["DATABASE_URL"] = database_url(os.environ)
    with contextlib.ExitStack() as stack:
        overrides = services(stack)
        child = subprocess.Popen(
            [sys.executable, __file__],
            env={**os.environ, **overrides, FLOW: "1", "DEMO_LOGS": str(LOGS)},
        )
        try:
            returncode = child.wait()
        except KeyboardInterrupt:  # the child had the SIGINT too: let it stop what it started
            returncode = child.wait()
    raise SystemExit(returncode)


def services(stack: contextlib.ExitStack) -> dict[str, str]:
    """The environment that points the flow at services that answer: the configured PostgreSQL
    and Redis, or embedded ones started on ``stack`` in place of those that do not answer."""
    import embedded

    import core.settings as configured  # read only: this process never sets Django up

    overrides: dict[str, str] = {}
    database = configured.DATABASES["default"]
    if not embedded.database_answers(database):
        where = database["HOST"] or database["OPTIONS"].get("host") or "127.0.0.1"
        say(f"PostgreSQL does not answer at {where}:{database['PORT'] or 5432}.")
        say("  Using an embedded PostgreSQL (pgserver) for this demo: nothing is kept.")
        with missing_fallback("PostgreSQL"):
            overrides["DATABASE_URL"] = stack.enter_context(
                embedded.embedded_postgres(LOGS / "postgres", database["NAME"])
            )
            overrides[EMBEDDED] = "1"
    redis_urls = {
        "REDIS_URL": configured.REDIS_URL,
        "CELERY_BROKER_URL": configured.CELERY_BROKER_URL,
    }
    silent = {name: url for name, url in redis_urls.items() if not embedded.redis_answers(url)}
    if silent:
        say(f"Redis does not answer at {', '.join(sorted(set(silent.values())))}.")
        say("  Using an embedded Redis-protocol server (fakeredis) for this demo: nothing is kept.")
        with missing_fallback("Redis"):
            netloc = stack.enter_context(embedded.embedded_redis())
        overrides.update({name: embedded.with_netloc(url, netloc) for name, url in silent.items()})
    return overrides


@contextlib.contextmanager
def missing_fallback(service: str) -> Iterator[None]:
    try:
        yield
    except ImportError as exc:
        raise SystemExit(
            f"demo: {service} does not answer, and the embedded fallback is not installed "
            f"({exc.name}): run .venv/bin/pip install -e '.[dev]', or start {service}"
        ) from exc


def flow() -> None:
    where = ensure_database()  # first: a database that is not the demo's is refused, untouched
    try:
        flow_on_database()
    finally:
        say(f"\n{where}")


def flow_on_database() -> None:
    with SmtpServer(faults=Faults(refuse={MISTYPED})) as sink:
        os.environ.update(
            {
                "CELERY_BROKER_KEY_PREFIX": f"demo-{RUN}:",
                "REDIS_KEY_PREFIX": f"demo-{RUN}",
                "EMAIL_HOST": HOST,
                "EMAIL_PORT": str(sink.port),
                "LOG_LEVEL": os.environ.get("LOG_LEVEL", "WARNING"),
                # Retries come quickly in a demo; the defaults are 2 s doubling up to 60 s.
                "EMAIL_RETRY_BACKOFF_BASE": "1",
                "EMAIL_RETRY_BACKOFF_MAX": "2",
                # The web app serves the static files collected here (WhiteNoise), as the Docker
                # image's from /app/staticfiles: a directory of the demo's own (gitignored), made
                # afresh each run, so the developer's staticfiles/ is left alone.
                "DJANGO_STATIC_ROOT": str(ROOT / ".demo" / "static"),
            }
        )
        import django

        django.setup()
        try:
            play(sink)
        except ProcessError as exc:  # a process that did not start: its log says why
            raise SystemExit(f"demo: {exc}") from exc


def play(sink: SmtpServer) -> None:
    from django.conf import settings
    from django.contrib.staticfiles.storage import staticfiles_storage
    from django.core.management import call_command

    from asyncwork.audit import cli_actor
    from asyncwork.models import DeadLetter
    from invoicing.models import EmailDelivery, Invoice
    from invoicing.services import invoice_recipient_correct
    from stack import stripe_events

    say(f"== Invoice emails, end to end (logs in {LOGS})")
    call_command("migrate", verbosity=0)  # which also syncs the scheduled jobs' schedules
    call_command("setup_groups", verbosity=0)
    say("database migrated (schedules synced), operator groups set up")
    env = {**os.environ}

    try:
        with contextlib.ExitStack() as running:
            worker = launch.celery_worker(
                env, name=f"demo-{RUN}", concurrency=2, log=LOGS / "worker.log"
            )
            running.callback(worker.stop, 20)
            beat = launch.celery_beat(env, log=LOGS / "beat.log")
            running.callback(beat.stop, 20)
            # While the worker and beat start: it takes seconds, and only the web app needs it
            # (its workers read STATIC_ROOT as they start).
            call_command("collectstatic", interactive=False, clear=True, verbosity=0)
            say(f"static files collected into {settings.STATIC_ROOT}")
            web = launch.gunicorn(
                env, config=launch.GunicornConfig(workers=2), log=LOGS / "web.log"
            )
            running.callback(web.stop, 20)
            worker.wait_ready(60)
            web.wait_ready(60)
            url = f"http://{HOST}:{web.port}/webhooks/stripe/"
            say(f"SMTP sink on :{sink.port}, worker and beat up, web app on :{web.port}")
            # The admin's stylesheet, by the hashed name its pages link to.
            stylesheet = staticfiles_storage.url("admin/css/base.css")
            with urllib.request.urlopen(
                f"http://{HOST}:{web.port}{stylesheet}", timeout=10
            ) as answer:
                say(f"  GET {stylesheet} -> {answer.status}, {answer.headers['Cache-Control']}")
            secret = settings.STRIPE_WEBHOOK_SECRETS[0]

            def deliver(event: dict[str, Any]) -> None:
                body = stripe_events.encode(event)
                status, answer = post(url, body, stripe_events.signature_header(body, secret))
                say(f"  POST {event['type']} {event['id']} -> {status} {json.dumps(answer)}")

            say("\n1. invoice.paid, delivered twice (a provider retry)")
            invoice_id = stripe_events.new_id("in")
            paid = stripe_events.event(
                "invoice.paid",
                stripe_events.invoice_object(
                    invoice_id=invoice_id,
                    customer_email="ada@example.com",
                    customer_name="Ada Lovelace",
                    amount=4200,
                    currency="eur",
                ),
            )
            deliver(paid)
            deliver(paid)
            expect("the email", lambda: sink.handler.wait_for(1, timeout=1), 60)
            time.sleep(1)  # room for a second email, were there one
            say(f"  emails received: {len(sink.messages)}")
            show_email(sink.messages[0])

            say("\n2. a paid invoice whose recipient the mail server refuses")
            refused_id = stripe_events.new_id("in")
            deliver(
                stripe_events.event(
                    "invoice.paid",
                    stripe_events.invoice_object(invoice_id=refused_id, customer_email=MISTYPED),
                )
            )
            letter = expect(
                "the dead letter",
                lambda: DeadLetter.objects.filter(
                    args=[Invoice.objects.get(provider_invoice_id=refused_id).pk]
                ).first(),
                60,
            )
            say("  python manage.py dlq list --waiting")
            call_command("dlq", "list", "--waiting")
            say(f"  reason: {letter.exception_message}")

            say("\n3. the operator corrects the recipient and replays the dead letter")
            refused = Invoice.objects.get(provider_invoice_id=refused_id)
            # What the admin's "Correct recipient" form calls: recorded, and kept apart from the
            # provider's address, so the provider's next event for the invoice keeps it.
            invoice_recipient_correct(
                invoice_id=refused.pk,
                email="jenny@example.com",
                reason="typo in the domain (exmaple.com)",
                actor=cli_actor(),
            )
            say("  recipient corrected: jenny@exmaple.com -> jenny@example.com")
            say(f"  python manage.py dlq replay {letter.pk}")
            call_command("dlq", "replay", str(letter.pk))
            expect("the replayed email", lambda: sink.handler.wait_for(2, timeout=1), 60)
            show_email(sink.messages[1])
            time.sleep(1)

            ours = Invoice.objects.filter(provider_invoice_id__in=[invoice_id, refused_id])
            sent = EmailDelivery.objects.filter(invoice__in=ours, state="sent").count()
            waiting = DeadLetter.objects.filter(
                args__in=[[pk] for pk in ours.values_list("pk", flat=True)],
                replayed_at__isnull=True,
            ).count()
            say(
                f"\n== {len(sink.messages)} emails received for 2 paid invoices "
                f"({sent} marked sent); dead letters waiting: {waiting}"
            )
            if len(sink.messages) != 2:
                raise SystemExit("demo: expected exactly two emails")
            leading = "took the leader lock" in beat.log_text()
            say(f"beat: {'dispatching scheduled jobs' if leading else 'standing by'}")
            say("\npython manage.py pipeline_status")
            with contextlib.suppress(SystemExit, Exception):
                call_command("pipeline_status")
    finally:
        _redis_cleanup()


def _redis_cleanup() -> None:
    """Delete this run's keys (and only those) from the broker and the cache."""
    import redis
    from django.conf import settings

    prefixes = {
        settings.CELERY_BROKER_URL: settings.CELERY_BROKER_TRANSPORT_OPTIONS["global_keyprefix"],
        settings.REDIS_URL: settings.CACHES["default"]["KEY_PREFIX"] + ":",
    }
    for url, prefix in prefixes.items():
        client = redis.Redis.from_url(url)
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Django's command-line utility."""

import os
import re
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line
    from django.db import OperationalError

    try:
        execute_from_command_line(sys.argv)
        sys.stdout.flush()  # here, where a closed pipe can still be caught
    except BrokenPipeError:
        # The reader stopped (`manage.py pipeline_status | head`): nothing more to say. Whatever
        # is still buffered goes to /dev/null, so the flush at exit fails no more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except ImproperlyConfigured as exc:
        # A configuration mistake is the operator's to fix: say what, without a traceback.
        sys.exit(f"Configuration error: {exc}")
    except OperationalError as exc:
        # The database DATABASE_URL names is missing, or its server does not answer: say
        # which, and how to fix it, in one line. Any other database error is Django's to show.
        if (why := database_unreachable(str(exc))) is None:
            raise
        sys.exit(f"Database error: {why}")


def database_unreachable(error: str) -> str | None:
    """What to tell the operator when ``error`` says the database is missing or its server
    does not answer; None for any other error."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    name, host, port = db["NAME"], db.get("HOST") or "localhost", db.get("PORT") or "5432"
    user = f" -U {db['USER']}" if db.get("USER") else ""
    if re.search(r'database "[^"]*" does not exist', error):
        return (
            f'database "{name}" does not exist on {host}:{port} (DATABASE_URL names it): '
            f"create it with `createdb -h {host} -p {port}{user} {name}`"
        )
    if re.search(r"Connection refused|could not connect|timeout expired", error):
        return (
            f"PostgreSQL does not answer on {host}:{port} (DATABASE_URL): start it, or set "
            "DATABASE_URL to one that does"
        )
    return None


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Django's command-line utility."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    try:
        execute_from_command_line(sys.argv)
    except ImproperlyConfigured as exc:
        # A configuration mistake is the operator's to fix: say what, without a traceback.
        sys.exit(f"Configuration error: {exc}")


if __name__ == "__main__":
    main()

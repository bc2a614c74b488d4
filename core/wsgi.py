"""WSGI entry point: ``gunicorn core.wsgi``."""

import os

from django.core.wsgi import get_wsgi_application

from core.startup import settings_load_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")

# gunicorn's master has checked the settings already when it read ./gunicorn.conf.py or
# core.gunicorn_conf. Started any other way, each worker stops here with one line; exit status
# 4 is gunicorn's "App failed to load", on which its arbiter stops instead of forking the
# worker again.
settings_load_or_exit(exit_code=4)
application = get_wsgi_application()

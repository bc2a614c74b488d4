"""WSGI entry point: ``gunicorn core.wsgi``."""

import os

from django.core.wsgi import get_wsgi_application

from core.startup import settings_load_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "core.settings")

# Without gunicorn.conf.py, each worker stops here; 4 is gunicorn's "App failed to load",
# on which the arbiter stops instead of forking again.
settings_load_or_exit(exit_code=4)
application = get_wsgi_application()

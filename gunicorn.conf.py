"""Read by gunicorn when started from this directory without ``-c`` (its default
``./gunicorn.conf.py``): ``gunicorn core.wsgi``, as the README, the demo and the Docker image
run it, starts as ``gunicorn -c python:core.gunicorn_conf core.wsgi`` does: settings that do
not load stop the master with one line before any worker starts, and X-Forwarded-Proto is left
to Django.
"""

from core.gunicorn_conf import *  # noqa: F403

# One image for every process of the application: web (gunicorn, the default command), the
# Celery worker and beat, and one-off management commands. compose.yaml shows each command.
FROM python:3.11-slim

# Production mode: no DJANGO_DEBUG here (DEBUG is off unless it is set), so a container started
# without DJANGO_SECRET_KEY or STRIPE_WEBHOOK_SECRET stops with one line naming what is missing.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=core.settings

# An unprivileged user with a fixed numeric id (so `runAsNonRoot` and volume permissions can
# rely on it) and a home directory (gunicorn puts its control socket in ~/.gunicorn).
RUN groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid app --create-home --home-dir /home/app \
      --shell /usr/sbin/nologin app

WORKDIR /app

# The runtime dependencies only (no [dev] extra), at the exact versions and hashes of
# requirements/base.txt: pip refuses a download that differs from what was locked. Installed
# before the code is copied, so a code change reuses this layer. psycopg[binary] brings its own
# libpq: no compiler or system library is needed. Then the project itself, without touching its
# dependencies; the code stays owned by root: the application cannot modify itself.
COPY requirements/base.txt requirements/base.txt
RUN pip install --require-hashes -r requirements/base.txt
COPY . .
RUN pip install --no-deps --no-build-isolation . \
 && rm -rf build ./*.egg-info

USER 10001:10001

EXPOSE 8000

# From WORKDIR, so gunicorn reads ./gunicorn.conf.py: settings are checked in its master.
CMD ["gunicorn", "core.wsgi", "--bind", "0.0.0.0:8000", "--workers", "3", "--timeout", "30", \
     "--worker-tmp-dir", "/dev/shm", "--access-logfile", "-"]

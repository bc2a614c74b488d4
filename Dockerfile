# One image for every process of the application: web (gunicorn, the default command), the
# Celery worker and beat, and one-off management commands. compose.yaml shows each command.
FROM python:3.11-slim@sha256:9c900dea9e8fb7e16277c179b555cc72d29a352dbc33cff48ad5a0412fd5bfc7

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
# libpq: no compiler or system library is needed. Then the machinery's distribution
# (packages/asyncwork) and the project itself, without touching their dependencies; the code
# stays owned by root: the application cannot modify itself.
COPY requirements/base.txt requirements/base.txt
RUN pip install --require-hashes -r requirements/base.txt
COPY . .
RUN pip install --no-deps --no-build-isolation ./packages/asyncwork . \
 && rm -rf build ./*.egg-info packages/asyncwork/build packages/asyncwork/*.egg-info

# The static files (the admin's and the browsable API's), collected once here into
# /app/staticfiles (STATIC_ROOT), under hashed names with gzip and Brotli copies, for the
# application to serve (WhiteNoise; core/settings.py, Static files). Owned by root like the code.
# The settings refuse to load without their two secrets (DEBUG is off), so this one command
# gets throw-away values on its own line: not ENV or ARG, so no container's environment has
# them and a deployment that forgot its own secrets still stops at start-up. They show in the
# image's history, which is harmless: collectstatic signs nothing and connects to nothing (no
# database or Redis at build), and the names it writes are hashes of the files' contents, so
# nothing it makes depends on them.
RUN DJANGO_SECRET_KEY=collectstatic-only-not-a-secret \
    STRIPE_WEBHOOK_SECRET=whsec_collectstatic_only_not_a_secret \
    python manage.py collectstatic --noinput

USER 10001:10001

EXPOSE 8000

# From WORKDIR, so gunicorn reads ./gunicorn.conf.py: settings are checked in its master.
CMD ["gunicorn", "core.wsgi", "--bind", "0.0.0.0:8000", "--workers", "3", "--timeout", "30", \
     "--worker-tmp-dir", "/dev/shm", "--access-logfile", "-"]

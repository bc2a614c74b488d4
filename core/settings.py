"""Settings, read from the environment (django-environ). Production is the default: unless
``DJANGO_DEBUG`` is on, the secrets have no default, and a missing one stops start-up with one
line naming it (``core.startup``). The other defaults suit PostgreSQL and Redis on localhost."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import environ
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()


def setting(name: str, default: Any, reason: str) -> Any:
    """The variable ``name`` read as the type of ``default`` (a list: comma-separated, each entry
    stripped, empty ones dropped); each call is a line of docs/reference/settings.md
    (``python -m scripts.configuration_doc``)."""
    if isinstance(default, bool):
        return env.bool(name, default=default)
    if isinstance(default, int):
        return env.int(name, default=default)
    if isinstance(default, list):
        return [e.strip() for e in env.list(name, default=default) if e.strip()]
    return env.str(name, default=default)


DEBUG = setting(
    "DJANGO_DEBUG",
    False,
    "1 or true for development only: debug pages and built-in, publicly known secrets",
)

_secrets_missing: list[str] = []


def _secret(name: str, *, dev_default: str, reason: str) -> str:
    """A setting with a development default only while DEBUG is on; a missing one is noted and
    start-up stops once all are read, naming every missing one."""
    value = env.str(name, default="").strip()
    if value:
        return value
    if DEBUG:
        return dev_default
    _secrets_missing.append(name)
    return ""


SECRET_KEY = _secret(
    "DJANGO_SECRET_KEY",
    dev_default="django-insecure-development-only-key-never-use-in-production-0123456789",
    reason="signs sessions and CSRF tokens; make one with secrets.token_urlsafe(50)",
)
ALLOWED_HOSTS = setting(
    "DJANGO_ALLOWED_HOSTS",
    ["localhost", "127.0.0.1", "[::1]", "testserver"],
    "the host names the app answers to",
)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    # Before staticfiles: runserver serves static files through WhiteNoise, as gunicorn does.
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "rest_framework",
    "knox",
    "drf_spectacular",
    "axes",
    "django_celery_beat",
    "django_tasks",
    # Email providers' APIs as backends, and their tracking webhooks (invoicing.bounces).
    "anymail",
    # Before the domain apps, which fill asyncwork's registries in their ready().
    "asyncwork.contrib.operators",
    "asyncwork",
    "asyncwork.contrib.periodic",
    "asyncwork.contrib.monitoring",
    "asyncwork.contrib.admin",
    "invoicing",
    "webhooks",
    # Last, so its ready() sees every app's.
    "core",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Static files are answered before sessions, authentication or the database.
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: turns a login refused for too many failures into its 429.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "core.urls"
WSGI_APPLICATION = "core.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

# --- Database -------------------------------------------------------------------------------
_DATABASE_URL = setting(
    "DATABASE_URL",
    "postgres://postgres@127.0.0.1:5432/invoicing",
    "PostgreSQL; libpq options go in its query (?connect_timeout=3, the default, sslmode=...)",
)
DATABASES = {"default": env.db_url_config(_DATABASE_URL)}
# A new connection per webhook would cost more than its work; health checks drop dead ones.
DATABASES["default"]["CONN_MAX_AGE"] = 60
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DATABASES["default"].setdefault("OPTIONS", {}).setdefault("connect_timeout", 3)
# Prepared statements: a statement run five times on a connection is parsed and planned once
# (psycopg's default threshold, which Django turns off unless OPTIONS gives it, for a pooler
# such as PgBouncer in transaction mode without its max_prepared_statements; none stands between
# these processes and PostgreSQL). They need psycopg's server-side binding. Every job's claim
# and outcome, every email's claim and mark run so: PostgreSQL's CPU per email about 2.2 -> 0.9
# ms (docs/explanation/performance.md).
DATABASES["default"]["OPTIONS"].setdefault("server_side_binding", True)
DATABASES["default"]["OPTIONS"].setdefault("prepare_threshold", 5)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Cache (circuit breaker state, alert dedupe) -------------------------------------------
REDIS_URL = setting(
    "REDIS_URL", "redis://127.0.0.1:6379/1", "the cache: breaker state, alert dedupe, health"
)
CACHES: dict[str, dict[str, Any]] = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": setting(
            "REDIS_KEY_PREFIX", "invoicing", "prefix of every cache key: runs sharing a Redis"
        ),
        "OPTIONS": {"socket_timeout": 1, "socket_connect_timeout": 1},
    }
}

# --- Auth, i18n -----------------------------------------------------------------------------------
# django-axes first: a locked-out login is refused before its password is checked.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# --- Static files ---------------------------------------------------------------------------------
# Served by WhiteNoise under content-hashed names. With DEBUG off, run `manage.py collectstatic`
# where gunicorn runs, or a page naming a static file fails ("Missing staticfiles manifest entry").
STATIC_URL = "static/"
STATIC_ROOT = Path(
    setting(
        "DJANGO_STATIC_ROOT",
        str(BASE_DIR / "staticfiles"),
        "where collectstatic writes the static files and the app serves them from",
    )
)
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
}

# --- Proxies and HTTPS ------------------------------------------------------------------------
# X-Forwarded-For (asyncwork.contrib.http) and X-Forwarded-Proto (gunicorn's scheme,
# gunicorn.conf.py) count only from these peers; empty: never.
_trusted_proxies = setting(
    "TRUSTED_PROXIES",
    [],
    "addresses or networks of the proxies in front of the app (behind the edge: its address)",
)
HTTPS_ONLY = setting(
    "DJANGO_SECURE_SSL_REDIRECT",
    not DEBUG,
    "0: plain HTTP (no redirect, Secure cookies, HSTS); check --deploy says so as core.I001",
)
SECURE_SSL_REDIRECT = HTTPS_ONLY
SESSION_COOKIE_SECURE = HTTPS_ONLY
CSRF_COOKIE_SECURE = HTTPS_ONLY
SECURE_HSTS_SECONDS = 365 * 24 * 3600 if HTTPS_ONLY else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = HTTPS_ONLY
SECURE_HSTS_PRELOAD = HTTPS_ONLY
# An explicit DJANGO_SECURE_SSL_REDIRECT=0 is a decision: `check --deploy` reports it as one
# INFO (core.I001, core/checks.py) instead of the four warnings about what it turned off.
HTTPS_OPTED_OUT = "DJANGO_SECURE_SSL_REDIRECT" in env and not HTTPS_ONLY
HTTPS_OPT_OUT_CHECKS = ["security.W004", "security.W008", "security.W012", "security.W016"]
SILENCED_SYSTEM_CHECKS = HTTPS_OPT_OUT_CHECKS if HTTPS_OPTED_OUT else []
# Probes from inside the deployment speak plain HTTP.
SECURE_REDIRECT_EXEMPT = [r"^health/$", r"^health/live$", r"^metrics$"]
CSRF_TRUSTED_ORIGINS = setting(
    "DJANGO_CSRF_TRUSTED_ORIGINS",
    [],
    "origins allowed to POST forms: the admin behind a proxy on another origin",
)

# --- Stripe webhooks ------------------------------------------------------------------------
# Several while a secret is rolled: Stripe signs with every active secret for up to 24 h.
STRIPE_WEBHOOK_SECRETS = [
    s.strip()
    for s in _secret(
        "STRIPE_WEBHOOK_SECRET",
        dev_default="whsec_development_only",
        reason="one whsec_..., or several separated by commas while a secret is rolled",
    ).split(",")
    if s.strip()
]
if _secrets_missing:
    # One line (core/startup.py), with no hint at DJANGO_DEBUG: its secrets are public.
    raise ImproperlyConfigured(
        f"{' and '.join(_secrets_missing)} must be set when DJANGO_DEBUG is off (the default): "
        f"{'it has' if len(_secrets_missing) == 1 else 'they have'} no production default."
    )
STRIPE_WEBHOOK_TOLERANCE = setting(
    "STRIPE_WEBHOOK_TOLERANCE", 300, "seconds a signature's timestamp may be off, either way"
)
# "test" while DEBUG is on: a development machine never emails a real customer unless told to.
STRIPE_LIVEMODE = (
    setting(
        "STRIPE_LIVEMODE",
        "test" if DEBUG else "live",
        "the Stripe mode acted on (live, test or any); another mode's event is stored as ignored",
    )
    .strip()
    .lower()
)
STRIPE_ACCOUNT = setting(
    "STRIPE_ACCOUNT", "", "Connect: the acct_... acted for; other accounts' events are ignored"
).strip()
STRIPE_API_VERSION = setting(
    "STRIPE_API_VERSION",
    "2025-09-30.clover",
    "the API version the handlers are written for; events of another are taken and counted",
).strip()
WEBHOOK_MAX_BODY_BYTES = setting(
    "WEBHOOK_MAX_BODY_BYTES", 1048576, "larger webhook bodies get 413 (the edge reads it too)"
)

# --- Stripe API (webhooks/stripe_api.py) ------------------------------------------------------
STRIPE_API_KEY = setting(
    "STRIPE_API_KEY",
    "",
    "a key reading customers, invoices and events (a restricted one will do); empty: API off",
).strip()
STRIPE_API_BASE = (
    setting(
        "STRIPE_API_BASE",
        "https://api.stripe.com",
        "where the Stripe API answers; with DJANGO_DEBUG off, https on stripe.com unless "
        "PROVIDER_API_ALLOWED_ORIGINS lists another",
    )
    .strip()
    .rstrip("/")
)
# Seconds to connect, then to wait for the answer, of each call to the Stripe API.
STRIPE_API_TIMEOUT_SECONDS = 10

# --- Email ------------------------------------------------------------------------------------
EMAIL_BACKEND = setting(
    "EMAIL_BACKEND",
    "asyncwork.contrib.mail.EmailBackend",
    "the email backend: the default is Django's SMTP backend plus UTF-8 local parts "
    "(asyncwork.contrib.mail); a provider's API through django-anymail, e.g. "
    "anymail.backends.postmark.EmailBackend, takes its settings from ANYMAIL_*",
)
EMAIL_HOST = setting("EMAIL_HOST", "127.0.0.1", "the SMTP server")
EMAIL_PORT = setting("EMAIL_PORT", 1025, "the SMTP server's port")
EMAIL_HOST_USER = setting("EMAIL_HOST_USER", "", "SMTP authentication: the user")
EMAIL_HOST_PASSWORD = setting("EMAIL_HOST_PASSWORD", "", "SMTP authentication: the password")
EMAIL_USE_TLS = setting("EMAIL_USE_TLS", False, "STARTTLS (usually port 587)")
EMAIL_USE_SSL = setting("EMAIL_USE_SSL", False, "TLS from the start (usually port 465)")
EMAIL_TIMEOUT = setting(
    "EMAIL_TIMEOUT", 10, "seconds for every SMTP socket operation, or a provider API's request"
)
DEFAULT_FROM_EMAIL = setting(
    "DEFAULT_FROM_EMAIL",
    "Billing <billing@example.com>",
    "the sender of every email and alert; its domain ends every Message-ID",
)
SERVER_EMAIL = DEFAULT_FROM_EMAIL


def anymail_from_environment(environ: dict[str, str]) -> dict[str, Any]:
    """django-anymail's ``ANYMAIL``: each ``ANYMAIL_<NAME>`` variable as ``ANYMAIL["<NAME>"]``
    (``ANYMAIL_POSTMARK_SERVER_TOKEN`` -> ``POSTMARK_SERVER_TOKEN``). A value that is JSON (a
    number, true or false, a list) is read as JSON, any other as text; a text that would read
    as JSON is written in JSON's quotes. A provider API's request timeout is ``EMAIL_TIMEOUT``
    (the send passes it to the backend)."""
    anymail: dict[str, Any] = {}
    for name, value in environ.items():
        if name.startswith("ANYMAIL_") and name != "ANYMAIL_":
            try:
                anymail[name.removeprefix("ANYMAIL_")] = json.loads(value)
            except ValueError:
                anymail[name.removeprefix("ANYMAIL_")] = value
    return anymail


# Documented in docs/reference/settings.md and docs/how-to/send-through-a-provider.md.
ANYMAIL = anymail_from_environment(dict(os.environ))
ADMINS = [
    ("Operator", a)
    for a in setting("DJANGO_ADMINS", [], "addresses that get the dead-letter alert mail")
]
# Any other hosted_invoice_url (javascript:, a look-alike host) is left out of the email.
INVOICE_URL_ALLOWED_HOSTS = [
    h.lower()
    for h in setting(
        "INVOICE_URL_ALLOWED_HOSTS",
        ["invoice.stripe.com"],
        "hosts the email may link to (https only); empty: never link",
    )
]

# --- Provider APIs (core/providers.py) --------------------------------------------------------
# What STRIPE_API_BASE and ANYMAIL_<ESP>_API_URL answer is taken as the provider's word: with
# DEBUG off each is https on the provider's own domain, or an origin listed here.
PROVIDER_API_ALLOWED_ORIGINS = setting(
    "PROVIDER_API_ALLOWED_ORIGINS",
    [],
    "origins (scheme://host:port) besides the providers' own that STRIPE_API_BASE and "
    "ANYMAIL_*_API_URL may name with DJANGO_DEBUG off, trusted as the provider: a stand-in, "
    "an egress proxy",
)

# --- Celery -----------------------------------------------------------------------------------
CELERY_BROKER_URL = setting(
    "CELERY_BROKER_URL",
    "redis://127.0.0.1:6379/0",
    "the broker: redis:// or, for RabbitMQ, amqp:// (docs/explanation/choosing-a-broker.md)",
)
# Messages carry ids and intent; JSON keeps them readable and refuses pickled code.
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = TIME_ZONE
# Nothing reads task results: the database holds every outcome.
CELERY_TASK_IGNORE_RESULT = True
# Late acknowledgement, requeue on a killed worker, one message reserved at a time, Redis's
# transport and queue order, RabbitMQ's publisher confirms and quorum queues: set by
# asyncwork.install (core/celery.py). A default time budget for every task; the email tasks
# set a tighter one of their own.
CELERY_TASK_SOFT_TIME_LIMIT = 100
CELERY_TASK_TIME_LIMIT = 120
# Cancelling an email task between the SMTP 250 and marking the key sent would make a
# duplicate; a finished task redelivered for want of an ack is a no-op under its claim.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Long-running workers grow; recycle pool processes before they do.
CELERY_WORKER_MAX_TASKS_PER_CHILD = 5000
CELERY_WORKER_MAX_MEMORY_PER_CHILD = 256_000  # KiB
# A task keeps the process's database connection, as a request does (asyncwork.db).
CELERY_DB_REUSE_MAX = 1000

# Redis: an unacknowledged message is redelivered after this: a job's redelivery finds it
# claimed or done, and a dead worker's jobs are rescued by heartbeat long before.
CELERY_BROKER_TRANSPORT_OPTIONS: dict[str, Any] = {
    "visibility_timeout": 180,
    "unacked_restore_interval": 10,
    "unacked_restore_throttle": 1,
    # A restore that died holding the mutex blocks others for this long, not 5 minutes.
    "unacked_mutex_expire": 30,
    # Publishing fails fast on a stalled broker; the outbox keeps the message.
    "socket_timeout": 2.0,
    "socket_connect_timeout": 1.0,
    "global_keyprefix": setting(
        "CELERY_BROKER_KEY_PREFIX", "", "prefix of every broker key: runs sharing a Redis"
    ),
}
# RabbitMQ: a dead worker's message returns as it disconnects.
if CELERY_BROKER_URL.startswith(("amqp://", "amqps://", "pyamqp://")):
    CELERY_BROKER_TRANSPORT_OPTIONS = {"connect_timeout": 1.0}
    # Celery's delay queues as quorum queues can lose a message on RabbitMQ 3.10.
    CELERY_BROKER_NATIVE_DELAYED_DELIVERY_QUEUE_TYPE = "classic"
    # After a partition the node may still hold a cut worker's connection; an exclusive
    # pidbox queue would refuse the returning worker (RESOURCE_LOCKED) until it noticed.
    CELERY_CONTROL_QUEUE_EXCLUSIVE = False
# django-celery-beat's DatabaseScheduler, dispatching only while it holds the leader lock.
CELERY_BEAT_SCHEDULER = "asyncwork.contrib.periodic.beat:LeaderDatabaseScheduler"

# --- Tasks (Django's task API on the machinery's backend, asyncwork.backend) ----------------
# The email tasks have a queue of their own: other work never delays an email.
TASKS = {"default": {"BACKEND": "asyncwork.backend.OutboxBackend", "QUEUES": ["default", "email"]}}

# --- The invoice email task -------------------------------------------------------------------
EMAIL_MAX_ATTEMPTS = 5
EMAIL_RETRY_BACKOFF_BASE = setting(
    "EMAIL_RETRY_BACKOFF_BASE", 2, "seconds: attempt n waits randrange(min(MAX, BASE * 2**n) + 1)"
)
EMAIL_RETRY_BACKOFF_MAX = setting(
    "EMAIL_RETRY_BACKOFF_MAX", 60, "seconds: the longest wait between two attempts"
)
# The claim lease outlives the task's hard limit, so a live claim is never taken over mid-send
# (core/checks.py holds any settings module to it).
EMAIL_TASK_SOFT_TIME_LIMIT = 45
EMAIL_TASK_TIME_LIMIT = 60
EMAIL_CLAIM_LEASE_SECONDS = 90

# --- Circuit breaker on the email provider (asyncwork.contrib.breaker) ------------------------
EMAIL_BREAKER_FAILURE_THRESHOLD = setting(
    "EMAIL_BREAKER_FAILURE_THRESHOLD",
    5,
    "consecutive transient SMTP failures, across all workers, that open the breaker",
)
EMAIL_BREAKER_RESET_SECONDS = setting(
    "EMAIL_BREAKER_RESET_SECONDS",
    30,
    "seconds the breaker stays open before one probe; a deferred email waits up to twice this",
)
# Seconds an open breaker may defer an email before it is dead-lettered.
EMAIL_PROVIDER_DEADLINE_SECONDS = 86400

# --- Scheduled jobs ---------------------------------------------------------------------------
# Save each entry's last run after every dispatch, for a standby taking over.
CELERY_BEAT_SYNC_EVERY = 1
WEBHOOK_BODY_RETENTION_DAYS = setting(
    "WEBHOOK_BODY_RETENTION_DAYS",
    30,
    "days a webhook's raw body and headers (personal data) are kept",
)
WEBHOOK_RETENTION_DAYS = setting(
    "WEBHOOK_RETENTION_DAYS", 30, "days a processed or ignored event's row is kept (at least 3)"
)


# --- The async machinery (ASYNCWORK: asyncwork/settings.py holds every key's default) ----------
def machinery(name: str, cast: type, reason: str) -> dict[str, Any]:
    """``ASYNCWORK[name]`` from the variable ``name`` where it is set, else nothing: the
    machinery's default holds, and its checks (asyncwork/checks.py) judge the value."""
    if name not in env:
        return {}
    return {name: [e.strip() for e in env.list(name)] if cast is list else env(name, cast=cast)}


ASYNCWORK: dict[str, Any] = {
    "METRIC_PREFIX": "invoicing_",
    "LOG_CONTEXT_FIELDS": ["event_id", "invoice_id"],
    "REDIS_URL": REDIS_URL,
    "TRUSTED_PROXIES": _trusted_proxies,
    # The apps whose models operators see; accounts and API tokens are not an operator's job.
    "OPERATOR_APPS": ["asyncwork", "operators", "invoicing", "webhooks", "django_celery_beat"],
    **machinery("API_TOKEN_TTL_HOURS", int, "hours an API token lives by default"),
    **machinery(
        "API_TOKEN_MAX_HOURS", int, "hours no API token may outlive, whatever --hours says"
    ),
    **machinery(
        "BACKPRESSURE_SOFT_MARK",
        int,
        "backlog (unpublished outbox rows, or messages waiting on the email queue) at which "
        "events with no handler get 503",
    ),
    **machinery("BACKPRESSURE_HARD_MARK", int, "backlog at which every webhook event gets 503"),
    **machinery(
        "DLQ_ALERT_THRESHOLD", int, "waiting dead letters that raise the alert (ERROR line, mail)"
    ),
    **machinery(
        "METRICS_ALLOWED_NETWORKS",
        list,
        "without a token, the client networks that may read "
        "/metrics (behind a load balancer or Docker's gateway every client is private)",
    ),
    **machinery(
        "METRICS_TOKEN",
        str,
        "when set, /metrics and the full /health/ need Authorization: Bearer it",
    ),
    **machinery(
        "WORKER_METRICS_PORT", int, "where a Celery worker serves its counters; 0: not served"
    ),
    **machinery(
        "WORKER_METRICS_ADDR", str, "the interface of that port (nothing authenticates it)"
    ),
}

# --- API tokens and admin logins ------------------------------------------------------------
# django-rest-knox: stored as a SHA-512 digest; issued by `manage.py api_token` only, each with
# its expiry (ASYNCWORK's API_TOKEN_TTL_HOURS and API_TOKEN_MAX_HOURS).
REST_KNOX = {
    "AUTH_HEADER_PREFIX": "Token",
    # A token's life is fixed when issued.
    "AUTO_REFRESH": False,
}
# Admin logins: a (username, client address) pair is refused (429) after this many failures,
# until the cool-off passes with none.
AXES_FAILURE_LIMIT = 5
AXES_COOLOFF_TIME = timedelta(minutes=15)
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_CLIENT_IP_CALLABLE = "asyncwork.contrib.http.client_address"
AXES_USERNAME_CALLABLE = "asyncwork.contrib.operators.login.login_username"
AXES_RESET_ON_SUCCESS = True
# No "AXES: BEGIN ..." line at every process start; lockouts are still logged.
AXES_VERBOSE = False

# --- REST framework ---------------------------------------------------------------------------
REST_FRAMEWORK = {
    # DRF's get_ident reads only REMOTE_ADDR; the app's is asyncwork.contrib.http.client_address.
    "NUM_PROXIES": 0,
    # Tokens first: the first class names the 401 challenge; with sessions first it is 403.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "asyncwork.contrib.operators.tokens.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # Staff, then what their permissions allow, as in the admin (asyncwork.contrib.permissions).
    "DEFAULT_PERMISSION_CLASSES": [
        "rest_framework.permissions.IsAdminUser",
        "asyncwork.contrib.permissions.ModelPermissionsWithPowers",
    ],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.PageNumberPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Invoice emails API",
    "DESCRIPTION": "Operator API: invoices and their payment email, dead letters and replay.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.IsAdminUser"],
}

# --- Logging ----------------------------------------------------------------------------------
LOG_FORMAT = setting("LOG_FORMAT", "text", "json: one JSON object per line")
# Logs travel further and live longer than the database rows they come from.
LOG_PII = setting("LOG_PII", False, "1: email addresses in full in log lines, not masked")
_FORMAT = {"fmt": "%(asctime)s %(levelname)s %(name)s %(message)s", "mask_pii": not LOG_PII}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "text": {"()": "asyncwork.contrib.logging.TextFormatter", **_FORMAT},
        "json": {"()": "asyncwork.contrib.logging.JsonFormatter", **_FORMAT},
    },
    "filters": {
        "context": {"()": "asyncwork.logging.ContextFilter"},
        "suspicious": {"()": "asyncwork.contrib.logging.SuspiciousRequestFilter"},
        "routine": {"()": "asyncwork.contrib.logging.RoutineRunFilter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": LOG_FORMAT,
            "filters": ["context"],
        }
    },
    "root": {
        "handlers": ["console"],
        "level": setting("LOG_LEVEL", "INFO", "the lowest level logged: DEBUG, INFO, WARNING..."),
    },
    "loggers": {
        # Replaces Django's handlers, whose mail_admins would mail ADMINS every ERROR from the
        # web worker through the invoices' SMTP account; ADMINS get the dead-letter alert only.
        "django": {"handlers": []},
        # A Host not in ALLOWED_HOSTS, an email tracking webhook failing its provider's
        # verification: one WARNING line and a count, not an ERROR traceback.
        "django.security.DisallowedHost": {"filters": ["suspicious"]},
        "django.security.AnymailWebhookValidationFailure": {"filters": ["suspicious"]},
        "django.db.backends": {"level": "INFO"},
        # A scheduled job's run: Celery's "received" and "succeeded" lines at DEBUG, the job's
        # own line at INFO only when it found something. An idle worker writes nothing.
        "celery.worker.strategy": {"filters": ["routine"]},
        "celery.app.trace": {"filters": ["routine"]},
        # Django's task framework logs each run it is told of: started and succeeded say what
        # Celery's lines say, and a failed one, at ERROR with its traceback, what the dead
        # letter's line says (whose traceback is on the row, and in the log only for a bug):
        # a dead letter is one ERROR line. "django.tasks" on Django 6, the backport's below.
        "django.tasks": {"level": "CRITICAL"},
        "django_tasks": {"level": "CRITICAL"},
    },
}

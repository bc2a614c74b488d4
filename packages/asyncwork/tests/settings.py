"""The package's own test settings: a minimal project (Django's apps, django-celery-beat, the
machinery and ``shop``, a test app with one model and a few jobs) on PostgreSQL at
127.0.0.1:5432, in a test database of the run's own (``test_asyncwork_<run id>``, created and
dropped by pytest-django), and a broker of the run's own: Redis at 127.0.0.1:6379, database 12
(used by nothing else here), every key under the run's prefix, which conftest.py deletes when
the run ends. Nothing is flushed."""

import os
import uuid

# A worker process a test starts is of the same run: it inherits these.
_RUN = os.environ.setdefault("ASYNCWORK_TESTS_RUN", uuid.uuid4().hex[:10])

SECRET_KEY = "asyncwork-tests-only"
DEBUG = False
USE_TZ = True
ALLOWED_HOSTS = ["testserver"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django_celery_beat",
    "asyncwork",
    "shop",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        # A worker process a test starts connects to the run's test database.
        "NAME": os.environ.get("ASYNCWORK_TESTS_DATABASE", "asyncwork"),
        "USER": "postgres",
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("PGPORT", "5432"),
        "TEST": {"NAME": f"test_asyncwork_{_RUN}"},
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
ROOT_URLCONF = "shop.urls"
CELERY_BROKER_URL = os.environ.get("ASYNCWORK_TESTS_BROKER", "redis://127.0.0.1:6379/12")
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": f"asyncwork-tests-{_RUN}:"}
ASYNCWORK = {"REDIS_URL": CELERY_BROKER_URL}
TASKS = {"default": {"BACKEND": "asyncwork.backend.OutboxBackend"}}
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
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

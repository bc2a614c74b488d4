from celery import Celery

from asyncwork.install import celery_install

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
celery_install(app)
app.autodiscover_tasks(["shop"])

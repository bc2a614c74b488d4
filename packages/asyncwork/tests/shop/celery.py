from celery import Celery

import asyncwork

app = Celery("shop")
app.config_from_object("django.conf:settings", namespace="CELERY")
asyncwork.install(app)
app.autodiscover_tasks(["shop"])

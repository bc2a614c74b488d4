"""Django's middleware, where Django's does work a request may not need."""

from __future__ import annotations

from functools import partial

from django.contrib.messages import middleware
from django.contrib.messages.storage import default_storage
from django.http import HttpRequest, HttpResponse
from django.utils.functional import SimpleLazyObject, empty


class MessageMiddleware(middleware.MessageMiddleware):
    """Django's, with the message storage (a cookie read, a signer) made only when a request
    first uses it: the webhook, the API and the probes never do."""

    def process_request(self, request: HttpRequest) -> None:
        request._messages = SimpleLazyObject(partial(default_storage, request))  # type: ignore[attr-defined]

    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        storage = getattr(request, "_messages", None)
        if isinstance(storage, SimpleLazyObject) and storage._wrapped is empty:
            return response
        return super().process_response(request, response)

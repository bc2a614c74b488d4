"""The API's default permission check (``asyncwork.contrib.permissions``), on a viewset of its own:
reading
needs the view permission, an action needs the power it declares, and an action that declares
none is refused to every operator (only a superuser passes DRF's ``add_`` rule)."""

from __future__ import annotations

from typing import Any

import pytest
from django.contrib.auth import get_user_model
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.test import APIRequestFactory, force_authenticate

from asyncwork.contrib.api import DeadLetterSerializer
from asyncwork.models import DeadLetter
from tests.helpers.factories import staff_user

pytestmark = pytest.mark.django_db


class Probe(viewsets.ReadOnlyModelViewSet[DeadLetter]):
    """No permission_classes: the settings' default applies, as to every viewset."""

    queryset = DeadLetter.objects.order_by("pk")
    serializer_class = DeadLetterSerializer
    action_permissions = {"declared": "asyncwork.replay_deadletter"}

    @action(detail=False, methods=["post"])
    def declared(self, request: Request) -> Response:
        return Response({"done": True})

    @action(detail=False, methods=["post"])
    def undeclared(self, request: Request) -> Response:
        return Response({"done": True})


def call(user: Any, method: str, name: str) -> int:
    request = getattr(APIRequestFactory(), method)("/probe/")
    force_authenticate(request, user=user)
    return int(Probe.as_view({method: name})(request).status_code)


def test_reads_need_view_and_actions_their_declared_power() -> None:
    viewer = staff_user("viewer", groups=["viewers"])
    operator = staff_user("operator", groups=["operators"])
    root = get_user_model().objects.create_superuser("root", "root@example.com", "pw-12345-long")

    assert call(staff_user("nobody"), "get", "list") == 403
    assert call(viewer, "get", "list") == 200
    assert call(viewer, "post", "declared") == 403
    assert call(operator, "post", "declared") == 200
    # An action that names no power is refused to every group, and open to a superuser only.
    assert call(operator, "post", "undeclared") == 403
    assert call(root, "post", "undeclared") == 200

"""The API's permission check: a read needs the model's ``view_`` permission, as in the admin
(DRF's lets any user read); an action needs ``view_`` and the power named for it in the view's
``action_permissions``, else ``add_``, which no operator group has.
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import DjangoModelPermissions
from rest_framework.request import Request

VIEW = "%(app_label)s.view_%(model_name)s"


class ModelPermissionsWithPowers(DjangoModelPermissions):
    perms_map = {
        **DjangoModelPermissions.perms_map,
        "GET": [VIEW],
        "HEAD": [VIEW],
        "OPTIONS": [VIEW],
    }

    def has_permission(self, request: Request, view: Any) -> bool:
        power = getattr(view, "action_permissions", {}).get(getattr(view, "action", None))
        if power is None:
            return super().has_permission(request, view)
        if not request.user or not request.user.is_authenticated:
            return False
        model = self._queryset(view).model
        view_perm = VIEW % {
            "app_label": model._meta.app_label,
            "model_name": model._meta.model_name,
        }
        return request.user.has_perms([view_perm, power])

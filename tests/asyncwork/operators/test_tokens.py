"""API tokens (django-rest-knox) issued by ``manage.py api_token``: the token works over real
HTTP to the API, the database holds only its digest, an expired or revoked one gets 401, no
token lives longer than ``API_TOKEN_MAX_HOURS``, and issuing and revoking one (from the
command line or the admin) are operator actions, recorded with the change or not at all."""

from __future__ import annotations

import hashlib
import io
from datetime import timedelta
from typing import Any

import pytest
import requests
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test import Client
from django.utils import timezone
from drf_spectacular.generators import SchemaGenerator
from knox.models import AuthToken
from rest_framework.test import APIClient

from asyncwork.contrib.operators.models import OperatorAction
from asyncwork.contrib.operators.tokens import api_token_create, api_token_revoke
from tests.helpers.factories import staff_user
from tests.helpers.processes import python

pytestmark = pytest.mark.django_db(transaction=True)  # the live server reads what we wrote

INVOICES = "/api/invoices/"


def issue(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("api_token", "create", *args, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue()


def get(live_server: Any, token: str) -> requests.Response:
    return requests.get(
        live_server.url + INVOICES, headers={"Authorization": f"Token {token}"}, timeout=10
    )


@pytest.fixture
def ops() -> Any:
    """A viewer: the API reads with staff and the model's view permission."""
    return staff_user("ops", groups=["viewers"])


def test_an_issued_token_works_and_only_its_digest_is_stored(live_server: Any, ops: Any) -> None:
    token, note = issue("ops")

    assert len(token) == 64  # stdout is the token alone: TOKEN=$(manage.py api_token ...)
    assert "expires at" in note
    response = get(live_server, token)
    assert response.status_code == 200, response.text
    assert response.json()["count"] == 0

    row = AuthToken.objects.get(user=ops)
    assert row.digest == hashlib.sha512(token.encode()).hexdigest()
    assert token.startswith(row.token_key)
    assert len(row.token_key) == 15  # knox's lookup prefix, not enough to authenticate
    # Nowhere in the table is the token itself.
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM knox_authtoken")
        stored = " ".join(str(value) for row_ in cursor.fetchall() for value in row_)
    assert token not in stored


def test_a_token_expires_after_the_configured_ttl(settings: Any, ops: Any) -> None:
    settings.ASYNCWORK = {**settings.ASYNCWORK, "API_TOKEN_TTL_HOURS": 3}
    before = timezone.now()
    issued = api_token_create(username="ops", actor="cli:test")
    assert before + timedelta(hours=3) <= issued.expiry <= timezone.now() + timedelta(hours=3)
    issue("ops", "--hours", "1")
    latest = AuthToken.objects.order_by("-created").first()
    assert latest is not None
    assert latest.expiry is not None
    assert latest.expiry - latest.created < timedelta(hours=1, seconds=5)
    assert AuthToken.objects.filter(user=ops, expiry__isnull=True).count() == 0


def test_an_expired_token_is_401_and_deleted(live_server: Any, ops: Any) -> None:
    token, _ = issue("ops")
    assert get(live_server, token).status_code == 200
    AuthToken.objects.filter(user=ops).update(expiry=timezone.now() - timedelta(seconds=1))

    response = get(live_server, token)

    assert response.status_code == 401
    assert response.json() == {"detail": "Invalid token."}
    assert not AuthToken.objects.filter(user=ops).exists()


def test_a_revoked_or_wrong_token_is_401(live_server: Any, ops: Any) -> None:
    token, _ = issue("ops")
    assert get(live_server, token[:-1] + ("0" if token[-1] != "0" else "1")).status_code == 401
    out = io.StringIO()
    call_command("api_token", "revoke", "ops", stdout=out)
    assert "revoked 1 token(s)" in out.getvalue()
    assert get(live_server, token).status_code == 401


@pytest.mark.parametrize(
    "header",
    [b"Token \xe9\xe9", b"Token", b"Token a b", b"Token " + b"f" * 5000, b"Bearer x"],
)
def test_malformed_authorization_headers_are_401_never_500(
    live_server: Any, ops: Any, header: bytes
) -> None:
    response = requests.get(
        live_server.url + INVOICES, headers={"Authorization": header}, timeout=10
    )
    assert response.status_code in (401, 403), response.text


@pytest.mark.parametrize("token", ["ab\x00cd", "\x7f" * 20, "ab\x1bcd"])
def test_control_characters_in_a_token_are_401_never_500(ops: Any, token: str) -> None:
    # Through Django's handler: an HTTP client library refuses to send these at all.
    client = APIClient(raise_request_exception=False)
    response = client.get(INVOICES, HTTP_AUTHORIZATION=f"Token {token}")
    assert (response.status_code, response.json()) == (401, {"detail": "Invalid token."})


def test_bad_command_input_is_a_clear_error(ops: Any) -> None:
    with pytest.raises(CommandError, match="no user named 'nobody'"):
        issue("nobody")
    with pytest.raises(CommandError, match="--hours must be at least 1"):
        issue("ops", "--hours", "0")
    get_user_model().objects.filter(pk=ops.pk).update(is_active=False)
    with pytest.raises(CommandError, match="inactive"):
        issue("ops")
    with pytest.raises(CommandError, match="no user named 'nobody'"):
        call_command("api_token", "revoke", "nobody", stdout=io.StringIO())
    assert not AuthToken.objects.exists()


def test_the_admin_lists_and_revokes_tokens_but_never_issues_one(
    live_server: Any, ops: Any
) -> None:
    token, _ = issue("ops")
    row = AuthToken.objects.get(user=ops)
    admin = Client()
    admin.force_login(get_user_model().objects.create_superuser("root", "r@example.com", "x"))

    listing = admin.get("/admin/knox/authtoken/")
    assert listing.status_code == 200
    assert row.token_key in listing.content.decode()
    assert token not in listing.content.decode()
    assert admin.get("/admin/knox/authtoken/add/").status_code == 403
    deleted = admin.post(f"/admin/knox/authtoken/{row.pk}/delete/", {"post": "yes"})
    assert deleted.status_code == 302
    assert not AuthToken.objects.exists()
    assert get(live_server, token).status_code == 401
    # Deleting from the list (the bulk action) revokes the same way; both are recorded.
    issue("ops")
    issue("ops")
    keys = set(AuthToken.objects.values_list("token_key", flat=True))
    listed = admin.post(
        "/admin/knox/authtoken/",
        {
            "action": "delete_selected",
            "_selected_action": list(AuthToken.objects.values_list("pk", flat=True)),
            "post": "yes",
        },
    )
    assert listed.status_code == 302
    assert not AuthToken.objects.exists()
    revoked = OperatorAction.objects.filter(action="api_token.revoke").order_by("pk")
    assert [(a.actor, a.target) for a in revoked] == [("admin:root", ops)] * 3
    before = [a.before or {} for a in revoked]
    assert before[0]["token_key"] == row.token_key
    assert {b["token_key"] for b in before[1:]} == keys


def test_the_schema_names_the_token_scheme() -> None:
    schema = SchemaGenerator().get_schema(request=None, public=True)
    scheme = schema["components"]["securitySchemes"]["knoxApiToken"]
    assert scheme == {**scheme, "type": "apiKey", "in": "header", "name": "Authorization"}


def audit_text() -> str:
    """Every stored value of every operator action, as one string."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT * FROM operators_operatoraction")
        return " ".join(str(value) for row in cursor.fetchall() for value in row)


def test_issuing_and_revoking_are_recorded_without_the_token(ops: Any) -> None:
    token, _ = issue("ops", "--actor", "alice")
    row = AuthToken.objects.get(user=ops)
    out = io.StringIO()
    call_command("api_token", "revoke", "ops", "--actor", "bob", stdout=out)

    issued, revoked = OperatorAction.objects.order_by("pk")
    assert (issued.action, issued.actor, issued.target) == ("api_token.issue", "cli:alice", ops)
    assert issued.after == {"token_key": row.token_key, "expiry": row.expiry.isoformat()}
    assert row.token_key in issued.detail
    assert (revoked.action, revoked.actor, revoked.target) == ("api_token.revoke", "cli:bob", ops)
    assert revoked.before == issued.after
    # Neither the token nor its digest is in the trail: only the lookup prefix.
    assert token not in audit_text()
    assert row.digest not in audit_text()
    assert token[len(row.token_key) :] not in audit_text()


def test_a_token_is_issued_or_revoked_with_its_record_or_not_at_all(ops: Any) -> None:
    # An action the trail refuses to record (no actor) rolls the change back with it.
    with pytest.raises(ValueError, match="needs an actor"):
        api_token_create(username="ops", actor="")
    assert not AuthToken.objects.exists()
    issue("ops")
    with pytest.raises(ValueError, match="needs an actor"):
        api_token_revoke(username="ops", actor="")
    assert AuthToken.objects.filter(user=ops).count() == 1
    assert list(OperatorAction.objects.values_list("action", flat=True)) == ["api_token.issue"]


def test_no_token_outlives_the_maximum_lifetime(settings: Any, ops: Any) -> None:
    assert "API_TOKEN_MAX_HOURS" not in settings.ASYNCWORK  # the default: 90 days
    settings.ASYNCWORK = {**settings.ASYNCWORK, "API_TOKEN_MAX_HOURS": 48}
    _, note = issue("ops", "--hours", "48")  # the maximum itself is allowed
    assert "expires at" in note
    with pytest.raises(CommandError, match=r"at most 48 hours \(API_TOKEN_MAX_HOURS\); 49 asked"):
        issue("ops", "--hours", "49")
    assert AuthToken.objects.count() == 1
    assert OperatorAction.objects.count() == 1  # the one token issued


def test_hours_above_the_maximum_exit_non_zero_with_one_line_and_no_token(ops: Any) -> None:
    """Through a real ``python manage.py``: the exit status and the message an operator sees."""
    result = python("manage.py", "api_token", "create", "ops", "--hours", "2161")
    assert result.returncode == 1
    assert result.stdout == ""  # nothing a script would take for a token
    assert result.stderr.splitlines() == [
        "CommandError: a token lives at most 2160 hours (API_TOKEN_MAX_HOURS); 2161 asked for"
    ]
    assert not AuthToken.objects.exists()
    assert not OperatorAction.objects.exists()

"""schemathesis against the API's OpenAPI schema: no request the schema allows (or that it does
not) gives a 5xx. Slow, and alone in its module: its cases are built as the module is collected,
which ``make check`` leaves out."""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from drf_spectacular.generators import SchemaGenerator
from hypothesis import HealthCheck, settings
from knox.models import AuthToken

from tests.helpers.deadletters import dead_letter
from tests.helpers.factories import staff_user

pytestmark = pytest.mark.slow

schema = schemathesis.openapi.from_dict(SchemaGenerator().get_schema(request=None, public=True))


@pytest.fixture
def token_header(db: Any) -> dict[str, str]:
    user = staff_user("fuzzer", groups=["operators"])
    dead_letter("fuzz-1")
    _, token = AuthToken.objects.create(user=user)
    return {"Authorization": f"Token {token}"}


@pytest.mark.django_db(transaction=True)
@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_schemathesis_no_5xx(case: Any, live_server: Any, token_header: dict[str, str]) -> None:
    response = case.call(base_url=live_server.url, headers=token_header)
    assert response.status_code < 500, (case.path, case.method, response.text[:500])

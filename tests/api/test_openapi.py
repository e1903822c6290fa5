"""GET /v1/openapi.json: an OpenAPI 3.1 document of exactly the routes served."""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from static._settings import ServerSettings
from static.api import create_app
from static.api._errors import BadRequest
from static.api._validation import (
    EMAIL_PATTERN,
    MAX_EMAIL_CHARS,
    MAX_NAME_CHARS,
    NAME_PATTERN,
    parse_new_account,
    parse_new_key,
)
from static.auth import open_authority
from static.store import open_database
from tests.support.api import Api

_METHODS = {"get", "post", "put", "patch", "delete"}


def _normalise(path: str) -> str:
    # "/v1/keys/<key_id>" (werkzeug) and "/v1/keys/{id}" (OpenAPI) are the same route.
    return re.sub(r"<[^>]+>|\{[^}]+\}", "{}", path)


def _documented(document: dict[str, object]) -> set[tuple[str, str]]:
    paths = document["paths"]
    assert isinstance(paths, dict)
    return {
        (_normalise(path), method.upper())
        for path, operations in paths.items()
        for method in operations
        if method in _METHODS
    }


def test_the_document_is_openapi_3_1(api: Api) -> None:
    response = api.http.get("/v1/openapi.json")
    assert response.status_code == 200
    document = response.json()
    assert document["openapi"].startswith("3.1")
    assert document["info"]["title"]
    for operations in document["paths"].values():
        for method, operation in operations.items():
            assert method in _METHODS
            assert operation["responses"]


def test_every_documented_operation_is_served(api: Api) -> None:
    document = api.http.get("/v1/openapi.json").json()
    for path, method in _documented(document):
        url = path.replace("{}", "00000000-0000-0000-0000-000000000000")
        response = api.http.request(method, url)
        # Unauthenticated, so a served route answers 200, 400 or 401: never "no such route".
        assert response.status_code not in {404, 405}, (method, path, response.status_code)


async def test_every_served_route_is_documented(tmp_path: Path) -> None:
    async with (
        open_database(f"sqlite:///{tmp_path / 'static.db'}") as db,
        open_authority(db, ServerSettings().api) as authority,
    ):
        app = create_app(db, ServerSettings(), authority)
        served = {
            (_normalise(rule.rule), method)
            for rule in app.url_map.iter_rules()
            for method in rule.methods or ()
            if method.lower() in _METHODS
        }
        response = await app.test_client().get("/v1/openapi.json")
        documented = _documented(await response.get_json())
    assert served == documented


# The schema's patterns and the parser decide alike, on any string (surrogates aside: JSON
# Schema has none, the parser refuses them).
_TEXT = st.text(
    st.characters(exclude_categories=["Cs"]) | st.sampled_from(" \t\n\x85\u3000@\x00\x7f"),
    max_size=260,
)


@settings(max_examples=500, deadline=None, database=None)
@given(value=_TEXT)
def test_the_email_schema_and_the_parser_agree(value: str) -> None:
    by_schema = len(value) <= MAX_EMAIL_CHARS and re.search(EMAIL_PATTERN, value) is not None
    try:
        parse_new_account({"email": value})
        by_parser = True
    except BadRequest:
        by_parser = False
    assert by_schema == by_parser


@settings(max_examples=500, deadline=None, database=None)
@given(value=_TEXT)
def test_the_name_schema_and_the_parser_agree(value: str) -> None:
    by_schema = len(value) <= MAX_NAME_CHARS and re.search(NAME_PATTERN, value) is not None
    try:
        parse_new_key({"name": value})
        by_parser = True
    except BadRequest:
        by_parser = False
    assert by_schema == by_parser

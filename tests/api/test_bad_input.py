"""Bad input never yields a 5xx, a stack trace or an HTML page: always a JSON 4xx."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.support.api import Api, assert_error, bearer, raw_request, unique_email


def _post_accounts(
    api: Api, body: bytes, content_type: str | None = "application/json"
) -> httpx.Response:
    headers = {"Content-Type": content_type} if content_type else {}
    return api.http.post("/v1/accounts", content=body, headers=headers)


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b'{"email": "a@b.c",}',
        b"{'email': 'a@b.c'}",
        b'{"email": "a@b.c"} trailing',
        b"\xff\xfe{}",
        b'{"email": "\xe9@b.c"}',  # latin-1, not UTF-8
        b'{"email": NaN}',
        b'{"email": Infinity}',
        b"[" * 100_00 + b"]" * 100_00,
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
    ],
    ids=[
        "truncated",
        "trailing-comma",
        "single-quotes",
        "trailing-garbage",
        "bom-garbage",
        "latin1",
        "nan",
        "infinity",
        "deep-array",
        "deep-object",
    ],
)
def test_malformed_json(api: Api, body: bytes) -> None:
    assert_error(_post_accounts(api, body), 400, "malformed json")


@pytest.mark.parametrize("body", [b"[]", b'"a@b.c"', b"42", b"null", b"true", b'[{"email":"x"}]'])
def test_body_must_be_an_object(api: Api, body: bytes) -> None:
    response = _post_accounts(api, body)
    assert_error(response, 400, "request body must be a json object")


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"],
)
def test_a_body_must_be_declared_json(api: Api, content_type: str | None) -> None:
    body = f'{{"email": "{unique_email()}"}}'.encode()
    response = _post_accounts(api, body, content_type)
    assert_error(response, 415, "content type must be application/json")


def test_json_content_type_with_parameters_is_fine(api: Api) -> None:
    body = f'{{"email": "{unique_email()}"}}'.encode()
    for content_type in ["application/json; charset=utf-8", "Application/JSON;charset=UTF-8"]:
        response = api.http.post(
            "/v1/accounts",
            content=body.replace(b"user-", f"user-{len(content_type)}-".encode()),
            headers={"Content-Type": content_type},
        )
        assert response.status_code == 200, response.text
    response = api.http.post(
        "/v1/accounts", content=body, headers={"Content-Type": "application/json; charset=latin-1"}
    )
    assert_error(response, 415)


def test_form_data_on_keys_is_refused(api: Api) -> None:
    signed = api.signup()
    response = api.http.post("/v1/keys", headers=bearer(signed.key), data={"name": "form"})
    assert_error(response, 415)
    assert len(api.keys(signed.key)) == 1


def test_oversized_body_is_413(api: Api) -> None:
    big = b'{"email": "' + b"a" * (64 * 1024) + b'@example.com"}'
    assert_error(_post_accounts(api, big), 413, "request body too large")
    signed = api.signup()
    for method, path in [("POST", "/v1/keys"), ("POST", "/v1/tokens"), ("GET", "/v1/keys")]:
        response = api.http.request(
            method,
            path,
            content=big,
            headers={**bearer(signed.key), "Content-Type": "application/json"},
        )
        assert_error(response, 413, "request body too large")


def test_oversized_chunked_body_is_413(api: Api) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"email": "'
        for _ in range(20):
            yield b"a" * 8192
        yield b'@example.com"}'

    response = api.http.post(
        "/v1/accounts", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert_error(response, 413, "request body too large")


def test_body_just_under_the_limit_is_read(api: Api) -> None:
    email = unique_email()
    body = f'{{"email": "{email}", "pad": "'.encode()
    body += b"p" * (64 * 1024 - len(body) - 2) + b'"}'
    assert len(body) == 64 * 1024
    response = _post_accounts(api, body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/"),
        ("GET", "/v1"),
        ("GET", "/v1/account"),
        ("GET", "/v1/keys/"),
        ("GET", "/v2/keys"),
        ("GET", "//v1//keys"),
        ("POST", "/v1/accounts/me/extra"),
        ("GET", "/v1/keys/a/b"),
        ("GET", "/static/../../etc/passwd"),
        ("GET", "/%00"),
    ],
)
def test_unknown_routes_are_json_404(api: Api, method: str, path: str) -> None:
    assert_error(api.http.request(method, path), 404, "Not found")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/accounts"),
        ("PUT", "/v1/accounts"),
        ("POST", "/v1/accounts/me"),
        ("DELETE", "/v1/accounts/me"),
        ("PUT", "/v1/keys"),
        ("DELETE", "/v1/keys"),
        ("GET", "/v1/keys/00000000-0000-0000-0000-000000000000"),
        ("PATCH", "/v1/keys/00000000-0000-0000-0000-000000000000"),
        ("GET", "/v1/tokens"),
        ("POST", "/.well-known/jwks.json"),
        ("POST", "/healthz"),
    ],
)
def test_wrong_methods_are_json_405(api: Api, method: str, path: str) -> None:
    response = api.http.request(method, path)
    assert_error(response, 405, "method not allowed")
    assert response.headers["allow"]
    assert method not in response.headers["allow"].replace(" ", "").split(",")


@pytest.mark.parametrize(
    "value",
    [
        "Bearer",
        "Bearer ",
        "Bearer    ",
        "Basic dXNlcjpwYXNz",
        "Token sk_live_x",
        "sk_live_" + "A" * 43,
        "Bearer two tokens",
        'Bearer "quoted"',
        "Bearer sk_live_a,b",
        "",
    ],
    ids=repr,
)
def test_malformed_authorization_headers(api: Api, value: str) -> None:
    # Raw bytes: httpx would refuse to send some of these.
    for method, path in [("GET", "/v1/accounts/me"), ("GET", "/v1/keys"), ("POST", "/v1/tokens")]:
        request = (
            f"{method} {path} HTTP/1.1\r\nHost: t\r\nAuthorization: {value}\r\n"
            "Content-Length: 0\r\nConnection: close\r\n\r\n"
        ).encode()
        response = raw_request(api.base_url, request)
        assert response.status == 401, (value, response)
        assert response.headers["content-type"] == "application/json"
        assert json.loads(response.body) == {"error": "invalid authorization header"}


def test_the_scheme_is_case_insensitive(api: Api) -> None:
    signed = api.signup()
    for scheme in ["bearer", "BEARER", "bEaReR"]:
        response = api.http.get(
            "/v1/accounts/me", headers={"Authorization": f"{scheme} {signed.key}"}
        )
        assert response.status_code == 200


def test_duplicate_authorization_headers_are_refused(api: Api) -> None:
    signed = api.signup()
    for values in [(signed.key, signed.key), (signed.key, "sk_live_" + "A" * 43)]:
        response = api.http.get(
            "/v1/accounts/me", headers=[("Authorization", f"Bearer {v}") for v in values]
        )
        assert_error(response, 401, "invalid authorization header")


@pytest.mark.parametrize(
    "value",
    [b"Bearer sk_live_\xe9\xe9", b"Bearer \xff\xfe", b"Bearer ab\x7fcd", b"Bearer caf\xc3\xa9"],
)
def test_non_ascii_authorization_values(api: Api, value: bytes) -> None:
    request = (
        b"GET /v1/accounts/me HTTP/1.1\r\nHost: test\r\nAuthorization: "
        + value
        + b"\r\nConnection: close\r\n\r\n"
    )
    response = raw_request(api.base_url, request)
    assert 400 <= response.status < 500
    if response.body:
        assert response.headers["content-type"].startswith("application/json")
        assert b"<" not in response.body


def test_raw_malformed_requests_get_no_5xx(api: Api) -> None:
    for request in [
        b"POST /v1/accounts HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/accounts HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n",
        b"GARBAGE\r\n\r\n",
        b"GET /v1/accounts/me HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer a\x00b\r\n\r\n",
    ]:
        response = raw_request(api.base_url, request)
        assert 400 <= response.status < 500, (request, response)
    # The server is still fine.
    assert api.http.get("/healthz").status_code == 200


def test_no_html_anywhere(api: Api) -> None:
    for method, path in [("GET", "/nope"), ("DELETE", "/v1/accounts"), ("GET", "/v1/accounts/me")]:
        response = api.http.request(method, path, headers={"Accept": "text/html"})
        assert response.headers["content-type"].startswith("application/json")
        assert "<html" not in response.text.lower()
        assert "traceback" not in response.text.lower()


def test_http2_request_answered_before_its_body_does_not_kill_the_server(api: Api) -> None:
    # Regression (hypercorn 0.17.3, still 0.18.0): DATA for a stream already answered raises
    # KeyError in the connection handler, which would end the whole server process.
    with httpx.Client(http1=False, http2=True, base_url=api.base_url, timeout=10) as h2:
        assert h2.get("/healthz").http_version == "HTTP/2"
        try:
            response = h2.post("/v1/keys", headers=bearer("garbage"), content=b"x" * 200_000)
        except httpx.HTTPError:
            pass  # the server may close that connection; it must stay up
        else:
            assert 400 <= response.status_code < 500
    for _ in range(3):
        assert api.http.get("/healthz").status_code == 200
    with httpx.Client(http1=False, http2=True, base_url=api.base_url, timeout=10) as h2:
        signed = api.signup()
        response = h2.get("/v1/accounts/me", headers=bearer(signed.key))
        assert response.http_version == "HTTP/2"
        assert response.json() == signed.account

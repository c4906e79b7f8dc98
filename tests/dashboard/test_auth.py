"""The dashboard's credentials: signed sessions, their expiry, CSRF tokens, bearer headers."""

from __future__ import annotations

from starlette.testclient import TestClient

from quota.dashboard import _auth
from tests.dashboard.conftest import BROWSER, login

TOKEN = "auth-test-token"


def test_a_session_is_valid_only_signed_with_the_token_and_unexpired() -> None:
    cookie = _auth.new_session(TOKEN, now=1_000_000)
    nonce = cookie.split(".")[1]
    assert _auth.session_id(TOKEN, cookie, now=1_000_001) == nonce
    assert _auth.session_id("another token", cookie, now=1_000_001) is None
    issued, _, mac = cookie.split(".")
    assert _auth.session_id(TOKEN, f"{issued}.{nonce}x.{mac}", now=1_000_001) is None
    assert _auth.session_id(TOKEN, f"{int(issued) + 1}.{nonce}.{mac}", now=1_000_001) is None
    expired = 1_000_000 + _auth.SESSION_TTL + 1
    assert _auth.session_id(TOKEN, cookie, now=expired) is None
    for bad in (None, "", "a.b", "x.y.z", "1.2.3.4"):
        assert _auth.session_id(TOKEN, bad, now=1_000_001) is None


def test_csrf_tokens_are_per_session_and_per_token() -> None:
    assert _auth.csrf_token(TOKEN, "a") != _auth.csrf_token(TOKEN, "b")
    assert _auth.csrf_token(TOKEN, "a") != _auth.csrf_token("other", "a")
    assert _auth.same(_auth.csrf_token(TOKEN, "a"), _auth.csrf_token(TOKEN, "a"))
    assert not _auth.same(None, "x")


def test_bearer_headers() -> None:
    assert _auth.bearer("Bearer abc") == "abc"
    assert _auth.bearer("bearer  abc ") == "abc"
    for bad in (None, "", "Basic abc", "Bearer", "Bearer  "):
        assert _auth.bearer(bad) is None


def test_logout_needs_the_csrf_token_and_ends_the_browser_session(client: TestClient) -> None:
    csrf = login(client)
    assert client.post("/logout", headers=BROWSER).status_code == 403
    assert client.get("/api/overview").status_code == 200
    r = client.post("/logout", data={"csrf_token": csrf}, headers=BROWSER, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    assert client.get("/api/overview").status_code == 401

"""`quota.dashboard.create_app` through Starlette's TestClient, on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

import quota
from quota.admin import Admin, PolicyRow
from quota.dashboard import create_app
from tests.dashboard.conftest import (
    BROWSER,
    HOT_KEY,
    HTML_KEY,
    SUBJECT,
    TOKEN,
    Seeded,
    csrf_of,
    login,
)

BEARER = {"authorization": f"Bearer {TOKEN}"}
#: Open without credentials, and holding no data.
OPEN = {"/health", "/login", "/static"}


def _routes(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every route of the app but the open ones."""
    found = []
    for route in app.routes:
        if isinstance(route, Mount) or route.path in OPEN:
            continue
        assert isinstance(route, Route)
        for method in sorted(route.methods or {"GET"}):
            if method != "HEAD":
                found.append((method, route.path))
    return found


def test_every_route_needs_the_token(app: Any, client: TestClient) -> None:
    routes = _routes(app)
    assert len(routes) >= 14
    for method, path in routes:
        api = client.request(
            method, path, headers={"accept": "application/json"}, follow_redirects=False
        )
        assert api.status_code == 401, (method, path)
        assert "Bearer" in api.headers["www-authenticate"]
        wrong = client.request(
            method,
            path,
            headers={"authorization": "Bearer nope", **BROWSER},
            follow_redirects=False,
        )
        assert wrong.status_code == 401, (method, path)
        page = client.request(method, path, headers=BROWSER, follow_redirects=False)
        if path.startswith("/api/"):
            assert page.status_code == 401, (method, path)
        else:
            assert page.status_code == 303, (method, path)
            assert page.headers["location"].startswith("/login?next="), (method, path)
        forged = client.request(
            method,
            path,
            follow_redirects=False,
            headers={**BROWSER, "cookie": f"quota_dashboard_session={int(time.time())}.abc.def"},
        )
        assert forged.status_code in (303, 401), (method, path)
    assert client.get("/health").json() == {"status": "ok"}


def test_the_bearer_token_reads_every_page(client: TestClient, seeded: Seeded) -> None:
    for path in ("/", "/keys", f"/quotas?subject={SUBJECT}", "/policies"):
        r = client.get(path, headers={**BEARER, **BROWSER})
        assert r.status_code == 200, path
    html = client.get("/quotas", params={"subject": SUBJECT}, headers={**BEARER, **BROWSER}).text
    assert 'aria-label="quota usage"' in html and "5 / 100" in html
    overview = client.get("/api/overview", headers=BEARER).json()
    assert overview["top"][0]["key"] == HOT_KEY
    assert overview["top"][0]["count"] == 7
    assert overview["health"]["reachable"] is True
    keys = client.get(
        "/keys", params={"key": HOT_KEY}, headers={**BEARER, "accept": "application/json"}
    ).json()
    assert keys["windows"][0]["count"] == 7
    with seeded.limiter.concurrency("<i>job</i>", 3):
        page = client.get("/keys", params={"key": "<i>job</i>"}, headers={**BEARER, **BROWSER})
        leased = client.get("/keys", headers={**BEARER, "accept": "application/json"}).json()
    assert (leased["leases"][0]["key"], leased["leases"][0]["held"]) == ("<i>job</i>", 1)
    assert "1 held, 2 free of 3" in page.text and "&lt;i&gt;job&lt;/i&gt;" in page.text
    assert "<i>job" not in page.text
    quotas = client.get(
        "/quotas", params={"subject": SUBJECT}, headers={**BEARER, "accept": "application/json"}
    ).json()
    assert quotas["usage"][0]["used"] == 5
    assert [e["idempotency_key"] for e in quotas["ledger"]] == ["job-1", "job-2"]


def test_login_form_sets_a_strict_http_only_cookie(client: TestClient) -> None:
    page = client.get("/login", headers=BROWSER)
    nonce = csrf_of(page.text)
    wrong = client.post("/login", data={"token": "nope", "csrf_token": nonce}, headers=BROWSER)
    assert wrong.status_code == 401
    assert "quota_dashboard_session" not in client.cookies
    nonce = csrf_of(wrong.text)
    r = client.post(
        "/login",
        data={"token": TOKEN, "csrf_token": nonce, "next": "/keys"},
        headers=BROWSER,
        follow_redirects=False,
    )
    assert r.status_code == 303
    assert r.headers["location"] == "/keys"
    cookie = r.headers["set-cookie"]
    assert "quota_dashboard_session=" in cookie
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
    assert "Secure" not in cookie  # plain HTTP here
    overview = client.get("/", headers=BROWSER)
    assert overview.status_code == 200
    assert HOT_KEY in overview.text
    assert client.get("/api/overview").status_code == 200


def test_login_needs_its_csrf_token_and_goes_only_to_this_app(client: TestClient) -> None:
    client.get("/login", headers=BROWSER)
    r = client.post("/login", data={"token": TOKEN, "csrf_token": "forged"}, headers=BROWSER)
    assert r.status_code == 403
    assert "quota_dashboard_session" not in client.cookies
    nonce = csrf_of(client.get("/login", headers=BROWSER).text)
    r = client.post(
        "/login",
        data={"token": TOKEN, "csrf_token": nonce, "next": "//evil.example/"},
        headers=BROWSER,
        follow_redirects=False,
    )
    assert r.headers["location"] == "/"


def test_https_sessions_are_secure_cookies(app: Any) -> None:
    with TestClient(app, base_url="https://testserver") as c:
        nonce = csrf_of(c.get("/login", headers=BROWSER).text)
        r = c.post(
            "/login",
            data={"token": TOKEN, "csrf_token": nonce},
            headers=BROWSER,
            follow_redirects=False,
        )
        assert "Secure" in r.headers["set-cookie"]


def test_a_post_without_its_csrf_token_changes_nothing(
    client: TestClient, seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    csrf = login(client)
    admin = Admin(seeded.limiter)
    changes = [
        ("/keys/reset", {"key": HOT_KEY}),
        ("/policies/set", {"route": "search", "rates": "5/minute"}),
        ("/policies/multiplier", {"tier": "auth", "multiplier": "2"}),
        ("/policies/abuse-threshold", {"threshold": "7"}),
        (
            "/quotas/grant",
            {"subject": SUBJECT, "name": "api-calls", "amount": "9", "period": "day"},
        ),
        ("/quotas/refund", {"subject": SUBJECT, "name": "api-calls", "idempotency_key": "job-1"}),
    ]
    with caplog.at_level(logging.WARNING, logger="quota.dashboard"):
        for path, data in changes:
            for token in (None, "forged", csrf[:-1] + ("0" if csrf[-1] != "0" else "1")):
                form = dict(data) if token is None else {**data, "csrf_token": token}
                r = client.post(path, data=form, headers=BROWSER)
                assert r.status_code == 403, (path, token)
    assert "CSRF" in caplog.text
    assert admin.windows(HOT_KEY)[0].count == 7
    assert admin.policies() == []
    assert admin.settings() == []
    usage = admin.usage(SUBJECT)
    assert (usage[0].used, usage[0].granted) == (5, 0)
    # With the token, the same change goes through.
    r = client.post("/keys/reset", data={"key": HOT_KEY, "csrf_token": csrf}, headers=BROWSER)
    assert r.status_code == 200
    assert admin.windows(HOT_KEY) == []


def test_changes_are_made_and_logged_with_who(
    client: TestClient, seeded: Seeded, caplog: pytest.LogCaptureFixture
) -> None:
    admin = Admin(seeded.limiter)
    with caplog.at_level(logging.INFO, logger="quota.dashboard"):
        r = client.post(
            "/quotas/grant",
            headers=BEARER,
            data={"subject": SUBJECT, "name": "api-calls", "amount": "10", "period": "day"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["granted"] == 10
        r = client.post(
            "/quotas/refund",
            headers=BEARER,
            data={"subject": SUBJECT, "name": "api-calls", "idempotency_key": "job-1"},
        )
        assert r.json()["result"]["refunded"] is True
        r = client.post(
            "/policies/multiplier",
            headers=BEARER,
            data={"tier": "auth", "multiplier": "2.5", "note": "launch"},
        )
        assert r.status_code == 200
        r = client.post("/policies/abuse-threshold", headers=BEARER, data={"threshold": "40"})
        assert r.status_code == 200
        csrf = login(client)
        r = client.post(
            "/keys/reset",
            headers=BROWSER,
            data={"key": HOT_KEY, "window": "3600", "csrf_token": csrf},
        )
        assert r.status_code == 200
        assert "reset window 3600s of key" in r.text
    usage = admin.usage(SUBJECT)[0]
    assert (usage.used, usage.granted) == (2, 10)
    assert {s.name: s.value for s in admin.settings()} == {
        "tier_multiplier.auth": "2.5",
        "abuse_threshold": "40",
    }
    assert admin.windows(HOT_KEY) == []
    lines = [r.getMessage() for r in caplog.records if r.name == "quota.dashboard"]
    assert any(line.startswith("bearer: granted 10 to 'tenant:acme'") for line in lines), lines
    assert any(re.match(r"session \S+: reset window 3600s of key 'user:hot'", x) for x in lines)


def test_bad_values_are_refused_as_quota_policy_refuses_them(
    client: TestClient, seeded: Seeded
) -> None:
    refused = [
        ("/policies/set", {"route": "search"}, "nothing to override"),
        ("/policies/set", {"route": "search", "algorithm": "gcra", "cost": "2"}, "give rates"),
        ("/policies/set", {"route": "search", "rates": "lots"}, "lots"),
        ("/policies/set", {"route": "search", "cost": "0"}, "cost"),
        ("/policies/set", {"route": "s", "subject": "a", "tier": "b", "cost": "1"}, "at most one"),
        ("/policies/multiplier", {"tier": "auth", "multiplier": "5000"}, "5000"),
        ("/policies/abuse-threshold", {"threshold": "x"}, "threshold"),
    ]
    for path, data, words in refused:
        r = client.post(path, data=data, headers=BEARER)
        assert r.status_code == 400, (path, data)
        assert words in r.json()["error"], r.json()
    assert Admin(seeded.limiter).policies() == []
    assert Admin(seeded.limiter).settings() == []


def test_keys_and_labels_render_escaped(client: TestClient, seeded: Seeded) -> None:
    Admin(seeded.limiter).set_policy(
        PolicyRow(
            route="search", subject='"><img src=x onerror=alert(1)>', cost=2, note="<b>bold</b>"
        )
    )
    csrf = login(client)
    pages = {
        "/": client.get("/", headers=BROWSER).text,
        "/keys": client.get("/keys", params={"q": "<script"}, headers=BROWSER).text,
        "/keys?key": client.get("/keys", params={"key": HTML_KEY}, headers=BROWSER).text,
        "/keys/reset": client.get("/keys/reset", params={"key": HTML_KEY}, headers=BROWSER).text,
        "/quotas": client.get("/quotas", params={"subject": "<i>x</i>"}, headers=BROWSER).text,
        "/policies": client.get("/policies", headers=BROWSER).text,
    }
    for name, html in pages.items():
        assert "<script>window" not in html, name
        assert "<img" not in html and "<b>bold" not in html and "<i>x" not in html, name
    assert "&lt;script&gt;window.pwned=1;alert(1)&lt;/script&gt;" in pages["/keys"]
    # And should one slip through, no inline script would run.
    csp = client.get("/keys", headers=BROWSER).headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "&lt;script&gt;window.pwned" in pages["/"]
    assert 'value="&#34;&gt;&lt;img' in pages["/policies"]
    # The reset form posts the key back exactly.
    assert (
        client.post(
            "/keys/reset", data={"key": HTML_KEY, "csrf_token": csrf}, headers=BROWSER
        ).status_code
        == 200
    )
    assert Admin(seeded.limiter).windows(HTML_KEY) == []


def test_read_only_refuses_every_change(seeded: Seeded) -> None:
    app = create_app(seeded.url, token=TOKEN, read_only=True)
    try:
        with TestClient(app) as client:
            csrf = login(client)
            for method, path in _routes(app):
                if method != "POST" or path == "/logout":
                    continue
                for headers, data in ((BEARER, {}), (BROWSER, {"csrf_token": csrf})):
                    r = client.post(
                        path,
                        data={
                            **data,
                            "key": HOT_KEY,
                            "route": "x",
                            "cost": "1",
                            "tier": "auth",
                            "multiplier": "2",
                            "threshold": "1",
                            "name": "abuse_threshold",
                        },
                        headers=headers,
                    )
                    assert r.status_code == 403, (path, headers)
            assert "read-only" in client.get("/policies", headers=BROWSER).text
            assert 'action="/policies/set"' not in client.get("/policies", headers=BROWSER).text
    finally:
        app.state.dashboard.admin.close()
    assert Admin(seeded.limiter).windows(HOT_KEY)[0].count == 7
    assert Admin(seeded.limiter).policies() == []


def test_a_policy_set_in_the_form_is_listed_by_quota_policy(
    client: TestClient, seeded: Seeded
) -> None:
    csrf = login(client)
    r = client.post(
        "/policies/set",
        headers=BROWSER,
        data={
            "csrf_token": csrf,
            "route": "search",
            "tier": "anon",
            "rates": "10/minute",
            "algorithm": "sliding_window",
            "fail_open": "closed",
            "note": "from the form",
        },
    )
    assert r.status_code == 200
    assert "set policy &#39;search&#39; for &#39;tier:anon&#39;" in r.text
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "from quota._cli import main; main()",
            "policy",
            "list",
            "--json",
            "--url",
            seeded.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    import json

    rows = json.loads(listed.stdout)
    assert [
        (r["route"], r["subject"], r["rates"], r["algorithm"], r["fail_open"], r["note"])
        for r in rows
    ] == [("search", "tier:anon", "10/minute", "sliding_window", False, "from the form")]
    r = client.post(
        "/policies/delete",
        headers=BROWSER,
        data={"csrf_token": csrf, "route": "search", "subject": "tier:anon"},
    )
    assert "deleted policy" in r.text
    assert Admin(seeded.limiter).policies() == []


def test_mounted_under_a_prefix_links_stay_under_it(seeded: Seeded) -> None:
    dashboard = create_app(seeded.url, token=TOKEN)
    outer = Starlette(routes=[Mount("/ops/quota", app=dashboard)])
    try:
        with TestClient(outer) as client:
            r = client.get("/ops/quota/keys", headers=BROWSER, follow_redirects=False)
            assert r.status_code == 303
            assert r.headers["location"] == "/ops/quota/login?next=%2Fkeys"
            login(client, "/ops/quota")
            for path in ("/", "/keys", f"/quotas?subject={SUBJECT}", "/policies"):
                html = client.get(f"/ops/quota{path}", headers=BROWSER).text
                links = re.findall(r'(?:href|action|src)="([^"#]*)"', html)
                assert links, path
                for link in links:
                    assert link.startswith("/ops/quota/"), (path, link)
            assert client.get("/ops/quota/static/dashboard.js").status_code == 200
            assert client.get("/ops/quota/api/overview").json()["top"][0]["key"] == HOT_KEY
    finally:
        dashboard.state.dashboard.admin.close()


def test_a_limiter_given_works_sync_and_async(seeded: Seeded) -> None:
    with TestClient(create_app(seeded.limiter, token=TOKEN)) as client:
        assert client.get("/api/overview", headers=BEARER).json()["top"][0]["count"] == 7
    limiter = quota.connect_async(seeded.url, pool_size=2)
    with TestClient(create_app(limiter, token=TOKEN)) as client:
        assert client.get("/api/overview", headers=BEARER).json()["top"][0]["count"] == 7
        client.portal.call(limiter.aclose)  # type: ignore[union-attr]


def test_bad_arguments_are_refused_when_built() -> None:
    with pytest.raises(quota.ConfigurationError, match="token"):
        create_app("sqlite:///x.db", token="")
    with pytest.raises(quota.ConfigurationError, match="limiter_or_url"):
        create_app(42, token=TOKEN)  # type: ignore[arg-type]

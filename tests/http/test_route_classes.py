"""Typos are told, not silently ignored.

The middlewares record the route classes they serve (``route_class.<name>`` rows of
``quota_settings``, at their first read of the runtime policies), so ``quota policy set``
and ``quota doctor`` warn about an override of a class nobody serves; a ``QUOTA_*``
environment variable that no setting reads is logged once, naming the closest known one.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from click.testing import CliRunner

import quota
from quota._cli import main
from quota.admin import Admin
from quota.http import HttpConfig, RoutePolicy
from quota.http.asgi import QuotaMiddleware
from quota.http.wsgi import QuotaWSGIMiddleware

SECRET = "route-classes-test-secret-0123456789"


def config(**more: Any) -> HttpConfig:
    return HttpConfig(
        policies=[
            RoutePolicy(name="api", paths=["/api"], rates="100/minute"),
            RoutePolicy(name="search", paths=["/search"], rates="10/minute"),
        ],
        hash_secret=SECRET,
        policy_cache_seconds=0,
        **more,
    )


def wsgi_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def wsgi_get(app: Any, path: str) -> str:
    status: list[str] = []
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "REMOTE_ADDR": "203.0.113.7"}
    b"".join(app(environ, lambda s, h, e=None: status.append(s)))
    return status[0]


def serve_once(url: str) -> None:
    app = QuotaWSGIMiddleware(wsgi_app, url=url, config=config())
    try:
        assert wsgi_get(app, "/api/x").startswith("200")
    finally:
        app.limiter.close()


def cli(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), env={"QUOTA_DATABASE_URL": None})


def test_a_wsgi_middleware_records_the_classes_it_serves(sql_url: str, caplog: Any) -> None:
    with quota.connect(sql_url) as limiter:
        assert Admin(limiter).served_routes() == []
    with caplog.at_level(logging.WARNING, logger="quota"):
        serve_once(sql_url)
        serve_once(sql_url)  # recorded once: the second finds them there
    with quota.connect(sql_url) as limiter:
        assert Admin(limiter).served_routes() == ["api", "search"]
        assert Admin(limiter).settings() == []  # no setting
    assert not [r for r in caplog.records if "quota_settings" in r.getMessage()]


def test_an_asgi_middleware_records_them_too(sql_url: str) -> None:
    starlette = pytest.importorskip("starlette.applications")
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    app = starlette.Starlette(routes=[Route("/api/x", lambda _r: PlainTextResponse("ok"))])
    app.add_middleware(QuotaMiddleware, url=sql_url, config=config())
    with TestClient(app) as client, quota.connect(sql_url) as limiter:
        # Recorded with a read of the runtime policies; the middleware's own limiter on
        # PostgreSQL holds that read to its fallback's budget, so a read refused while its
        # first connection opens (a loaded machine) leaves the record to the next one.
        deadline = time.monotonic() + 30
        while True:
            assert client.get("/api/x").status_code == 200
            served = Admin(limiter).served_routes()
            if served or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert served == ["api", "search"]


def test_policy_set_warns_about_a_route_class_nobody_serves(sql_url: str) -> None:
    serve_once(sql_url)
    typo = cli("policy", "set", "apii", "--rates", "1/minute", "--url", sql_url)
    assert typo.exit_code == 0, typo.output
    assert typo.stdout.strip() == "set apii for *"
    assert "no middleware on this database serves a route class 'apii'" in typo.stderr
    assert "did you mean 'api'?" in typo.stderr
    other = cli("policy", "set", "nosuchroute", "--rates", "1/minute", "--url", sql_url)
    assert "'nosuchroute'" in other.stderr and "api, search" in other.stderr
    fine = cli("policy", "set", "search", "--rates", "1/minute", "--url", sql_url)
    assert (fine.exit_code, fine.stderr) == (0, "")
    every = cli("policy", "set", "*", "--rates", "1/minute", "--url", sql_url)
    assert (every.exit_code, every.stderr) == (0, "")


def test_policy_set_is_quiet_before_any_middleware_recorded_its_classes(sqlite_url: str) -> None:
    result = cli("policy", "set", "apii", "--rates", "1/minute", "--url", sqlite_url)
    assert (result.exit_code, result.stderr) == (0, "")


def test_doctor_flags_an_override_of_a_class_nobody_serves(sql_url: str) -> None:
    serve_once(sql_url)
    assert cli("policy", "set", "apii", "--rates", "1/minute", "--url", sql_url).exit_code == 0
    found = [f for f in quota.diagnose(sql_url, timeout=5) if f.check == "route_classes"]
    assert [f.severity for f in found] == ["warn"]
    assert "'apii'" in found[0].message and "did you mean 'api'?" in found[0].message
    assert "quota policy delete apii" in found[0].fix
    cli("policy", "delete", "apii", "--url", sql_url)
    cli("policy", "set", "api", "--rates", "1/minute", "--url", sql_url)
    found = [f for f in quota.diagnose(sql_url, timeout=5) if f.check == "route_classes"]
    assert [f.severity for f in found] == ["ok"]


# -- environment variables ------------------------------------------------------------------


def _warnings(caplog: Any) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "quota" and r.levelno == 30]


def test_a_misspelt_variable_is_logged_once_with_the_closest_name(caplog: Any) -> None:
    word = uuid.uuid4().hex[:6].upper()  # a name no other test has had logged
    env = {f"QUOTA_POLICY_APII{word}_RATES": "1/minute", "QUOTA_SHADW" + word: "1"}
    api = RoutePolicy(name="api", paths=["/api"], rates="100/minute")
    with caplog.at_level(logging.WARNING, logger="quota"):
        HttpConfig.from_env(env, policies=[api], hash_secret=SECRET)
        HttpConfig.from_env(env, policies=[api], hash_secret=SECRET)
    logged = _warnings(caplog)
    assert len(logged) == 2, logged
    assert any(f"QUOTA_POLICY_APII{word}_RATES" in m and "QUOTA_POLICY_API_RATES" in m
               for m in logged)  # fmt: skip
    assert any("QUOTA_SHADOW?" in m for m in logged)


def test_known_variables_are_not_logged(caplog: Any) -> None:
    env = {
        "QUOTA_POLICY_API_RATES": "5/minute",
        "QUOTA_POLICY_DEFAULT_RATES": "5/minute",
        "QUOTA_SHADOW": "0",
        "QUOTA_DATABASE_URL": "sqlite:///x.db",
        "QUOTA_SHED_CEILING": "10",
        "QUOTA_TEST_POSTGRES_URL": "postgresql://x/y",
        "OTHER_THING": "1",
    }
    api = RoutePolicy(name="api", paths=["/api"], rates="100/minute")
    with caplog.at_level(logging.WARNING, logger="quota"):
        HttpConfig.from_env(env, policies=[api], hash_secret=SECRET)
    assert _warnings(caplog) == []

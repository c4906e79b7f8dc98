"""`quota dashboard`: the token rule, checked before binding, and the app it serves."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.error
import urllib.request

import pytest

from tests.dashboard.conftest import HOT_KEY, TOKEN, Seeded, free_port, quota_command, served

pytestmark = pytest.mark.slow


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        quota_command("dashboard", *args), env=env, capture_output=True, text=True, timeout=60
    )


def _env(**extra: str) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k != "QUOTA_DASHBOARD_TOKEN"}
    env.update(extra)
    return env


def _bound(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_it_refuses_to_start_without_a_token(sqlite_url: str) -> None:
    port = free_port()
    for extra in ([], ["--read-only"]):
        r = _run("--url", sqlite_url, "--port", str(port), *extra, env=_env())
        assert r.returncode == 2, r
        assert "QUOTA_DASHBOARD_TOKEN" in r.stderr
        assert not _bound(port)
    empty = _run("--url", sqlite_url, "--port", str(port), env=_env(QUOTA_DASHBOARD_TOKEN=""))
    assert empty.returncode == 2 and "QUOTA_DASHBOARD_TOKEN" in empty.stderr


def test_insecure_local_is_for_loopback_only(sqlite_url: str) -> None:
    port = free_port()
    r = _run(
        "--url",
        sqlite_url,
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        "--insecure-local",
        env=_env(),
    )
    assert r.returncode == 2, r
    assert "loopback" in r.stderr and "QUOTA_DASHBOARD_TOKEN" in r.stderr
    assert not _bound(port)


def test_a_database_not_there_is_exit_3_before_serving(tmp_path: object) -> None:
    r = _run("--url", f"sqlite:///{tmp_path}/absent.db", env=_env(QUOTA_DASHBOARD_TOKEN=TOKEN))
    assert r.returncode == 3 and "does not exist" in r.stderr


def test_it_serves_the_app_behind_the_token(seeded: Seeded) -> None:
    with served(seeded.url) as base:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{base}/api/overview", timeout=10)
        assert refused.value.code == 401
        refused.value.close()
        ask = urllib.request.Request(
            f"{base}/api/overview", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(ask, timeout=10) as r:
            body = json.load(r)
            assert body["top"][0]["key"] == HOT_KEY
            # A process of its own makes no decisions: no rates, and the page says why.
            assert body["rates"] is None
        page = urllib.request.Request(
            f"{base}/", headers={"Authorization": f"Bearer {TOKEN}", "Accept": "text/html"}
        )
        with urllib.request.urlopen(page, timeout=10) as r:
            html = r.read().decode()
            assert 'id="rates-hint"' in html and "never sees them" in html
    with served(seeded.url, "--read-only") as base:
        change = urllib.request.Request(
            f"{base}/keys/reset",
            data=f"key={HOT_KEY}".encode(),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(change, timeout=10)
        assert refused.value.code == 403
        refused.value.close()

"""``quota policy list/set/delete``: the runtime overrides from the command line."""

from __future__ import annotations

import json

from click.testing import CliRunner

from quota._cli import main
from quota.http import hashed_subject

SECRET = "cli-hash-secret-0123456789"


def _run(url: str, *args: str, secret: str | None = SECRET) -> tuple[int, str]:
    env = {"QUOTA_HASH_SECRET": secret} if secret else {"QUOTA_HASH_SECRET": ""}
    result = CliRunner().invoke(main, ["--url", url, "policy", *args], env=env)
    return result.exit_code, result.output


def test_set_list_and_delete_overrides(sqlite_url: str) -> None:
    assert _run(sqlite_url, "list")[1].strip() == "no overrides"
    assert _run(sqlite_url, "set", "api", "--rates", "5/minute", "--note", "launch")[0] == 0
    assert _run(sqlite_url, "set", "*", "--tier", "auth", "--exempt")[0] == 0
    code, out = _run(sqlite_url, "set", "chat", "--ip", "198.51.100.7", "--fail-closed", "--json")
    assert code == 0
    stored = json.loads(out)
    assert stored["subject"] == hashed_subject("ip", "198.51.100.7", SECRET.encode())
    assert stored["fail_open"] is False

    code, out = _run(sqlite_url, "list", "--json")
    rows = {(r["route"], r["subject"]): r for r in json.loads(out)}
    assert set(rows) == {("api", "*"), ("*", "tier:auth"), ("chat", stored["subject"])}
    assert rows[("api", "*")]["rates"] == "5/minute"
    assert rows[("*", "tier:auth")]["exempt"] is True
    assert "198.51.100.7" not in out, "the raw IP is never stored"

    assert _run(sqlite_url, "delete", "api")[0] == 0
    assert _run(sqlite_url, "delete", "api")[0] == 4
    assert _run(sqlite_url, "delete", "chat", "--ip", "198.51.100.7")[0] == 0
    assert len(json.loads(_run(sqlite_url, "list", "--json")[1])) == 1


def test_a_second_set_replaces_the_row(sqlite_url: str) -> None:
    _run(sqlite_url, "set", "api", "--rates", "5/minute", "--cost", "2")
    _run(sqlite_url, "set", "api", "--rates", "9/minute")

    (row,) = json.loads(_run(sqlite_url, "list", "--json")[1])
    assert (row["rates"], row["cost"]) == ("9/minute", None)


def test_bad_input_is_a_usage_error(sqlite_url: str) -> None:
    assert _run(sqlite_url, "set", "api", "--rates", "5/lightyear")[0] == 2
    assert _run(sqlite_url, "set", "api", "--tier", "auth", "--ip", "1.2.3.4")[0] == 2
    code, out = _run(sqlite_url, "set", "api", "--token", "t", secret=None)
    assert code == 2
    assert "QUOTA_HASH_SECRET" in out


def test_a_database_without_the_table_is_exit_3(tmp_path: object) -> None:
    url = f"sqlite:///{tmp_path}/missing.db"
    assert _run(url, "list")[0] == 3

"""The 429 body and the partition key of draft-ietf-httpapi-ratelimit-headers-10.

- The default 429 is the draft's ``quota-exceeded`` problem type, its
  ``violated-policies`` naming the policy that denied exactly as
  ``RateLimit-Policy`` and ``RateLimit`` name it (read back with a real
  Structured Field Values parser, ``http_sfv``), and it keeps the members
  clients already read (``code``, ``retry_after``, ``limit``, ``window``,
  ``burst``). ``problem_type="about:blank"`` gives back the earlier body
  byte for byte.
- The 503 of a fail-closed class whose limiter failed stays ``about:blank``:
  no quota was exceeded or lowered, the limiter could not decide.
- ``partition_key=True`` adds ``pk`` (a Byte Sequence) to every item of both
  fields: stable for one caller, apart for two, the same on every instance
  sharing the hash secret, and free of the IP or token. Off (the default),
  the fields are exactly what they were, the policy value a cached string.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from http_sfv.list import List as SfList  # the `test` extra

import quota
from quota import ConfigurationError, Decision
from quota.http import HttpConfig, RoutePolicy
from quota.http._responses import (
    QUOTA_EXCEEDED,
    PolicyShape,
    partition_key,
    rate_limit_headers,
    too_many_requests,
    unavailable,
)
from tests._http_support import FRAMEWORKS, HttpClient, Reply, make_client
from tests._support import Clock

SECRET = "problem-test-secret-0123456789"
NOW = 1_750_000_000.5
ALLOWED = Decision(True, "k", 100, 40, 60, 60, 1_750_000_020, 0)
DENIED = Decision(False, "k", 100, 0, 100, 60, 1_750_000_020, 20)


def config(rates: str = "3/minute", **changes: Any) -> HttpConfig:
    settings: dict[str, Any] = {
        "policies": [RoutePolicy(name="api", paths=["/api"], rates=rates)],
        "hash_secret": SECRET,
        "runtime_policies": False,
    }
    settings.update(changes)
    return HttpConfig(**settings)


@pytest.fixture(params=FRAMEWORKS)
def make(
    request: pytest.FixtureRequest, tmp_path: Path, clock: Clock
) -> Iterator[Callable[..., HttpClient]]:
    url = f"sqlite:///{tmp_path / 'quota.db'}"
    quota.migrate(url)
    clients: list[HttpClient] = []

    def build(cfg: HttpConfig, **options: Any) -> HttpClient:
        client = make_client(request.param, url, clock, cfg, **options)
        clients.append(client)
        return client

    yield build
    for client in clients:
        client.close()


def sf_list(reply: Reply, name: str) -> SfList:
    parsed = SfList()
    parsed.parse((reply.header(name) or "").encode())
    return parsed


def until_denied(client: HttpClient, limit: int, **headers: str) -> Reply:
    for _ in range(limit):
        assert client.get("/api/items", **headers).status == 200
    denied = client.get("/api/items", **headers)
    assert denied.status == 429
    return denied


# -- the 429 body --------------------------------------------------------------------


def test_the_default_429_is_the_quota_exceeded_problem_type(make: Any) -> None:
    denied = until_denied(make(config()), 3)

    body = denied.json()
    retry = int(denied.header("Retry-After") or 0)
    assert denied.header("Content-Type") == "application/problem+json"
    assert body == {
        "type": "https://iana.org/assignments/http-problem-types#quota-exceeded",
        "title": "Quota Exceeded",
        "status": 429,
        "detail": f"Rate limit of 3 per minute exceeded; retry after {retry}s.",
        "violated-policies": ["api"],
        "code": "RATE_LIMITED",
        "retry_after": retry,
        "limit": 3,
        "window": 60,
    }
    assert body["type"] == QUOTA_EXCEEDED
    (policy,) = sf_list(denied, "RateLimit-Policy")
    (limit,) = sf_list(denied, "RateLimit")
    assert body["violated-policies"] == [policy.value] == [limit.value]
    assert limit.params["t"] == retry


def test_violated_policies_names_the_rate_that_denied_among_several(make: Any) -> None:
    """``100/minute;3/day``: the daily rate denies, and the body names it as the fields do."""
    denied = until_denied(make(config("100/minute;3/day")), 3)

    body = denied.json()
    policies = [item.value for item in sf_list(denied, "RateLimit-Policy")]
    (limit,) = sf_list(denied, "RateLimit")
    assert policies == ["api-0", "api-1"]
    assert body["violated-policies"] == ["api-1"] == [limit.value]
    assert (body["limit"], body["window"]) == (3, 86400)


def test_a_token_bucket_429_keeps_its_burst(make: Any) -> None:
    denied = until_denied(make(config("1/s burst 5")), 5)

    body = denied.json()
    (policy,) = sf_list(denied, "RateLimit-Policy")
    assert body["violated-policies"] == [policy.value] == ["api"]
    assert (body["limit"], body["window"], body["burst"]) == (1, 1, 5)
    assert policy.params["quota-burst"] == 5


@pytest.mark.parametrize("style", ["legacy", "none"])
def test_violated_policies_is_there_without_the_ietf_fields(make: Any, style: str) -> None:
    denied = until_denied(make(config(headers=style)), 3)

    assert denied.header("RateLimit-Policy") is None
    assert denied.json()["violated-policies"] == ["api"]


def test_about_blank_gives_back_the_earlier_body_exactly(make: Any) -> None:
    denied = until_denied(make(config(problem_type="about:blank")), 3)

    retry = int(denied.header("Retry-After") or 0)
    assert denied.body == (
        b'{"type":"about:blank","title":"Too Many Requests","status":429,'
        b'"detail":"Rate limit of 3 per minute exceeded; retry after %ds.",'
        b'"code":"RATE_LIMITED","retry_after":%d,"limit":3,"window":60}' % (retry, retry)
    )
    assert denied.header("Content-Length") == str(len(denied.body))


def test_about_blank_keeps_the_burst_member() -> None:
    shape = PolicyShape("api", [quota.parse_rates("1/s burst 5")[0]])
    denied = Decision(False, "k", 5, 0, 5, 1, 1_750_000_001, 1)

    body = json.loads(too_many_requests(denied, [], shape, "about:blank").body)

    assert body == {
        "type": "about:blank", "title": "Too Many Requests", "status": 429,
        "detail": "Rate limit of 1 per second, bursts of 5 exceeded; retry after 1s.",
        "code": "RATE_LIMITED", "retry_after": 1, "limit": 1, "window": 1, "burst": 5,
    }  # fmt: skip


def test_without_a_shape_no_policy_is_named() -> None:
    body = json.loads(too_many_requests(DENIED, []).body)

    assert body["type"] == QUOTA_EXCEEDED
    assert "violated-policies" not in body
    assert (body["limit"], body["window"], body["retry_after"]) == (100, 60, 20)


def test_the_503_of_a_failed_limiter_stays_about_blank() -> None:
    body = json.loads(unavailable(5).body)

    assert body["type"] == "about:blank"
    assert body["status"] == 503
    assert body["code"] == "RATE_LIMIT_UNAVAILABLE"
    assert "violated-policies" not in body


# -- configuration -------------------------------------------------------------------


def test_the_problem_type_and_partition_key_come_from_the_environment() -> None:
    default = HttpConfig.from_env({})
    assert (default.problem_type, default.partition_key) == ("quota-exceeded", False)

    env = {"QUOTA_PROBLEM_TYPE": " about:blank ", "QUOTA_PARTITION_KEY": "true"}
    cfg = HttpConfig.from_env(env)
    assert (cfg.problem_type, cfg.partition_key) == ("about:blank", True)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"QUOTA_PROBLEM_TYPE": "quota_exceeded"}, "$QUOTA_PROBLEM_TYPE"),
        ({"QUOTA_PARTITION_KEY": "maybe"}, "$QUOTA_PARTITION_KEY"),
    ],
)
def test_a_malformed_variable_is_refused_by_name(env: dict[str, str], named: str) -> None:
    with pytest.raises(ConfigurationError, match=f"\\{named}"):
        HttpConfig.from_env(env)


@pytest.mark.parametrize(
    "changes", [{"problem_type": "https://example.com/x"}, {"partition_key": "yes"}]
)
def test_bad_settings_are_refused(changes: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match=next(iter(changes))):
        HttpConfig(**changes)


# -- pk ------------------------------------------------------------------------------


def test_off_the_fields_are_as_before_and_the_policy_is_the_cached_string() -> None:
    shape = PolicyShape("api", [(100, 60), (1000, 86400)])

    both = dict(rate_limit_headers(ALLOWED, shape, NOW, "both", retry_after=False))

    assert both["RateLimit-Policy"] is shape.policy
    assert both == {
        "X-RateLimit-Limit": "100",
        "X-RateLimit-Remaining": "40",
        "X-RateLimit-Reset": "1750000020",
        "RateLimit-Policy": '"api-0";q=100;w=60, "api-1";q=1000;w=86400',
        "RateLimit": '"api-0";r=40;t=20',
    }


@pytest.mark.parametrize("style", ["both", "legacy", "ietf", "none"])
@pytest.mark.parametrize("decision", [ALLOWED, DENIED], ids=["allowed", "denied"])
def test_pk_only_adds_a_parameter_in_every_style(style: str, decision: Decision) -> None:
    shape = PolicyShape("api", [(100, 60), quota.parse_rates("1/s burst 5")[0]])
    secret = SECRET.encode()
    plain = rate_limit_headers(decision, shape, NOW, style, retry_after=not decision.allowed)
    keyed = rate_limit_headers(
        decision, shape, NOW, style, retry_after=not decision.allowed,
        partition="http:api:anon:ip:abc", secret=secret,
    )  # fmt: skip

    assert [name for name, _ in keyed] == [name for name, _ in plain]
    pk = partition_key("http:api:anon:ip:abc", secret)
    for (name, with_pk), (_, without) in zip(keyed, plain, strict=True):
        if name in ("RateLimit-Policy", "RateLimit"):
            parsed, bare = SfList(), SfList()
            parsed.parse(with_pk.encode())
            bare.parse(without.encode())
            assert [i.value for i in parsed] == [i.value for i in bare]
            for item, before in zip(parsed, bare, strict=True):
                assert isinstance(item.params["pk"], bytes)
                assert len(item.params["pk"]) == 12
                assert f":{base64.b64encode(item.params['pk']).decode()}:" == pk
                rest = {k: v for k, v in item.params.items() if k != "pk"}
                assert rest == dict(before.params)
            assert with_pk.count(f";pk={pk}") == len(parsed)
        else:
            assert with_pk == without


def _pk(reply: Reply) -> tuple[bytes, bytes]:
    (policy,) = sf_list(reply, "RateLimit-Policy")
    (limit,) = sf_list(reply, "RateLimit")
    return policy.params["pk"], limit.params["pk"]


def test_pk_names_the_callers_partition(make: Any) -> None:
    client = make(config("5/minute", partition_key=True), token_validator=lambda _token: True)

    one = [client.get("/api/items", authorization="Bearer token-one") for _ in range(2)]
    two = client.get("/api/items", authorization="Bearer token-two")
    anon = client.get("/api/items")

    pks = {_pk(r) for r in one}
    assert len(pks) == 1, "one caller, one partition key"
    ((on_policy, on_limit),) = pks
    assert on_policy == on_limit
    assert _pk(two)[0] != on_policy
    assert _pk(anon)[0] not in (on_policy, _pk(two)[0])
    for reply in (*one, two, anon):
        for field in ("RateLimit-Policy", "RateLimit"):
            value = reply.header(field) or ""
            assert "token" not in value and "203.0.113.9" not in value


def test_pk_is_on_the_429_too(make: Any) -> None:
    client = make(config(partition_key=True))
    allowed = client.get("/api/items")
    client.get("/api/items")
    client.get("/api/items")
    denied = client.get("/api/items")

    assert denied.status == 429
    assert _pk(denied) == _pk(allowed)
    assert denied.json()["violated-policies"] == ["api"]


def test_pk_is_the_same_on_every_instance_sharing_the_secret(make: Any) -> None:
    first = make(config(partition_key=True)).get("/api/items")
    second = make(config(partition_key=True)).get("/api/items")
    other = make(config(partition_key=True, hash_secret="another-secret-0123456789")).get(
        "/api/items"
    )

    assert _pk(first) == _pk(second)
    assert _pk(other) != _pk(first)


def test_pk_is_off_by_default(make: Any) -> None:
    reply = make(config()).get("/api/items")

    for field in ("RateLimit-Policy", "RateLimit"):
        assert all("pk" not in item.params for item in sf_list(reply, field))
    assert reply.header("RateLimit-Policy") == '"api";q=3;w=60'

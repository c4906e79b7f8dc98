"""quota's data in the Django admin (quota.contrib.django.admin), on SQLite and PostgreSQL.

The admin's users live in Django's ``default`` database; quota's tables are
in the ``quota_db`` alias, reached through `quota.admin` on the project's limiter.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.test import Client, override_settings

from quota.admin import Admin, PolicyRow
from quota.contrib.django import conf

pytestmark = [
    pytest.mark.usefixtures("quota_db"),
    pytest.mark.django_db(transaction=True),
]

ADMIN_SETTINGS = override_settings(
    ROOT_URLCONF="tests.contrib.django.admin_urls",
    MIDDLEWARE=[
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.middleware.csrf.CsrfViewMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
    ],
)


@pytest.fixture(autouse=True)
def _admin_site() -> Iterator[None]:
    with ADMIN_SETTINGS:
        yield


@pytest.fixture
def staff() -> Client:
    """A client logged in as a superuser."""
    user = User.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def quota_admin() -> Admin:
    return Admin(conf.get_limiter())


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _policy_id(route: str, subject: str) -> str:
    from quota.contrib.django.admin import _encode

    return _encode(route, subject)


POLICIES = "/admin/quota/routepolicy/"
SETTINGS = "/admin/quota/setting/"
HOT_KEYS = "/admin/quota/hotkey/"
USAGE = "/admin/quota/subjectusage/"


@pytest.mark.parametrize(
    ("url", "title"),
    [
        ("/admin/quota/", "Route policies"),
        (POLICIES, "Route policies"),
        (SETTINGS, "Settings"),
        (HOT_KEYS, "Hot keys"),
        (USAGE, "Durable usage and ledger"),
    ],
)
def test_the_pages_render(staff: Client, url: str, title: str) -> None:
    response = staff.get(url)
    assert response.status_code == 200
    assert title in response.content.decode()


def test_a_policy_added_in_the_admin_is_stored_through_quota_admin(
    staff: Client, quota_admin: Admin
) -> None:
    route = _unique("search")
    response = staff.post(
        f"{POLICIES}add/",
        {"route": route, "subject": "tier:anon", "rates": "10/minute", "cost": "2", "note": "hi"},
    )
    assert response.status_code == 302, response.content.decode()
    stored = [row for row in quota_admin.policies() if row.route == route]
    assert [(r.subject, r.rates, r.cost, r.note) for r in stored] == [
        ("tier:anon", "10/minute", 2, "hi")
    ]
    assert route.encode() in staff.get(POLICIES).content

    from click.testing import CliRunner

    from quota._cli import main

    listed = CliRunner().invoke(
        main, ["policy", "list", "--json", "--url", conf.database_url()], catch_exceptions=False
    )
    assert listed.exit_code == 0, listed.output
    assert route in [row["route"] for row in json.loads(listed.output)]


def test_a_bad_rate_reshows_the_form_and_stores_nothing(staff: Client, quota_admin: Admin) -> None:
    route = _unique("search")
    response = staff.post(
        f"{POLICIES}add/", {"route": route, "subject": "*", "rates": "ten a minute"}
    )
    assert response.status_code == 200
    assert response.context["form"].errors["rates"]
    assert b"errorlist" in response.content and b"ten a minute" in response.content
    assert route not in [row.route for row in quota_admin.policies()]


def test_a_row_that_overrides_nothing_is_refused(staff: Client, quota_admin: Admin) -> None:
    route = _unique("search")
    response = staff.post(f"{POLICIES}add/", {"route": route, "subject": "*"})
    assert response.status_code == 200
    assert response.context["form"].non_field_errors()
    assert route not in [row.route for row in quota_admin.policies()]


def test_a_policy_is_changed_and_deleted(staff: Client, quota_admin: Admin) -> None:
    route = _unique("search")
    quota_admin.set_policy(PolicyRow(route=route, subject="tier:pro", rates="5/minute"))
    object_id = _policy_id(route, "tier:pro")

    page = staff.get(f"{POLICIES}{object_id}/change/")
    assert page.status_code == 200 and b"5/minute" in page.content
    changed = staff.post(
        f"{POLICIES}{object_id}/change/",
        {"route": "ignored", "subject": "ignored", "rates": "7/minute", "fail_open": "false"},
    )
    assert changed.status_code == 302
    [row] = [row for row in quota_admin.policies() if row.route == route]
    assert (row.subject, row.rates, row.fail_open) == ("tier:pro", "7/minute", False)

    confirm = staff.get(f"{POLICIES}{object_id}/delete/")
    assert confirm.status_code == 200
    assert route in [row.route for row in quota_admin.policies()]
    deleted = staff.post(f"{POLICIES}{object_id}/delete/", {"post": "yes"})
    assert deleted.status_code == 302
    assert route not in [row.route for row in quota_admin.policies()]
    assert staff.get(f"{POLICIES}{object_id}/change/").status_code == 404


def test_settings_are_validated_set_and_deleted(staff: Client, quota_admin: Admin) -> None:
    name = f"tier_multiplier.{_unique('t')}"
    bad = staff.post(f"{SETTINGS}add/", {"name": name, "value": "5000"})
    assert bad.status_code == 200 and bad.context["form"].errors["value"]
    assert name not in [row.name for row in quota_admin.settings()]

    assert staff.post(f"{SETTINGS}add/", {"name": name, "value": "2.5"}).status_code == 302
    assert [row.value for row in quota_admin.settings() if row.name == name] == ["2.5"]
    assert (
        staff.post(f"{SETTINGS}add/", {"name": "abuse_threshold", "value": "many"}).status_code
        == 200
    )

    from quota.contrib.django.admin import _encode

    deleted = staff.post(f"{SETTINGS}{_encode(name)}/delete/", {"post": "yes"})
    assert deleted.status_code == 302
    assert name not in [row.name for row in quota_admin.settings()]


def test_usage_and_ledger_are_found_by_subject(staff: Client) -> None:
    subject, other = _unique("user"), _unique("user")
    limiter = conf.get_limiter()
    limiter.consume_quota(subject, "generations", limit=1000, period="month", cost=3)
    limiter.consume_quota(other, "uploads", limit=10, period="month")

    page = staff.get(USAGE, {"q": subject})
    assert page.status_code == 200
    assert b"generations" in page.content and b"uploads" not in page.content
    ledger = page.context["tables"][1]["rows"]
    assert len(ledger) == 1 and "generations" in ledger[0]["cells"]
    assert b"generations" not in staff.get(USAGE).content


def test_counters_are_read_only(staff: Client) -> None:
    for url in (HOT_KEYS, USAGE):
        assert staff.get(f"{url}add/").status_code == 404
    index = staff.get("/admin/quota/").content.decode()
    assert f'href="{POLICIES}add/"' in index
    assert f'href="{HOT_KEYS}add/"' not in index and f'href="{USAGE}add/"' not in index


def test_the_reset_action_resets_a_hot_key(staff: Client, quota_admin: Admin) -> None:
    key, kept = _unique("hot"), _unique("hot")
    limiter = conf.get_limiter()
    for _ in range(3):
        limiter.rate_limit(key, 10, 60)
    limiter.rate_limit(kept, 10, 60)
    listed = staff.get(HOT_KEYS).content.decode()
    assert key in listed and kept in listed

    confirm = staff.post(HOT_KEYS, {"action": "reset", "_selected_action": [key]})
    assert confirm.status_code == 200 and key in confirm.content.decode()
    assert [usage.count for usage in quota_admin.windows(key)] == [3]

    done = staff.post(HOT_KEYS, {"action": "reset", "_selected_action": [key], "post": "yes"})
    assert done.status_code == 302
    assert quota_admin.windows(key) == []
    assert [usage.count for usage in quota_admin.windows(kept)] == [1]


def _client_for(**fields: Any) -> Client:
    user = User.objects.create_user(_unique("u"), password="pw", **fields)
    client = Client()
    client.force_login(user)
    return client


def test_a_non_staff_user_is_refused(quota_admin: Admin) -> None:
    client = _client_for(is_staff=False)
    route = _unique("search")
    for url in (POLICIES, HOT_KEYS, USAGE):
        response = client.get(url)
        assert response.status_code == 302 and "/login/" in response["Location"]
    client.post(f"{POLICIES}add/", {"route": route, "subject": "*", "rates": "1/minute"})
    assert route not in [row.route for row in quota_admin.policies()]


def test_staff_without_permissions_is_refused(quota_admin: Admin) -> None:
    client = _client_for(is_staff=True)
    route = _unique("search")
    assert client.get(POLICIES).status_code == 403
    response = client.post(f"{POLICIES}add/", {"route": route, "subject": "*", "rates": "1/minute"})
    assert response.status_code == 403
    assert route not in [row.route for row in quota_admin.policies()]

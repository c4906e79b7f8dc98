"""quota's data in the Django admin, under the app label ``quota``.

With ``django.contrib.admin`` installed, ``admin.autodiscover()`` registers:

* route policies and settings (tier multipliers, the abuse threshold): add,
  change and delete, each value checked by `quota.admin` before anything is
  written;
* hot keys: the busiest keys' fixed windows, read-only, with a "reset"
  action (confirmed on a second page);
* durable usage and ledger: one subject's, read-only, found by its subject.

The models are table-less (`quota.contrib.django.models`); every page reads
and writes through `quota.admin.Admin` on the project's limiter
(`quota.contrib.django.conf.get_limiter`), wherever ``QUOTA`` keeps quota's
tables.
"""

from __future__ import annotations

import base64
import datetime
import json
from collections.abc import Callable, Sequence
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from quota._core.errors import ConfigurationError
from quota.admin import ANY, Admin, PolicyRow, SettingRow, parse_setting
from quota.contrib.django import conf
from quota.contrib.django.models import HotKey, RoutePolicy, Setting, SubjectUsage

#: The most keys the hot keys page lists.
HOT_KEYS = 100


def quota_admin() -> Admin:
    """The `quota.admin.Admin` over the project's limiter."""
    return Admin(conf.get_limiter())


def _encode(*parts: str) -> str:
    """An object id for the admin's URLs naming a row by its key (any characters)."""
    return base64.urlsafe_b64encode(json.dumps(parts).encode()).decode().rstrip("=")


def _decode(object_id: str, size: int) -> list[str]:
    try:
        parts = json.loads(base64.urlsafe_b64decode(object_id + "=" * (-len(object_id) % 4)))
    except ValueError as exc:
        raise Http404(f"no such row: {object_id!r}") from exc
    if (
        not isinstance(parts, list)
        or len(parts) != size
        or not all(isinstance(p, str) for p in parts)
    ):
        raise Http404(f"no such row: {object_id!r}")
    return parts


def _when(epoch: float | None) -> str:
    if not epoch:
        return ""
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).isoformat(
        timespec="seconds"
    )


def _blank(value: object) -> object:
    return "" if value is None else value


class _QuotaModelAdmin(admin.ModelAdmin):  # type: ignore[misc]
    """A page of quota's data: its own views over `quota.admin`, no queryset."""

    def _context(self, request: HttpRequest, title: str, **more: Any) -> dict[str, Any]:
        return {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": title,
            "changelist_url": self._url("changelist"),
            **more,
        }

    def _url(self, view: str, *args: str) -> str:
        name = f"admin:{self.opts.app_label}_{self.opts.model_name}_{view}"
        return str(reverse(name, args=args, current_app=self.admin_site.name))

    def _name(self, view: str) -> str:
        return f"{self.opts.app_label}_{self.opts.model_name}_{view}"

    def _check(self, allowed: bool) -> None:
        if not allowed:
            raise PermissionDenied


class _RowAdmin(_QuotaModelAdmin):
    """Rows keyed by a few strings, listed, added, changed and deleted through `quota.admin`."""

    form_class: type[forms.Form]
    columns: Sequence[str] = ()
    key_size = 1

    def rows(self, quota: Admin) -> list[Any]:
        raise NotImplementedError

    def key(self, row: Any) -> list[str]:
        raise NotImplementedError

    def cells(self, row: Any) -> list[object]:
        raise NotImplementedError

    def initial(self, row: Any) -> dict[str, Any]:
        raise NotImplementedError

    def save(self, quota: Admin, form: forms.Form) -> None:
        raise NotImplementedError

    def delete(self, quota: Admin, key: list[str]) -> bool:
        raise NotImplementedError

    def get_urls(self) -> list[URLPattern]:
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.changelist_view), name=self._name("changelist")),
            path("add/", wrap(self.add_view), name=self._name("add")),
            path("<str:object_id>/change/", wrap(self.change_view), name=self._name("change")),
            path("<str:object_id>/delete/", wrap(self.delete_view), name=self._name("delete")),
        ]

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        self._check(self.has_view_or_change_permission(request))
        table = {
            "columns": self.columns,
            "rows": [
                {"cells": self.cells(row), "url": self._url("change", _encode(*self.key(row)))}
                for row in self.rows(quota_admin())
            ],
            "empty": f"No {self.opts.verbose_name_plural}.",
        }
        add_url = self._url("add") if self.has_add_permission(request) else None
        context = self._context(
            request, self.opts.verbose_name_plural.capitalize(), tables=[table], add_url=add_url
        )
        return TemplateResponse(request, "admin/quota/list.html", context)

    def _find(self, object_id: str) -> tuple[list[str], Any]:
        key = _decode(object_id, self.key_size)
        for row in self.rows(quota_admin()):
            if self.key(row) == key:
                return key, row
        raise Http404(f"no {self.opts.verbose_name} {' '.join(key)!r}")

    def _form_view(
        self, request: HttpRequest, title: str, form: forms.Form, **more: Any
    ) -> HttpResponse:
        if request.method == "POST" and form.is_valid():
            try:
                self.save(quota_admin(), form)
            except ConfigurationError as exc:
                form.add_error(None, str(exc))
            else:
                messages.success(request, f"The {self.opts.verbose_name} was saved.")
                return HttpResponseRedirect(self._url("changelist"))
        context = self._context(request, title, form=form, **more)
        return TemplateResponse(request, "admin/quota/form.html", context)

    def add_view(
        self, request: HttpRequest, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        self._check(self.has_add_permission(request))
        data = request.POST if request.method == "POST" else None
        return self._form_view(request, f"Add {self.opts.verbose_name}", self.form_class(data))

    def change_view(
        self, request: HttpRequest, object_id: str, form_url: str = "", extra_context: Any = None
    ) -> HttpResponse:
        self._check(self.has_view_or_change_permission(request))
        key, row = self._find(object_id)
        if request.method == "POST":
            self._check(self.has_change_permission(request))
        data = request.POST if request.method == "POST" else None
        form = self.form_class(data, initial=self.initial(row))
        for name in self.key_fields:
            form.fields[name].disabled = True
        delete_url = self._url("delete", object_id) if self.has_delete_permission(request) else None
        title = f"Change {self.opts.verbose_name} {' '.join(key)}"
        return self._form_view(request, title, form, delete_url=delete_url)

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: Any = None
    ) -> HttpResponse:
        self._check(self.has_delete_permission(request))
        key, _ = self._find(object_id)
        if request.method == "POST" and request.POST.get("post") == "yes":
            self.delete(quota_admin(), key)
            messages.success(request, f"The {self.opts.verbose_name} {' '.join(key)} was deleted.")
            return HttpResponseRedirect(self._url("changelist"))
        context = self._context(
            request,
            f"Delete {self.opts.verbose_name}",
            question=f"Delete this {self.opts.verbose_name}?",
            items=[" ".join(key)],
        )
        return TemplateResponse(request, "admin/quota/confirm.html", context)

    key_fields: Sequence[str] = ()


def _optional_bool(value: str) -> bool | None:
    return {"true": True, "false": False}.get(value)


class PolicyForm(forms.Form):  # type: ignore[misc]
    """The fields of ``quota policy set``, checked as `quota.admin.PolicyRow` checks them."""

    route = forms.CharField(max_length=200, help_text="Route class name, or * for all.")
    subject = forms.CharField(
        max_length=200, initial=ANY,
        help_text="*, tier:<name>, tenant:<id>, or one caller's subject (ip:<hash>, ...).",
    )  # fmt: skip
    rates = forms.CharField(
        required=False, help_text='Rate string replacing the class\'s, e.g. "10/minute; 100/hour".'
    )
    algorithm = forms.CharField(
        required=False, help_text="Algorithm for the rates; blank keeps the class's."
    )
    cost = forms.IntegerField(
        required=False, min_value=1, help_text="Hits per request; blank keeps the class's."
    )
    fail_open = forms.TypedChoiceField(
        required=False, coerce=_optional_bool, empty_value=None,
        choices=[("", "keep the class's"), ("true", "fail open"), ("false", "fail closed")],
    )  # fmt: skip
    exempt = forms.BooleanField(required=False, help_text="Let the subject through unlimited.")
    note = forms.CharField(required=False, help_text="Why the row exists.")

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean()
        if self.errors:
            return data
        values = {
            "route": data["route"], "subject": data["subject"],
            "algorithm": data["algorithm"] or None, "cost": data["cost"],
            "fail_open": data["fail_open"], "exempt": data["exempt"], "note": data["note"] or None,
        }  # fmt: skip
        try:
            PolicyRow(**values)
        except ConfigurationError as exc:
            raise forms.ValidationError(str(exc)) from exc
        try:
            self.row = PolicyRow(**values, rates=data["rates"] or None)
        except ConfigurationError as exc:
            self.add_error("rates", str(exc))
        return data


class RoutePolicyAdmin(_RowAdmin):
    """Route policy overrides (``quota policy``): add, change, delete."""

    form_class = PolicyForm
    columns = (
        "route",
        "subject",
        "rates",
        "algorithm",
        "cost",
        "fail open",
        "exempt",
        "note",
        "updated",
    )
    key_size = 2
    key_fields = ("route", "subject")

    def rows(self, quota: Admin) -> list[PolicyRow]:
        return quota.policies()

    def key(self, row: PolicyRow) -> list[str]:
        return [row.route, row.subject]

    def cells(self, row: PolicyRow) -> list[object]:
        return [
            row.route, row.subject, _blank(row.rates), _blank(row.algorithm), _blank(row.cost),
            _blank(row.fail_open), row.exempt, _blank(row.note), _when(row.updated_at),
        ]  # fmt: skip

    def initial(self, row: PolicyRow) -> dict[str, Any]:
        fail_open = {True: "true", False: "false"}.get(row.fail_open, "")  # type: ignore[arg-type]
        return {
            "route": row.route, "subject": row.subject, "rates": row.rates or "",
            "algorithm": row.algorithm or "", "cost": row.cost, "fail_open": fail_open,
            "exempt": row.exempt, "note": row.note or "",
        }  # fmt: skip

    def save(self, quota: Admin, form: forms.Form) -> None:
        quota.set_policy(form.row)

    def delete(self, quota: Admin, key: list[str]) -> bool:
        return quota.delete_policy(key[0], key[1])


class SettingForm(forms.Form):  # type: ignore[misc]
    """A setting's name and value, checked by `quota.admin.parse_setting`."""

    name = forms.CharField(
        max_length=200,
        help_text="tier_multiplier.<tier> (0.001 to 1000) or abuse_threshold (0: off).",
    )
    value = forms.CharField(max_length=200)
    note = forms.CharField(required=False, help_text="Why the value was set.")

    def clean(self) -> dict[str, Any]:
        data: dict[str, Any] = super().clean()
        if self.errors:
            return data
        try:
            parse_setting(data["name"], data["value"])
        except ConfigurationError as exc:
            self.add_error("value", str(exc))
        return data


class SettingAdmin(_RowAdmin):
    """Runtime settings (``quota settings``): tier multipliers and the abuse threshold."""

    form_class = SettingForm
    columns = ("name", "value", "note", "updated")
    key_fields = ("name",)

    def rows(self, quota: Admin) -> list[SettingRow]:
        return quota.settings()

    def key(self, row: SettingRow) -> list[str]:
        return [row.name]

    def cells(self, row: SettingRow) -> list[object]:
        return [row.name, _blank(row.value), _blank(row.note), _when(row.updated_at)]

    def initial(self, row: SettingRow) -> dict[str, Any]:
        return {"name": row.name, "value": row.value or "", "note": row.note or ""}

    def save(self, quota: Admin, form: forms.Form) -> None:
        data = form.cleaned_data
        quota.set_setting(data["name"], data["value"], note=data["note"] or None)

    def delete(self, quota: Admin, key: list[str]) -> bool:
        return quota.delete_setting(key[0])


class _ReadOnlyAdmin(_QuotaModelAdmin):
    """Counters: listed, never added, changed or deleted."""

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def _list_urls(self, view: Callable[..., HttpResponse]) -> list[URLPattern]:
        return [path("", self.admin_site.admin_view(view), name=self._name("changelist"))]


class HotKeyAdmin(_ReadOnlyAdmin):
    """The busiest keys' running fixed windows, with a "reset" action."""

    def get_urls(self) -> list[URLPattern]:
        return self._list_urls(self.changelist_view)

    def _may_reset(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(f"{self.opts.app_label}.reset_hotkey"))

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        self._check(self.has_view_permission(request))
        if request.method == "POST" and request.POST.get("action") == "reset":
            response = self._reset(request)
            if response is not None:
                return response
        usages = quota_admin().top(HOT_KEYS)
        table = {
            "columns": ("key", "window (s)", "count", "resets at"),
            "rows": [
                {
                    "id": usage.key,
                    "cells": [usage.key, usage.window, usage.count, _when(usage.reset_at)],
                }
                for usage in usages
            ],
            "empty": "No key has a running window.",
            "action": "reset" if self._may_reset(request) else None,
            "action_label": "Reset the selected keys' counts",
        }
        context = self._context(request, "Hot keys", tables=[table])
        return TemplateResponse(request, "admin/quota/list.html", context)

    def _reset(self, request: HttpRequest) -> HttpResponse | None:
        self._check(self._may_reset(request))
        keys = sorted(set(request.POST.getlist("_selected_action")))
        if not keys:
            messages.warning(request, "Select the keys to reset.")
            return None
        if request.POST.get("post") != "yes":
            context = self._context(
                request, "Reset keys", question="Forget these keys' counts in every window?",
                items=keys, selected=keys, action="reset",
            )  # fmt: skip
            return TemplateResponse(request, "admin/quota/confirm.html", context)
        quota = quota_admin()
        deleted = sum(quota.reset(key) for key in keys)
        messages.success(request, f"Reset {len(keys)} key(s): {deleted} window(s) forgotten.")
        return HttpResponseRedirect(self._url("changelist"))


class SubjectUsageAdmin(_ReadOnlyAdmin):
    """One subject's durable quotas and ledger, found by the subject."""

    def get_urls(self) -> list[URLPattern]:
        return self._list_urls(self.changelist_view)

    def changelist_view(self, request: HttpRequest, extra_context: Any = None) -> HttpResponse:
        self._check(self.has_view_permission(request))
        subject = request.GET.get("q", "").strip()
        tables: list[dict[str, Any]] = []
        error = None
        if subject:
            quota = quota_admin()
            try:
                usage = quota.usage(subject, include_ended=True)
                ledger = quota.ledger(subject)
            except ConfigurationError as exc:
                error = str(exc)
            else:
                tables = [
                    {
                        "caption": "Usage",
                        "columns": ("quota", "period", "period start", "resets at", "limit", "used", "reserved", "remaining"),
                        "rows": [
                            {"cells": [u.name, u.period, _when(u.period_start), _when(u.resets_at), _blank(u.limit), u.used, u.reserved, _blank(u.remaining)]}
                            for u in usage
                        ],
                        "empty": f"No durable quota for {subject!r}.",
                    },
                    {
                        "caption": "Ledger",
                        "columns": ("id", "at", "quota", "kind", "cost", "used", "remaining", "idempotency key"),
                        "rows": [
                            {"cells": [e.id, _when(e.at), e.name, e.kind, e.cost, _blank(e.used), _blank(e.remaining), _blank(e.idempotency_key)]}
                            for e in ledger
                        ],
                        "empty": f"No ledger entry for {subject!r}.",
                    },
                ]  # fmt: skip
        context = self._context(
            request,
            "Durable usage and ledger",
            tables=tables,
            search=True,
            query=subject,
            error=error,
        )
        return TemplateResponse(request, "admin/quota/list.html", context)


admin.site.register(RoutePolicy, RoutePolicyAdmin)
admin.site.register(Setting, SettingAdmin)
admin.site.register(HotKey, HotKeyAdmin)
admin.site.register(SubjectUsage, SubjectUsageAdmin)

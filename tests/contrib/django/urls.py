"""URLs of the decorator tests: each view in tests.contrib.django.views at /<name>/."""

from __future__ import annotations

from django.urls import path

from tests.contrib.django import views

_FUNCTIONS = [
    "by_ip", "by_user", "by_user_or_ip", "by_header", "by_get", "by_post", "by_callable",
    "by_dotted", "every_ten_seconds", "tuple_rate", "callable_rate", "dotted_rate", "closed",
    "post_only", "unsafe_only", "listed_methods", "not_blocking", "stacked",
    "stacked_inner_limits", "shared_one", "shared_two", "async_by_ip", "async_by_user", "many",
]  # fmt: skip

urlpatterns = [path(f"{name}/", getattr(views, name), name=name) for name in _FUNCTIONS] + [
    path("class/", views.ClassView.as_view()),
    path("async-class/", views.AsyncClassView.as_view()),
]

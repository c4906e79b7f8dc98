"""`Ratelimited`: what a blocking `ratelimit` decorator raises."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.core.exceptions import PermissionDenied

if TYPE_CHECKING:
    from quota._core.decision import Decision

__all__ = ["Ratelimited"]


class Ratelimited(PermissionDenied):  # type: ignore[misc]
    """A request over a `ratelimit` limit, with `block=True`.

    A ``PermissionDenied`` as django-ratelimit's is, so code catching either
    still works, and Django answers 403 unless
    `quota.contrib.django.ratelimiting.RatelimitMiddleware` is installed
    (which answers 429). `decision` is the limiter's `quota.Decision` and
    `group` the group that denied (both None when raised by hand).
    """

    def __init__(
        self, *args: Any, decision: Decision | None = None, group: str | None = None
    ) -> None:
        super().__init__(*args)
        self.decision = decision
        self.group = group

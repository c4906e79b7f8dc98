"""An operator dashboard over `quota.admin`: an ASGI app (the ``dashboard`` extra).

    from quota.dashboard import create_app

    app = create_app("postgresql://app@db/app", token=os.environ["QUOTA_DASHBOARD_TOKEN"])
    # or, inside a Starlette / FastAPI app:
    main_app.mount("/quota", create_app(limiter, token=token, read_only=True))

Pages: the overview (store health, the fallback, decisions and denials per
second by route and tier from a `quota.Metrics`, the busiest keys), the keys
(search, windows, reset), a subject's durable quotas and ledger (grant,
refund), and the route policies and settings (the same edits as ``quota
policy``). Every page and API route needs the token, as a bearer token or
through the login form's session cookie; see docs/dashboard.md. It reads and
writes only through `quota.admin` and the limiter's public methods.
"""

from __future__ import annotations

from quota.dashboard._app import create_app

__all__ = ["create_app"]

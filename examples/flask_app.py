"""A small Flask app behind quota's WSGI middleware, on the embedded SQLite default.

    pip install 'quota[flask]'
    export QUOTA_HASH_SECRET=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
    flask --app examples.flask_app run

Then ``curl -i localhost:5000/api/directory`` a few times. The same
environment variables and ``quota policy`` overrides apply as for the
FastAPI example.
"""

from __future__ import annotations

from typing import Any

from flask import Flask, jsonify

import quota
from quota.http import HttpConfig, RoutePolicy
from quota.http.wsgi import QuotaWSGIMiddleware

POLICIES = [
    RoutePolicy(
        name="chat", paths=["/api/chat"], rates="10/minute", tier_rates={"auth": "60/minute"}
    ),
    RoutePolicy(name="directory", paths=["/api/directory"], rates="30/minute"),
    RoutePolicy(name="writes", paths=["/api"], rates="20/minute", mutations_only=True),
]

# An example's convenience: a real deployment runs `quota migrate` in its deploy step.
quota.migrate(quota.default_url())

app = Flask(__name__)
app.wsgi_app = QuotaWSGIMiddleware(  # type: ignore[method-assign]
    app.wsgi_app, config=HttpConfig.from_env(policies=POLICIES, exclude=["/health"])
)


@app.get("/health")
def health() -> Any:
    return jsonify(status="ok")


@app.get("/api/directory")
def directory() -> Any:
    return jsonify(namespaces=["alpha", "beta"])


@app.post("/api/chat")
def chat() -> Any:
    return jsonify(reply="hello")


@app.post("/api/notes")
def notes() -> Any:
    return jsonify(saved="yes")

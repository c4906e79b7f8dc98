"""Load shedding: `ConcurrencyGuard` and `SheddingMiddleware`.

Slow requests are held on events, never on sleeps: a request that got in
waits for `release`, so the test knows exactly how many are inside when it
looks. Every wait is bounded, so a broken guard fails the test instead of
hanging it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

import quota
from quota.http.shedding import (
    ENV_CEILING,
    ENV_RETRY_AFTER,
    ConcurrencyGuard,
    Message,
    Scope,
    SheddingMiddleware,
)

WAIT = 10.0  # seconds: the bound on every wait for an event
C = 4  # the ceiling
N = 5 * C  # concurrent requests


class Boom(Exception):
    """Raised by a request on purpose."""


# -- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "4", None])
def test_a_bad_ceiling_names_the_field_and_value(bad: object) -> None:
    with pytest.raises(quota.ConfigurationError, match=rf"ceiling .*{bad!r}"):
        ConcurrencyGuard(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -5, False, 2.0, "1"])
def test_a_bad_retry_after_names_the_field_and_value(bad: object) -> None:
    with pytest.raises(quota.ConfigurationError, match=rf"retry_after .*{bad!r}"):
        ConcurrencyGuard(4, bad)  # type: ignore[arg-type]


def test_from_env_reads_ceiling_and_retry_after() -> None:
    guard = ConcurrencyGuard.from_env(
        environ={ENV_CEILING: "12", ENV_RETRY_AFTER: " 30 "}, ceiling=2, retry_after=5
    )
    assert (guard.ceiling, guard.retry_after) == (12, 30)


def test_from_env_falls_back_to_the_arguments_when_unset() -> None:
    guard = ConcurrencyGuard.from_env(environ={}, ceiling=7, retry_after=3)
    assert (guard.ceiling, guard.retry_after) == (7, 3)


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CEILING, "9")
    monkeypatch.delenv(ENV_RETRY_AFTER, raising=False)
    assert ConcurrencyGuard.from_env().ceiling == 9


def test_from_env_without_any_ceiling_says_which_variable_to_set() -> None:
    with pytest.raises(quota.ConfigurationError, match=ENV_CEILING):
        ConcurrencyGuard.from_env(environ={})


@pytest.mark.parametrize("variable", [ENV_CEILING, ENV_RETRY_AFTER])
@pytest.mark.parametrize("raw", ["abc", "0", "-3", "1.5", "99999999999"])
def test_a_malformed_variable_is_named_with_its_value(variable: str, raw: str) -> None:
    with pytest.raises(quota.ConfigurationError) as info:
        ConcurrencyGuard.from_env(environ={variable: raw}, ceiling=4)
    assert variable in str(info.value)
    assert repr(raw) in str(info.value)


def test_overloaded_is_a_quota_error_carrying_retry_after() -> None:
    guard = ConcurrencyGuard(1, 42)
    with guard, pytest.raises(quota.Overloaded) as info, guard:
        pass
    assert isinstance(info.value, quota.QuotaError)
    assert info.value.retry_after == 42
    assert "1 request(s) already in flight" in str(info.value)


# -- the sync face: threads -------------------------------------------------------------


class _ThreadLoad:
    """N threads calling `enter(work)` at once, admitted ones held until `release`."""

    def __init__(self, guard: ConcurrencyGuard, outcome: str) -> None:
        self.guard = guard
        self.outcome = outcome
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.settled = 0  # requests that got in or were shed
        self.all_settled = threading.Event()
        self.release = threading.Event()
        self.shed: list[quota.Overloaded] = []
        self.finished = 0
        self.errors: list[BaseException] = []

    def _settle(self) -> None:
        with self.lock:
            self.settled += 1
            if self.settled == N:
                self.all_settled.set()

    def work(self) -> str:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        self._settle()
        try:
            assert self.release.wait(WAIT), "never released"
        finally:
            with self.lock:
                self.running -= 1
        if self.outcome == "error":
            raise Boom
        return "done"

    def run(self, call: Callable[[], str]) -> None:
        def request() -> None:
            try:
                call()
            except quota.Overloaded as exc:
                with self.lock:
                    self.shed.append(exc)
                self._settle()
            except Boom:
                pass
            except BaseException as exc:  # pragma: no cover - reported below
                self.errors.append(exc)
            with self.lock:
                self.finished += 1

        threads = [threading.Thread(target=request) for _ in range(N)]
        for thread in threads:
            thread.start()
        try:
            assert self.all_settled.wait(WAIT), f"only {self.settled} of {N} settled"
            assert self.guard.in_flight == C
        finally:
            self.release.set()
            for thread in threads:
                thread.join(WAIT)
        assert not any(thread.is_alive() for thread in threads)


@pytest.mark.parametrize("outcome", ["success", "error"])
@pytest.mark.parametrize("form", ["context", "decorator"])
def test_threads_above_the_ceiling_are_shed_and_the_count_returns_to_zero(
    form: str, outcome: str
) -> None:
    guard = ConcurrencyGuard(C, retry_after=3)
    load = _ThreadLoad(guard, outcome)
    if form == "decorator":
        call = guard(load.work)
    else:

        def call() -> str:
            with guard:
                return load.work()

    load.run(call)

    assert load.errors == []
    assert load.peak == C
    assert len(load.shed) == N - C
    assert {exc.retry_after for exc in load.shed} == {3}
    assert load.finished == N
    assert guard.in_flight == 0


def test_a_decorated_function_keeps_its_name_and_result() -> None:
    guard = ConcurrencyGuard(2)

    @guard
    def handler(x: int, *, y: int) -> int:
        """Adds."""
        assert guard.in_flight == 1
        return x + y

    assert handler(1, y=2) == 3
    assert (handler.__name__, handler.__doc__) == ("handler", "Adds.")
    assert guard.in_flight == 0


def test_nested_entries_of_one_guard_each_take_a_slot() -> None:
    guard = ConcurrencyGuard(2)
    with guard:
        with guard:
            assert guard.in_flight == 2
            with pytest.raises(quota.Overloaded), guard:
                pass  # pragma: no cover
            assert guard.in_flight == 2
        assert guard.in_flight == 1
    assert guard.in_flight == 0


# -- the async face: tasks --------------------------------------------------------------


class _TaskLoad:
    """N tasks entering the guard at once; admitted ones held until `release`."""

    def __init__(self, guard: ConcurrencyGuard, outcome: str) -> None:
        self.guard = guard
        self.outcome = outcome
        self.running = 0
        self.peak = 0
        self.settled = 0
        self.all_settled = asyncio.Event()
        self.release = asyncio.Event()
        self.shed = 0
        self.results: list[Any] = []

    def _settle(self) -> None:
        self.settled += 1
        if self.settled == N:
            self.all_settled.set()

    async def work(self) -> str:
        self.running += 1
        self.peak = max(self.peak, self.running)
        self._settle()
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        if self.outcome == "error":
            raise Boom
        return "done"

    async def run(self, call: Callable[[], Awaitable[str]]) -> None:
        async def request() -> str:
            try:
                return await call()
            except quota.Overloaded:
                self.shed += 1
                self._settle()
                return "shed"

        tasks = [asyncio.create_task(request()) for _ in range(N)]
        try:
            await asyncio.wait_for(self.all_settled.wait(), WAIT)
            assert self.guard.in_flight == C
            if self.outcome == "cancel":
                for task in tasks:
                    task.cancel()
            else:
                self.release.set()
        finally:
            self.results = await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), WAIT
            )


@pytest.mark.parametrize("outcome", ["success", "error", "cancel"])
@pytest.mark.parametrize("form", ["context", "decorator"])
def test_tasks_above_the_ceiling_are_shed_and_the_count_returns_to_zero(
    form: str, outcome: str
) -> None:
    guard = ConcurrencyGuard(C)

    async def main() -> _TaskLoad:
        load = _TaskLoad(guard, outcome)
        if form == "decorator":
            call = guard(load.work)
        else:

            async def call() -> str:
                async with guard:
                    return await load.work()

        await load.run(call)
        return load

    load = asyncio.run(main())

    assert load.peak == C
    assert load.shed == N - C
    admitted = [r for r in load.results if r != "shed"]
    assert len(admitted) == C
    expected = {"success": str, "error": Boom, "cancel": asyncio.CancelledError}[outcome]
    assert all(isinstance(r, expected) for r in admitted), admitted
    assert guard.in_flight == 0


def test_a_decorated_coroutine_function_stays_a_coroutine_function() -> None:
    import inspect

    guard = ConcurrencyGuard(1)

    @guard
    async def handler() -> int:
        return guard.in_flight

    assert inspect.iscoroutinefunction(handler)
    assert asyncio.run(handler()) == 1
    assert guard.in_flight == 0


# -- fail-open --------------------------------------------------------------------------


class _BrokenLock:
    def __enter__(self) -> None:
        raise RuntimeError("lock is broken")

    def __exit__(self, *exc: object) -> None:  # pragma: no cover - never entered
        pass


def test_a_guard_whose_internals_fail_serves_the_request_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    guard = ConcurrencyGuard(1)
    guard._lock = _BrokenLock()  # type: ignore[assignment]
    served = []

    @guard
    def handler() -> str:
        served.append("decorated")
        return "ok"

    @guard
    async def ahandler() -> str:
        served.append("async decorated")
        return "ok"

    async def async_context() -> None:
        async with guard:
            served.append("async with")

    with caplog.at_level(logging.ERROR, logger="quota"):
        for _ in range(3):  # over the ceiling of 1, were the guard counting
            with guard:
                served.append("with")
            assert handler() == "ok"
            assert asyncio.run(ahandler()) == "ok"
            asyncio.run(async_context())

    assert len(served) == 12
    assert guard.in_flight == 0
    records = [r for r in caplog.records if r.name == "quota"]
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "serving the request anyway" in records[0].getMessage()
    assert records[0].exc_info is not None


def test_a_failing_metrics_sink_does_not_stop_the_shedding(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class BrokenMetrics(quota.Metrics):
        def record_shed(self, route: str = "") -> None:
            raise RuntimeError("metrics down")

    guard = ConcurrencyGuard(1, metrics=BrokenMetrics())
    log_errors = caplog.at_level(logging.ERROR, logger="quota")
    with log_errors, guard, pytest.raises(quota.Overloaded), guard:
        pass  # pragma: no cover
    assert guard.in_flight == 0
    assert any("counting a shed request" in r.getMessage() for r in caplog.records)


def test_sheds_are_counted_in_metrics_by_route() -> None:
    metrics = quota.Metrics()
    guard = ConcurrencyGuard(1, metrics=metrics, route="/search")
    with guard:
        for _ in range(3):
            with pytest.raises(quota.Overloaded), guard:
                pass  # pragma: no cover
    assert metrics.snapshot()["shed"] == {"/search": 3}


# -- ASGI -------------------------------------------------------------------------------


def _http_scope(path: str = "/") -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def _call(app: Any, scope: Scope) -> list[Message]:
    """Drive one request through a raw ASGI app; return what it sent."""
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def _status(sent: list[Message]) -> int:
    return int(sent[0]["status"])


def _headers(sent: list[Message]) -> dict[bytes, bytes]:
    return dict(sent[0]["headers"])


class _SlowApp:
    """An ASGI app whose requests wait for `release`, then answer 200 (or fail)."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome
        self.inside = 0
        self.peak = 0
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.scopes: list[str] = []

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        self.scopes.append(scope["type"])
        if scope["type"] != "http":
            return
        self.inside += 1
        self.peak = max(self.peak, self.inside)
        if self.inside == C:
            self.entered.set()
        try:
            await self.release.wait()
        finally:
            self.inside -= 1
        if self.outcome == "error":
            raise Boom
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.mark.parametrize("outcome", ["success", "error", "cancel"])
def test_the_middleware_answers_503_with_retry_after_above_the_ceiling(outcome: str) -> None:
    guard = ConcurrencyGuard(C, retry_after=9)

    async def main() -> tuple[_SlowApp, list[Any]]:
        inner = _SlowApp(outcome)
        app = SheddingMiddleware(inner, guard)
        tasks = [asyncio.create_task(_call(app, _http_scope())) for _ in range(N)]
        try:
            await asyncio.wait_for(inner.entered.wait(), WAIT)
            # The shed requests finish without waiting on anything.
            shed = [t for t in tasks if t.done()]
            while len(shed) < N - C:
                await asyncio.wait_for(
                    asyncio.wait(
                        [t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED
                    ),
                    WAIT,
                )
                shed = [t for t in tasks if t.done()]
            assert guard.in_flight == C
            if outcome == "cancel":
                for task in tasks:
                    if not task.done():
                        task.cancel()
            else:
                inner.release.set()
        finally:
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), WAIT)
        return inner, results

    inner, results = asyncio.run(main())

    assert inner.peak == C
    answered = [r for r in results if isinstance(r, list)]
    rejected = [r for r in answered if _status(r) == 503]
    assert len(rejected) == N - C
    for sent in rejected:
        headers = _headers(sent)
        assert headers[b"retry-after"] == b"9"
        assert headers[b"content-type"] == b"application/problem+json"
        body = json.loads(sent[1]["body"])
        assert body["code"] == "OVERLOADED"
        assert body["error"] == "overloaded"
        assert body["retry_after"] == 9
        assert int(headers[b"content-length"]) == len(sent[1]["body"])
    others = [r for r in results if r not in rejected]
    expected: Any = {"success": list, "error": Boom, "cancel": asyncio.CancelledError}[outcome]
    assert len(others) == C
    assert all(isinstance(r, expected) for r in others), others
    if outcome == "success":
        assert all(_status(r) == 200 for r in others)
    assert guard.in_flight == 0


@pytest.mark.parametrize("scope_type", ["lifespan", "websocket"])
def test_lifespan_and_websocket_scopes_pass_through_even_at_the_ceiling(scope_type: str) -> None:
    guard = ConcurrencyGuard(1)
    inner = _SlowApp("success")
    app = SheddingMiddleware(inner, guard)

    async def main() -> list[Message]:
        with guard:  # the guard is full
            return await _call(app, {"type": scope_type})

    assert asyncio.run(main()) == []
    assert inner.scopes == [scope_type]
    assert guard.in_flight == 0


def test_the_middleware_lets_an_overloaded_from_the_app_propagate() -> None:
    inner_guard = ConcurrencyGuard(1)

    async def app(scope: Scope, receive: Any, send: Any) -> None:
        with inner_guard, inner_guard:
            pass  # pragma: no cover

    guard = ConcurrencyGuard(5)
    with pytest.raises(quota.Overloaded):
        asyncio.run(_call(SheddingMiddleware(app, guard), _http_scope()))
    assert guard.in_flight == 0


def test_the_middleware_needs_a_guard() -> None:
    with pytest.raises(quota.ConfigurationError, match="guard"):
        SheddingMiddleware(_SlowApp("success"), 5)  # type: ignore[arg-type]


def test_the_middleware_in_front_of_a_starlette_app() -> None:
    pytest.importorskip("starlette")
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def home(request: Any) -> PlainTextResponse:
        return PlainTextResponse("hello")

    guard = ConcurrencyGuard(1, retry_after=4)
    app = SheddingMiddleware(Starlette(routes=[Route("/", home)]), guard)
    with TestClient(app) as client:  # runs the lifespan through the middleware
        assert client.get("/").text == "hello"
        with guard:  # one request already in flight: the next is shed
            response = client.get("/")
        assert response.status_code == 503
        assert response.headers["retry-after"] == "4"
        assert response.json()["error"] == "overloaded"
        assert client.get("/").status_code == 200
    assert guard.in_flight == 0

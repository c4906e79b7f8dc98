"""What a fallback owes the database after an outage: bounded by ``max_keys``, written
back in batches of one statement each, and written behind decisions that come from the
database again as soon as it answers.

The outages of the first tests are made at the store boundary (a wrapper around the
database store that fails every call like an unreachable server while switched off), so
they count exactly which statements the write-back sends. The last one is a real outage
of PostgreSQL: a TCP gate of the test's own between the limiter and the shared server,
closed and opened again; the server itself is never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import pytest

import quota
from quota import Fallback, Metrics, StorageError
from tests._support import POSTGRES_FACES, SQLITE_FACES
from tests.conftest import backend_params

#: Long windows on the real clock (the write-back skips windows that have ended): a test
#: never straddles the end of a day.
WINDOW = 86400


class Switch:
    """The database store behind a fallback, made to fail like an outage while `down`.

    It records the name of every statement that reached the database, and fails the
    next `fail_batches` write-back statements (``hit_batch``) as an outage would.
    """

    def __init__(self, store: Any) -> None:
        self.store = store
        self.dialect = store.dialect
        self.up = True
        self.down = False
        self.fail_batches = 0
        self.statements: list[str] = []

    def _check(self, statement: Any) -> None:
        name = getattr(statement, "name", "sql")
        if self.down:
            raise StorageError("switched off by the test")
        if name == "hit_batch" and self.fail_batches:
            self.fail_batches -= 1
            raise StorageError("write-back refused by the test")
        self.statements.append(name)

    def execute(self, statement: Any, params: Sequence[Any]) -> Any:
        self._check(statement)
        return self.store.execute(statement, params)

    execute_strict = execute

    def run(self, op: Any, **kwargs: Any) -> Any:
        return self.store.run(op, **kwargs)

    def close(self) -> None:
        self.store.close()


class AsyncSwitch(Switch):
    async def execute(self, statement: Any, params: Sequence[Any]) -> Any:  # type: ignore[override]
        self._check(statement)
        return await self.store.execute(statement, params)

    execute_strict = execute  # type: ignore[assignment]

    async def run(self, op: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        return await self.store.run(op, **kwargs)

    async def aclose(self) -> None:
        await self.store.aclose()


def _url(request: pytest.FixtureRequest, face: str) -> str:
    return str(request.getfixturevalue("pg_clean_url" if face in POSTGRES_FACES else "sqlite_url"))


def _counts(url: str, prefix: str) -> dict[str, int]:
    """Every stored fixed-window count of keys starting with `prefix`, by key."""
    sql = "SELECT client_key, count FROM quota_counters WHERE client_key LIKE 'k:{}%'"
    if url.startswith("sqlite"):
        with contextlib.closing(sqlite3.connect(urlsplit(url).path)) as conn:
            rows = conn.execute(sql.format(prefix)).fetchall()
    else:
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            rows = conn.execute(sql.format(prefix).replace("%", "%%")).fetchall()
    return {str(key)[2:]: int(count) for key, count in rows}


def _through_switch(
    face: str, url: str, fallback: Fallback, metrics: Metrics,
    scenario: Callable[[Callable[[str], Awaitable[Any]], Any, Switch], Awaitable[None]],
) -> None:  # fmt: skip
    """Run `scenario(call, store, switch)` on a limiter of `face` whose database store is
    behind a `Switch`; `call(key)` counts one hit of `key`."""
    if face.endswith("sync"):
        with quota.connect(url, fallback=fallback, metrics=metrics, pool_size=2) as limiter:
            switch = limiter.store.primary = Switch(limiter.store.primary)  # type: ignore[attr-defined]

            async def call(key: str) -> Any:
                return limiter.rate_limit(key, 10**6, WINDOW)

            asyncio.run(scenario(call, limiter.store, switch))
        return

    async def main() -> None:
        async with quota.connect_async(
            url, fallback=fallback, metrics=metrics, pool_size=2
        ) as limiter:
            store = limiter.store
            switch = store.primary = AsyncSwitch(store.primary)  # type: ignore[attr-defined]

            async def call(key: str) -> Any:
                return await limiter.rate_limit(key, 10**6, WINDOW)

            await scenario(call, store, switch)

    asyncio.run(main())


async def _settled(store: Any, seconds: float = 30) -> None:
    """Wait (bounded) until the store is up and owes nothing."""
    deadline = time.monotonic() + seconds
    while not (store.up and not store.health.owes()) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert store.up and not store.health.owes(), "the write-back did not end"


@pytest.mark.parametrize("face", backend_params(*SQLITE_FACES, *POSTGRES_FACES))
def test_outage_debt_is_bounded_by_max_keys(request: pytest.FixtureRequest, face: str) -> None:
    """Past `max_keys` owed windows the ones owed least recently are dropped and counted;
    the rest are written back in full (main: every window of the outage stayed owed)."""
    url = _url(request, face)
    prefix = f"debt-{uuid.uuid4().hex[:8]}-"
    keys, kept = 3000, 1000
    metrics = Metrics()
    fallback = Fallback(timeout=0.5, probe_interval=0.05, max_keys=kept)

    async def scenario(call: Any, store: Any, switch: Switch) -> None:
        await call(prefix + "warm")
        switch.down = True
        for i in range(keys):
            await call(f"{prefix}{i}")
            await call(f"{prefix}{i}")
        await call(f"{prefix}0")  # owed again: now the debt owed most recently
        assert not store.up and store.health.owes()
        switch.down = False
        await _settled(store)

    _through_switch(face, url, fallback, metrics, scenario)
    assert metrics.snapshot().get("fallback_debt_dropped") == keys + 1 - kept
    expected = {f"{prefix}{i}": 2 for i in range(keys - kept + 1, keys)}
    expected[f"{prefix}0"] = 1  # its first two hits were dropped with the debt of key 0
    assert {k: v for k, v in _counts(url, prefix).items() if k != prefix + "warm"} == expected


@pytest.mark.parametrize("face", backend_params(*SQLITE_FACES, *POSTGRES_FACES))
def test_owed_hits_are_written_back_in_batches(request: pytest.FixtureRequest, face: str) -> None:
    """One statement per batch, none per window; a batch that fails is owed again and
    written once (main: one ``hit`` statement per owed window)."""
    url = _url(request, face)
    prefix = f"batch-{uuid.uuid4().hex[:8]}-"
    keys = 2500
    fallback = Fallback(timeout=0.2, probe_interval=0.05, max_keys=10_000)
    rows = 2000  # windows a batch carries: a fifth of the 200 ms budget at ~20 µs each

    async def scenario(call: Any, store: Any, switch: Switch) -> None:
        await call(prefix + "warm")
        switch.down = True
        for i in range(keys):
            for _ in range(1 + i % 3):
                await call(f"{prefix}{i}")
        assert store.health.owes()
        switch.statements.clear()
        switch.fail_batches = 1
        switch.down = False
        await _settled(store)
        sent = [name for name in switch.statements if name != "schema_version"]
        assert sent == ["hit_batch"] * math.ceil(keys / rows), sent[:5]

    _through_switch(face, url, fallback, Metrics(), scenario)
    counts = _counts(url, prefix)
    counts.pop(prefix + "warm")
    assert counts == {f"{prefix}{i}": 1 + i % 3 for i in range(keys)}


@pytest.mark.redis
@pytest.mark.parametrize("face", ["redis-sync", "redis-async"])
def test_owed_hits_are_written_back_to_redis_in_pipelines(redis_url: str, face: str) -> None:
    """Redis's batch is one pipeline of the hits' scripts (main: one script call each)."""
    prefix = f"redis-{uuid.uuid4().hex[:8]}-"
    keys = 700
    fallback = Fallback(timeout=0.05, probe_interval=0.05, max_keys=10_000)
    rows = 500  # windows a batch carries: a fifth of the 50 ms budget at ~20 µs each
    peeked: dict[str, int] = {}

    async def scenario(call: Any, store: Any, switch: Switch) -> None:
        await call(prefix + "warm")
        switch.down = True
        for i in range(keys):
            for _ in range(1 + i % 2):
                await call(f"{prefix}{i}")
        switch.statements.clear()
        switch.down = False
        await _settled(store)
        sent = [name for name in switch.statements if name != "schema_version"]
        assert sent == ["hit_batch"] * math.ceil(keys / rows), sent[:5]
        for i in range(keys):
            decision = await call(f"{prefix}{i}")  # one more hit, counted on Redis
            peeked[f"{prefix}{i}"] = decision.count

    _through_switch(face, redis_url, fallback, Metrics(), scenario)
    assert peeked == {f"{prefix}{i}": 2 + i % 2 for i in range(keys)}


# -- a real outage of PostgreSQL, made by a gate the test opens and closes -------------------


class Gate:
    """Forwards 127.0.0.1:port to a server while open. Closed, it cuts every connection and
    closes each new one at once: the server looks down, and a probe fails fast."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.open = True
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self.port = int(self._server.getsockname()[1])
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                continue
            if not self.open:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            client.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                pump = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                pump.start()
                self._threads.append(pump)

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close_gate(self) -> None:
        self.open = False
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def open_gate(self) -> None:
        self.open = True

    def stop(self) -> None:
        self.close_gate()
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self._server.close()


@contextlib.contextmanager
def gated(pg_url: str) -> Iterator[tuple[Gate, str]]:
    parts = urlsplit(pg_url)
    gate = Gate((parts.hostname or "127.0.0.1", parts.port or 5432))
    try:
        yield gate, parts._replace(netloc=f"{parts.username}@127.0.0.1:{gate.port}").geturl()
    finally:
        gate.stop()


#: How long after the database answers again the store may take to be back: one probe
#: interval, a new connection through the gate, and what a busy 2-core machine adds.
BACK_WITHIN = 2.0


@pytest.mark.postgres
@pytest.mark.slow
@pytest.mark.parametrize("face", ["sync", "async"])
def test_the_store_is_back_before_200k_owed_windows_are_written(
    pg_clean_url: str, face: str
) -> None:
    """With 200,000 windows owed, decisions come from PostgreSQL again within about a probe
    interval of its return, and the debt follows behind, every hit written once (main: the
    store came back 15-19 s later, after one INSERT per window)."""
    keys = 200_000
    prefix = f"back-{uuid.uuid4().hex[:8]}-"
    fallback = Fallback(timeout=0.2, probe_interval=0.1, max_keys=keys)
    seen: dict[str, Any] = {}

    async def scenario(call: Callable[[str], Awaitable[Any]], store: Any, gate: Gate) -> None:
        for _ in range(3):
            await call(prefix + "warm")
        assert store.up
        gate.close_gate()
        for i in range(keys):
            await call(f"{prefix}{i}")
        assert not store.up and store.health.owes()
        gate.open_gate()
        opened = time.monotonic()
        while not store.up and time.monotonic() - opened < 60:
            await asyncio.sleep(0.01)
        seen["back_after"] = time.monotonic() - opened
        seen["owed_when_back"] = store.health.owes()
        decision = await call(prefix + "after")  # decided by PostgreSQL meanwhile
        seen["up_after_call"] = store.up and decision.allowed
        await _settled(store, 120)

    with gated(pg_clean_url) as (gate, url):
        if face == "sync":
            with quota.connect(url, fallback=fallback, pool_size=2) as limiter:

                async def call(key: str) -> Any:
                    return limiter.rate_limit(key, 10**6, WINDOW)

                asyncio.run(scenario(call, limiter.store, gate))
        else:

            async def main() -> None:
                async with quota.connect_async(url, fallback=fallback, pool_size=2) as limiter:

                    async def call(key: str) -> Any:
                        return await limiter.rate_limit(key, 10**6, WINDOW)

                    await scenario(call, limiter.store, gate)

            asyncio.run(main())
    assert seen["back_after"] < BACK_WITHIN, seen
    assert seen["owed_when_back"], seen  # the switch did not wait for the write-back
    assert seen["up_after_call"], seen
    counts = _counts(pg_clean_url, prefix)
    assert counts.pop(prefix + "warm") == 3 and counts.pop(prefix + "after") == 1
    assert len(counts) == keys and set(counts.values()) == {1}


@pytest.mark.parametrize("face", backend_params(*POSTGRES_FACES))
def test_a_batch_the_store_rejects_is_written_hit_by_hit_and_only_the_rejected_hit_dropped(
    pg_clean_url: str, face: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A statement error (here a trigger refusing one key) fails the whole batch; the
    batch is written again hit by hit, and only the hit the store refuses is dropped,
    logged at ERROR: the rest of the batch is not lost with it, nor owed forever."""
    import psycopg

    prefix = f"poison-{uuid.uuid4().hex[:8]}-"
    fallback = Fallback(timeout=0.5, probe_interval=0.05)

    async def scenario(call: Any, store: Any, switch: Switch) -> None:
        await call(prefix + "warm")
        switch.down = True
        for i in range(20):
            await call(f"{prefix}{i}")
        await call(prefix + "bad")
        switch.statements.clear()
        switch.down = False
        await _settled(store)
        sent = [name for name in switch.statements if name != "schema_version"]
        assert sent == ["hit_batch"] + ["hit"] * 21, sent  # the batch, then hit by hit

    with psycopg.connect(pg_clean_url, autocommit=True) as conn:
        conn.execute(
            "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$"
            f" BEGIN IF NEW.client_key = 'k:{prefix}bad' THEN"
            " RAISE EXCEPTION 'refused by the test'; END IF; RETURN NEW; END $$"
        )
        conn.execute(
            "CREATE TRIGGER refuse_poison BEFORE INSERT ON quota_counters"
            " FOR EACH ROW EXECUTE FUNCTION refuse_poison()"
        )
    try:
        with caplog.at_level("ERROR", logger="quota"):
            _through_switch(face, pg_clean_url, fallback, Metrics(), scenario)
    finally:
        with psycopg.connect(pg_clean_url, autocommit=True) as conn:
            conn.execute("DROP TRIGGER refuse_poison ON quota_counters")
            conn.execute("DROP FUNCTION refuse_poison()")
    counts = _counts(pg_clean_url, prefix)
    counts.pop(prefix + "warm")
    assert counts == {f"{prefix}{i}": 1 for i in range(20)}
    assert any("rejected the write-back" in r.getMessage() for r in caplog.records)

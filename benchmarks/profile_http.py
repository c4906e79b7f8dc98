"""CPU per request of `QuotaMiddleware` itself, in process: no server, no load generator.

    python benchmarks/profile_http.py                                   # memory://
    python benchmarks/profile_http.py --store postgresql://user@127.0.0.1/db --profile

Calls the middleware around a trivial ASGI app directly, from ``--tasks``
concurrent tasks on one event loop, ``--requests`` times, with the request
`bench_app.py` serves (``GET /`` with an ``X-API-Key`` among ``--keys``), and
prints the process's CPU time per request (user + system) against the app
called bare: what the middleware adds, without uvicorn's and wrk's share of
the machine. ``--store none`` uses the stand-in limiter of ``bench_app.py``
(the middleware's own cost); on a SQL store it is the middleware's own
limiter, with group commit. ``--profile`` adds cProfile's top functions and
counts per request (function calls, tasks created, loop callbacks).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"11")]})  # fmt: skip
    await send({"type": "http.response.body", "body": b'{"ok":true}'})


async def _receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b""}


async def _send(_message: Any) -> None:
    return None


def _scope(key: int) -> dict[str, Any]:
    return {
        "type": "http", "method": "GET", "path": "/", "raw_path": b"/", "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), (b"x-api-key", b"key-%d" % key)],
        "client": ("127.0.0.1", 5555), "scheme": "http", "http_version": "1.1",
    }  # fmt: skip


async def _measure(app: Any, requests: int, tasks: int, keys: int) -> float:
    scopes = [_scope(k + 1) for k in range(keys)]

    async def worker(first: int, count: int) -> None:
        for i in range(count):
            await app(scopes[(first + i * tasks) % keys], _receive, _send)

    await asyncio.gather(*(worker(k, 200) for k in range(tasks)))  # warm up
    start = time.process_time()
    await asyncio.gather(*(worker(k, requests // tasks) for k in range(tasks)))
    return (time.process_time() - start) / (requests // tasks * tasks) * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default="memory://", help="memory://, postgresql://…, none")
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("QUOTA_HASH_SECRET", "bench-hash-secret-0123456789")
    import quota

    if args.store != "none" and not args.store.startswith("memory:"):
        quota.migrate(args.store)
    asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> None:
    import quota
    from benchmarks.bench_app import _config, _NoDatabase
    from quota.http.asgi import QuotaMiddleware

    if args.store == "none":
        middleware = QuotaMiddleware(_app, limiter=_NoDatabase(), config=_config())  # type: ignore[arg-type]
    elif args.store.startswith("memory:"):
        middleware = QuotaMiddleware(
            _app, limiter=quota.connect_async(args.store), config=_config()
        )
    else:
        middleware = QuotaMiddleware(_app, url=args.store, config=_config())
    bare = await _measure(_app, args.requests, args.tasks, args.keys)
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    limited = await _measure(middleware, args.requests, args.tasks, args.keys)
    if profiler is not None:
        profiler.disable()
    await middleware.limiters.aclose()
    print(f"{args.store.split('@')[-1]}: bare {bare:.1f} us, with quota {limited:.1f} us,"
          f" +{limited - bare:.1f} us CPU per request{' (under cProfile)' if profiler else ''}")  # fmt: skip
    if profiler is not None:
        stats = pstats.Stats(profiler)
        print(_counted(stats, 200 * args.tasks + args.requests // args.tasks * args.tasks))
        stats.sort_stats("tottime").print_stats(25)


def _counted(stats: pstats.Stats, requests: int) -> str:
    """Counts per request under cProfile (warm-up included): steadier than time on a busy machine."""
    tasks = callbacks = 0
    for (path, _, name), (_, calls, *_) in stats.stats.items():  # type: ignore[attr-defined]
        if "asyncio" in path and name == "create_task":
            tasks += calls
        elif "asyncio" in path and name == "call_soon":
            callbacks += calls
    total = stats.total_calls  # type: ignore[attr-defined]
    return (f"per request: {total / requests:.0f} function calls, {tasks / requests:.3f} tasks"
            f" created, {callbacks / requests:.2f} loop callbacks (call_soon)")  # fmt: skip


if __name__ == "__main__":
    main()

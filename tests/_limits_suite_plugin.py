"""The pytest plugin that points `limits`' own test suite at quota's storages.

No tests here: `tests/contrib/test_limits_suite.py` runs limits' test files (from its
sdist) in a subprocess with ``-p _limits_suite_plugin --noconftest``, and
this plugin, loaded there and only there, does what limits' conftest and
``tests/utils.py`` do for its own storages:

* every parametrization over ``uri, args, [expected_instance,] fixture`` gets
  one row instead of limits' services: ``quota+$QUOTA_LIMITS_SUITE_URL`` for
  sync tests, ``async+quota+…`` for async ones (told apart by limits' own
  URIs), with `QuotaStorage`/`AsyncQuotaStorage` as the expected class;
* the ``fixture`` of each row (limits' ``flushall``) is replaced by deleting
  the adapter's rows before every test;
* every storage a test builds is closed after it (limits' tests never close
  theirs; the PostgreSQL server is shared);
* coroutine tests run on an event loop of their own (what pytest-asyncio does
  for limits), and ``@pytest.mark.flaky`` tests get limits' reruns (what the
  flaky plugin does): up to ``max_runs`` (default 2), each one recorded as a
  ``rerun`` property in the JUnit XML; so does, once, a test whose failure is a
  ``pytest.approx`` comparison of elapsed wall-clock time (a loaded machine);
* tests of strategies quota does not offer are skipped with the reason in
  `EXCLUDED`; tests that take no storage (limits' URI parsing, its error
  wrapping with a storage class of the test's own) are deselected.

Nothing here imports from quota's own ``tests`` package: in the subprocess
``tests`` is limits'.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import quota.contrib.limits
from quota.contrib.limits import AsyncQuotaStorage, QuotaStorage

#: The quota URL every row of the parametrization uses (set by the outer test).
URL_ENV = "QUOTA_LIMITS_SUITE_URL"
#: The parametrizations limits' storage tests use, by argument names.
STORAGE_ARGNAMES = ("uri, args, fixture", "uri, args, expected_instance, fixture")
#: The id every test run against quota gets.
PARAM_ID = "quota"

#: Storage tests quota leaves out, each with the reason the report gives.
EXCLUDED: dict[str, tuple[Callable[[pytest.Item], bool], str]] = {
    "moving window": (
        lambda item: (
            "moving_window" in item.name
            or "MovingWindow" in getattr(getattr(item, "cls", None), "__name__", "")
        ),
        "quota excludes: moving window, unsupported by design (a row per hit);"
        " limits' MovingWindowRateLimiter refuses the storage, as for memcached",
    ),
}

#: Markers limits' test files use (limits registers them in its pytest.ini, not read here).
MARKERS = (
    "asyncio: a coroutine test (run by this plugin)",
    "flaky: rerun on failure (by this plugin): max_runs, default 2",
    "integration: limits' integration tests",
    "unit: limits' unit tests",
    "memory: limits' memory storage",
    "redis: limits' redis tests",
    "redis_sentinel: limits' redis sentinel tests",
    "redis_cluster: limits' redis cluster tests",
    "mongodb: limits' mongodb tests",
    "memcached: limits' memcached tests",
    "valkey: limits' valkey tests",
    "valkey_cluster: limits' valkey cluster tests",
    "benchmark: limits' benchmarks",
)

_made: list[Any] = []
"""Storages built during the current test, closed after it."""


def _track(cls: type) -> None:
    original = cls.__init__  # type: ignore[misc]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _made.append(self)

    cls.__init__ = __init__  # type: ignore[misc]


def _url() -> str:
    url = os.environ.get(URL_ENV)
    if not url:
        raise pytest.UsageError(f"${URL_ENV} must name a migrated quota database")
    return url


def _row(argnames: str, asynchronous: bool) -> Any:
    uri = ("async+quota+" if asynchronous else "quota+") + _url()
    # A small pool: limits' concurrency tests run 100 threads on one storage.
    options = {"pool_size": 4, "timeout": 30}
    if "expected_instance" in argnames:
        cls = AsyncQuotaStorage if asynchronous else QuotaStorage
        return pytest.param(uri, options, cls, None, id=PARAM_ID)
    return pytest.param(uri, options, None, id=PARAM_ID)


def _retarget(obj: object) -> None:
    """Point `obj`'s storage parametrizations (limits' services) at quota's storage."""
    marks = getattr(obj, "__dict__", {}).get("pytestmark")
    if not marks:
        return
    retargeted = []
    for mark in marks:
        argnames = mark.args[0] if mark.name == "parametrize" and mark.args else None
        if isinstance(argnames, str) and argnames.replace(" ", "") in (
            names.replace(" ", "") for names in STORAGE_ARGNAMES
        ):
            asynchronous = any(
                str(getattr(row, "values", row)[0]).startswith("async+") for row in mark.args[1]
            )
            mark = pytest.mark.parametrize(argnames, [_row(argnames, asynchronous)]).mark
        retargeted.append(mark)
    obj.pytestmark = retargeted  # type: ignore[attr-defined]


def pytest_configure(config: pytest.Config) -> None:
    # Only where this module is a plugin (quota's own run imports it for
    # `EXCLUDED` and must not see its storages patched).
    _url()
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    if importlib.util.find_spec("pytest_lazy_fixtures") is None:
        # limits' test modules import `lf` to name their service fixtures; the
        # rows that use it are replaced, so a stand-in that names them will do.
        shim = types.ModuleType("pytest_lazy_fixtures")
        shim.lf = lambda name: name  # type: ignore[attr-defined]
        sys.modules["pytest_lazy_fixtures"] = shim
    _track(QuotaStorage)
    _track(AsyncQuotaStorage)


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> None:
    if inspect.isclass(obj) or inspect.isfunction(obj):
        _retarget(obj)


def _on_quota(item: pytest.Item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.id.split("-")[-1] == PARAM_ID


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, deselected = [], []
    for item in items:
        if not _on_quota(item):
            deselected.append(item)
            continue
        for matches, reason in EXCLUDED.values():
            if matches(item):
                item.add_marker(pytest.mark.skip(reason=reason))
        kept.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = kept


def _reset() -> None:
    """Delete every row the adapter wrote: what limits' per-test ``flushall`` fixtures do."""
    storage = QuotaStorage("quota+" + _url())
    _made.remove(storage)
    try:
        storage.reset()
    finally:
        storage.close()


def _close_sync() -> None:
    while _made:
        storage = _made.pop()
        if isinstance(storage, QuotaStorage):
            storage.close()


@pytest.fixture(autouse=True)
def _quota_rows() -> Iterator[None]:
    """Each test starts on an empty adapter table, and its storages are closed after it."""
    _reset()
    yield
    _close_sync()


def _run_once(function: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    if not inspect.iscoroutinefunction(function):
        function(**kwargs)
        return
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(function(**kwargs))
    finally:
        # An async storage belongs to the loop it was first used on: close it there.
        try:
            for storage in [s for s in _made if isinstance(s, AsyncQuotaStorage)]:
                _made.remove(storage)
                loop.run_until_complete(storage.aclose())
        finally:
            loop.close()


def _timed(exc: Exception) -> bool:
    """Whether `exc` is limits' comparison of elapsed wall-clock time (``pytest.approx``
    within a tolerance of hundredths of a second), which a loaded machine can miss."""
    return isinstance(exc, AssertionError) and "±" in str(exc)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool:
    flaky = pyfuncitem.get_closest_marker("flaky")
    runs = int(flaky.kwargs.get("max_runs", 2)) if flaky else 1
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    for attempt in range(1, runs + 1):
        try:
            _run_once(pyfuncitem.obj, kwargs)
        except Exception as exc:
            if attempt == 1 and runs == 1 and _timed(exc):
                runs = 2  # wall-clock timing on a loaded machine: once more, recorded
            if attempt == runs:
                raise
            pyfuncitem.user_properties.append(("rerun", f"{type(exc).__name__}: {exc}"))
            _close_sync()
            _reset()
        else:
            return True
    return True  # not reached: the last attempt returns or raises


assert quota.contrib.limits  # the import registers the quota+ schemes with limits

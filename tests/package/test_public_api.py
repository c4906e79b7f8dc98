"""The public surface: one sorted ``__all__`` that is exactly what `quota` exports."""

from __future__ import annotations

import importlib.metadata
import types

import quota


def _exported() -> set[str]:
    return {
        name
        for name in dir(quota)
        if not name.startswith("_")
        and not isinstance(getattr(quota, name), types.ModuleType)
        and name != "annotations"  # from __future__ import annotations
    }


def test_all_is_sorted_without_duplicates() -> None:
    assert quota.__all__ == sorted(quota.__all__)
    assert len(set(quota.__all__)) == len(quota.__all__)


def test_all_is_exactly_the_public_names() -> None:
    assert set(quota.__all__) == _exported()


def test_every_name_in_all_exists() -> None:
    missing = [name for name in quota.__all__ if not hasattr(quota, name)]
    assert missing == []


def test_the_version_matches_the_installed_distribution() -> None:
    assert quota.__version__ == importlib.metadata.version("quota")


def test_the_admin_module_exports_exactly_its_public_names() -> None:
    import quota.admin

    names = {
        name
        for name in dir(quota.admin)
        if not name.startswith("_")
        and not isinstance(getattr(quota.admin, name), types.ModuleType)
        and name != "annotations"
    }
    assert len(set(quota.admin.__all__)) == len(quota.admin.__all__)
    assert set(quota.admin.__all__) == names
    assert {"Admin", "AsyncAdmin", "Health", "PolicyRow", "SettingRow"} <= names


def test_load_shedding_lives_in_the_http_package() -> None:
    """The shedding guard and middleware are HTTP pieces: `quota.http.shedding`, not `quota`."""
    from quota.http import shedding

    for name in ("ConcurrencyGuard", "SheddingMiddleware"):
        assert not hasattr(quota, name)
        assert isinstance(getattr(shedding, name), type)

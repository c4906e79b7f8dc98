"""Bounds of the factors that scale limits (tier multipliers, plan scales, pressure factors)."""

from __future__ import annotations

from collections.abc import Mapping

from quota._core.errors import ConfigurationError

#: Bounds of every tier multiplier, plan scale and pressure factor (pressure
#: factors are at most 1). Within them a request's combined factor stays in
#: 1e-9..1e6, so a scaled limit is a finite number `scale_rate` can clamp.
MIN_FACTOR = 0.001
MAX_FACTOR = 1000.0


def check_factors(name: str, value: object, *, maximum: float = MAX_FACTOR) -> dict[str, float]:
    """`value`, a mapping of name to factor, checked and as floats (`ConfigurationError` naming
    `name`, the entry and its value for one out of bounds)."""
    if not isinstance(value, Mapping):
        raise ConfigurationError(f"{name} must be a mapping of name to number, got {value!r}")
    out = {}
    for key, factor in value.items():
        if (
            isinstance(factor, bool)
            or not isinstance(factor, (int, float))
            or not MIN_FACTOR <= factor <= maximum  # NaN fails this too
        ):
            raise ConfigurationError(
                f"{name}[{key!r}] must be a number between {MIN_FACTOR:g} and {maximum:g},"
                f" got {factor!r}"
            )
        out[str(key)] = float(factor)
    return out

"""The one reading of whole numbers, decimal numbers and true/false words (`quota._core.parsing`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quota._core.parsing import FALSE_WORDS, TRUE_WORDS, parse_decimal, parse_flag, parse_whole


@pytest.mark.parametrize(
    "text, expected",
    [
        ("0", 0), ("42", 42), (" 7 \n", 7), ("007", 7),
        ("9" * 19, 10**19 - 1),  # nineteen digits: every 64-bit count
        ("9" * 20, None), ("", None), (" ", None), ("-1", None), ("+1", None), ("1.0", None),
        ("1_000", None), ("²", None), ("\u0661\u0660", None), ("1e3", None), ("0x10", None),
    ],
)  # fmt: skip
def test_whole(text: str, expected: int | None) -> None:
    assert parse_whole(text) == expected


def test_signed_whole() -> None:
    assert parse_whole("-12", signed=True) == -12
    assert parse_whole(" 12 ", signed=True) == 12
    assert parse_whole("-" + "9" * 19, signed=True) == -(10**19 - 1)
    assert parse_whole("--1", signed=True) is None
    assert parse_whole("-", signed=True) is None
    assert parse_whole("-12") is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2", 2.0), ("0.5", 0.5), (".5", 0.5), ("5.", 5.0), ("1e-3", 0.001), ("1E+2", 100.0),
        (" 1.5\t", 1.5), ("0", 0.0),
        ("", None), (".", None), ("-1", None), ("+1", None), ("nan", None), ("inf", None),
        ("1_000", None), ("1e", None), ("1e1234", None), ("\u0661.\u0660", None), ("²", None),
        ("1e999", None),  # overflows a float: not a finite number
    ],
)  # fmt: skip
def test_decimal(text: str, expected: float | None) -> None:
    assert parse_decimal(text) == expected


def test_decimal_digits_edge() -> None:
    """Twenty digits either side of the point read; twenty-one do not."""
    assert parse_decimal("9" * 20) == float("9" * 20)
    assert parse_decimal("9" * 21) is None
    assert parse_decimal("0." + "1" * 20) == float("0." + "1" * 20)
    assert parse_decimal("0." + "1" * 21) is None
    assert parse_decimal("." + "1" * 20) is not None
    assert parse_decimal("." + "1" * 21) is None
    # The longest shortest text of a float in positional notation: three zeros, 17 digits.
    assert parse_decimal("0.00012345678901234567") == 0.00012345678901234567


@given(st.floats(min_value=0.0, allow_nan=False, allow_infinity=False))
def test_decimal_reads_back_every_float(number: float) -> None:
    """What quota writes back (``repr`` of a float) reads again as the same number."""
    assert parse_decimal(repr(abs(number))) == abs(number)


@pytest.mark.parametrize("word", sorted(TRUE_WORDS))
def test_true_words(word: str) -> None:
    assert parse_flag(word) is True
    assert parse_flag(f" {word.upper()} ") is True


@pytest.mark.parametrize("word", sorted(FALSE_WORDS))
def test_false_words(word: str) -> None:
    assert parse_flag(word) is False
    assert parse_flag(f"\t{word.title()}\n") is False


@pytest.mark.parametrize("word", ["", "y", "n", "2", "enabled", "none", "truee", "tru e"])
def test_other_words(word: str) -> None:
    assert parse_flag(word) is None


def test_words() -> None:
    assert {"1", "true", "yes", "on"} == TRUE_WORDS
    assert {"0", "false", "no", "off"} == FALSE_WORDS

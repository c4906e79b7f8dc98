"""The SQLite checks: the library's version and the file's journal mode."""

from __future__ import annotations

from pathlib import Path

from quota._tools.doctor.base import ERROR, OK, WARN, Finding, Session


def sqlite_version_finding(version: tuple[int, int, int], text: str) -> Finding:
    """The SQLite library this Python links against, against the oldest quota runs on."""
    from quota._stores.sqlite import MIN_SQLITE  # imports aiosqlite: not at `import quota` time

    needed = ".".join(map(str, MIN_SQLITE))
    if version >= MIN_SQLITE:
        return Finding("sqlite_version", OK, f"SQLite {text} (quota needs {needed} or newer)")
    return Finding(
        "sqlite_version", ERROR,
        f"SQLite {text} is too old: quota needs {needed} or newer (for INSERT … RETURNING)",
        "use a Python linked against a newer SQLite (e.g. a current python.org or"
        " distribution build), or pysqlite3-binary",
    )  # fmt: skip


def journal_mode(session: Session) -> list[Finding]:
    """The ``journal_mode`` finding of the open file."""
    assert session.path is not None  # a SQLite session
    return [journal_mode_finding(str(session.query("PRAGMA journal_mode")[0][0]), session.path)]


def journal_mode_finding(mode: str, path: Path) -> Finding:
    """WAL lets readers and the writer work at once; quota sets it when a limiter connects."""
    if mode.lower() == "wal":
        return Finding("journal_mode", OK, "journal_mode is WAL")
    return Finding(
        "journal_mode", WARN,
        f"journal_mode is {mode!r}, not WAL: readers and the writer block each other."
        " A limiter switches the file to WAL when it first connects, so this is expected"
        " right after `quota migrate`; if it stays after the app has run, something switches"
        " it back, or the file system cannot do WAL (network file systems cannot)",
        f"run `sqlite3 '{path}' 'PRAGMA journal_mode=WAL'` and keep the file on a local disk",
    )  # fmt: skip

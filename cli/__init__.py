"""The ``quota`` command line (installed as ``quota._cli``); see `main`."""

from .main import main

__all__ = ["main"]

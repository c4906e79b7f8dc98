"""The test suite of `quota`; a package so spawned workers can import its helpers."""

"""Test stand-in (tests/standins/ray): see ray/__init__.py."""

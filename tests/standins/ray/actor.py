"""Test stand-in (tests/standins/ray): see ray/__init__.py."""


class ActorHandle:
    """Only for annotations and isinstance checks."""

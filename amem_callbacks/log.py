"""The package's logger (``amem_callbacks``), and warnings said once per process."""

import logging

logger = logging.getLogger("amem_callbacks")
_warned: set = set()


def warn_once(key, message: str, *args) -> None:
    """``logger.warning(message, *args)`` the first time this process meets ``key``."""
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)

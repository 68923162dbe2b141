"""Test stand-in (tests/standins/ray): see ray/__init__.py."""

from ray import needs_ray

get_actor = needs_ray("experimental.state.api.get_actor")

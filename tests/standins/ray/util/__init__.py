"""Test stand-in (tests/standins/ray): see ray/__init__.py."""

from ray import needs_ray

get_node_ip_address = needs_ray("util.get_node_ip_address")
list_named_actors = needs_ray("util.list_named_actors")
placement_group_table = needs_ray("util.placement_group_table")

from ray.util import placement_group, scheduling_strategies  # noqa: E402,F401

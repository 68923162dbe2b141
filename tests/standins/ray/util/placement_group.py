"""Test stand-in (tests/standins/ray): see ray/__init__.py."""

from ray import needs_ray


class PlacementGroup:
    """Only for annotations and isinstance checks."""


placement_group = needs_ray("util.placement_group.placement_group")
remove_placement_group = needs_ray("util.placement_group.remove_placement_group")

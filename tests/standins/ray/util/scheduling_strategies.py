"""Test stand-in (tests/standins/ray): see ray/__init__.py."""

from ray import needs_ray


class NodeAffinitySchedulingStrategy:
    __init__ = needs_ray("util.scheduling_strategies.NodeAffinitySchedulingStrategy")


class PlacementGroupSchedulingStrategy:
    __init__ = needs_ray("util.scheduling_strategies.PlacementGroupSchedulingStrategy")

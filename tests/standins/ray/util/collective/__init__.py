"""Test stand-in (tests/standins/ray): see ray/__init__.py. Imported by verl's
NCCL checkpoint engines, which the naive (colocated) path does not use."""

from ray import needs_ray

init_collective_group = needs_ray("util.collective.init_collective_group")
create_collective_group = needs_ray("util.collective.create_collective_group")
destroy_collective_group = needs_ray("util.collective.destroy_collective_group")
broadcast = needs_ray("util.collective.broadcast")

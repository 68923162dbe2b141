"""Framework adapters, installed as ``amem_callbacks.adapters``: one module per
framework, each importing its framework only when used."""

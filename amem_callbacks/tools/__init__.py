"""The ``amem-callbacks`` command's tools: doctor, demo, bench (none is imported by the engine)."""

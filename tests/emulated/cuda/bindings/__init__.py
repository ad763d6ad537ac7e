"""EMULATED ``cuda.bindings`` (cuda-python >= 12.6 layout) for tests; only ``runtime`` exists."""

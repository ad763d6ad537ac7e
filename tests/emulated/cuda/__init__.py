"""EMULATED cuda-python for tests (never shipped): see :mod:`cuda.bindings.runtime` in this folder."""

"""EMULATED ``cuda.cudart`` (cuda-python < 12.6 layout): the same module as ``cuda.bindings.runtime``."""

from cuda.bindings.runtime import *  # noqa: F401,F403
from cuda.bindings.runtime import __all__  # noqa: F401

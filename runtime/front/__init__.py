"""What a user holds: :class:`~medusa_runtime.front.session.MedusaSession` (Python API), the request
parser and batch server (``serving``), prompt files (``prompts``) and ``python -m medusa_runtime``
(``cli``).

Layer 6, the top of the runtime: nothing in the runtime imports it except the package's own
``__init__`` (the public API) and ``__main__``."""

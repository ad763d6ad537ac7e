"""Token trees: the static tree and its buffers (``tree``), the ``--tree`` grammar and per-step tree
specs (``treespec``), the heads' calibration map (``calibration``). Pure numpy.

Layer 1 of the runtime: it imports only ``errors``."""

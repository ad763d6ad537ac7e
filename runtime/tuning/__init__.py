"""Which tree runs: timing tree sizes on this machine (``autotree``), the per-machine cache of that pick
(``treecache``) and the one resolver of a ``--tree`` spec (``resolve``).

Layer 5 of the runtime: it times the decode loop (``decode``)."""

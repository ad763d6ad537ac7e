"""The decode step, in the order it runs: candidates from the heads (``candidates``), the engine's tree
step and the acceptance rules (``acceptance``), KV compaction and stops inside the loop (``loop``), and the
scheduler that runs many sequences through the same loop (``batch``).

Layer 4 of the runtime: it drives an engine (``engines``, layer 3) over an artifact (``contract``)."""

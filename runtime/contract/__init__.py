"""The artifact contract, read: ``manifest.json`` (its typed schema), the graphs' declared I/O, the loaded
:class:`~medusa_runtime.contract.artifact.Artifact` and its tokenizer and chat template.

Layer 2 of the runtime (below: ``trees``, then ``errors`` / ``stops``); everything downstream reads an
artifact through here."""

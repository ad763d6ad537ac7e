"""The PyTorch reference model: the backbone (Llama, Mistral, Qwen2, Qwen3), the Medusa heads,
their step and decode loop.

Modules: ``families`` (one entry per supported family: its config mapping, defaults, GGUF name, test
shapes), ``config`` (the backbone's geometry and feature switches), ``backbone`` (the decoder),
``heads`` (Medusa heads, Medusa paper §2.1.1), ``medusa`` (:class:`~medusa_export.model.medusa.MedusaModel`
and its tree step), ``decode`` (the PyTorch engine for ``medusa_runtime.decode.loop``).
"""

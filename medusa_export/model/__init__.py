"""The PyTorch reference model: the Llama backbone, the Medusa heads, their step and decode loop.

Modules: ``backbone`` (Llama backbone), ``heads`` (Medusa heads, seeds/001 §2.1.1), ``medusa``
(:class:`~medusa_export.model.medusa.MedusaModel` and its tree step), ``decode`` (the PyTorch
engine for ``medusa_runtime.loop``).
"""

"""Export: the ONNX graphs, their weight-only quantization, the manifest and the artifact's files.

Modules: ``graph`` (the graph builder the writers use), ``portable`` (the standard-op step graph),
``fused`` (ONNX Runtime's fused-operator step graph), ``acceptance`` (the step's acceptance outputs),
``sampler`` (the in-graph sampler), ``heads_graph`` (the Medusa heads graph),
``weights`` (``weights.bin``: recipes, the streaming writer, checksums), ``writer`` (both graphs written
from the tensor sources), ``contract`` (the graphs' I/O contract as data), ``quantize`` (MatMulNBits
weight-only precisions), ``precisions`` (the table of precisions every stage reads), ``config`` (the export's options and choices),
``manifest`` (the artifact's ``manifest.json``), ``build`` (sources + tree -> the artifact's files in a folder).
``build`` itself (export, TensorRT check, validation, the folder moved into place) is :mod:`medusa_export.pipeline`.
"""

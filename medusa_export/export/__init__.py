"""Export: the ONNX graphs, their weight-only quantization, the manifest and the artifact ``build``.

Modules: ``portable`` (traced standard-op step and heads graphs), ``fused`` (ONNX Runtime's
fused-operator step graph), ``quantize`` (MatMulNBits weight-only precisions), ``config``
(``build``'s options and choices), ``manifest`` (the artifact's ``manifest.json``), ``build``
(model + tree -> a validated artifact directory).
"""

"""Export: the ONNX graphs, their weight-only quantization, and the artifact ``build``.

Modules: ``portable`` (traced standard-op step and heads graphs), ``fused`` (ONNX Runtime's
fused-operator step graph), ``quantize`` (MatMulNBits weight-only precisions), ``build``
(model + tree -> a validated artifact directory, manifest included).
"""

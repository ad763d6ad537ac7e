"""medusa-export: export Medusa speculative decoding to ONNX / TensorRT, checked against PyTorch."""

__version__ = "0.1.0"

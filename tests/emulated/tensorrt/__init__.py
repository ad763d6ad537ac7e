"""EMULATED TensorRT Python API for tests (never shipped): the subset medusa-export uses, NOT TensorRT.

A test double that lets CI execute the project's engine build (``medusa_export.trt.builder``)
and its ``tensorrt`` runtime backend (``medusa_runtime`` TrtEngine) end to end:

* ``Builder`` / ``OnnxParser`` / ``IBuilderConfig`` / ``IOptimizationProfile`` check what TensorRT checks
  at build time (profiles for every dynamic input, min <= opt <= max, fixed dims kept), and
  ``build_serialized_network`` returns an *emulated plan*: a header line and JSON (TensorRT version,
  the device's name and compute capability, flags, profiles, I/O tensors, the ONNX file's path and
  SHA-256). The ONNX is referenced, not copied: weights stay in the artifact's ``weights.bin``.
* ``Runtime.deserialize_cuda_engine`` refuses (returns None, logs why) a plan of another TensorRT
  version or GPU model, as TensorRT does, and one whose ONNX changed since the build.
* ``IExecutionContext.execute_async_v3`` runs the ONNX with ONNX Runtime on the CPU, reading inputs from
  and writing outputs to the emulated device memory of :mod:`cuda.bindings.runtime` (also emulated).
  A strongly typed network computes in the ONNX's types: ONNX Runtime runs float16 as float16 and a bfloat16
  graph with its bfloat16 rounding points computed in float32 (it has no bfloat16 MatMul). TF32 changes nothing.

Strict where TensorRT is; each rule cites the header (``include/NvInferRuntime.h``, ``include/NvInfer.h``
of github.com/NVIDIA/TensorRT) or guide it comes from. ``EMULATED_TENSORRT_VERSION`` (default 10.15.1)
chooses the version; at 11 or above the APIs TensorRT 11 removed are absent (BuilderFlag FP16 / INT8 /
BF16 / FP8 / precision constraints, calibrators, weak typing: every network is strongly typed,
``ILayer.precision`` / ``set_output_type`` and ``ICudaEngine.device_memory_size`` gone), as the 11.x
headers have them. Errors go to the logger and to :func:`emulator_last_error`.

Held to the real bindings (tests/test_trt_real_bindings.py reads ``tensorrt_bindings`` of a pinned 10.x and 11.x
release): every public class, enum member and value, method with its parameter names, and property here exists
there; a public class takes no attribute it does not define (``__slots__``, as pybind classes raise
AttributeError); the emulator's own state is private (``_name``) and its helpers are ``emulator_*``.
"""

from __future__ import annotations

import builtins
import enum
import hashlib
import json
import os
import sys
import threading
from pathlib import Path

import numpy as np
import onnx
from cuda.bindings import runtime as _cudart

EMULATED = True
__version__ = os.environ.get("EMULATED_TENSORRT_VERSION", "10.15.1")
_MAJOR = int(__version__.split(".")[0])
_TRT11 = _MAJOR >= 11
PLAN_MAGIC = b"EMULATED-TENSORRT-PLAN 1\n"
_last_error = [""]


def emulator_last_error() -> str:
    """Why the last emulated call failed (emulator only)."""
    return _last_error[0]


class ILogger:
    """The logger interface (``log`` is the subclass's); its Severity values are also the class's attributes."""

    __slots__ = ()

    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = Severity

    def __init__(self):
        pass

    def log(self, severity, msg: str) -> None:
        raise NotImplementedError


class Logger(ILogger):
    """ILogger with a minimum severity; messages at or above it go to stderr."""

    __slots__ = ("min_severity",)

    def __init__(self, min_severity=ILogger.Severity.WARNING):
        self.min_severity = min_severity

    def log(self, severity, msg: str) -> None:
        if severity <= self.min_severity:
            print(f"[emulated TensorRT] {msg}", file=sys.stderr)


def _error(logger, msg: str) -> None:
    _last_error[0] = msg
    (logger or Logger()).log(ILogger.ERROR, msg)


class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    BF16 = 7
    INT64 = 8


# The module's DataType aliases, as the real bindings name them (``tensorrt.bool`` shadows the builtin here: the
# emulator's code says ``builtins.bool``).
float32, float16, bfloat16, int8, int32, int64, uint8, bool = (  # noqa: A001
    DataType.FLOAT, DataType.HALF, DataType.BF16, DataType.INT8, DataType.INT32, DataType.INT64, DataType.UINT8,
    DataType.BOOL)
_NP = {DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8, DataType.INT32: np.int32,
       DataType.BOOL: np.bool_, DataType.UINT8: np.uint8, DataType.INT64: np.int64}
_FROM_ONNX = {onnx.TensorProto.FLOAT: DataType.FLOAT, onnx.TensorProto.FLOAT16: DataType.HALF,
              onnx.TensorProto.INT8: DataType.INT8, onnx.TensorProto.INT32: DataType.INT32,
              onnx.TensorProto.BOOL: DataType.BOOL, onnx.TensorProto.UINT8: DataType.UINT8,
              onnx.TensorProto.BFLOAT16: DataType.BF16, onnx.TensorProto.INT64: DataType.INT64}


def nptype(trt_type: DataType):
    """The numpy type of a TensorRT DataType (TypeError for BF16, which numpy lacks, as in TensorRT)."""
    if DataType(trt_type) not in _NP:
        raise TypeError(f"{DataType(trt_type).name} has no numpy equivalent")
    return _NP[DataType(trt_type)]


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class ExecutionContextAllocationStrategy(enum.IntEnum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0


class ProfilingVerbosity(enum.IntEnum):
    LAYER_NAMES_ONLY = 0
    NONE = 1
    DETAILED = 2


if _TRT11:
    # NvInfer.h 11.x: kSTRONGLY_TYPED = 0, "Deprecated in TensorRT 11.0. Strongly typed mode is always enabled.
    # This flag is retained for API compatibility but is ignored." (kEXPLICIT_BATCH is gone.)
    class NetworkDefinitionCreationFlag(enum.IntEnum):
        STRONGLY_TYPED = 0
        PREFER_JIT_PYTHON_PLUGINS = 1
        PREFER_AOT_PYTHON_PLUGINS = 2

    # NvInfer.h 11.x enum BuilderFlag: kFP16 (0), kINT8 (1), kOBEY/PREFER_PRECISION_CONSTRAINTS, kBF16, kFP8 ...
    # are removed ("strongly typed mode is always enabled": precision comes from the network's types).
    class BuilderFlag(enum.IntEnum):
        DEBUG = 2
        GPU_FALLBACK = 3
        REFIT = 4
        DISABLE_TIMING_CACHE = 5
        TF32 = 6
        SPARSE_WEIGHTS = 7
        VERSION_COMPATIBLE = 12
        EXCLUDE_LEAN_RUNTIME = 13
        ERROR_ON_TIMING_CACHE_MISS = 15
else:
    class NetworkDefinitionCreationFlag(enum.IntEnum):  # NvInfer.h 10.x
        EXPLICIT_BATCH = 0  # deprecated and ignored in 10.x
        STRONGLY_TYPED = 1

    class BuilderFlag(enum.IntEnum):  # NvInfer.h 10.x, values as the 10.16 bindings have them
        FP16 = 0
        INT8 = 1
        DEBUG = 2
        GPU_FALLBACK = 3
        REFIT = 4
        DISABLE_TIMING_CACHE = 5
        TF32 = 6
        SPARSE_WEIGHTS = 7
        OBEY_PRECISION_CONSTRAINTS = 9
        PREFER_PRECISION_CONSTRAINTS = 10
        VERSION_COMPATIBLE = 13
        EXCLUDE_LEAN_RUNTIME = 14
        FP8 = 15
        ERROR_ON_TIMING_CACHE_MISS = 16
        BF16 = 17


class LayerType(enum.IntEnum):  # NvInfer.h enum class LayerType (the members the parser gives here)
    CONVOLUTION = 0
    CAST = 1
    ACTIVATION = 2
    POOLING = 3
    SOFTMAX = 6
    CONCATENATION = 8
    ELEMENTWISE = 9
    UNARY = 11
    SHUFFLE = 13
    REDUCE = 14
    TOPK = 15
    GATHER = 16
    MATRIX_MULTIPLY = 17
    CONSTANT = 19
    IDENTITY = 20
    SLICE = 22
    SHAPE = 23
    SELECT = 30


class UnaryOperation(enum.IntEnum):
    EXP, LOG, SQRT, RECIP, ABS, NEG, SIN, COS = range(8)


class ElementWiseOperation(enum.IntEnum):
    SUM, PROD, MAX, MIN, SUB, DIV, POW = range(7)


_LAYER_OF_OP = {"MatMul": LayerType.MATRIX_MULTIPLY, "Gemm": LayerType.MATRIX_MULTIPLY, "Softmax": LayerType.SOFTMAX,
                "LogSoftmax": LayerType.SOFTMAX, "TopK": LayerType.TOPK, "Gather": LayerType.GATHER,
                "Concat": LayerType.CONCATENATION, "Constant": LayerType.CONSTANT, "Slice": LayerType.SLICE,
                "Where": LayerType.SELECT, "Cast": LayerType.CAST, "Shape": LayerType.SHAPE,
                "Identity": LayerType.IDENTITY, "Reshape": LayerType.SHUFFLE, "Transpose": LayerType.SHUFFLE}
_UNARY = {"Exp": UnaryOperation.EXP, "Log": UnaryOperation.LOG, "Sqrt": UnaryOperation.SQRT,
          "Reciprocal": UnaryOperation.RECIP, "Abs": UnaryOperation.ABS, "Neg": UnaryOperation.NEG,
          "Sin": UnaryOperation.SIN, "Cos": UnaryOperation.COS}
_ELEMENTWISE = {"Add": ElementWiseOperation.SUM, "Mul": ElementWiseOperation.PROD, "Max": ElementWiseOperation.MAX,
                "Min": ElementWiseOperation.MIN, "Sub": ElementWiseOperation.SUB, "Div": ElementWiseOperation.DIV,
                "Pow": ElementWiseOperation.POW}


class Dims(tuple):
    """A shape; -1 marks a dynamic dimension."""

    __slots__ = ()


class ITensor:
    __slots__ = ("name", "shape", "_dtype")

    def __init__(self, name: str, dtype: DataType, shape: tuple):
        self.name, self._dtype, self.shape = name, dtype, Dims(shape)

    def _set_dtype(self, dtype) -> None:
        self._dtype = DataType(dtype)

    # NvInfer.h 11.x ITensor has no setType (a strongly typed network's types follow from the graph): read-only there.
    dtype = property(lambda self: self._dtype, None if _TRT11 else _set_dtype)


class ILayer:
    """One parsed ONNX node (name and type as TensorRT's ONNX parser gives them); :func:`_layer` makes the
    subclass of its type."""

    __slots__ = ("name", "_network", "_type", "_outputs", "_precision")

    def __init__(self, network: "INetworkDefinition", node: onnx.NodeProto):
        self._network, self.name = network, node.name
        self._type = _LAYER_OF_OP.get(node.op_type) or (
            LayerType.UNARY if node.op_type in _UNARY else LayerType.ELEMENTWISE if node.op_type in _ELEMENTWISE
            else LayerType.REDUCE if node.op_type.startswith("Reduce") else LayerType.SHUFFLE)
        self._outputs = [ITensor(o, DataType.FLOAT, ()) for o in node.output]
        self._precision = None

    type = property(lambda self: self._type)
    num_outputs = property(lambda self: len(self._outputs))

    def get_output(self, index: int) -> ITensor:
        return self._outputs[index]

    if not _TRT11:  # NvInfer.h 11.x ILayer has no setPrecision / setOutputType (weak typing removed)
        def _weak_typing_only(self, what: str) -> None:
            # NvInfer.h, NetworkDefinitionCreationFlag::kSTRONGLY_TYPED: "Setting layer precision and layer
            # output types is not allowed" in a strongly typed network.
            if self._network._strongly_typed:
                raise RuntimeError(f"emulated TensorRT: {what} on layer {self.name!r} of a strongly typed network "
                                   "(NvInfer.h kSTRONGLY_TYPED: setting layer precision and output types is not allowed)")

        @property
        def precision(self):
            return self._precision or DataType.FLOAT

        @precision.setter
        def precision(self, dtype):
            self._weak_typing_only("setPrecision")
            self._precision = DataType(dtype)
            self._network._pinned.add(self.name)

        def set_output_type(self, index: int, dtype) -> None:
            self._weak_typing_only("setOutputType")
            self._outputs[index]._set_dtype(dtype)


class IUnaryLayer(ILayer):
    __slots__ = ("op",)


class IElementWiseLayer(ILayer):
    __slots__ = ("op",)


def _layer(network: "INetworkDefinition", node: onnx.NodeProto) -> ILayer:
    """The layer of ``node``: an IUnaryLayer / IElementWiseLayer (with its ``op``) or an ILayer."""
    for cls, ops in ((IUnaryLayer, _UNARY), (IElementWiseLayer, _ELEMENTWISE)):
        if node.op_type in ops:
            layer = cls(network, node)
            layer.op = ops[node.op_type]
            return layer
    return ILayer(network, node)


class INetworkDefinition:
    __slots__ = ("_strongly_typed", "_onnx_path", "_inputs", "_outputs", "_layers", "_pinned")

    def __init__(self, flags: int):
        # TensorRT 11 is always strongly typed (NvInfer.h 11.x, kSTRONGLY_TYPED "is always enabled").
        self._strongly_typed = _TRT11 or builtins.bool(flags & (1 << int(NetworkDefinitionCreationFlag.STRONGLY_TYPED)))
        self._onnx_path: Path | None = None
        self._inputs: list[ITensor] = []
        self._outputs: list[ITensor] = []
        self._layers: list[ILayer] = []
        self._pinned: set[str] = set()

    num_inputs = property(lambda self: len(self._inputs))
    num_outputs = property(lambda self: len(self._outputs))
    num_layers = property(lambda self: len(self._layers))

    def get_input(self, index: int) -> ITensor:
        return self._inputs[index]

    def get_output(self, index: int) -> ITensor:
        return self._outputs[index]

    def get_layer(self, index: int) -> ILayer:
        return self._layers[index]

    def get_flag(self, flag) -> bool:
        return flag == NetworkDefinitionCreationFlag.STRONGLY_TYPED and self._strongly_typed


def _value_infos(values) -> list[ITensor]:
    out = []
    for v in values:
        t = v.type.tensor_type
        out.append(ITensor(v.name, _FROM_ONNX[t.elem_type],
                           tuple(d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim)))
    return out


class OnnxParser:
    """Reads the ONNX graph's inputs, outputs and nodes (no op support check: the project's readiness check does it)."""

    __slots__ = ("_network", "_logger", "_errors")

    def __init__(self, network: INetworkDefinition, logger):
        self._network, self._logger, self._errors = network, logger, []

    def parse_from_file(self, model: str) -> bool:
        path = Path(model)
        if not path.is_file():
            self._errors.append(f"ONNX file {path} not found")
            return False
        model = onnx.load(str(path), load_external_data=False)
        n = self._network
        n._onnx_path = path.resolve()
        n._inputs, n._outputs = _value_infos(model.graph.input), _value_infos(model.graph.output)
        n._layers = [_layer(n, node) for node in model.graph.node]
        return True

    num_errors = property(lambda self: len(self._errors))

    def get_error(self, index: int) -> str:
        return self._errors[index]


class IOptimizationProfile:
    __slots__ = ("_shapes",)

    def __init__(self):
        self._shapes: dict[str, tuple] = {}

    def set_shape(self, input: str, min, opt, max) -> None:  # noqa: A002 - TensorRT's argument names
        # NvInferRuntime.h IOptimizationProfile::setDimensions: "(2) 0 <= minDims.d[i] <= optDims.d[i] <= maxDims.d[i]"
        # and "(1) minDims.nbDims == optDims.nbDims == maxDims.nbDims".
        lo, mid, hi = (tuple(int(d) for d in s) for s in (min, opt, max))
        if not len(lo) == len(mid) == len(hi) or not all(0 <= a <= b <= c for a, b, c in zip(lo, mid, hi)):
            raise ValueError(f"emulated TensorRT: profile shapes of {input} need equal ranks and 0 <= min <= opt <= "
                             f"max (NvInferRuntime.h IOptimizationProfile::setDimensions): {lo}, {mid}, {hi}")
        self._shapes[input] = (lo, mid, hi)

    def get_shape(self, input: str):  # noqa: A002 - TensorRT's argument name
        return [Dims(s) for s in self._shapes[input]]


class ITimingCache:
    __slots__ = ("_data",)

    def __init__(self, data: bytes = b""):
        self._data = bytes(data) or b"emulated timing cache\n"

    def serialize(self) -> bytes:
        return self._data


class IBuilderConfig:
    # NvInfer.h 11.x IBuilderConfig has no setInt8Calibrator / setCalibrationProfile
    __slots__ = ("_flags", "_profiles", "_pool_limits", "profiling_verbosity", "_timing_cache",
                 *(() if _TRT11 else ("int8_calibrator", "_calibration_profile")))

    def __init__(self):
        # NvInfer.h BuilderFlag::kTF32: "Enable TF32 ... This is enabled by default" (10.x and 11.x).
        self._flags: set = {BuilderFlag.TF32}
        self._profiles: list[IOptimizationProfile] = []
        self._pool_limits: dict = {}
        self.profiling_verbosity = ProfilingVerbosity.LAYER_NAMES_ONLY
        self._timing_cache = None
        if not _TRT11:
            self.int8_calibrator = None
            self._calibration_profile = None

    def set_flag(self, flag) -> None:
        self._flags.add(BuilderFlag(flag))

    def clear_flag(self, flag) -> None:
        self._flags.discard(BuilderFlag(flag))

    def get_flag(self, flag) -> bool:
        return BuilderFlag(flag) in self._flags

    def set_memory_pool_limit(self, pool, pool_size: int) -> None:
        self._pool_limits[MemoryPoolType(pool)] = int(pool_size)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        self._profiles.append(profile)
        return len(self._profiles) - 1

    num_optimization_profiles = property(lambda self: len(self._profiles))

    def create_timing_cache(self, serialized_timing_cache: bytes) -> ITimingCache:
        return ITimingCache(serialized_timing_cache)

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        self._timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self._timing_cache

    if not _TRT11:
        def set_calibration_profile(self, profile: IOptimizationProfile) -> bool:
            self._calibration_profile = profile
            return True


if not _TRT11:  # the TensorRT 11 migration guide: the implicit-quantization calibrators are removed
    class IInt8Calibrator:
        """Base of the calibrators: get_batch_size(), get_batch(names) -> device pointers or None,
        read_calibration_cache(), write_calibration_cache(cache)."""

        __slots__ = ()

    class IInt8EntropyCalibrator2(IInt8Calibrator):
        __slots__ = ()

        def __init__(self):
            pass


class IHostMemory(bytes):
    """A serialized plan (bytes; TensorRT's object supports the buffer protocol)."""

    __slots__ = ()
    nbytes = property(len)


def _device_info(logger) -> tuple[int, dict] | None:
    err, dev = _cudart.cudaGetDevice()
    if int(err):
        _error(logger, f"no current CUDA device: {_cudart.emulator_last_error()}")
        return None
    _, props = _cudart.cudaGetDeviceProperties(dev)
    return dev, {"name": props.name.decode(), "compute_capability": [props.major, props.minor]}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class Builder:
    __slots__ = ("_logger",)

    def __init__(self, logger):
        self._logger = logger

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        return INetworkDefinition(int(flags))

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig()

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def _check(self, network: INetworkDefinition, config: IBuilderConfig) -> str | None:
        if network._onnx_path is None:
            return "the network is empty (nothing parsed)"
        dynamic = [t for t in network._inputs if -1 in t.shape]
        if dynamic and not config._profiles:
            # IOptimizationProfile::setDimensions: "This function must be called three times ... for any network
            # input tensor that has dynamic dimensions"; a build without a profile fails.
            return "the network has dynamic inputs and no optimization profile"
        for i, prof in enumerate(config._profiles):
            for t in network._inputs:
                if t.name not in prof._shapes:
                    if -1 in t.shape:
                        return f"profile {i} has no shape for the dynamic input {t.name}"
                    continue
                for s in prof._shapes[t.name]:
                    # setDimensions "(3) if networkDims.d[i] != -1, then minDims.d[i] == optDims.d[i] ==
                    # maxDims.d[i] == networkDims.d[i]" (and (1): equal ranks).
                    if len(s) != len(t.shape) or any(n != -1 and n != d for n, d in zip(t.shape, s)):
                        return f"profile {i} gives {t.name} the shape {s}, the network has {t.shape}"
        weak = {BuilderFlag[f] for f in ("FP16", "INT8", "BF16") if f in BuilderFlag.__members__}
        if network._strongly_typed and config._flags & weak:
            # NvInfer.h kSTRONGLY_TYPED: "Every tensor in the network has a data type defined in the network
            # following only type inference rules"; TensorRT 10 rejects precision flags on such a network.
            return f"builder flags {sorted(f.name for f in config._flags & weak)} on a strongly typed network"
        if not _TRT11 and BuilderFlag.INT8 in config._flags and config.int8_calibrator is None:
            return "BuilderFlag.INT8 without a calibrator (and the network has no Q/DQ scales)"
        return None

    def _calibrate(self, network: INetworkDefinition, config: IBuilderConfig) -> str | None:
        """Feed the calibrator's batches through the checks a real calibration makes: every input, on the device,
        at the calibration profile's opt shape (the developer guide, "INT8 Calibration with dynamic shapes")."""
        cal = config.int8_calibrator
        prof = config._calibration_profile or config._profiles[0]
        cache = cal.read_calibration_cache()
        if cache:
            return None
        names = [t.name for t in network._inputs]
        dev = _cudart.cudaGetDevice()[1]
        batches = 0
        while (ptrs := cal.get_batch(names)) is not None:
            if len(ptrs) != len(names):
                return f"the calibrator gave {len(ptrs)} pointers for {len(names)} inputs"
            for t, p in zip(network._inputs, ptrs):
                shape = prof._shapes.get(t.name, (t.shape,) * 3)[1]
                n = int(np.prod(shape)) * np.dtype(nptype(t.dtype)).itemsize
                try:
                    _cudart.emulator_device_view(int(p), n, dev)
                except _cudart.EmulatedCudaError as e:
                    return f"calibration input {t.name}: {e}"
            batches += 1
        if not batches:
            return "the calibrator gave no batch"
        cal.write_calibration_cache(b"emulated calibration cache: %d batches\n" % batches)
        return None

    def build_serialized_network(self, network: INetworkDefinition, config: IBuilderConfig) -> IHostMemory | None:
        """The emulated plan, or None (the reason logged) where TensorRT's build would fail."""
        device = _device_info(self._logger)
        if device is None:
            return None
        problem = self._check(network, config)
        if problem is None and not _TRT11 and config.int8_calibrator is not None and BuilderFlag.INT8 in config._flags:
            problem = self._calibrate(network, config)
        if problem:
            _error(self._logger, f"build failed: {problem}")
            return None
        header = {
            "tensorrt": __version__, "device": device[1], "onnx": str(network._onnx_path),
            "onnx_sha256": _sha256(network._onnx_path), "strongly_typed": network._strongly_typed,
            "flags": sorted(f.name for f in config._flags), "pinned_fp32_layers": len(network._pinned),
            "io": [{"name": t.name, "mode": "INPUT", "dtype": t.dtype.name, "shape": list(t.shape)}
                   for t in network._inputs] + [{"name": t.name, "mode": "OUTPUT", "dtype": t.dtype.name,
                                                "shape": list(t.shape)} for t in network._outputs],
            "profiles": [{n: [list(s) for s in v] for n, v in p._shapes.items()} for p in config._profiles],
        }
        return IHostMemory(PLAN_MAGIC + json.dumps(header).encode())


class Runtime:
    __slots__ = ("_logger",)

    def __init__(self, logger):
        self._logger = logger

    def deserialize_cuda_engine(self, serialized_engine) -> "ICudaEngine | None":
        """The engine, or None (NvInferRuntime.h IRuntime::deserializeCudaEngine: "\\return The engine, or nullptr
        if it could not be deserialized")."""
        data = bytes(serialized_engine)
        if not data.startswith(PLAN_MAGIC):
            _error(self._logger, "deserialize: not a plan of this (emulated) TensorRT")
            return None
        try:
            header = json.loads(data[len(PLAN_MAGIC):])
        except ValueError:
            _error(self._logger, "deserialize: the plan is truncated or corrupt")
            return None
        # Developer guide, "Serialized engines are not portable across platforms or TensorRT versions" and are
        # "specific to the exact GPU model that they were built on" (unless built version-/hardware-compatible).
        if header["tensorrt"] != __version__:
            _error(self._logger, f"deserialize: the plan was built by TensorRT {header['tensorrt']}, this is {__version__}")
            return None
        device = _device_info(self._logger)
        if device is None:
            return None
        if header["device"]["compute_capability"] != device[1]["compute_capability"]:
            _error(self._logger, f"deserialize: the plan was built for compute capability "
                                f"{header['device']['compute_capability']}, device {device[0]} has "
                                f"{device[1]['compute_capability']}")
            return None
        onnx_path = Path(header["onnx"])
        if not onnx_path.is_file() or _sha256(onnx_path) != header["onnx_sha256"]:
            _error(self._logger, f"deserialize: the emulated plan's ONNX {onnx_path} is missing or changed since the build")
            return None
        return ICudaEngine(header, device[0], self._logger)


_SESSIONS: dict[tuple[str, str], object] = {}
_SESSIONS_LOCK = threading.Lock()


def _session(path: str, sha: str):
    """One ONNX Runtime CPU session per ONNX file (shared by the engines of a test run)."""
    import onnxruntime as ort

    with _SESSIONS_LOCK:
        if (path, sha) not in _SESSIONS:
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1
            model = onnx.load(path, load_external_data=False)
            if any(t.data_type == onnx.TensorProto.BFLOAT16 for t in model.graph.initializer):
                # ONNX Runtime's CPU has no bfloat16 MatMul: the graph runs with its bfloat16 rounding points computed
                # in float32 (medusa_export.trt.typed.rounded_in_float32), as the project validates it.
                from medusa_export.trt.typed import rounded_in_float32

                source = rounded_in_float32(model, Path(path).parent).SerializeToString()
            else:
                source = path
            _SESSIONS[(path, sha)] = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
        return _SESSIONS[(path, sha)]


class ICudaEngine:
    __slots__ = ("_header", "_device", "_logger", "_io", "_names")
    _SCRATCH = 1 << 20  # emulated scratch bytes per profile

    def __init__(self, header: dict, device: int, logger):
        self._header, self._device, self._logger = header, device, logger
        self._io = {t["name"]: t for t in header["io"]}
        self._names = [t["name"] for t in header["io"]]

    num_io_tensors = property(lambda self: len(self._names))
    num_optimization_profiles = property(lambda self: len(self._header["profiles"]))

    def get_tensor_name(self, index: int) -> str:
        return self._names[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        return TensorIOMode[self._io[name]["mode"]] if name in self._io else TensorIOMode.NONE

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType[self._io[name]["dtype"]]

    def get_tensor_shape(self, name: str) -> Dims:
        return Dims(self._io[name]["shape"])

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        return [Dims(s) for s in self._header["profiles"][profile_index][name]]

    def get_device_memory_size_for_profile_v2(self, profile_index: int) -> int:
        return self._SCRATCH * (profile_index + 1)

    @property
    def device_memory_size_v2(self) -> int:
        return self._SCRATCH * self.num_optimization_profiles

    if not _TRT11:  # getDeviceMemorySize: "Deprecated in TensorRT 10.1"; absent from the 11.x NvInferRuntime.h
        device_memory_size = device_memory_size_v2

    def create_execution_context(self, strategy=ExecutionContextAllocationStrategy.STATIC) -> "IExecutionContext":
        return IExecutionContext(self, ExecutionContextAllocationStrategy(strategy))


class IExecutionContext:
    __slots__ = ("_engine", "_strategy", "_profile", "_shapes", "_addresses", "_scratch")

    def __init__(self, engine: ICudaEngine, strategy: ExecutionContextAllocationStrategy):
        self._engine, self._strategy = engine, strategy
        # setOptimizationProfileAsync: "The newly created execution context will be assigned optimization profile 0."
        self._profile = 0
        self._shapes: dict[str, tuple] = {}
        self._addresses: dict[str, int] = {}
        self._scratch: tuple[int, int] | None = None

    engine = property(lambda self: self._engine)

    def _fail(self, msg: str) -> bool:
        _error(self._engine._logger, msg)
        return False

    def set_optimization_profile_async(self, profile_index: int, stream_handle) -> bool:
        # "\return true if the call succeeded, else false (e.g. input out of range)"
        if not 0 <= profile_index < self._engine.num_optimization_profiles:
            return self._fail(f"profile {profile_index} out of range [0, {self._engine.num_optimization_profiles})")
        self._profile = profile_index
        self._shapes.clear()  # "must be called before calling setInputShape() for all dynamic input tensors"
        return True

    def set_device_memory(self, memory: int, size: int) -> None:
        self._scratch = (int(memory), int(size))

    @property
    def device_memory(self):
        return self._scratch[0] if self._scratch else 0

    @device_memory.setter
    def device_memory(self, ptr: int) -> None:
        self._scratch = (int(ptr), self._engine.get_device_memory_size_for_profile_v2(self._profile))

    def set_input_shape(self, name: str, shape) -> bool:
        """NvInferRuntime.h setInputShape: "\\return True on success, false if the provided name does not map to an
        input tensor"; "Each dimension must agree with the network dimension unless the latter was -1"; and
        IOptimizationProfile: "A runtime error will be raised if the input tensor dimensions fall outside the
        valid range for this profile"."""
        e = self._engine
        shape = tuple(int(d) for d in shape)
        if e.get_tensor_mode(name) != TensorIOMode.INPUT:
            return self._fail(f"set_input_shape: {name!r} is not an input tensor")
        net = e.get_tensor_shape(name)
        if len(net) != len(shape) or any(n != -1 and n != d for n, d in zip(net, shape)):
            return self._fail(f"set_input_shape: {name} {shape} disagrees with the network's {tuple(net)}")
        lo, _, hi = e.get_tensor_profile_shape(name, self._profile)
        if not all(a <= d <= b for a, d, b in zip(lo, shape, hi)):
            return self._fail(f"set_input_shape: {name} {shape} is outside profile {self._profile}'s range "
                              f"[{tuple(lo)}, {tuple(hi)}]")
        self._shapes[name] = shape
        return True

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if self._engine.get_tensor_mode(name) == TensorIOMode.NONE:
            return self._fail(f"set_tensor_address: no I/O tensor {name!r}")
        # setTensorAddress: "The pointer must have at least 256-byte alignment."
        if int(memory) % 256:
            return self._fail(f"set_tensor_address: {name} at 0x{int(memory):x} is not 256-byte aligned")
        self._addresses[name] = int(memory)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._addresses.get(name, 0)

    def _symbols(self) -> dict:
        sizes = {}
        for name, shape in self._shapes.items():
            for sym, d in zip(self._onnx_dims(name), shape):
                if isinstance(sym, str):
                    sizes[sym] = d
        return sizes

    def _onnx_dims(self, name: str) -> list:
        dims = self._engine._header.setdefault("_dims", {})
        if not dims:
            model = onnx.load(self._engine._header["onnx"], load_external_data=False)
            for v in (*model.graph.input, *model.graph.output):
                dims[v.name] = [d.dim_param if not d.HasField("dim_value") else d.dim_value
                                for d in v.type.tensor_type.shape.dim]
        return dims[name]

    def get_tensor_shape(self, name: str) -> Dims:
        """An input's set shape; an output's shape from the inputs' (-1 where it cannot be known yet)."""
        if self._engine.get_tensor_mode(name) == TensorIOMode.INPUT:
            return Dims(self._shapes.get(name, self._engine.get_tensor_shape(name)))
        sizes = self._symbols()
        return Dims(d if isinstance(d, int) else sizes.get(d, -1) for d in self._onnx_dims(name))

    def infer_shapes(self) -> list[str]:
        """NvInferRuntime.h inferShapes: the names of the "insufficiently specified input tensors" (dynamic
        dimensions whose runtime dimensions have not been set via setInputShape)."""
        e = self._engine
        return [n for n in e._names if e.get_tensor_mode(n) == TensorIOMode.INPUT
                and -1 in e.get_tensor_shape(n) and n not in self._shapes]

    def _nbytes(self, name: str, shape) -> int:
        return int(np.prod(shape, dtype=np.int64)) * np.dtype(nptype(self._engine.get_tensor_dtype(name))).itemsize

    def execute_async_v3(self, stream_handle: int) -> bool:
        """Run the ONNX with ONNX Runtime on the bound emulated device memory; False (the reason logged) where
        TensorRT's enqueueV3 would fail."""
        e = self._engine
        try:
            dev = _cudart.emulator_check_stream(stream_handle)
        except _cudart.EmulatedCudaError as err:
            return self._fail(f"execute_async_v3: {err}")
        if dev != e._device:
            # The engine's memory lives on the device it was deserialized on (IRuntime uses the current device).
            return self._fail(f"execute_async_v3 on device {dev}; the engine was deserialized on device {e._device}")
        missing = self.infer_shapes()
        if missing:
            return self._fail(f"execute_async_v3: input shapes not set: {missing}")
        # setTensorAddress: "Before calling enqueueV3(), each input must have a non-null address and each output
        # must have a non-null address or an IOutputAllocator to set it later."
        unbound = [n for n in e._names if not self._addresses.get(n)]
        if unbound:
            return self._fail(f"execute_async_v3: I/O tensors without an address: {unbound}")
        if self._strategy == ExecutionContextAllocationStrategy.USER_MANAGED:
            # ExecutionContextAllocationStrategy::kUSER_MANAGED: "The user supplies custom allocation to the
            # execution context" (setDeviceMemoryV2, at least getDeviceMemorySizeForProfileV2 bytes).
            need = e.get_device_memory_size_for_profile_v2(self._profile)
            if self._scratch is None or self._scratch[1] < need:
                return self._fail(f"execute_async_v3: a USER_MANAGED context needs {need} bytes of scratch "
                                  f"(set_device_memory), has {self._scratch}")
        try:
            if self._scratch is not None:
                _cudart.emulator_device_view(self._scratch[0], e.get_device_memory_size_for_profile_v2(self._profile),
                                             dev)
            feeds = {}
            for n in e._names:
                if e.get_tensor_mode(n) == TensorIOMode.INPUT:
                    shape = self._shapes.get(n, tuple(e.get_tensor_shape(n)))
                    raw = _cudart.emulator_device_view(self._addresses[n], self._nbytes(n, shape), dev)
                    feeds[n] = raw.view(nptype(e.get_tensor_dtype(n))).reshape(shape).copy()
            outs = [n for n in e._names if e.get_tensor_mode(n) == TensorIOMode.OUTPUT]
            values = _session(e._header["onnx"], e._header["onnx_sha256"]).run(outs, feeds)
            for n, v in zip(outs, values):
                v = np.ascontiguousarray(v, dtype=nptype(e.get_tensor_dtype(n)))
                want = tuple(self.get_tensor_shape(n))
                if v.shape != want:
                    return self._fail(f"execute_async_v3: output {n} came out {v.shape}, the context said {want}")
                _cudart.emulator_device_view(self._addresses[n], v.nbytes, dev)[:] = v.reshape(-1).view(np.uint8)
        except _cudart.EmulatedCudaError as err:
            return self._fail(f"execute_async_v3: {err}")
        return True

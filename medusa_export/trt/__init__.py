"""TensorRT engines from an artifact (``medusa-export engine``).

Stages: the readiness check (``medusa_export.trt.readiness``, no TensorRT) -> the
equivalent ``trtexec`` commands and a build script written into ``engines/`` (always) ->
the engines built with Polygraphy's TensorRT loaders and recorded in the manifest (only
where TensorRT imports). Profiles and shapes come from ``medusa_runtime.engines.trt_plan``, the
same module the runtime's TensorRT backend selects profiles with.
"""

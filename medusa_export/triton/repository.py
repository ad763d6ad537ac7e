"""``medusa-export triton``: an artifact -> a Triton Inference Server model repository.

Reads only the artifact (manifest, files) and writes::

    REPO/
      medusa_repository.json      what was generated from what (also marks the folder as ours)
      README.md                   how to start the server and call the models
      medusa/config.pbtxt         Python backend, decoupled: the Medusa loop (text or ids in, ids + text out)
      medusa/1/model.py           medusa_export/triton/model.py
      medusa/1/medusa_runtime/    the torch-free runtime package, copied (the backend's Python needs
                                  only numpy, onnxruntime, tokenizers, jinja2)
      medusa/1/artifact/          the artifact (hard links where the file system allows, else copies)
      medusa_step/config.pbtxt    the backbone step graph as its own model: tensorrt_plan when the
      medusa_step/1/...           artifact holds built plans, else onnxruntime (model.onnx + weights.bin)
      medusa_heads/...            the heads graph, likewise

Where the artifact goes (``artifact_mode``): ``copy`` (default) places an independent copy
inside the repository, because a Triton repository is deployed as one folder (mounted into
a container, synced to object storage) and a path outside it breaks when it moves; ``link``
hard-links the files instead (free on one file system, but the repository then shares the
files with the artifact: rebuilding an engine into the artifact in place changes the
repository too); ``reference`` writes the artifact's absolute path into the config and
symbolic links for the engine models (nothing copied; works only where that path exists,
whatever the working directory). Within the repository, the engine models hard-link the
repository's own copy, so each file is stored once.

The engine models are stateless: a client that drives them passes the whole past K/V on
every call (docs/cpp_contract.md gives the loop). The ``medusa`` model keeps its KV cache
in the Python backend between the steps of a request instead; it does not call them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from medusa_runtime.decode.acceptance import SAMPLING_SETTINGS
from medusa_runtime.contract.artifact import MANIFEST, Artifact, load_artifact
from medusa_runtime.decode.batch import DEFAULT_BATCH_SIZE
from medusa_runtime.engines import backend_spec
from medusa_runtime.contract.manifest import Graph

from .. import __version__
from ..errors import ArtifactError, MedusaError
from ..files import partial_dir, replace_dir

MARKER = "medusa_repository.json"
TRITON_DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int64": "TYPE_INT64",
                 "int32": "TYPE_INT32", "int8": "TYPE_INT8", "bool": "TYPE_BOOL", "string": "TYPE_STRING"}
_TEMPLATE = Path(__file__).with_name("model.py")

#: The ``medusa`` model's inputs: (name, Triton type, dims); every one is optional (see medusa_runtime.front.serving).
#: The sampling settings are SamplingConfig's fields (medusa_runtime.decode.acceptance.SAMPLING_SETTINGS), one value each.
GENERATION_INPUTS = (
    ("text_input", "TYPE_STRING", [1]),
    ("messages", "TYPE_STRING", [1]),
    ("input_ids", "TYPE_INT64", [-1]),
    ("max_new_tokens", "TYPE_INT32", [1]),
    *((s.name, TRITON_DTYPES[s.dtype], [1]) for s in SAMPLING_SETTINGS),
    ("stop", "TYPE_STRING", [-1]),
    ("stream", "TYPE_BOOL", [1]),
    ("raw", "TYPE_BOOL", [1]),
)
GENERATION_OUTPUTS = (
    ("output_ids", "TYPE_INT64", [-1]),
    ("text_output", "TYPE_STRING", [1]),
    ("finish_reason", "TYPE_STRING", [1]),
    ("num_input_tokens", "TYPE_INT32", [1]),
    ("tokens_per_step", "TYPE_FP32", [1]),
)
ARTIFACT_MODES = ("copy", "link", "reference")


@dataclass(frozen=True)
class TritonConfig:
    """Options of ``medusa-export triton``; the CLI reads its defaults from here.

    Attributes:
        model_name: name of the generation model; the engine models are NAME_step and NAME_heads.
        artifact_mode: "copy", "link" (hard links) or "reference" (absolute path); see the module docstring.
        instances: model instances of the generation model (each owns a session and its own batch).
        batch_size: requests that share a step in one instance (in-flight batching; the model
            parameter ``batch_size``).
        threads: CPU threads per instance (None: ONNX Runtime's default).
        backend: medusa_runtime backend of the generation model (None: tensorrt when the
            artifact holds built plans, else onnxruntime).
        engine_precision: which built TensorRT plans to use (None: the first built one).
        engine_models: also write the step and heads graphs as models of their own.
        max_new_tokens_limit: largest max_new_tokens a request may ask (None: the context).
        tree: the model parameter ``tree``: a ``--tree`` spec (None: the runtime's default, the tree
            fastest on the serving machine, timed when the instance loads and cached;
            :mod:`medusa_runtime.tuning.treecache`).
    """

    model_name: str = "medusa"
    artifact_mode: str = "copy"
    instances: int = 1
    batch_size: int = DEFAULT_BATCH_SIZE
    threads: int | None = None
    backend: str | None = None
    engine_precision: str | None = None
    engine_models: bool = True
    max_new_tokens_limit: int | None = None
    tree: str | None = None

    def __post_init__(self) -> None:
        if not self.model_name or not all(c.isalnum() or c in "_-" for c in self.model_name):
            raise MedusaError(f"model name {self.model_name!r} must be letters, digits, '_' or '-'")
        if self.artifact_mode not in ARTIFACT_MODES:
            raise MedusaError(f"unknown artifact mode {self.artifact_mode!r}; choose one of {', '.join(ARTIFACT_MODES)}")
        if self.instances < 1:
            raise MedusaError(f"--instances must be >= 1, got {self.instances}")
        if self.batch_size < 1:
            raise MedusaError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.threads is not None and self.threads < 1:
            raise MedusaError(f"--threads must be >= 1, got {self.threads}")
        if self.max_new_tokens_limit is not None and self.max_new_tokens_limit < 1:
            raise MedusaError(f"--max-new-tokens-limit must be >= 1, got {self.max_new_tokens_limit}")
        if self.backend is not None:
            backend_spec(self.backend)  # MedusaError naming the backends for an unknown one


# ---------------------------------------------------------------------------
# config.pbtxt
# ---------------------------------------------------------------------------


def _dims(shape: list) -> str:
    """Manifest shape -> pbtxt dims: symbols (S, P, R) become -1."""
    return "[ " + ", ".join(str(d) if isinstance(d, int) else "-1" for d in shape) + " ]"


def _tensor(name: str, dtype: str, dims: str, optional: bool = False) -> str:
    return f'  {{ name: "{name}" data_type: {dtype} dims: {dims}{" optional: true" if optional else ""} }}'


def _io_block(kind: str, lines: list[str]) -> str:
    return f"{kind} [\n" + ",\n".join(lines) + "\n]\n"


def _parameters(params: dict[str, str]) -> str:
    return "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items())


def generation_config(name: str, params: dict[str, str], instances: int, gpu: bool) -> str:
    """config.pbtxt of the Python-backend generation model (decoupled; Triton's ``max_batch_size`` 0: the
    model batches concurrent requests itself, see ``batch_size`` in ``params``)."""
    return (
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        "model_transaction_policy { decoupled: true }\n"
        + _io_block("input", [_tensor(n, t, _dims(d), optional=True) for n, t, d in GENERATION_INPUTS])
        + _io_block("output", [_tensor(n, t, _dims(d)) for n, t, d in GENERATION_OUTPUTS])
        + f"instance_group [ {{ kind: {'KIND_GPU' if gpu else 'KIND_CPU'} count: {instances} }} ]\n"
        + _parameters(params)
    )


def engine_config(name: str, graph: Graph, plan: bool, profiles: int = 1) -> str:
    """config.pbtxt of one graph of the artifact served on its own.

    Args:
        name: model name.
        graph: the manifest's ``graphs[...]`` entry (inputs/outputs with dtype and shape).
        plan: a TensorRT plan (``tensorrt_plan``) rather than the ONNX graph (``onnxruntime``).
        profiles: the plan's optimization profiles; every one is made available to the instance,
            so Triton picks the one that fits each request's shapes (prefill, tree step, decode).

    Raises:
        ArtifactError: a dtype Triton has no type for.
    """
    def tensors(specs):
        out = []
        for t in specs:
            if t.dtype not in TRITON_DTYPES:
                raise ArtifactError(f"tensor {t.name} has dtype {t.dtype}, which has no Triton type")
            out.append(_tensor(t.name, TRITON_DTYPES[t.dtype], _dims(t.shape)))
        return out

    head = (f'name: "{name}"\nplatform: "tensorrt_plan"\ndefault_model_filename: "model.plan"\n' if plan else
            f'name: "{name}"\nbackend: "onnxruntime"\ndefault_model_filename: "model.onnx"\n')
    body = "max_batch_size: 0\n" + _io_block("input", tensors(graph.inputs)) + _io_block("output", tensors(graph.outputs))
    if plan:
        listed = ", ".join(f'"{i}"' for i in range(profiles))
        body += f"instance_group [ {{ kind: KIND_GPU count: 1 profile: [ {listed} ] }} ]\n"
    return head + body


# ---------------------------------------------------------------------------
# the repository
# ---------------------------------------------------------------------------


def built_plans(art: Artifact, precision: str | None = None) -> tuple[str, dict] | None:
    """(precision, engine record) of built TensorRT plans of the artifact (listed in its checksums,
    so load_artifact has checked they are present), or None.

    Raises:
        ArtifactError: ``precision`` was asked for but has no built plans.
    """
    from medusa_runtime.engines.trt_plan import plan_graphs

    engines = art.manifest.engines or {}
    built = [(p, rec) for p, rec in engines.items() if rec.get("status") == "built"
             and all(rec.get(f"{g}_plan") in art.manifest.checksums for g in plan_graphs(art.manifest))]
    if precision is not None:
        found = [b for b in built if b[0] == precision]
        if not found:
            raise ArtifactError(f"the artifact has no built {precision} TensorRT plans "
                                f"(built: {', '.join(p for p, _ in built) or 'none'})")
        return found[0]
    return built[0] if built else None


def _place(src: Path, dst: Path, how: str) -> None:
    """Put ``src`` at ``dst``: "copy", "link" (a hard link, or a copy across file systems) or
    "symlink" (a symbolic link to its absolute path)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if how == "symlink":
        os.symlink(src.resolve(), dst)
        return
    if how == "link":
        try:
            os.link(src, dst)
            return
        except OSError:
            pass
    shutil.copy2(src, dst)


def _place_artifact(art: Artifact, dst: Path, how: str) -> None:
    for rel in list(art.manifest.checksums) + [MANIFEST]:
        _place(art.path / rel, dst / rel, how)


def _copy_runtime(dst: Path) -> None:
    import medusa_runtime

    src = Path(medusa_runtime.__file__).parent
    for f in sorted(src.rglob("*.py")):  # subpackages included (medusa_runtime.engines)
        target = dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)


def _engine_models(art: Artifact, repo: Path, name: str, plans: tuple[str, dict] | None, how: str) -> list[str]:
    """NAME_step and NAME_heads (path-conditioned heads: NAME_heads_level{j}, one per level) from ``art`` (the
    repository's own copy, or the referenced artifact)."""
    from medusa_runtime.engines.trt_plan import graph_profiles

    written = []
    heads = [k for k in art.manifest.graphs if k.startswith("heads")]
    for graph, suffix in (("model", "step"), *((k, k) for k in heads)):
        model = f"{name}_{suffix}"
        version = repo / model / "1"
        spec = art.manifest.graphs[graph]
        if plans is not None:
            _place(art.path / plans[1][f"{graph}_plan"], version / "model.plan", how)
            text = engine_config(model, spec, plan=True, profiles=len(graph_profiles(art.manifest, graph)))
        else:
            _place(art.file(graph), version / "model.onnx", how)
            _place(art.file("weights"), version / art.manifest.files["weights"], how)  # external data, beside it
            text = engine_config(model, spec, plan=False)
        (repo / model / "config.pbtxt").write_text(text)
        written.append(model)
    return written


def _readme(cfg: TritonConfig, engine_models: list[str], backend: str) -> str:
    name = cfg.model_name
    fields = ", ".join(n for n, _, _ in GENERATION_INPUTS)
    outs = ", ".join(n for n, _, _ in GENERATION_OUTPUTS)
    engines = (f"`{'`, `'.join(engine_models)}` serve the artifact's graphs alone (stateless: the client passes "
               "the whole past K/V each call; docs/cpp_contract.md of medusa-export gives the loop). They need "
               "Triton's onnxruntime or tensorrt backend.\n" if engine_models else "")
    tree = (f"Tree: `--tree {cfg.tree}` (model parameter `tree`)." if cfg.tree else
            "Tree: the runtime's default, the tree fastest on the serving machine: timed when the model\n"
            "instance loads (a few seconds, in the server log) and cached ($MEDUSA_EXPORT_CACHE, default\n"
            "~/.cache/medusa-export); TensorRT plans keep their tree. The model parameter `tree` fixes one\n"
            "(a --tree spec of medusa-export generate, e.g. `artifact`, `root`, `8`).")
    return f"""# Triton model repository (medusa-export {__version__})

`{name}` (Python backend, decoupled) runs the Medusa decode loop with the copied `medusa_runtime`:
concurrent requests share batched steps, up to {cfg.batch_size} per instance (model parameter
`batch_size`; a request joins at the next step and leaves when it ends, with the tokens it
would get alone). Backend `{backend}`: its Python needs {backend_spec(backend).needs}.
{tree}

    tritonserver --model-repository $PWD
    # only the generation model (e.g. a server with the Python backend alone):
    tritonserver --model-repository $PWD --model-control-mode=explicit --load-model={name}

Inputs (all optional but one of text_input, messages, input_ids; the generation settings may
also be given as request parameters): {fields}. Sampling: temperature 0 (default) is greedy;
above 0, acceptance "sample" (default; the output is distributed exactly as plain sampling with
the same temperature, top_k, top_p) or "typical" (faster, lossy; posterior_threshold and
posterior_alpha are its epsilon and delta); seed makes it reproducible. Defaults and ranges:
medusa_runtime/front/serving.py.
Outputs: {outs}. With stream=true one response per tree step (that step's ids and text), then
a final one with the finish reason; otherwise one response. Use gRPC streaming (decoupled model).

{engines}"""


def write_repository(artifact_dir: str | Path, out: str | Path, cfg: TritonConfig = TritonConfig()) -> Path:
    """Write a Triton model repository for an artifact (atomically: a temporary folder moved into place).

    Args:
        artifact_dir: the artifact (``medusa-export build`` output).
        out: the repository folder (created, or replaced if it is a repository written by this function).
        cfg: the options.

    Returns:
        The repository path (absolute).

    Raises:
        ArtifactError: the artifact is invalid, ``out`` is a foreign non-empty folder, or
            asked-for plans are missing.
    """
    art = load_artifact(artifact_dir)
    out = Path(out).absolute()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / MARKER).is_file())):
        raise ArtifactError(f"{out} exists and is not a repository written by medusa-export triton; refusing to replace it")
    plans = built_plans(art, cfg.engine_precision)
    backend = cfg.backend or ("tensorrt" if plans else "onnxruntime")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_dir(out)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        version = tmp / cfg.model_name / "1"
        _copy_runtime(version / "medusa_runtime")
        shutil.copy2(_TEMPLATE, version / "model.py")
        if cfg.artifact_mode == "reference":
            artifact_param, source, how = str(art.path.resolve()), art, "symlink"
        else:
            _place_artifact(art, version / "artifact", cfg.artifact_mode)
            artifact_param, how = "artifact", "link"
            source = Artifact(version / "artifact", art.manifest, art.tree)  # engine models link the repo's copy
        params = {"artifact_dir": artifact_param, "backend": backend, "batch_size": str(cfg.batch_size)}
        if backend == "tensorrt" and plans:
            params["precision"] = plans[0]
        if cfg.threads:
            params["threads"] = str(cfg.threads)
        if cfg.max_new_tokens_limit:
            params["max_new_tokens_limit"] = str(cfg.max_new_tokens_limit)
        if cfg.tree:
            params["tree"] = cfg.tree
        (tmp / cfg.model_name / "config.pbtxt").write_text(
            generation_config(cfg.model_name, params, cfg.instances, gpu=backend_spec(backend).gpu))
        engines = _engine_models(source, tmp, cfg.model_name, plans, how) if cfg.engine_models else []
        (tmp / "README.md").write_text(_readme(cfg, engines, backend))
        record = {"generator": f"medusa-export {__version__}", "artifact": str(art.path.resolve()),
                  "artifact_mode": cfg.artifact_mode, "model": art.model.name,
                  "generation_model": cfg.model_name, "backend": backend, "engine_models": engines,
                  "engine_format": ("tensorrt_plan " + plans[0]) if plans else "onnxruntime"}
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out

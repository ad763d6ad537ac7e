"""``medusa-export build``: model + tree -> a validated artifact directory, the stages run in order.

The orchestration above the stage packages (none of them imports this module, nor a stage above its own):

1. pre-flight: the weights plan from the headers (:func:`~.export.writer.plan_graphs`), each stage's memory
   and the validation checks that fit (:func:`~.validation.plan.plan_validation`);
2. export (:mod:`.export`): the two graphs with their weights streamed from the checkpoint into
   ``weights.bin``, then tree / tokenizer / manifest (:func:`~.export.build.write_files`);
3. ``--tree auto``: the tree step timed on ONNX Runtime here (:mod:`medusa_runtime.tuning.autotree`), the tree and
   the manifest rewritten;
4. the ONNX checked for TensorRT (:func:`~.trt.readiness.check_artifact`, no TensorRT needed);
5. validation (:func:`~.validation.checks.run_checks`), the build record, and the finished folder moved
   into place.

Everything is written to a temporary sibling folder first, so a failed or interrupted build (Ctrl-C, SIGTERM,
SIGHUP) leaves nothing half-written and an old artifact intact; what a SIGKILL'd build leaves is removed by the
next build into the same folder, and a lock file beside the folder keeps two builds from writing it at once.
The model is never materialised for the export; the checks that need the PyTorch reference build it from the
same sources (truncated when the whole one does not fit).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path

from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.trees.tree import Tree

from .errors import ArtifactError, InvalidTreeError, MedusaError
from .export.build import check_output_dir, vocab_origin, write_files
from .export.config import ExportConfig
from .export.manifest import selection_json, write_manifest
from .export.weights import WEIGHTS_FILE
from .export.writer import plan_graphs, write_graphs
from .files import OutputBusyError, OutputLock, partial_dir, remove_stale, replace_dir
from .loading.draft_vocab import subset_ids
from .loading.registry import LoadedMedusa
from .loading.sources import sources_of
from .trt.readiness import check_artifact
from .validation.checks import run_checks
from .validation.config import ValidationConfig
from .validation.plan import plan_validation
from .validation.validate import ValidationError

_E, _V = ExportConfig, ValidationConfig


@dataclass(frozen=True)
class BuildConfig:
    """``build``'s options: the export's (:class:`~.export.config.ExportConfig`) and the validation's
    (:class:`~.validation.config.ValidationConfig`), each documented there, with their defaults.

    Each stage gets only its part (:attr:`export`, :attr:`validation`); the fields are flat so a caller writes
    ``BuildConfig(precision="int4", validate=False)``, and the CLI reads its defaults from the two parts.

    Raises:
        UnknownPrecisionError, UnsupportedGraphError, HeadsVocabError, MedusaError: as the two parts do (each
            checks its own fields when this is made).
    """

    precision: str = _E.precision
    heads_precision: str = _E.heads_precision
    max_context: int | None = _E.max_context
    block_size: int = _E.block_size
    quantize_lm_head: bool = _E.quantize_lm_head
    accuracy_level: int | None = _E.accuracy_level
    graph: str = _E.graph
    heads_vocab: int = _E.heads_vocab
    batch_size: int = _E.batch_size
    int4_scales: str = _E.int4_scales
    validate: bool = _V.validate
    checks: str = _V.checks
    validate_layers: int = _V.validate_layers
    new_tokens: int = _V.new_tokens

    def __post_init__(self) -> None:
        self.export, self.validation  # noqa: B018 - each part checks its own fields

    @property
    def export(self) -> ExportConfig:
        """The export's part (what :mod:`.export` reads)."""
        return ExportConfig(**{f.name: getattr(self, f.name) for f in fields(ExportConfig)})

    @property
    def validation(self) -> ValidationConfig:
        """The validation's part (what :mod:`.validation` reads)."""
        return ValidationConfig(**{f.name: getattr(self, f.name) for f in fields(ValidationConfig)})


class Stages:
    """Prints numbered stages with their wall time (the build's progress display) and keeps the times."""

    def __init__(self, total: int, out=sys.stderr):
        self.total, self.n, self.out = total, 0, out
        self.times: list[dict] = []

    @contextmanager
    def __call__(self, what: str):
        self.n += 1
        print(f"[{self.n}/{self.total}] {what} ...", file=self.out, flush=True)
        t = time.perf_counter()
        yield
        dt = time.perf_counter() - t
        self.times.append({"stage": what, "seconds": round(dt, 2)})
        print(f"[{self.n}/{self.total}] {what}: done in {dt:.1f}s", file=self.out, flush=True)


def _choose_tree_here(folder: Path, *, progress: bool, policy: str = "static") -> tuple[Tree, list, str]:
    """``--tree auto`` (``auto:dynamic``) on the artifact being built: the resolver times tree steps with ONNX Runtime
    and picks the best; (the static tree, the table, the tree policy to record: "" or "dynamic:T")."""
    from medusa_runtime.engines.ort import OrtEngine
    from medusa_runtime.trees.treespec import AUTO, AUTO_DYNAMIC
    from medusa_runtime.tuning.resolve import TreeContext, resolve_tree

    artifact = load_artifact(folder)
    say = (lambda line: print(f"    {line}", file=sys.stderr, flush=True)) if progress else None
    res = resolve_tree(AUTO_DYNAMIC if policy == "dynamic" else AUTO,
                       TreeContext.of_artifact(artifact, OrtEngine(artifact), progress=say,
                                               notice=lambda line: print(f"[note: {line}]", file=sys.stderr, flush=True)))
    return res.tree.static_shape(artifact.head_accuracies), list(res.timings), res.tree.policy_spec


def check_qdq_request(ecfg: ExportConfig, config) -> None:
    """What a Q/DQ build can refuse from the model's config, before it opens a weight: an int4 ``block_size`` that
    does not divide every product's input dimension K (hidden, the attention output, the MLP's intermediate), and fp8
    where a visible GPU lacks its tensor cores (compute capability 8.9+, :data:`~.trt.config.ENGINE_PRECISION_TABLE`).

    Raises:
        UnsupportedGraphError: naming the dimension, the block sizes that divide them all, or the GPU's capability
            and the way to build for another machine.
    """
    from .export.config import UnsupportedGraphError
    from .trt.typed import INT4_BLOCKS

    if ecfg.precision == "int4" and ecfg.block_size is not None:
        dims = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
                "attention width (heads x head_dim)": config.num_attention_heads * config.head_dim}
        bad = {k: v for k, v in dims.items() if v % ecfg.block_size}
        if bad or ecfg.block_size not in INT4_BLOCKS:
            ok = [b for b in INT4_BLOCKS if all(v % b == 0 for v in dims.values())]
            why = (f"does not divide {', '.join(f'{k} {v}' for k, v in bad.items())}" if bad else
                   f"is not one of TensorRT's int4 block sizes {', '.join(map(str, INT4_BLOCKS))}")
            raise UnsupportedGraphError(f"--block-size {ecfg.block_size} {why}; choose "
                                        f"{' or '.join(map(str, ok)) or 'another precision (no size divides them)'}, "
                                        "or leave --block-size out (the largest that divides each weight's K)")
        if ecfg.int4_scales == "awq":  # the calibration's block Grams are per weight at the largest block dividing K
            raise UnsupportedGraphError(f"--block-size {ecfg.block_size} with --int4-scales awq: AWQ's clip search runs "
                                        "at each weight's default block (the largest of 128, 64, 32, 16 dividing its "
                                        "K); leave --block-size out, or give --int4-scales rtn")
    if ecfg.precision == "fp8":
        from .trt.builder import gpu_key
        from .trt.config import engine_precision

        need = engine_precision("fp8").min_compute_capability
        cc = str(gpu_key(0).get("compute_capability", "unknown"))
        if cc != "unknown" and tuple(int(x) for x in cc.split(".")) < need:
            raise UnsupportedGraphError(
                f"--precision fp8 needs a GPU of compute capability {'.'.join(map(str, need))} or newer (Ada, Hopper); "
                f"the visible GPU has {cc}: choose --precision int8 or int4, or build for another machine with no GPU "
                "visible (CUDA_VISIBLE_DEVICES=)")


def _write_qdq(tmp: Path, lm, src, tree: Tree, ecfg, max_context: int, written, vocab_ids, policy: str,
               calibration_prompts: list[str] | None, progress: bool):
    """``--graph portable --precision int8|fp8|int4``: the float16 graphs just written (with their manifest, which
    the W8A8 calibration runs them through) rewritten in place as the Q/DQ graphs (:mod:`.trt.quantized`: the same
    rewrite ``engine --precision`` does), then the manifest re-written over them (checksums, the rewrite's record in
    ``precision.quantization``). The float16 weights' checkpoint records no longer describe ``weights.bin``: they are
    dropped (the checksums check has nothing to re-make; the rewrite's inputs were checked as they were written).

    Returns:
        (the :class:`~.export.writer.WrittenGraphs` of the Q/DQ weights file, the manifest written).
    """
    from .export.writer import WrittenGraphs
    from .trt.quantized import write_quantized

    t0 = time.perf_counter()
    art_manifest = load_artifact(tmp).manifest
    files = {g: art_manifest.graphs[g].file for g in art_manifest.graphs}
    report, record = write_quantized(tmp, files, ecfg.precision, calibration_prompts,
                                     paths={**files, "weights": WEIGHTS_FILE}, int4_block=ecfg.block_size,
                                     int4_scales=ecfg.int4_scales, progress=progress)
    import onnx

    offsets = set()  # the tensors of the new weights.bin (shared ones, e.g. the tied lm_head, once)
    for f in files.values():
        for t in onnx.load(str(tmp / f), load_external_data=False).graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                offsets.add({e.key: e.value for e in t.external_data}["offset"])
    info = {"tensors": len(offsets), "bytes": report.weights_bytes, "deduplicated": None, "records": None}
    qdq = WrittenGraphs(info, {}, written.seconds + time.perf_counter() - t0)
    manifest = write_files(tmp, lm, src, tree, ecfg, max_context, qdq, vocab_ids, policy)
    record = {k: v for k, v in record.items() if k != "weights"}
    manifest = replace(manifest, precision=replace(manifest.precision,
                                                   extra={**manifest.precision.extra, "quantization": record}))
    write_manifest(tmp, manifest)
    return qdq, manifest


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def build_artifact(lm: LoadedMedusa, tree: Tree, out: str | Path, cfg: BuildConfig = BuildConfig(), *,
                   prompts: list[str] | None = None, progress: bool = True, auto_tree: bool = False,
                   tree_policy: str = "static", calibration_prompts: list[str] | None = None) -> Path:
    """Export, validate and write an artifact to ``out`` (atomically).

    Args:
        lm: the model: opened as sources (:func:`~medusa_export.loading.sources.open_model`, nothing loaded),
            or loaded (its ``model`` is then exported from memory).
        tree: the validated tree (depth <= the model's heads).
        out: the artifact directory (created or replaced).
        cfg: the export's options (precisions, context, graph: :attr:`BuildConfig.export`) and the validation's
            (``validate``, ``checks``, ``validate_layers``, ``new_tokens``: :attr:`BuildConfig.validation`).
        prompts: validation prompts (user messages); default: the project's own.
        progress: print stage progress and progress bars.
        auto_tree: ``--tree auto``: ``tree`` is only the largest candidate; after export the tree
            step is timed at several sizes on ONNX Runtime on this machine and the tree with the
            most expected tokens per second is kept (:mod:`medusa_runtime.tuning.autotree`; the table
            goes to the manifest's ``tree.selection``).
        tree_policy: "static", or "dynamic" (``--tree dynamic:T`` / ``auto:dynamic``): the runtime chooses a
            ``tree.size``-node tree every step from the heads' log-probabilities; recorded as
            the manifest's ``tree.policy`` = "dynamic:T" (``tree`` stays the static tree of fixed-tree engines).
        calibration_prompts: the W8A8 (``--graph portable --precision int8|fp8``) calibration prompts (user
            messages); default: the project's own.

    Returns:
        The artifact path.

    Raises:
        InvalidTreeError: the tree is deeper than the heads.
        HeadsVocabError: ``cfg.heads_vocab`` is outside [tree.topk, V] or the model has no draft vocabulary.
        ArtifactError: the output folder cannot be written, or another build is writing it (a lock file
            ``.NAME.lock`` beside it; two builds into one folder never interleave).
        InsufficientMemoryError: the pre-flight estimate of the export, or of a check asked for by name,
            exceeds the memory available (both numbers and the options in the message).
        InsufficientDiskError: the weights do not fit on the output's file system.
        CheckpointError: a checkpoint file is missing, truncated or disagrees with its config.
        ValidationError: a check failed (the first divergence is in the message).
        CalibrationPromptsError: fewer calibration prompts than the precision's method needs.
        UnsupportedGraphError: an int4 Q/DQ ``block_size`` that does not divide the model's dimensions; fp8 where a
            visible GPU has no fp8 tensor cores.
    """
    t_start = time.perf_counter()
    ecfg, vcfg = cfg.export, cfg.validation
    out = Path(out).absolute()
    src = sources_of(lm)
    if ecfg.qdq:  # refused before anything is written
        from .trt.quantized import check_calibration_prompts

        calibration_prompts = check_calibration_prompts(ecfg.precision, calibration_prompts)
        check_qdq_request(ecfg, src.config)
    num_heads = src.heads_config.num_heads
    if tree.max_depth > num_heads:
        raise InvalidTreeError(f"tree depth {tree.max_depth} exceeds the model's {num_heads} Medusa heads")
    vocab_ids = None
    if ecfg.heads_vocab:
        vocab_ids = subset_ids(lm.draft_vocab, ecfg.heads_vocab, src.config.vocab_size, tree.topk, model=lm.name)
    check_output_dir(out)
    max_context = ecfg.max_context or lm.max_context
    if tree.size > max_context:
        raise MedusaError(f"the tree ({tree.size} nodes) does not fit --max-context {max_context}")
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if progress else (lambda line: None)
    weights_plan = plan_graphs(src, ecfg, tree.topk, vocab_ids, max_context)
    plan = plan_validation(src, ecfg.precision, weights_plan.nbytes(), graph=ecfg.graph, checks=vcfg.checks,
                           layers=vcfg.validate_layers, validate=vcfg.validate)
    say(f"pre-flight: {plan.available / 1e9:.1f} GB available; estimated peaks: "
        + ", ".join(f"{k} {v / 1e9:.1f} GB" for k, v in plan.estimates.items()
                    if k == "export" or k in plan.checks or (k.startswith("gpu") and "gpu" in plan.checks)))
    for line in plan.describe() if vcfg.validate else ["validation: skipped (--no-validate)"]:
        say(f"  {line}")
    stages = Stages(3 + bool(plan.checks) + auto_tree + ecfg.qdq, out=sys.stderr if progress else open(os.devnull, "w"))
    tmp = partial_dir(out)
    try:
        lock = OutputLock(out)
    except OutputBusyError as exc:
        raise ArtifactError(f"{exc}; wait for it to finish or choose another output folder") from None
    except OSError as exc:  # e.g. /proc or a read-only mount that os.access called writable
        raise ArtifactError(f"output folder {out} cannot be written: the lock file {out.parent / f'.{out.name}.lock'} "
                            f"cannot be created ({exc.strerror}); choose an output folder on a writable file "
                            "system") from None
    try:
        for stale in remove_stale(out):  # left by a build that was killed (SIGKILL)
            say(f"removed {stale.name}, left by a build that did not finish")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        flavour = "fused step (ONNX Runtime GroupQueryAttention, RMSNorm, QuickGelu)" if ecfg.graph == "fused" \
            else "portable step (standard ONNX ops)"
        heads = "Medusa heads" if src.heads_config.head_type == "medusa" else "path-conditioned heads (a graph per level)"
        with stages(f"writing the graphs from the checkpoint: {flavour} + {heads}, weights streamed to "
                    f"{WEIGHTS_FILE} ({ecfg.graphs_dtype + ', quantized below' if ecfg.qdq else ecfg.precision})"):
            written = write_graphs(tmp, src, ecfg, tree.topk, vocab_ids=vocab_ids, vocab_origin=vocab_origin(lm, vocab_ids),
                                   max_context=max_context, progress=progress)
            say(f"    {written.weights['bytes'] / 1e9:.2f} GB in {written.seconds:.1f}s "
                f"({written.weights['bytes'] / 1e9 / max(written.seconds, 1e-9):.2f} GB/s), "
                f"{written.weights['tensors']} tensors")
        with stages("writing tree, tokenizer and manifest"):
            policy = f"dynamic:{tree.size}" if tree_policy == "dynamic" and not auto_tree else ""
            manifest = write_files(tmp, lm, src, tree, ecfg, max_context, written, vocab_ids, policy)
        if ecfg.qdq:
            with stages(f"rewriting the weight products as {ecfg.precision} Q/DQ (TensorRT explicit quantization)"):
                written, manifest = _write_qdq(tmp, lm, src, tree, ecfg, max_context, written, vocab_ids, policy,
                                               calibration_prompts, progress)
        if auto_tree:
            with stages("timing tree steps on ONNX Runtime to choose the tree (--tree auto)"):
                tree, table, policy = _choose_tree_here(tmp, progress=progress, policy=tree_policy)
                graphs = {rel: c for rel, c in manifest.checksums.items() if rel.endswith((".onnx", WEIGHTS_FILE))}
                manifest = write_files(tmp, lm, src, tree, ecfg, max_context, written, vocab_ids, policy, graphs)
                manifest = replace(manifest, tree=replace(manifest.tree, selection=selection_json(table, tree.size)))
        with stages("checking the ONNX for TensorRT (no TensorRT needed)"):
            manifest = replace(manifest, trt_readiness=check_artifact(tmp, manifest).to_json())
            write_manifest(tmp, manifest)
        if plan.checks:
            with stages(f"validating: {', '.join(plan.checks)}"):
                validation = run_checks(plan, tmp, lm, src, vcfg, prompts=prompts, vocab_ids=vocab_ids,
                                        progress=progress)
                manifest = replace(manifest, validation=validation)
                write_manifest(tmp, manifest)
                if not validation["passed"]:
                    raise ValidationError("validation failed:\n  " + "\n  ".join(validation["failures"]))
        stages.times.append({"stage": "total", "seconds": round(time.perf_counter() - t_start, 2)})
        manifest = replace(manifest, build={
            "stages": stages.times, "peak_rss_bytes": _peak_rss(),
            "weights_gb_per_s": round(written.weights["bytes"] / 1e9 / max(written.seconds, 1e-9), 3),
            "preflight": {"available_bytes": plan.available, "estimates": plan.estimates}})
        write_manifest(tmp, manifest)
        replace_dir(tmp, out)
    except BaseException:  # Ctrl-C, and SIGTERM / SIGHUP (medusa_runtime.front.cli.run_command makes them one)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.release()
    return out


@dataclass(frozen=True)
class BuildRequest:
    """What ``medusa-export build`` was asked, besides :class:`BuildConfig`: the model, its sources, the tree and
    the output folder.

    Attributes:
        model: a registry name, an HF folder or a ``.gguf`` file.
        tree: the ``--tree`` spec (None: the registry entry's default tree).
        out: the artifact folder (None: :func:`default_out`).
        force: replace an existing artifact folder.
        model_path, heads, trust_remote_code: the model's sources (:func:`~.loading.sources.open_model`).
        prompt_file: a JSONL file of validation prompts (None: the project's own).
        calibration_prompt_file: a JSONL file of W8A8 calibration prompts (None: the project's own).
    """

    model: str
    tree: str | None = None
    out: str | None = None
    force: bool = False
    model_path: str | None = None
    heads: str | None = None
    trust_remote_code: bool = False
    prompt_file: str | None = None
    calibration_prompt_file: str | None = None


@dataclass(frozen=True)
class Built:
    """A finished build: the artifact folder, the model as opened, the seconds the opening took, and what it replaced
    there (``--force``: :func:`~.files.replaced_files`; None when the folder was new or empty)."""

    path: Path
    lm: LoadedMedusa
    opening: float
    replaced: str | None = None


def default_out(name: str, spec, size: int | None, precision: str, graph: str) -> str | None:
    """``build``'s default ``--out``: ``artifacts/<model>-t<tree>-<precision>[-fused]``.

    Args:
        name: the model's registry name (or its folder's name).
        spec: the ``--tree`` asked for (a :class:`~medusa_runtime.trees.treespec.TreeSpec`): ``auto`` names the
            folder ``tauto``, a per-step policy prefixes ``dyn``.
        size: the built tree's node count, or None before the heads are open.
        precision: ``--precision``; graph: ``--graph`` (``fused`` / ``contrib`` append ``-fused`` / ``-contrib``).

    Returns:
        The folder path, or None when it depends on ``size`` and that is not known yet (a preset or a
        tree file: their node count depends on the heads' count).
    """
    n = {"auto": "auto", "size": spec.size, "dynamic": spec.size}.get(spec.kind, size)
    if n is None:
        return None
    tree = f"dyn{n}" if spec.policy == "dynamic" else f"{n}"
    return f"artifacts/{name}-t{tree}-{precision}{'' if graph == 'portable' else f'-{graph}'}"


def build(request: BuildRequest, cfg: BuildConfig = BuildConfig()) -> Built:
    """``medusa-export build``: the pre-flight, the model opened, the tree resolved, then :func:`build_artifact`.

    Everything that can be refused without the model (a prompt file, an unknown model, a bad ``--tree``, an
    output folder that may not be replaced) is refused before the model opens (~20 s on the embedded model).

    Args:
        request: the model, tree and folder asked for.
        cfg: the export's and validation's options.

    Returns:
        The :class:`Built` artifact.

    Raises:
        PromptFileError, RegistryError, InvalidTreeError, ArtifactError, CalibrationPromptsError: before the model
            opens.
        InvalidSettingError: ``max_context`` above the model's ``max_position_embeddings``.
        Everything :func:`build_artifact` raises.
    """
    from medusa_runtime.errors import InvalidSettingError
    from medusa_runtime.tuning.resolve import TreeContext, build_spec, resolve_tree

    from .files import check_replaceable
    from .loading import sources
    from .loading.registry import entry_for
    from .validation.checks import check_prompts_fit, prompt_ids
    from .validation.validate import read_prompts

    prompts = read_prompts(request.prompt_file) if request.prompt_file else None
    calibration = None
    if cfg.export.qdq:  # missing, empty or too few calibration prompts: refused before the model opens
        from .trt.quantized import check_calibration_prompts

        file = request.calibration_prompt_file
        calibration = check_calibration_prompts(cfg.precision, read_prompts(file) if file else None, source=file or "")
    entry, _ = entry_for(request.model)
    rows = cfg.export.step_rows
    chains_only = rows is not None and rows["trees"] == "chain"  # Medusa is exact on chains only (ExportConfig.step_rows)
    default_tree = "chain" if chains_only else entry.default_tree
    asked = build_spec(default_tree if request.tree is None else request.tree)
    early_out = request.out or default_out(entry.name, asked, None, cfg.precision, cfg.graph)
    if early_out:  # None: a preset or tree file, whose size needs the heads' count (checked once they are open)
        check_replaceable(Path(early_out), force=request.force, default=not request.out)
    t0 = time.perf_counter()
    print(f"opening {request.model} (headers and configs; weights are read while the graphs are written) ...",
          file=sys.stderr, flush=True)
    lm = sources.open_model(request.model, model_path=request.model_path, heads_path=request.heads,
                            trust_remote_code=request.trust_remote_code)
    opening = time.perf_counter() - t0
    for note in lm.notes:
        print(f"[note: {note}]", file=sys.stderr, flush=True)
    positions = lm.sources.config.max_position_embeddings
    if cfg.max_context is not None and not 2 <= cfg.max_context <= positions:
        raise InvalidSettingError(f"--max-context must be in 2..{positions} ({lm.name}'s max_position_embeddings is "
                                  f"{positions}), got {cfg.max_context}")
    res = resolve_tree(asked, TreeContext(num_heads=lm.sources.heads_config.num_heads, accuracies=lm.head_accuracies,
                                          chains_only=chains_only))
    tree = res.tree.static_shape(lm.head_accuracies)  # per-step trees: the T-node tree fixed-tree engines run
    out = request.out or default_out(lm.name, asked, tree.size, cfg.precision, cfg.graph)
    replacing = check_replaceable(Path(out), force=request.force, default=not request.out)  # a preset's, or made
    if replacing:  # meanwhile; with --force: what goes, named before the export starts
        print(f"[note: --force: {out} holds {replacing}; all of it is replaced when this build passes]",
              file=sys.stderr, flush=True)
    if cfg.validate:  # a prompt the artifact's context cannot hold fails now, not after the export
        texts, ids = prompt_ids(lm, prompts)
        for note in check_prompts_fit(texts, ids, cfg.max_context or lm.max_context, cfg.new_tokens):
            print(f"[note: {note}]", file=sys.stderr, flush=True)
    path = build_artifact(lm, tree, out, cfg, prompts=prompts, auto_tree=res.deferred, tree_policy=res.policy,
                          calibration_prompts=calibration or None)
    return Built(path, lm, opening, replacing)

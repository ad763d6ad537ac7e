"""``medusa-export`` command line: one sub-command per stage.

Each sub-command lives in its own function; defaults come from the dataclasses and the
registry, not restated here. Imports are lazy: :func:`main` builds only the parser of the
command it runs, and each command imports what it needs when it runs, so the runtime's
commands (``generate --artifact``, ``chat``) import neither torch, transformers nor onnx.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import warnings
from pathlib import Path

from medusa_runtime.front.cli import (MAX_THREADS, add_chat_args, add_prompt_args, add_runtime_args, add_sampling_args,
                                check_threads, check_utf8, nothing_asked, run_command, sampling_from_args)
from medusa_runtime.errors import EXIT_CODES_HELP, EXIT_MISMATCH, MedusaError

from .args import add_artifact_arg, add_hidden_alias, add_prompt_file_arg, check_int, check_output_file

PROG = "medusa-export"


def _add_model_args(p: argparse.ArgumentParser, *, runtime_alternative: bool = False) -> None:
    """--model, --model-path, --heads, --trust-remote-code (the PyTorch side's model).

    ``runtime_alternative`` (generate): ``--artifact`` is the other choice, so nothing of the
    registry (which imports torch) is read while the parser is built; the default is applied
    by the command.
    """
    if runtime_alternative:
        p.add_argument("--model", help="run the PyTorch reference loop on this registered model (`medusa-export "
                                       "models` lists them) or HF model dir / .gguf file instead of an artifact "
                                       "(default without --artifact: the registry's default model)")
    else:
        from ..loading.registry import DEFAULT_MODEL, load_registry

        names = ", ".join(sorted(load_registry()))
        p.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"registered model name ({names}) or a path to an HF model dir / .gguf file "
                            f"(default: {DEFAULT_MODEL})")
    p.add_argument("--model-path", help="local backbone weights to use instead of the registry's source")
    p.add_argument("--heads", help="Medusa heads (dir or file: ours, medusa_lm_head.pt/.safetensors) "
                                   "instead of the registry's")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow transformers to run code shipped with the checkpoint (off by default)")


def print_notes(lm) -> None:
    """The loaded model's notes (GGUF limits, FP8, no chat template), one line each on stderr."""
    for note in lm.notes:
        print(f"[note: {note}]", file=sys.stderr, flush=True)


def cmd_generate(args) -> int:
    """One prompt, streamed to stdout: the runtime over ``--artifact``, else the PyTorch reference."""
    if args.artifact:
        from medusa_runtime.front.cli import run_generate

        reference_only = [f for f, v in (("--model", args.model), ("--model-path", args.model_path),
                                         ("--heads", args.heads), ("--trust-remote-code", args.trust_remote_code)) if v]
        if reference_only:
            raise MedusaError(f"{', '.join(reference_only)} choose(s) the PyTorch reference's model; with --artifact "
                              "the artifact runs as built (give one or the other)")
        return run_generate(args)
    if args.stop:
        raise MedusaError("--stop needs --artifact (the runtime); the PyTorch reference stops at EOS and length only")
    if args.prompt_file or args.batch_size is not None:
        raise MedusaError("--prompt-file and --batch-size need --artifact (the runtime's batch scheduler); the PyTorch "
                          "reference answers one --prompt")
    sampling = sampling_from_args(args)  # bad values fail before the model is loaded
    check_utf8(args.prompt, "--prompt")
    from medusa_runtime.trees.treespec import tree_from_spec

    from ..chat import apply_chat_template, TextStreamer
    from ..loading.registry import DEFAULT_MODEL, load_model
    from ..model.decode import medusa_generate

    model = args.model or DEFAULT_MODEL
    t0 = time.perf_counter()
    print(f"loading {model} ...", file=sys.stderr, flush=True)
    lm = load_model(model, model_path=args.model_path, heads_path=args.heads,
                    trust_remote_code=args.trust_remote_code)
    print_notes(lm)
    spec = "root" if args.vanilla else lm.default_tree if args.tree is None else args.tree  # '' is an error
    tree = tree_from_spec(spec, num_heads=lm.model.num_heads,
                          accuracies=lm.head_accuracies)
    if args.raw:
        prompt_ids = lm.tokenizer.encode(args.prompt)
    else:
        prompt_ids = apply_chat_template(lm.tokenizer, lm.chat_template, [{"role": "user", "content": args.prompt}])
    max_context = args.max_context or lm.max_context
    print(f"loaded in {time.perf_counter() - t0:.1f}s; tree: {tree.size} nodes, depth {tree.max_depth}; "
          f"heads: {lm.heads_source}", file=sys.stderr, flush=True)
    streamer = TextStreamer(lm.tokenizer, sys.stdout)
    t1 = time.perf_counter()
    res = medusa_generate(lm.model, prompt_ids, tree, max_new_tokens=args.max_new_tokens,
                          eos_token_ids=lm.eos_token_ids, max_context=max_context,
                          sampling=sampling, on_tokens=streamer.put, sampler=True)  # any top-k / top-p
    streamer.end()
    dt = time.perf_counter() - t1
    if not res.forward_passes:
        print(f"\n{nothing_asked(res.finish_reason)}", file=sys.stderr)
        return 0
    print(f"\n[{len(res.tokens)} tokens in {res.forward_passes} forward passes (prefill + {res.steps} tree steps); "
          f"mean accepted tokens per step: {res.mean_accepted:.2f}; {len(res.tokens) / dt:.1f} tokens/s "
          f"(PyTorch reference, {sampling.describe()}); finish: {res.finish_reason}]", file=sys.stderr)
    if lm.heads_are_initial:
        print("[note: these Medusa heads are untrained (initialised as in the Medusa paper §2.1.1, they "
              "repeat the base model's next-token guess), so few candidates are accepted]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    """Interactive multi-turn chat over an artifact (the runtime)."""
    from medusa_runtime.front.cli import run_chat

    return run_chat(args)


def cmd_build(args) -> int:
    """Export + validate an artifact, the weights streamed from the checkpoint (nothing materialised)."""
    from ..pipeline import BuildConfig, BuildRequest, build
    from .trt import after_build

    t0 = time.perf_counter()
    cfg = BuildConfig(precision=args.precision, heads_precision=args.heads_precision, max_context=args.max_context,
                      new_tokens=args.max_new_tokens, validate=not args.no_validate, accuracy_level=args.accuracy_level,
                      graph=args.graph, heads_vocab=args.heads_vocab, checks=args.checks,
                      validate_layers=args.validate_layers, batch_size=args.batch_size, block_size=args.block_size,
                      int4_scales=args.int4_scales)
    built = build(BuildRequest(args.model, tree=args.tree, out=args.out, force=args.force, model_path=args.model_path,
                               heads=args.heads, trust_remote_code=args.trust_remote_code,
                               prompt_file=args.prompt_file, calibration_prompt_file=args.calibration_prompt_file), cfg)
    _print_summary(built.path, time.perf_counter() - t0, built.lm, opening=built.opening)
    if built.replaced:
        print(f"  replaced (--force): {built.replaced}")
    print_machine_tree(built.path)
    return after_build(args, built.path)


def print_machine_tree(path) -> None:
    """After a build: time the tree sizes on this machine as the runtime's default does (and cache the result, so
    the first ``generate`` reuses it), and print the artifact's tree beside this machine's pick, with the expected
    tokens/s of each. Skipped, with the reason, when the artifact would not fit in memory on ONNX Runtime."""
    import psutil

    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.errors import MedusaError
    from medusa_runtime.front.session import MedusaSession
    from medusa_runtime.tuning.treecache import DEFAULT_SPEC, TREE_ENV, default_spec

    if default_spec() != DEFAULT_SPEC:
        print(f"  on this machine: generate and chat run --tree {default_spec()} (${TREE_ENV}), not timed")
        return
    art = load_artifact(path)
    need = ((art.manifest.build or {}).get("preflight") or {}).get("estimates", {}).get("self", 0)
    free = psutil.virtual_memory().available
    if need > free:
        print(f"  on this machine: tree sizes not timed (running the artifact on ONNX Runtime needs about "
              f"{need / 1e9:.1f} GB, {free / 1e9:.1f} GB available); generate and chat time them on their first run")
        return
    print("  on this machine: timing tree sizes on ONNX Runtime (what generate, chat and Triton run by default) ...",
          flush=True)
    try:
        session = MedusaSession(path, tree=None, notice=None)
    except MedusaError as exc:
        print(f"  on this machine: tree sizes not timed ({exc})")
        return
    choice = session.default_tree
    if choice is None:  # an engine whose tree is fixed
        print(f"  on this machine: generate and chat run the {session.tree.size}-node tree ({session.tree_source})")
        return
    for line in machine_tree_lines(choice, art.tree.size):
        print(line)


def machine_tree_lines(choice, artifact_size: int) -> list[str]:
    """The build summary's lines on the artifact's tree against this machine's pick (``choice``: a
    :class:`medusa_runtime.tuning.treecache.DefaultTree`)."""
    r = choice.record

    def row(size: int, what: str) -> str:
        t = r.row(size)
        if t is None:
            return f"        {what}: {size} nodes (not among the timed sizes)"
        return (f"        {what}: {size} node{'s' if size > 1 else ''}, {t.expected_tokens:.2f} expected tokens/step, "
                f"{t.ms_per_step:.1f} ms/step, {t.tokens_per_second:.1f} expected tokens/s")

    pick = "plain decoding" if r.chosen == 1 else f"the {r.chosen}-node tree"
    return [f"  on this machine (timed in {r.seconds:.1f} s, {choice.where()}):",
            row(artifact_size, "the artifact's tree"), row(r.chosen, "this machine's pick"),
            *([row(1, "plain decoding")] if r.chosen != 1 else []),
            f"        generate, chat and Triton run {pick} here by default; --tree artifact runs the "
            f"{artifact_size}-node tree"]


def architecture_line(lm) -> str:
    """The build summary's line on the backbone's family and switches (the sliding window said plainly), for
    a loaded or an opened model."""
    from ..loading.sources import sources_of

    c = sources_of(lm).config
    text = f"  architecture: {c.model_type}"
    if c.features:
        text += f" ({', '.join(c.features)})"
    windows = [c.window(i) for i in range(c.num_hidden_layers)]
    if any(w is not None for w in windows):
        text += (f"; sliding window of {c.sliding_window} tokens on {sum(w is not None for w in windows)} of "
                 f"{len(windows)} layers, applied in the attention mask by position: exact at any context")
    if lm.quantization:
        text += f"; checkpoint {lm.quantization}"
    return text


def _print_summary(path, seconds: float, lm=None, opening: float | None = None) -> None:
    import json

    from medusa_runtime.contract.manifest import MANIFEST, Manifest

    from .trt import readiness_line

    m = Manifest.from_json(json.loads((Path(path) / MANIFEST).read_text()))
    print(f"\nartifact: {path}  ({m.total_bytes() / 1e6:.1f} MB, built in {seconds:.0f}s from opening the model)")
    print(f"  model: {m.model.name} ({m.model.num_layers} layers, {m.model.medusa_heads} Medusa heads), "
          f"precision {m.precision_name}, max context {m.model.max_context}")
    if lm is not None:
        print(architecture_line(lm))
    policy = m.tree.policy
    print(f"  tree: {m.tree.size} nodes, depth {m.tree.depth} (tree.json)"
          + (f"; runtimes choose a {policy.split(':')[1]}-node tree every step ({policy})" if policy else ""))
    if m.head_type != "medusa":
        print(f"  heads: {m.head_type} (path-conditioned): {m.heads.runs}")
    sel = m.tree.selection
    if sel:
        best = next(c for c in sel["candidates"] if c["size"] == sel["chosen"])
        print(f"        chosen by --tree auto: {best['expected_tokens_per_step']:.2f} expected tokens/step, "
              f"{1e3 * best['expected_tokens_per_step'] / best['expected_tokens_per_second']:.1f} ms/step here, "
              f"{best['expected_tokens_per_second']:.1f} "
              f"expected tokens/s (all sizes: manifest tree.selection)")
    for key in ["model", *(k for k in m.files if k.startswith("heads")), "weights"]:
        f = m.files[key]
        print(f"  {f:12s} {m.checksums[f].bytes / 1e6:9.1f} MB")
    b = m.build
    if b:
        # "total" is the stages' sum; "built in" above also counts opening the model, shown first
        times = ", ".join(f"{'all stages' if t['stage'] == 'total' else t['stage'].split(':')[0]} {t['seconds']:.1f}s"
                          for t in b["stages"])
        opened = "" if opening is None else f"opening the model {opening:.1f}s (before the stages), "
        print(f"  time per stage: {opened}{times}")
        print(f"  peak resident memory {b['peak_rss_bytes'] / 1e9:.2f} GB; weights written at "
              f"{b['weights_gb_per_s']:.2f} GB/s")
    v = m.validation
    template = m.files.get("chat_template")
    no_template = not template or not (Path(path) / template).read_text().strip()
    if v:
        from ..validation.validate import validation_summary

        print(f"  validation: {validation_summary(v)}")
        if no_template:
            print("              (no chat template, a base model: the validation prompts were encoded as plain text)")
    else:
        print("  validation: skipped")
    if no_template:
        print("  chat template: none (a base model): `generate --artifact` continues a plain-text prompt; "
              "`chat` needs a template")
    line = readiness_line(m.trt_readiness, m.flavour)
    if line:
        print(line)


def cmd_verify(args) -> int:
    """Validate an existing artifact with the checks that fit (or those asked for); exit 1
    (:data:`EXIT_MISMATCH`) on a failure."""
    from medusa_runtime.contract.artifact import load_artifact

    from ..export.config import ExportConfig
    from ..validation.checks import check_record, passed_notes, result_lines, run_checks
    from ..validation.config import ValidationConfig
    from ..validation.plan import plan_validation
    from ..validation.source import open_source, source_lines
    from ..validation.validate import default_prompts, read_prompts

    check_int(args.limit, "--limit", low=1)  # bad options fail before anything is loaded or run
    check_int(args.max_new_tokens, "--max-new-tokens", low=1)
    check_output_file(args.junit, "--junit")
    texts = read_prompts(args.prompt_file, args.limit) if args.prompt_file else default_prompts()[: args.limit]
    art = load_artifact(args.artifact)  # the big files' hashes below, once
    m = art.manifest
    lm = open_source(m, args.model_path, args.heads)
    print_notes(lm)
    for line in source_lines(lm, args.model_path, args.heads):
        print(f"  {line}", file=sys.stderr)
    built = ExportConfig.of_manifest(m)  # what the artifact was exported with (the pre-flight's sizes)
    cfg = ValidationConfig(new_tokens=args.max_new_tokens, checks=args.checks, validate_layers=args.validate_layers)
    plan = plan_validation(lm.sources, built.precision, m.weights.bytes, graph=built.graph, checks=cfg.checks,
                           layers=cfg.validate_layers)
    for line in plan.describe():
        print(f"  {line}", file=sys.stderr)
    if "checksums" not in plan.checks:  # the checksums check re-reads every tensor; otherwise hash the whole files
        load_artifact(args.artifact, full_verify=True)
    v = run_checks(plan, art.path, lm, lm.sources, cfg, prompts=texts)
    for line in result_lines(v):
        print(line)
    if args.junit:
        from ..validation.junit import write_junit

        write_junit(args.junit, v)
    if not v["passed"]:
        print("FAILED:\n  " + "\n  ".join(v["failures"]), file=sys.stderr)
        return EXIT_MISMATCH
    compared = any(check_record(v, check).get("prompts") for check in v["ran"])
    prompts_run = (f"{len(texts)} prompt" + ("" if len(texts) == 1 else "s")) if compared else "no prompt compared"
    print(f"PASSED: {prompts_run}, precision {m.precision_name} (checks: {', '.join(v['ran'])})"
          + "".join(f"; {note}" for note in passed_notes(v)))
    return 0


def cmd_triton(args) -> int:
    """Write a Triton Inference Server model repository for an artifact."""
    from ..triton.repository import TritonConfig, write_repository

    check_threads(args.threads)

    cfg = TritonConfig(model_name=args.name, artifact_mode=args.artifact_mode, instances=args.instances,
                       batch_size=args.batch_size, threads=args.threads,
                       backend=args.backend, engine_precision=args.engine_precision,
                       engine_models=not args.no_engine_models, max_new_tokens_limit=args.max_new_tokens_limit,
                       tree=args.tree)
    repo = write_repository(args.artifact, args.out, cfg)
    print(f"Triton model repository: {repo} (see {repo / 'README.md'})")
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``medusa-export`` parser: every sub-command, or only ``command``'s (what :func:`main` runs)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Export Medusa speculative decoding (backbone + heads + token tree) to ONNX / TensorRT "
                    "and run it. Stages: generate (PyTorch reference) -> build (ONNX artifact) -> verify.",
        epilog=EXIT_CODES_HELP,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    adders = [_COMMANDS[command]] if command in _COMMANDS else list(dict.fromkeys(_COMMANDS.values()))
    for add in adders:
        add(sub)
    return parser


def _add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply (an artifact with the runtime, or the PyTorch reference)",
                       description="Apply the chat template to --prompt, decode with Medusa (greedy by default; "
                                   "--temperature > 0 samples, exactly as plain sampling with --acceptance sample) "
                                   "and print the reply, the mean accepted tokens per step and tokens/s. With "
                                   "--artifact the torch-free runtime runs the artifact (--model is not needed), and "
                                   "--prompt-file answers every prompt of a JSONL file, up to --batch-size sequences "
                                   "sharing each step, one JSON line per prompt; otherwise the PyTorch reference loop "
                                   "runs --model.", epilog=EXIT_CODES_HELP)
    _add_model_args(p, runtime_alternative=True)
    add_runtime_args(p, artifact_required=False)
    add_prompt_args(p)
    p.add_argument("--max-context", type=int, help="KV capacity in tokens (default: the model's or the artifact's)")
    p.add_argument("--raw", action="store_true", help="encode --prompt as is, without the chat template")
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


def _add_chat_parser(sub) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn chat with an artifact (streaming)",
                       description="Chat with an artifact through the torch-free runtime: the chat template over "
                                   "the whole conversation, the KV cache reused across turns, tokens streamed as "
                                   "they are accepted; tokens per step and tokens/s after each reply. "
                                   "/reset starts a new conversation, /exit or Ctrl-D quits.", epilog=EXIT_CODES_HELP)
    add_chat_args(p)
    p.set_defaults(func=cmd_chat)


def _add_build_parser(sub) -> None:
    from ..export.config import (FUSED_PRECISIONS, GRAPHS, HEADS_PRECISIONS, PRECISIONS, QUANTIZED_HEADS_DEFAULT,
                                 ExportConfig)
    from ..validation.config import ValidationConfig
    from .trt import add_build_engine_args

    p = sub.add_parser("build", help="export a Medusa model to a validated ONNX artifact",
                       description="Export backbone + heads to ONNX (backbone step graph for prefill and tree "
                                   "steps, heads graph, one weights file), write the manifest, tree and tokenizer, "
                                   "and validate ONNX Runtime against the PyTorch reference. The artifact is written "
                                   "to a temporary folder and moved into place only when everything passed.",
                       epilog=EXIT_CODES_HELP)
    _add_model_args(p)
    p.add_argument("--tree", help="node budget (e.g. 64: the greedy tree from the heads' calibrated accuracies), "
                                  "preset (root, chain), JSON file of medusa_choices, or 'auto' (after export, time "
                                  "the tree step at several sizes here and keep the most expected tokens/s), "
                                  "'dynamic:T' (the runtime chooses a T-node tree every step from the heads' "
                                  "log-probabilities; the artifact's static tree is the T-node greedy tree) or "
                                  "'auto:dynamic' (auto over per-step trees) (default: the model's registered tree)")
    p.add_argument("--out", help="artifact directory, new or empty (default: artifacts/MODEL-tTREE-PRECISION, + -fused "
                                 "or -contrib for --graph fused or contrib); an existing artifact there is replaced only "
                                 "with --force")
    p.add_argument("--force", action="store_true",
                   help="replace an existing artifact in --out, with everything in it (engines/ plans, other files); "
                        "without it such an --out is refused, naming what would be deleted")
    p.add_argument("--precision", choices=PRECISIONS, default=ExportConfig.precision,
                   help="backbone weights: fp32 (exact) or fp16; int8, fp8 (W8A8) or int4 (weight-only): with --graph "
                        "portable standard Q/DQ graphs (ONNX Runtime and TensorRT), with --graph contrib|fused "
                        "MatMulNBits (int8 / int4, ONNX Runtime only); quantized ones validated as Medusa == plain "
                        f"greedy of the same graph (default: {ExportConfig.precision})")
    p.add_argument("--graph", choices=GRAPHS, default=ExportConfig.graph,
                   help="backbone step graph: portable (standard ONNX ops, written from the weights: ONNX Runtime and "
                        "TensorRT), contrib (the portable step with MatMulNBits int8/int4 weights, flavour ort-contrib) "
                        "or fused "
                        "(ONNX Runtime's fused operators: GroupQueryAttention with rotary inside, SimplifiedLayerNormalization, "
                        f"QuickGelu, head-major KV cache written in place; ONNX Runtime CPU only, flavour "
                        f"ort-fused; precisions {', '.join(FUSED_PRECISIONS)}) (default: {ExportConfig.graph})")
    p.add_argument("--heads-precision", choices=HEADS_PRECISIONS, default=ExportConfig.heads_precision,
                   help="Medusa heads graph weights (they only propose candidates, so the output does not change): "
                        "same as --precision, int8 or int4 (MatMulNBits: the heads cost ~2.7x less, ONNX Runtime only), "
                        f"or auto: same, except {QUANTIZED_HEADS_DEFAULT} for the MatMulNBits int8/int4 graphs (--graph "
                        f"contrib|fused) (default: {ExportConfig.heads_precision})")
    p.add_argument("--heads-vocab", type=int, default=ExportConfig.heads_vocab, metavar="N",
                   help="project the Medusa heads onto the N most frequent tokens of the model's draft vocabulary "
                        "(draft_vocab.json beside the heads) instead of the whole vocabulary: the heads graph costs "
                        "~V/N times less, the output never changes, a correct guess outside the subset is lost; "
                        f"0 = the full vocabulary (default: {ExportConfig.heads_vocab})")
    p.add_argument("--accuracy-level", type=int, choices=(1, 4), default=ExportConfig.accuracy_level,
                   help="MatMulNBits compute of an int8/int4 backbone: 4 = int8 activations (fastest; the artifact "
                        "records a row regime, manifest precision.step_rows: one-token steps run as two rows and "
                        "trees are chains, so Medusa equals plain greedy of the graph token for token), 1 = fp32 "
                        "activations (any tree, but a step of more than one row dequantizes the 4-bit weights: "
                        "slow) (default: 4 for int4 and int8; docs/precisions.md)")
    p.add_argument("--max-context", type=int, metavar="N",
                   help="KV capacity the artifact is built for, 2..the model's max_position_embeddings; every "
                        "validation prompt must fit it (checked before the export) (default: the model's)")
    p.add_argument("--batch-size", type=int, default=ExportConfig.batch_size, metavar="N",
                   help="sequences per step: 1 = the batch-1 step graph; N > 1 = a step graph with a dynamic batch "
                        "dimension (per-row past lengths), so generate --batch-size runs all "
                        "rows in one call (docs/batching.md) (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=ExportConfig.block_size, metavar="N",
                   help="quantization block along K: MatMulNBits' (--graph contrib|fused; default 32) or the int4 Q/DQ "
                        "graph's (--graph portable; one of 128, 64, 32, 16 dividing every K; default per weight the "
                        "largest that divides its K)")
    p.add_argument("--int4-scales", choices=("awq", "rtn"), default=ExportConfig.int4_scales,
                   help="--graph portable --precision int4: block scales by AWQ's clip search on the calibration prompts "
                        "(closer to fp32; minutes on a small model, hours for 7B on 2 cores) or round-to-nearest (no "
                        "calibration) (default: %(default)s)")
    add_prompt_file_arg(p, "validation prompts (default: the project's own 3 prompts)", aliases=("--prompts",))
    add_prompt_file_arg(p, "W8A8 (--graph portable --precision int8|fp8) calibration prompts, 2 or more (default: the "
                           "project's own)", flag="--calibration-prompt-file", dest="calibration_prompt_file")
    p.add_argument("--max-new-tokens", type=int, default=ValidationConfig.new_tokens,
                   help=f"greedy tokens compared per validation prompt (default: {ValidationConfig.new_tokens})")
    add_hidden_alias(p, "--new-tokens", dest="max_new_tokens", type=int)
    p.add_argument("--no-validate", action="store_true", help="skip validation (not recommended)")
    _add_check_args(p)
    add_build_engine_args(p)
    p.set_defaults(func=cmd_build)


def _add_verify_parser(sub) -> None:
    from ..validation.config import ValidationConfig

    p = sub.add_parser("verify", help="check an artifact against the PyTorch reference (for CI)",
                       description="Re-run build's validation on an existing artifact with the checks that fit in "
                                   "memory (or those --checks names): step outputs within tolerance and greedy tokens "
                                   "identical, on the whole model or its first --validate-layers layers; weights "
                                   "checksums against the checkpoint; Medusa vs plain greedy. Exits 1 on any failure.",
                       epilog=EXIT_CODES_HELP)
    add_artifact_arg(p)
    add_prompt_file_arg(p, "prompts to compare on (default: the project's own)", aliases=("--prompts",))
    p.add_argument("--limit", type=int, metavar="N", help="use only the first N prompts, N >= 1 (default: all)")
    p.add_argument("--max-new-tokens", type=int, default=ValidationConfig.new_tokens,
                   help=f"greedy tokens compared per prompt (default: {ValidationConfig.new_tokens})")
    add_hidden_alias(p, "--new-tokens", dest="max_new_tokens", type=int)
    p.add_argument("--model-path", help="local backbone weights (default: the manifest's model name; needed for "
                                        "an artifact built from a local folder)")
    p.add_argument("--heads", help="heads to load (default: the manifest's model name's heads)")
    p.add_argument("--junit", metavar="FILE", help="also write a JUnit XML report to this file (its folder must "
                                                   "exist and be writable: checked before the run)")
    _add_check_args(p)
    p.set_defaults(func=cmd_verify)


def _add_check_args(p: argparse.ArgumentParser) -> None:
    """--checks and --validate-layers (build and verify)."""
    from ..validation.config import ValidationConfig

    p.add_argument("--checks", default=ValidationConfig.checks,
                   help="validation checks: auto (estimate each check's memory from the headers and run what fits: "
                        "the full PyTorch-vs-ONNX Runtime check when the model fits twice, else the truncated check, "
                        "weights checksums and Medusa-vs-plain-greedy of the whole artifact), or a comma-separated "
                        "list of full, truncated, checksums, self, gpu (full forces the full check) "
                        f"(default: {ValidationConfig.checks})")
    p.add_argument("--validate-layers", type=int, default=ValidationConfig.validate_layers, metavar="N",
                   help="layers of the truncated check: the same exporter on the first N layers (+ final norm, lm_head, "
                        f"heads) against the PyTorch reference of that truncation (default: {ValidationConfig.validate_layers})")


def _add_triton_parser(sub) -> None:
    from medusa_runtime.engines import BACKENDS

    from ..triton.repository import ARTIFACT_MODES, TritonConfig

    p = sub.add_parser("triton", help="write a Triton Inference Server model repository for an artifact",
                       description="A model repository with a Python-backend model that runs the Medusa loop "
                                   "(decoupled: text or token ids in, token ids and text out, streaming per tree "
                                   "step) and the artifact's step and heads graphs as models of their own "
                                   "(tensorrt_plan when the artifact holds built plans, else onnxruntime).",
                       epilog=EXIT_CODES_HELP)
    add_artifact_arg(p)
    p.add_argument("--out", required=True, help="repository folder (created or replaced)")
    p.add_argument("--name", default=TritonConfig.model_name,
                   help=f"generation model name; the engine models are NAME_step and NAME_heads "
                        f"(default: {TritonConfig.model_name})")
    p.add_argument("--artifact-mode", choices=ARTIFACT_MODES, default=TritonConfig.artifact_mode,
                   help="copy: an independent copy inside the repository (default); link: hard links (no space, "
                        "but shared with the artifact); reference: the artifact's absolute path, nothing copied")
    p.add_argument("--instances", type=int, default=TritonConfig.instances,
                   help=f"instances of the generation model, each with its own session and batch "
                        f"(default: {TritonConfig.instances})")
    p.add_argument("--batch-size", type=int, default=TritonConfig.batch_size,
                   help=f"concurrent requests that share each step in one instance (in-flight batching) "
                        f"(default: {TritonConfig.batch_size})")
    p.add_argument("--threads", type=int, metavar="N",
                   help=f"CPU threads per instance, 1..{MAX_THREADS} (default: ONNX Runtime's choice)")
    p.add_argument("--backend", choices=sorted(BACKENDS),
                   help="medusa_runtime backend (default: tensorrt with built plans, else onnxruntime)")
    p.add_argument("--engine-precision", help="which built TensorRT plans to serve (default: the first built)")
    p.add_argument("--no-engine-models", action="store_true", help="write only the generation model")
    p.add_argument("--max-new-tokens-limit", type=int, help="largest max_new_tokens a request may ask (default: the context)")
    p.add_argument("--tree", help="the tree the model runs, as generate's --tree (default: the fastest on the serving "
                                  "machine, timed when the model instance loads and cached; TensorRT plans keep the "
                                  "artifact's tree)")
    p.set_defaults(func=cmd_triton)


def _add_engine_parser(sub) -> None:
    from .trt import add_trt_commands

    add_trt_commands(sub)


def _add_doctor_parser(sub) -> None:
    from .doctor import add_doctor_command

    add_doctor_command(sub)


def _add_heads_parsers(sub) -> None:
    from .heads import add_heads_commands

    add_heads_commands(sub)


def _add_models_parser(sub) -> None:
    p = sub.add_parser("models", help="list the registered models")
    p.set_defaults(func=cmd_models)


def cmd_models(args) -> int:
    """Print the registry: name, architecture (model_type and family), heads format, default tree, description;
    the default model is marked."""
    from ..loading.registry import DEFAULT_MODEL, load_registry
    from ..model.families import FAMILIES

    print(f"{'name':24s} {'architecture':26s} {'heads':14s} {'tree':5s} description")
    for name, e in sorted(load_registry().items()):
        fam = FAMILIES.get(e.architecture)
        arch = f"{e.architecture} ({fam.name if fam else 'unsupported'})"
        heads = e.heads.get("format", e.heads["source"])
        mark = " [default]" if name == DEFAULT_MODEL else ""
        print(f"{name:24s} {arch:26s} {heads:14s} {e.default_tree:5s} {e.description}{mark}")
    return 0


#: Sub-command -> the function that adds its parser (train-heads and calibrate are added together).
_COMMANDS = {
    "generate": _add_generate_parser,
    "chat": _add_chat_parser,
    "build": _add_build_parser,
    "verify": _add_verify_parser,
    "triton": _add_triton_parser,
    "engine": _add_engine_parser,
    "doctor": _add_doctor_parser,
    "train-heads": _add_heads_parsers,
    "calibrate": _add_heads_parsers,
    "models": _add_models_parser,
}


@contextlib.contextmanager
def notes_as_lines():
    """While it is open, a :class:`~medusa_export.errors.NoteWarning` prints as the command's other notes do: one
    ``[note: ...]`` line on stderr, without Python's category and source line; other warnings print as before."""
    from ..errors import NoteWarning

    with warnings.catch_warnings():
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, NoteWarning):
                print(f"[note: {message}]", file=sys.stderr, flush=True)
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def main(argv: list[str] | None = None) -> int:
    """Run ``medusa-export`` on ``argv`` (default: the process's); returns the exit code.

    Only the named command's parser is built, so a command imports nothing it does not use.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and argv[0] in _COMMANDS else None
    with notes_as_lines():
        return run_command(build_parser(command).parse_args(argv), PROG)


if __name__ == "__main__":
    sys.exit(main())

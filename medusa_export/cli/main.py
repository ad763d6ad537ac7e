"""``medusa-export`` command line: one sub-command per stage.

Each sub-command lives in its own function; defaults come from the dataclasses and the
registry, not restated here.
"""

from __future__ import annotations

import argparse
import sys
import time

from medusa_runtime.acceptance import TypicalConfig
from medusa_runtime.cli import add_chat_args, add_runtime_args, add_sampling_args, run_command
from medusa_runtime.errors import MedusaError

from ..export.config import FUSED_PRECISIONS, GRAPHS, HEADS_PRECISIONS, PRECISIONS, QUANTIZED_HEADS_DEFAULT, BuildConfig
from ..loading.registry import DEFAULT_MODEL, load_registry
from .doctor import add_doctor_command
from .heads import add_heads_commands
from .trt import add_build_engine_args, add_trt_commands, after_build, readiness_line


def _add_model_args(p: argparse.ArgumentParser) -> None:
    names = ", ".join(sorted(load_registry()))
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registered model name ({names}) or a path to an HF model dir / .gguf file "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--model-path", help="local backbone weights to use instead of the registry's source")
    p.add_argument("--heads", help="Medusa heads (dir or file: ours, medusa_lm_head.pt/.safetensors) "
                                   "instead of the registry's")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow transformers to run code shipped with the checkpoint (off by default)")


def _typical(args) -> TypicalConfig | None:
    if args.temperature <= 0:
        return None
    return TypicalConfig(args.temperature, args.posterior_threshold, args.posterior_alpha)


def cmd_generate(args) -> int:
    """One prompt, streamed to stdout: the runtime over ``--artifact``, else the PyTorch reference."""
    if args.artifact:
        from medusa_runtime.cli import run_generate

        return run_generate(args)
    if args.stop:
        raise MedusaError("--stop needs --artifact (the runtime); the PyTorch reference stops at EOS and length only")
    from medusa_runtime.tree import tree_from_spec

    from ..chat import apply_chat_template, TextStreamer
    from ..loading.registry import load_model
    from ..model.decode import medusa_generate

    t0 = time.perf_counter()
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    lm = load_model(args.model, model_path=args.model_path, heads_path=args.heads,
                    trust_remote_code=args.trust_remote_code)
    tree = tree_from_spec("root" if args.vanilla else args.tree or lm.default_tree, num_heads=lm.model.num_heads,
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
                          typical=_typical(args), seed=args.seed, on_tokens=streamer.put)
    streamer.end()
    dt = time.perf_counter() - t1
    print(f"\n[{len(res.tokens)} tokens in {res.steps + 1} forward passes (prefill + {res.steps} tree steps); "
          f"mean accepted tokens per step: {res.mean_accepted:.2f}; {len(res.tokens) / dt:.1f} tokens/s "
          f"(PyTorch reference); finish: {res.finish_reason}]", file=sys.stderr)
    if lm.heads_are_initial:
        print("[note: these Medusa heads are untrained (initialised as in the Medusa paper §2.1.1, they "
              "repeat the base model's next-token guess), so few candidates are accepted]", file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    """Interactive multi-turn chat over an artifact (the runtime)."""
    from medusa_runtime.cli import run_chat

    return run_chat(args)


def cmd_build(args) -> int:
    """Export + validate an artifact, the weights streamed from the checkpoint (nothing materialised)."""
    from medusa_runtime.autotree import DEFAULT_SIZES, is_auto
    from medusa_runtime.tree import tree_from_spec

    from ..export.build import build_artifact
    from ..loading.sources import open_model
    from ..validation.validate import read_prompts

    cfg = BuildConfig(precision=args.precision, heads_precision=args.heads_precision, max_context=args.max_context,
                      new_tokens=args.new_tokens, validate=not args.no_validate, accuracy_level=args.accuracy_level,
                      graph=args.graph, heads_vocab=args.heads_vocab, checks=args.checks,
                      validate_layers=args.validate_layers)
    t0 = time.perf_counter()
    print(f"opening {args.model} (headers and configs; weights are read while the graphs are written) ...",
          file=sys.stderr, flush=True)
    lm = open_model(args.model, model_path=args.model_path, heads_path=args.heads,
                    trust_remote_code=args.trust_remote_code)
    num_heads = lm.sources.heads_config.num_heads
    spec = args.tree or lm.default_tree
    auto = is_auto(spec)  # the largest candidate first; build_artifact times the others after export
    tree = tree_from_spec(str(max(DEFAULT_SIZES)) if auto else spec, num_heads=num_heads,
                          accuracies=lm.head_accuracies)
    graph = "-fused" if cfg.graph == "fused" else ""
    out = args.out or f"artifacts/{lm.name}-t{'auto' if auto else tree.size}-{cfg.precision}{graph}"
    prompts = read_prompts(args.prompts) if args.prompts else None
    path = build_artifact(lm, tree, out, cfg, prompts=prompts, auto_tree=auto)
    _print_summary(path, time.perf_counter() - t0)
    return after_build(args, path)


def _print_summary(path, seconds: float) -> None:
    import json
    from pathlib import Path

    m = json.loads((Path(path) / "manifest.json").read_text())
    size = sum(r["bytes"] for r in m["checksums"].values())
    print(f"\nartifact: {path}  ({size / 1e6:.1f} MB, built in {seconds:.0f}s)")
    print(f"  model: {m['model']['name']} ({m['model']['num_layers']} layers, {m['model']['medusa_heads']} Medusa heads), "
          f"precision {m['precision']['name']}, max context {m['model']['max_context']}")
    print(f"  tree: {m['tree']['size']} nodes, depth {m['tree']['depth']} (tree.json)")
    sel = m["tree"].get("selection")
    if sel:
        best = next(c for c in sel["candidates"] if c["size"] == sel["chosen"])
        print(f"        chosen by --tree auto: {best['expected_tokens_per_step']:.2f} expected tokens/step, "
              f"{best['step_ms'] + best['heads_ms']:.1f} ms/step here, {best['expected_tokens_per_second']:.1f} "
              f"expected tokens/s (all sizes: manifest tree.selection)")
    for key in ("model", "heads", "weights"):
        f = m["files"][key]
        print(f"  {f:12s} {m['checksums'][f]['bytes'] / 1e6:9.1f} MB")
    b = m.get("build")
    if b:
        times = ", ".join(f"{t['stage'].split(':')[0]} {t['seconds']:.1f}s" for t in b["stages"])
        print(f"  time per stage: {times}")
        print(f"  peak resident memory {b['peak_rss_bytes'] / 1e9:.2f} GB; weights written at "
              f"{b['weights_gb_per_s']:.2f} GB/s")
    v = m.get("validation")
    if v:
        from ..validation.validate import validation_summary

        print(f"  validation: {validation_summary(v)}")
    else:
        print("  validation: skipped")
    if readiness_line(m):
        print(readiness_line(m))


def cmd_verify(args) -> int:
    """Validate an existing artifact with the checks that fit (or those asked for); exit 1 on a failure."""
    from medusa_runtime.artifact import load_artifact

    from ..export.build import reference_problem
    from ..loading.sources import open_model
    from ..validation.checks import run_checks
    from ..validation.plan import plan_validation
    from ..validation.validate import PromptReport, ValidationReport, default_prompts, read_prompts

    art = load_artifact(args.artifact, full_verify=True)
    m = art.manifest
    name = m["model"]["name"]
    if name in load_registry() or not args.model_path:
        lm = open_model(name, model_path=args.model_path, heads_path=args.heads)
    else:  # an artifact of a local model: --model-path is the model
        lm = open_model(args.model_path, heads_path=args.heads)
    texts = read_prompts(args.prompts, args.limit) if args.prompts else default_prompts()[: args.limit]
    cfg = BuildConfig(precision=m["precision"]["name"], graph="fused" if m["flavour"] == "ort-fused" else "portable",
               new_tokens=args.new_tokens, checks=args.checks, validate_layers=args.validate_layers,
               max_context=m["model"]["max_context"])
    plan = plan_validation(lm.sources, cfg.precision, m["weights"]["bytes"], graph=cfg.graph, checks=cfg.checks,
                           layers=cfg.validate_layers, reference_problem=reference_problem(lm.sources, lm))
    for line in plan.describe():
        print(f"  {line}", file=sys.stderr)
    v = run_checks(plan, art.path, lm, lm.sources, cfg, prompts=texts)
    for check in v["ran"]:
        rec = v if check == "full" else v[check]
        for p in rec.get("prompts", []):
            if "max_logprob_diff" in p:
                status = "identical" if p["identical"] else ("near-tie" if p["near_tie"] else "MISMATCH")
                print(f"{check:9s} {status:9s} {p['tokens']:4d} tokens  log-prob diff {p['max_logprob_diff']:.1e}  "
                      f"{p['prompt'][:60]!r}")
            else:
                print(f"{check:9s} {'identical' if p['identical'] else 'MISMATCH':9s} {p['tokens']:4d} tokens  "
                      f"{p['prompt'][:60]!r}")
        if check == "checksums" and rec["passed"]:
            print(f"checksums {rec['tensors']} tensors ({rec['bytes'] / 1e9:.2f} GB) re-read and re-made from the checkpoint")
    if args.junit:
        from ..validation.junit import write_junit

        rec = v if "full" in v["ran"] else v.get("truncated") or v.get("gpu")
        if rec is not None:
            write_junit(args.junit, ValidationReport(rec["precision"], rec["new_tokens"],
                                                     [PromptReport(**p) for p in rec["prompts"]]))
    if not v["passed"]:
        print("FAILED:\n  " + "\n  ".join(v["failures"]), file=sys.stderr)
        return 1
    print(f"PASSED: {', '.join(v['ran'])} ({len(texts)} prompts, precision {m['precision']['name']})")
    return 0


def cmd_triton(args) -> int:
    """Write a Triton Inference Server model repository for an artifact."""
    from ..triton.repository import TritonConfig, write_repository

    cfg = TritonConfig(model_name=args.name, artifact_mode=args.artifact_mode, instances=args.instances, threads=args.threads,
                       backend=args.backend, engine_precision=args.engine_precision,
                       engine_models=not args.no_engine_models, max_new_tokens_limit=args.max_new_tokens_limit)
    repo = write_repository(args.artifact, args.out, cfg)
    print(f"Triton model repository: {repo} (see {repo / 'README.md'})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="medusa-export",
        description="Export Medusa speculative decoding (backbone + heads + token tree) to ONNX / TensorRT "
                    "and run it. Stages: generate (PyTorch reference) -> build (ONNX artifact) -> verify.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="generate a reply (an artifact with the runtime, or the PyTorch reference)",
                       description="Apply the chat template to --prompt, decode with Medusa (greedy by default) "
                                   "and print the reply, the mean accepted tokens per step and tokens/s. With "
                                   "--artifact the torch-free runtime runs the artifact (--model is not needed); "
                                   "otherwise the PyTorch reference loop runs --model.")
    _add_model_args(p)
    add_runtime_args(p, artifact_required=False)
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--max-context", type=int, help="KV capacity in tokens (default: the model's or the artifact's)")
    p.add_argument("--raw", action="store_true", help="encode --prompt as is, without the chat template")
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive multi-turn chat with an artifact (streaming)",
                       description="Chat with an artifact through the torch-free runtime: the chat template over "
                                   "the whole conversation, the KV cache reused across turns, tokens streamed as "
                                   "they are accepted; tokens per step and tokens/s after each reply. "
                                   "/reset starts a new conversation, /exit or Ctrl-D quits.")
    add_chat_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("build", help="export a Medusa model to a validated ONNX artifact",
                       description="Export backbone + heads to ONNX (backbone step graph for prefill and tree "
                                   "steps, heads graph, one weights file), write the manifest, tree and tokenizer, "
                                   "and validate ONNX Runtime against the PyTorch reference. The artifact is written "
                                   "to a temporary folder and moved into place only when everything passed.")
    _add_model_args(p)
    p.add_argument("--tree", help="node budget (e.g. 64: the greedy tree from the heads' calibrated accuracies), "
                                  "preset (root, chain), JSON file of medusa_choices, or 'auto' (after export, time "
                                  "the tree step at several sizes here and keep the most expected tokens/s) "
                                  "(default: the model's registered tree)")
    p.add_argument("--out", help="artifact directory (default: artifacts/MODEL-tTREE-PRECISION, + -fused for --graph fused)")
    p.add_argument("--precision", choices=PRECISIONS, default=BuildConfig.precision,
                   help="backbone weights: fp32 (exact) or fp16, portable graphs (ONNX Runtime and TensorRT); int8 or "
                        "int4, weight-only MatMulNBits graphs (ONNX Runtime only), validated as Medusa == plain greedy "
                        f"of the same graph (default: {BuildConfig.precision})")
    p.add_argument("--graph", choices=GRAPHS, default=BuildConfig.graph,
                   help="backbone step graph: portable (traced standard ONNX ops: ONNX Runtime and TensorRT) or fused "
                        "(ONNX Runtime's fused operators: GroupQueryAttention with rotary inside, SimplifiedLayerNormalization, "
                        f"QuickGelu, head-major KV cache written in place; ONNX Runtime CPU only, flavour "
                        f"ort-fused; precisions {', '.join(FUSED_PRECISIONS)}) (default: {BuildConfig.graph})")
    p.add_argument("--heads-precision", choices=HEADS_PRECISIONS, default=BuildConfig.heads_precision,
                   help="Medusa heads graph weights (they only propose candidates, so the output does not change): "
                        "same as --precision, int8 or int4 (MatMulNBits: the heads cost ~2.7x less, ONNX Runtime only), "
                        f"or auto: same for fp32/fp16 (portable), {QUANTIZED_HEADS_DEFAULT} for int8/int4 "
                        f"(default: {BuildConfig.heads_precision})")
    p.add_argument("--heads-vocab", type=int, default=BuildConfig.heads_vocab, metavar="N",
                   help="project the Medusa heads onto the N most frequent tokens of the model's draft vocabulary "
                        "(draft_vocab.json beside the heads) instead of the whole vocabulary: the heads graph costs "
                        "~V/N times less, the output never changes, a correct guess outside the subset is lost; "
                        f"0 = the full vocabulary (default: {BuildConfig.heads_vocab})")
    p.add_argument("--accuracy-level", type=int, choices=(1, 4), default=BuildConfig.accuracy_level,
                   help="MatMulNBits compute of an int8/int4 backbone: 1 = fp32 activations (batch invariant, so "
                        "Medusa stays identical to plain greedy of the graph), 4 = int8 activations (faster, but a "
                        "tree step's rounding differs from one-token steps and outputs can diverge) "
                        "(default: 1 for int4, 4 for int8, which has no fast fp32-compute kernel)")
    p.add_argument("--max-context", type=int, help="KV capacity the artifact is built for (default: the model's)")
    p.add_argument("--prompts", help="JSONL file of validation prompts ('prompt', 'turns' or 'messages'; "
                                     "default: the project's own 3 prompts)")
    p.add_argument("--new-tokens", type=int, default=BuildConfig.new_tokens,
                   help=f"greedy tokens compared per validation prompt (default: {BuildConfig.new_tokens})")
    p.add_argument("--no-validate", action="store_true", help="skip validation (not recommended)")
    _add_check_args(p)
    add_build_engine_args(p)
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("verify", help="check an artifact against the PyTorch reference (for CI)",
                       description="Re-run build's validation on an existing artifact with the checks that fit in "
                                   "memory (or those --checks names): step outputs within tolerance and greedy tokens "
                                   "identical, on the whole model or its first --validate-layers layers; weights "
                                   "checksums against the checkpoint; Medusa vs plain greedy. Exits 1 on any failure.")
    p.add_argument("artifact", help="artifact directory")
    p.add_argument("--prompts", help="JSONL file of prompts (default: the project's own)")
    p.add_argument("--limit", type=int, help="use only the first N prompts")
    p.add_argument("--new-tokens", type=int, default=BuildConfig.new_tokens,
                   help=f"greedy tokens compared per prompt (default: {BuildConfig.new_tokens})")
    p.add_argument("--model-path", help="local backbone weights (default: the manifest's model name)")
    p.add_argument("--heads", help="heads to load (default: the manifest's model name's heads)")
    p.add_argument("--junit", help="also write a JUnit XML report to this file")
    _add_check_args(p)
    p.set_defaults(func=cmd_verify)

    _add_triton_parser(sub)
    add_trt_commands(sub)
    add_doctor_command(sub)
    add_heads_commands(sub)

    p = sub.add_parser("models", help="list the registered models")
    p.set_defaults(func=cmd_models)
    return parser


def _add_check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checks", default=BuildConfig.checks,
                   help="validation checks: auto (estimate each check's memory from the headers and run what fits: "
                        "the full PyTorch-vs-ONNX Runtime check when the model fits twice, else the truncated check, "
                        "weights checksums and Medusa-vs-plain-greedy of the whole artifact), or a comma-separated "
                        "list of full, truncated, checksums, self, gpu (full forces the full check) "
                        f"(default: {BuildConfig.checks})")
    p.add_argument("--validate-layers", type=int, default=BuildConfig.validate_layers, metavar="N",
                   help="layers of the truncated check: the same exporter on the first N layers (+ final norm, lm_head, "
                        f"heads) against the PyTorch reference of that truncation (default: {BuildConfig.validate_layers})")


def _add_triton_parser(sub) -> None:
    from medusa_runtime.engines import BACKENDS

    from ..triton.repository import ARTIFACT_MODES, TritonConfig

    p = sub.add_parser("triton", help="write a Triton Inference Server model repository for an artifact",
                       description="A model repository with a Python-backend model that runs the Medusa loop "
                                   "(decoupled: text or token ids in, token ids and text out, streaming per tree "
                                   "step) and the artifact's step and heads graphs as models of their own "
                                   "(tensorrt_plan when the artifact holds built plans, else onnxruntime).")
    p.add_argument("artifact", help="artifact directory")
    p.add_argument("--out", required=True, help="repository folder (created or replaced)")
    p.add_argument("--name", default=TritonConfig.model_name,
                   help=f"generation model name; the engine models are NAME_step and NAME_heads "
                        f"(default: {TritonConfig.model_name})")
    p.add_argument("--artifact-mode", choices=ARTIFACT_MODES, default=TritonConfig.artifact_mode,
                   help="copy: an independent copy inside the repository (default); link: hard links (no space, "
                        "but shared with the artifact); reference: the artifact's absolute path, nothing copied")
    p.add_argument("--instances", type=int, default=TritonConfig.instances,
                   help=f"instances of the generation model, each with its own session (default: {TritonConfig.instances})")
    p.add_argument("--threads", type=int, help="CPU threads per instance (default: ONNX Runtime's choice)")
    p.add_argument("--backend", choices=sorted(BACKENDS),
                   help="medusa_runtime backend (default: tensorrt with built plans, else onnxruntime)")
    p.add_argument("--engine-precision", help="which built TensorRT plans to serve (default: the first built)")
    p.add_argument("--no-engine-models", action="store_true", help="write only the generation model")
    p.add_argument("--max-new-tokens-limit", type=int, help="largest max_new_tokens a request may ask (default: the context)")
    p.set_defaults(func=cmd_triton)


def cmd_models(args) -> int:
    """Print the registry."""
    for name, e in sorted(load_registry().items()):
        print(f"{name:14s} {e.description} (default tree: {e.default_tree})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv), "medusa-export")


if __name__ == "__main__":
    sys.exit(main())

"""``medusa-export`` command line: one sub-command per stage.

Each sub-command lives in its own function; defaults come from the dataclasses and the
registry, not restated here.
"""

from __future__ import annotations

import argparse
import sys
import time

from medusa_runtime.acceptance import TypicalConfig
from medusa_runtime.errors import MedusaError

from .registry import DEFAULT_MODEL, load_registry

_TYPICAL = TypicalConfig()


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


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128, help="maximum new tokens (default: 128)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy acceptance (lossless, default); > 0 = typical acceptance at this temperature")
    p.add_argument("--posterior-threshold", type=float, default=_TYPICAL.posterior_threshold,
                   help=f"typical acceptance epsilon (default: {_TYPICAL.posterior_threshold})")
    p.add_argument("--posterior-alpha", type=float, default=_TYPICAL.posterior_alpha,
                   help=f"typical acceptance delta (default: {_TYPICAL.posterior_alpha})")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling under typical acceptance (default: 0)")


def _typical(args) -> TypicalConfig | None:
    if args.temperature <= 0:
        return None
    return TypicalConfig(args.temperature, args.posterior_threshold, args.posterior_alpha)


def cmd_generate(args) -> int:
    """Reference PyTorch Medusa generation for one prompt, streamed to stdout."""
    from medusa_runtime.tree import tree_from_spec

    from .chat import apply_chat_template, TextStreamer
    from .decode import medusa_generate
    from .registry import load_model

    t0 = time.perf_counter()
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    lm = load_model(args.model, model_path=args.model_path, heads_path=args.heads,
                    trust_remote_code=args.trust_remote_code)
    tree = tree_from_spec(args.tree or lm.default_tree, num_heads=lm.model.num_heads)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="medusa-export",
        description="Export Medusa speculative decoding (backbone + heads + token tree) to ONNX / TensorRT "
                    "and run it. Stages: generate (PyTorch reference) -> build (ONNX artifact) -> verify.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="generate a reply with the PyTorch reference Medusa loop",
                       description="Apply the chat template to --prompt, decode with Medusa (greedy by default) "
                                   "and print the reply and the mean accepted tokens per step.")
    _add_model_args(p)
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--tree", help="node budget (e.g. 64), preset (root, chain) or JSON file of medusa_choices "
                                  "(default: the model's registered tree)")
    p.add_argument("--max-context", type=int, help="KV capacity in tokens (default: the model's)")
    p.add_argument("--raw", action="store_true", help="encode --prompt as is, without the chat template")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("models", help="list the registered models")
    p.set_defaults(func=cmd_models)
    return parser


def cmd_models(args) -> int:
    """Print the registry."""
    for name, e in sorted(load_registry().items()):
        print(f"{name:14s} {e.description} (default tree: {e.default_tree})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MedusaError as exc:
        print(f"medusa-export: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("medusa-export: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""Put a set of heads (Medusa or path-conditioned) into a copy of a built artifact.

    python scripts/attach_heads.py ARTIFACT --heads DIR --out NEW [--model smollm2-135m] [--heads-vocab 8192]
                                   [--heads-precision int8] [--tree 6]

The new artifact keeps ARTIFACT's step graph and gets heads graphs that return log-probabilities
(per-step trees, ``--tree dynamic:T``), or, for path-conditioned heads, one graph per tree level
(see :mod:`medusa_export.heads_graphs` for the contract). A bridge until ``medusa-export build``
writes these graphs itself (issue 13's graph builder).
"""

from __future__ import annotations

import argparse
import sys

from medusa_export.heads_graphs import attach_heads
from medusa_export.loading.registry import DEFAULT_MODEL, load_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact")
    p.add_argument("--heads", required=True, help="heads folder (heads.safetensors + heads.json, accuracies.json)")
    p.add_argument("--out", required=True, help="the new artifact folder")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the artifact's model (default: {DEFAULT_MODEL})")
    p.add_argument("--heads-vocab", type=int, default=0, help="project onto the top N draft-vocabulary ids (0: all)")
    p.add_argument("--heads-precision", choices=("fp32", "int8"), default="fp32")
    p.add_argument("--tree", help="the artifact's static tree (default: the greedy tree of its current size)")
    args = p.parse_args(argv)
    lm = load_model(args.model, heads_path=args.heads)
    out = attach_heads(args.artifact, lm, args.heads, args.out, heads_vocab=args.heads_vocab,
                       precision=args.heads_precision, tree=args.tree)
    print(f"{out}: {lm.model.heads.config.head_type} heads from {args.heads}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

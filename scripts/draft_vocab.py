"""Write a model's draft vocabulary (token ids by frequency) from self-distillation replies.

    python scripts/draft_vocab.py REPLIES --vocab-size 49152 --source "..." --out models/smollm2-135m

REPLIES is a reply store folder (``<cache>/replies`` of ``medusa-export train-heads``, which also
writes ``draft_vocab.json`` beside the heads it trains) or a JSONL file (optionally gzip) with a
``tokens`` list per line. Use the heads' training replies, never evaluation data.
See :mod:`medusa_export.training.draft_vocab`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from medusa_export.training.draft_vocab import draft_vocab_json, frequency_order, write_draft_vocab


def read_replies(path: Path, vocab_size: int):
    """Yield each reply's tokens: from a reply store folder, or each line's ``tokens`` list (plain or gzip JSONL)."""
    if path.is_dir():
        from medusa_export.training.reply_store import ReplyStore

        for r in ReplyStore(path, vocab_size=vocab_size).read():
            yield r.reply.tolist()
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)["tokens"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("replies", type=Path)
    p.add_argument("--vocab-size", type=int, required=True, help="the model's vocabulary size V")
    p.add_argument("--source", required=True, help="one line: where the replies come from")
    p.add_argument("--out", type=Path, required=True, help="folder (beside the heads) for draft_vocab.json")
    args = p.parse_args(argv)
    ids, counts = frequency_order(read_replies(args.replies, args.vocab_size))
    if len(ids) and ids.max() >= args.vocab_size:
        p.error(f"the replies hold id {int(ids.max())} >= --vocab-size {args.vocab_size}")
    doc = draft_vocab_json(ids, counts, vocab_size=args.vocab_size, source=args.source)
    path = write_draft_vocab(doc, args.out)
    print(f"{path}: {doc['distinct_ids']} ids from {doc['total_tokens']} tokens; coverage {doc['coverage']}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Head calibration: per-head top-i accuracies a_k^(i) on held-out prompts (seeds/001 §2.3.3).

The backbone answers the prompts greedily (batched, replies stored as token ids, hidden states
recomputed: see :mod:`medusa_export.training.replies`); at every reply position the heads' top-k are compared
with the tokens the backbone actually wrote next. Under greedy acceptance the Medusa
output equals this greedy reply, so the same data also gives the exact acceptance of any
tree by simulation (:func:`simulate_acceptance`), without running the decode loop.

``accuracies.json`` (beside ``heads.safetensors``) holds ``accuracies[k-1][i]`` = a_k^(i),
the probability that head k's i-th choice (0-based) is the right token; each row sums to
the head's top-k accuracy (<= 1). :func:`medusa_runtime.tree.greedy_tree` builds trees from it;
:func:`medusa_export.loading.accuracies.load_accuracies` reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from medusa_runtime.tree import Tree

from ..loading.accuracies import ACCURACIES_FILE, ACCURACIES_FORMAT
from ..model.heads import MedusaHeads

@torch.no_grad()
def heads_topk(heads: MedusaHeads, hidden: torch.Tensor, topk: int, *, chunk: int = 256) -> torch.Tensor:
    """hidden [n, d] -> int64 [n, K, topk]: every head's best tokens at every position (fp32)."""
    dtype = next(heads.parameters()).dtype
    out = []
    for s in range(0, hidden.shape[0], chunk):
        logits = heads(hidden[s:s + chunk].to(dtype))  # [K, c, V]
        out.append(torch.topk(logits, topk, dim=-1).indices.permute(1, 0, 2))
    if not out:
        return torch.zeros(0, heads.config.num_heads, topk, dtype=torch.long)
    return torch.cat(out)


def accuracy_counts(tokens: Sequence[int], topk_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hits of each head's i-th choice on one reply.

    Args:
        tokens: r_0..r_{n-1}.
        topk_ids: int [n, K, topk]; row i holds the heads' choices at hidden[i] (head k
            predicts r_{i+k}).

    Returns:
        (hits int [K, topk], positions int [K]: how many positions had a target for head k).
    """
    r = np.asarray(tokens)
    n, num_heads, topk = topk_ids.shape
    hits = np.zeros((num_heads, topk), dtype=np.int64)
    count = np.zeros(num_heads, dtype=np.int64)
    for k in range(1, num_heads + 1):
        m = n - k
        if m <= 0:
            continue
        eq = topk_ids[:m, k - 1, :] == r[k:, None]  # [m, topk]
        hits[k - 1] = eq.sum(0)
        count[k - 1] = m
    return hits, count


def head_accuracies(heads: MedusaHeads, hiddens: Sequence[torch.Tensor],
                    tokens: Sequence[Sequence[int]], topk: int = 10) -> np.ndarray:
    """a_k^(i) over a set of replies: float64 [K, topk]."""
    return pooled_accuracies(tokens, [heads_topk(heads, h, topk).numpy() for h in hiddens])


def pooled_accuracies(tokens: Sequence[Sequence[int]], topks: Sequence[np.ndarray]) -> np.ndarray:
    """:func:`accuracy_counts` summed over replies, as rates: float64 [K, topk]."""
    hits = count = 0
    for t, k in zip(tokens, topks):
        c_hits, c_count = accuracy_counts(t, k)
        hits, count = hits + c_hits, count + c_count
    return np.asarray(hits, dtype=np.float64) / np.maximum(np.asarray(count, dtype=np.float64), 1)[:, None]


def save_accuracies(acc: np.ndarray, out_dir: str | Path, *, source: str, positions: int) -> Path:
    """Write ``accuracies.json`` (see the module docstring) and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "format": ACCURACIES_FORMAT,
        "version": 1,
        "num_heads": int(acc.shape[0]),
        "topk": int(acc.shape[1]),
        "source": source,
        "positions": int(positions),
        "top1": [round(float(a), 4) for a in acc[:, 0]],
        "accuracies": [[round(float(a), 6) for a in row] for row in acc],
    }
    path = out / ACCURACIES_FILE
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def accepted_length(root_index: int, tokens: Sequence[int], topk_ids: np.ndarray, tree: Tree) -> int:
    """Candidates accepted at one greedy step (not counting the bonus token).

    The step's root is r_i (i = root_index) and the heads' choices come from hidden[i]
    (``topk_ids[i]``, [K, topk]); a node [i1..id] holds head d's i_d-th choice and is
    accepted when its whole path equals r_{i+1..i+d}. Tokens beyond the reply never match.
    """
    n = len(tokens)
    best = 0
    choices = topk_ids[root_index]
    for path in tree.choices:
        d = len(path)
        if d <= best or root_index + d >= n:
            continue
        if all(choices[j, path[j]] == tokens[root_index + j + 1] for j in range(d)):
            best = d
    return best


def simulate_steps(tokens: Sequence[int], topk_ids: np.ndarray, tree: Tree, *, max_new_tokens: int,
                   eos_token_ids: Sequence[int] = ()) -> list[int]:
    """Tokens per step of greedy Medusa decoding on a known greedy reply (as the decode loop counts them).

    Args:
        tokens: the greedy reply r_0..r_{n-1} (generated a few tokens past max_new_tokens,
            so that the last step's candidates can be checked).
        topk_ids: int [n, K, topk], the heads' choices at each hidden[i].
        tree: the tree.
        max_new_tokens: the decode loop's limit.
        eos_token_ids: stop tokens.

    Returns:
        accepted candidates + 1 for each tree step after the prefill.
    """
    eos = set(int(e) for e in eos_token_ids)
    steps: list[int] = []
    if not len(tokens) or int(tokens[0]) in eos:
        return steps
    i, emitted = 0, 1
    while emitted < max_new_tokens and i + 1 < len(tokens):
        acc = accepted_length(i, tokens, topk_ids, tree)
        step = list(tokens[i + 1:i + acc + 2])
        steps.append(acc + 1)
        i += acc + 1
        if any(int(t) in eos for t in step):
            break
        emitted += len(step)
    return steps


def simulate_acceptance(replies_tokens: Sequence[Sequence[int]], replies_topk: Sequence[np.ndarray], tree: Tree, *,
                        max_new_tokens: int, eos_token_ids: Sequence[int] = (2,)) -> float:
    """Mean tokens per step over all steps of all replies (pooled), see :func:`simulate_steps`."""
    steps = []
    for t, k in zip(replies_tokens, replies_topk):
        steps.extend(simulate_steps(t, k, tree, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids))
    return float(np.mean(steps)) if steps else 0.0


@dataclass
class Calibration:
    """Accuracies plus the per-reply data they came from (for simulating trees)."""

    accuracies: np.ndarray
    tokens: list[list[int]]
    topk_ids: list[np.ndarray]
    positions: int


def calibrate(gen, heads: MedusaHeads, prompts, cache_root: str | Path, *, max_new_tokens: int = 133,
              batch_size: int = 32, topk: int = 10, progress: bool = True) -> Calibration:
    """Greedy replies (stored under ``cache_root``), then the heads' a_k^(i) on them.

    Replies are decoded and their hidden states recomputed in fp32 (where top-k ties matter), with
    :class:`~medusa_export.training.batch_decode.BatchedDecoder`.

    Args:
        gen: a :class:`medusa_export.training.distill.Generator`.
        heads: the heads to measure.
        prompts: held-out :class:`~medusa_export.training.distill.Prompt` list (never trained on).
        cache_root: replies are stored in a sub-folder named after the prompts' source, their
            count and ``max_new_tokens``; their hidden states are cached beside them.
    """
    from .batch_decode import BatchedDecoder
    from .features import cached_features
    from .replies import decode_requests, generate_to_store
    from .reply_store import ReplyStore

    key = f"{prompts[0].source if prompts else 'none'}-{len(prompts)}p-{max_new_tokens}t"
    cache = Path(cache_root) / key
    store = ReplyStore(cache / "replies", vocab_size=gen.lm_head.weight.shape[0],
                       meta={"source": gen.source, "max_new_tokens": max_new_tokens, "dtype": "float32"})
    reqs = decode_requests(gen.tokenizer, gen.chat_template, prompts, have=store.ids(), max_prompt_tokens=10**9)
    decoder = BatchedDecoder(gen.hf_model, batch_size=batch_size, dtype=torch.float32,
                             capacity=max((len(r.prompt) for r in reqs), default=0) + max_new_tokens + 1)
    generate_to_store(decoder, reqs, store, max_new_tokens=max_new_tokens, eos_token_ids=gen.eos_token_ids,
                      progress=progress)
    by_id = {r.id: r for r in store.read()}
    replies = [by_id[p.id] for p in prompts if p.id in by_id]
    feats = cached_features(decoder, replies, cache, source=gen.source)
    tokens = [r.reply.tolist() for r in replies]
    heads = heads.float().eval()
    topks, start = [], 0
    for n in feats.lengths:
        topks.append(heads_topk(heads, feats.hidden[start:start + n].float(), topk).numpy())
        start += n
    return Calibration(pooled_accuracies(tokens, topks), tokens, topks, int(sum(len(t) for t in tokens)))

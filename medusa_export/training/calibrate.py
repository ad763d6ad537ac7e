"""Head calibration: per-head top-i accuracies a_k^(i) on held-out prompts (Medusa paper §2.3.3).

The backbone answers the prompts greedily (batched, replies stored as token ids, hidden states
recomputed: see :mod:`medusa_export.training.replies`); at every reply position the heads' top-k are compared
with the tokens the backbone actually wrote next. Under greedy acceptance the Medusa
output equals this greedy reply, so the same data also gives the exact acceptance of any
tree by simulation (:func:`simulate_acceptance`), without running the decode loop.

``accuracies.json`` (beside ``heads.safetensors``) holds ``accuracies[k-1][i]`` = a_k^(i),
the probability that head k's i-th choice (0-based) is the right token; each row sums to
the head's top-k accuracy (<= 1). :func:`medusa_runtime.trees.tree.greedy_tree` builds trees from it;
:func:`medusa_export.loading.accuracies.load_accuracies` reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from medusa_runtime.trees.dynamic import DynamicTree
from medusa_runtime.decode.candidates import Proposal, dynamic_levels, dynamic_medusa
from medusa_runtime.trees.calibration import ProbabilityMap
from medusa_runtime.trees.tree import Tree
from torch import nn

from ..loading.accuracies import ACCURACIES_FILE, ACCURACIES_FORMAT

def path_ids_of(tokens: Sequence[int], num_heads: int) -> torch.Tensor:
    """int64 [n, K]: at position i, the reply's own path r_i .. r_{i+K-1} (clamped to the last token).

    What a path-conditioned head reads when every node on its path is right, the only case in
    which its candidate can be accepted: so teacher-forced accuracies are the conditional
    accuracies a tree needs.
    """
    t = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
    n = t.shape[0]
    idx = (torch.arange(n)[:, None] + torch.arange(num_heads)[None]).clamp(max=max(n - 1, 0))
    return t[idx] if n else torch.zeros(0, num_heads, dtype=torch.long)


class Projection:
    """The heads' vocabulary projection as an artifact runs it: the shared weight, or its rows of a token subset
    (``build --heads-vocab N``: the draft vocabulary's top N), with log-softmax and top-k over it.

    Args:
        heads: the heads (their shared projection).
        vocab_ids: int64 [N] subset ids, or None for all V.
    """

    def __init__(self, heads: nn.Module, vocab_ids: np.ndarray | None = None):
        w = heads.projection_weights()[0].detach().float()
        self.ids = None if vocab_ids is None else torch.as_tensor(np.asarray(vocab_ids, dtype=np.int64))
        self.weight = w if self.ids is None else w[self.ids]

    def topk(self, states: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """states [..., d] -> (token ids int64 [..., k], log-probabilities float32 [..., k])."""
        top = torch.topk(torch.log_softmax(states.float() @ self.weight.T, dim=-1), k, dim=-1)
        ids = top.indices if self.ids is None else self.ids[top.indices]
        return ids, top.values


@torch.no_grad()
def heads_topk(heads: nn.Module, hidden: torch.Tensor, topk: int, *, tokens: Sequence[int] | None = None,
               chunk: int = 256, with_logprobs: bool = False, vocab_ids: np.ndarray | None = None):
    """Every head's best tokens at every position (fp32).

    Args:
        heads: Medusa heads, or path-conditioned heads (which then read the reply's own path,
            :func:`path_ids_of`, so ``tokens`` is needed).
        hidden: [n, d] hidden states (hidden[i] predicts r_i).
        topk: choices per head.
        tokens: the reply r_0..r_{n-1} (path-conditioned heads only).
        with_logprobs: also return their log-probabilities.
        vocab_ids: the heads' token subset (:class:`Projection`), or None.

    Returns:
        int64 [n, K, topk] (and float32 [n, K, topk] log-probabilities with ``with_logprobs``).

    Raises:
        ValueError: path-conditioned heads without ``tokens``.
    """
    dtype = next(heads.parameters()).dtype
    k_heads = heads.config.num_heads
    paths = None
    if heads.conditioned:
        if tokens is None:
            raise ValueError("path-conditioned heads need the reply's tokens")
        paths = path_ids_of(tokens, k_heads)
    proj = Projection(heads, vocab_ids)
    ids, lps = [], []
    for s in range(0, hidden.shape[0], chunk):
        h = hidden[s:s + chunk].to(dtype)
        states = heads.head_states(h, paths[s:s + chunk] if paths is not None else None)  # [K, c, d]
        top_ids, top_lp = proj.topk(states, topk)
        ids.append(top_ids.permute(1, 0, 2))
        lps.append(top_lp.permute(1, 0, 2))
    if not ids:
        empty = torch.zeros(0, k_heads, topk)
        return (empty.long(), empty) if with_logprobs else empty.long()
    return (torch.cat(ids), torch.cat(lps)) if with_logprobs else torch.cat(ids)


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


def head_accuracies(heads: nn.Module, hiddens: Sequence[torch.Tensor],
                    tokens: Sequence[Sequence[int]], topk: int = 10) -> np.ndarray:
    """a_k^(i) over a set of replies: float64 [K, topk] (path-conditioned heads: given the right path)."""
    return pooled_accuracies(tokens, [heads_topk(heads, h, topk, tokens=t).numpy() for h, t in zip(hiddens, tokens)])


def pooled_accuracies(tokens: Sequence[Sequence[int]], topks: Sequence[np.ndarray]) -> np.ndarray:
    """:func:`accuracy_counts` summed over replies, as rates: float64 [K, topk]."""
    hits = count = 0
    for t, k in zip(tokens, topks):
        c_hits, c_count = accuracy_counts(t, k)
        hits, count = hits + c_hits, count + c_count
    return np.asarray(hits, dtype=np.float64) / np.maximum(np.asarray(count, dtype=np.float64), 1)[:, None]


def save_accuracies(acc: np.ndarray, out_dir: str | Path, *, source: str, positions: int, head_type: str = "medusa",
                    calibration: ProbabilityMap | None = None, simulated: dict | None = None) -> Path:
    """Write ``accuracies.json`` (see the module docstring) and return its path.

    Args:
        acc: float [K, topk] a_k^(i).
        head_type: the heads' type (their accuracies are conditional on the right path for "hydra").
        calibration: the heads' probability map (per-step trees), or None.
        simulated: {"static" | "dynamic": {nodes: tokens per step}} simulated on the same replies.
    """
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
        "head_type": head_type,
    }
    if calibration is not None:
        data["calibration"] = calibration.to_json()
    if simulated:
        data["simulated"] = {policy: {str(n): round(float(v), 4) for n, v in sorted(table.items())}
                             for policy, table in simulated.items()}
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
        topk_ids: int [n, K, topk], the heads' choices at each hidden[i] (path-conditioned
            heads: teacher-forced on the reply, :func:`heads_topk`; exact, since a node can only
            be accepted when its path is the reply's).
        tree: the tree.
        max_new_tokens: the decode loop's limit.
        eos_token_ids: stop tokens.

    Returns:
        accepted candidates + 1 for each tree step after the prefill.
    """
    return simulate_with(tokens, lambda i: accepted_length(i, tokens, topk_ids, tree),
                         max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)


def simulate_with(tokens: Sequence[int], accepted_at, *, max_new_tokens: int,
                  eos_token_ids: Sequence[int] = ()) -> list[int]:
    """:func:`simulate_steps` with any acceptance: ``accepted_at(i)`` = candidates accepted at the step whose root is r_i."""
    eos = set(int(e) for e in eos_token_ids)
    steps: list[int] = []
    if not len(tokens) or int(tokens[0]) in eos:
        return steps
    i, emitted = 0, 1
    while emitted < max_new_tokens and i + 1 < len(tokens):
        acc = accepted_at(i)
        step = list(tokens[i + 1:i + acc + 2])
        steps.append(acc + 1)
        i += acc + 1
        if any(int(t) in eos for t in step):
            break
        emitted += len(step)
    return steps


def proposal_accepted(proposal: Proposal, tokens: Sequence[int], root_index: int) -> int:
    """Candidates of a step's proposal (tree + tokens) that greedy acceptance keeps, given the reply r."""
    b = proposal.tree.buffers()
    n = len(tokens)
    ok = np.zeros(proposal.tree.size, dtype=bool)
    ok[0] = True
    best = 0
    for node in range(1, proposal.tree.size):  # parents come first
        pos = root_index + int(b.depth[node])
        ok[node] = ok[b.parent[node]] and pos < n and int(proposal.tokens[node]) == int(tokens[pos])
        if ok[node]:
            best = max(best, int(b.depth[node]))
    return best


@torch.no_grad()
def simulate_dynamic(heads: nn.Module, hidden: torch.Tensor, tokens: Sequence[int], spec: DynamicTree, *,
                     max_new_tokens: int, eos_token_ids: Sequence[int] = (),
                     topk: tuple[np.ndarray, np.ndarray] | None = None,
                     vocab_ids: np.ndarray | None = None) -> list[int]:
    """Tokens per step with per-step trees (:mod:`medusa_runtime.decode.candidates`) on a known greedy reply.

    Medusa heads: the tree comes from the heads' top-k at the step's hidden state (``topk`` = the
    :func:`heads_topk` ids and log-probabilities of the reply, or computed here). Path-conditioned
    heads run level by level on the candidates' own paths, as the runtime does (only h_t and the
    embeddings are needed, not the backbone).

    Args:
        vocab_ids: the heads' token subset (:class:`Projection`), or None.

    Returns:
        accepted candidates + 1 for each step.
    """
    hidden = hidden.float()
    if heads.conditioned:
        proj = Projection(heads, vocab_ids)

        def at(i: int) -> int:
            h = hidden[i:i + 1]

            def run_level(depth, paths):
                paths = torch.as_tensor(paths)
                ids, lp = proj.topk(heads.head_state(depth - 1, h.expand(len(paths), -1), paths), spec.topk)
                return ids.numpy(), lp.numpy()

            return proposal_accepted(dynamic_levels(int(tokens[i]), run_level, spec), tokens, i)
    else:
        ids, lps = topk if topk is not None else (t.numpy() for t in heads_topk(
            heads, hidden, spec.topk, with_logprobs=True, vocab_ids=vocab_ids))

        def at(i: int) -> int:
            return proposal_accepted(dynamic_medusa(int(tokens[i]), ids[i], lps[i], spec), tokens, i)
    return simulate_with(tokens, at, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)


def fit_probability_map(tokens: Sequence[Sequence[int]], topk_ids: Sequence[np.ndarray],
                        topk_logprobs: Sequence[np.ndarray], *, bins: int = 24,
                        lowest: float = -12.0) -> ProbabilityMap:
    """Per head, P(a candidate is right | its log-probability): binned, then made non-decreasing (isotonic).

    Every top-k candidate of head k at position i (with a target r_{i+k}) is one sample. For
    path-conditioned heads the log-probabilities come from the right path (teacher forcing), so
    the map is P(right | ancestors right, q), what per-step trees need; for Medusa heads it is
    the marginal (Medusa paper's independence approximation).

    Args:
        tokens, topk_ids, topk_logprobs: per reply, r and the :func:`heads_topk` outputs [n, K, k].
        bins: log-probability bins over [lowest, 0].

    Returns:
        The map; bins without samples are dropped (interpolated over).
    """
    edges = np.linspace(lowest, 0.0, bins + 1)
    num_heads = topk_ids[0].shape[1] if topk_ids else 0
    hits = np.zeros((num_heads, bins))
    count = np.zeros((num_heads, bins))
    lp_sum = np.zeros((num_heads, bins))
    for r, ids, lps in zip(tokens, topk_ids, topk_logprobs):
        r = np.asarray(r)
        n = len(r)
        for k in range(1, num_heads + 1):
            m = n - k
            if m <= 0:
                continue
            right = ids[:m, k - 1, :] == r[k:, None]  # [m, topk]
            lp = np.asarray(lps[:m, k - 1, :], dtype=np.float64)
            b = np.clip(np.searchsorted(edges, lp, side="right") - 1, 0, bins - 1)
            np.add.at(hits[k - 1], b, right)
            np.add.at(count[k - 1], b, 1)
            np.add.at(lp_sum[k - 1], b, lp)
    used = count.sum(0) > 0
    centres = np.where(used, lp_sum.sum(0) / np.maximum(count.sum(0), 1), 0.0)[used]
    p = np.zeros((num_heads, int(used.sum())))
    for k in range(num_heads):
        p[k] = _isotonic(hits[k, used] / np.maximum(count[k, used], 1), np.maximum(count[k, used], 1e-9))
    return ProbabilityMap(centres, np.clip(p, 0.0, 1.0))  # bin means: strictly increasing (disjoint bins)


def _isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [value, weight, length]
    for v, wt in zip(y, w):
        blocks.append([float(v), float(wt), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return np.concatenate([[v] * n for v, _, n in blocks]) if blocks else np.zeros(0)


def simulate_acceptance(replies_tokens: Sequence[Sequence[int]], replies_topk: Sequence[np.ndarray], tree: Tree, *,
                        max_new_tokens: int, eos_token_ids: Sequence[int] = (2,)) -> float:
    """Mean tokens per step over all steps of all replies (pooled), see :func:`simulate_steps`."""
    steps = []
    for t, k in zip(replies_tokens, replies_topk):
        steps.extend(simulate_steps(t, k, tree, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids))
    return float(np.mean(steps)) if steps else 0.0


@dataclass
class Calibration:
    """Accuracies plus the per-reply data they came from (for simulating trees).

    Attributes:
        accuracies: float64 [K, topk] a_k^(i).
        tokens: the replies.
        topk_ids / topk_logprobs: per reply, the heads' teacher-forced top-k [n, K, topk] and log-probabilities.
        hiddens: per reply, the hidden states [n, d] (fp32) (per-step trees of path-conditioned heads run on them).
        positions: reply tokens.
        probability_map: the heads' calibration map (:func:`fit_probability_map`).
    """

    accuracies: np.ndarray
    tokens: list[list[int]]
    topk_ids: list[np.ndarray]
    positions: int
    topk_logprobs: list[np.ndarray] = field(default_factory=list)
    hiddens: list[torch.Tensor] = field(default_factory=list)
    probability_map: ProbabilityMap | None = None


def calibrate(gen, heads: nn.Module, prompts, cache_root: str | Path, *, max_new_tokens: int = 133,
              batch_size: int = 32, topk: int = 10, progress: bool = True,
              vocab_ids: np.ndarray | None = None) -> Calibration:
    """Greedy replies (stored under ``cache_root``), then the heads' a_k^(i) on them.

    Replies are decoded and their hidden states recomputed in fp32 (where top-k ties matter), with
    :class:`~medusa_export.training.batch_decode.BatchedDecoder`.

    Args:
        gen: a :class:`medusa_export.training.distill.Generator`.
        heads: the heads to measure.
        prompts: held-out :class:`~medusa_export.training.distill.Prompt` list (never trained on).
        cache_root: replies are stored in a sub-folder named after the prompts' source, their
            count and ``max_new_tokens``; their hidden states are cached beside them.
        vocab_ids: the heads' token subset (an artifact's ``--heads-vocab``), or None for all V.
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
    topks, lps, hiddens, start = [], [], [], 0
    for n, t in zip(feats.lengths, tokens):
        h = feats.hidden[start:start + n].float()
        ids, lp = heads_topk(heads, h, topk, tokens=t, with_logprobs=True, vocab_ids=vocab_ids)
        topks.append(ids.numpy())
        lps.append(lp.numpy())
        hiddens.append(h)
        start += n
    return Calibration(pooled_accuracies(tokens, topks), tokens, topks, int(sum(len(t) for t in tokens)), lps, hiddens,
                       fit_probability_map(tokens, topks, lps))

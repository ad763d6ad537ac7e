"""Host-side acceptance of a verified tree: greedy and typical (seeds/001 §2.3.1).

Pure numpy. Inputs are the tokens placed on the tree's nodes and what the backbone
computed at each node; the output is which nodes are accepted and the next token.

Conventions used everywhere in this project:

* The root (node 0) is always accepted: it is the backbone's own next token, chosen
  at the previous step.
* ``accepted`` lists node indices from the root down one root-to-leaf path.
* ``next_token`` is chosen from the backbone's prediction at the last accepted node:
  the "bonus" token, which becomes the next step's root.
* One step therefore produces ``len(accepted)`` tokens: the accepted candidates after
  the root plus the bonus token (the root itself was produced by the previous step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .tree import Tree


@dataclass(frozen=True)
class TypicalConfig:
    """Typical acceptance parameters; the one place their defaults are defined.

    Attributes:
        temperature: softmax temperature (> 0) for the posterior and for sampling the
            bonus token.
        posterior_threshold: epsilon, the hard probability threshold (seeds/001 §2.3.1;
            FasterDecoding/Medusa ``medusa_generate`` default 0.09).
        posterior_alpha: delta, the entropy-dependent threshold factor (Medusa default 0.3);
            the threshold is min(epsilon, delta * exp(-H)).
    """

    temperature: float = 0.7
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"typical acceptance needs temperature > 0, got {self.temperature}")
        if not 0 < self.posterior_threshold <= 1:
            raise ValueError(f"posterior_threshold (epsilon) must be in (0, 1], got {self.posterior_threshold}")
        if not self.posterior_alpha > 0:
            raise ValueError(f"posterior_alpha (delta) must be > 0, got {self.posterior_alpha}")


@dataclass(frozen=True)
class Acceptance:
    """Result of accepting one tree step.

    Attributes:
        accepted: int64 [n] node indices, root first (n >= 1).
        next_token: the bonus token predicted at the last accepted node.
        path_index: the row of ``retrieve_indices`` that won.
    """

    accepted: np.ndarray
    next_token: int
    path_index: int

    @property
    def accept_length(self) -> int:
        """Accepted candidates after the root (0 .. tree depth)."""
        return len(self.accepted) - 1


def _prefix_lengths(ok: np.ndarray, retrieve: np.ndarray) -> np.ndarray:
    """Per path, the number of consecutive accepted non-root nodes. ok: bool [T]."""
    valid = retrieve[:, 1:] >= 0
    node_ok = np.where(valid, ok[np.maximum(retrieve[:, 1:], 0)], False)
    return np.cumprod(node_ok, axis=1).sum(axis=1)


def accept_greedy(tree: Tree, tokens: np.ndarray, node_argmax: np.ndarray) -> Acceptance:
    """Greedy acceptance (temperature 0): lossless w.r.t. plain greedy decoding.

    A non-root node is accepted while the backbone's argmax at its parent equals the
    node's token, all its ancestors being accepted too. The longest accepted path wins;
    among equally long paths the first row of ``retrieve_indices`` wins (paths are
    ordered by leaf node order, so the smallest top-k indices win). Any tie gives the
    same tokens, since the accepted tokens are the argmax chain itself.

    Args:
        tree: the tree (T nodes).
        tokens: int [T], the token at each node.
        node_argmax: int [T], the backbone's argmax next token at each node.

    Returns:
        The :class:`Acceptance`; ``next_token`` = node_argmax at the last accepted node.
    """
    b = tree.buffers()
    tokens = np.asarray(tokens)
    node_argmax = np.asarray(node_argmax)
    ok = np.zeros(tree.size, dtype=bool)
    ok[1:] = node_argmax[b.parent[1:]] == tokens[1:]
    lengths = _prefix_lengths(ok, b.retrieve_indices)
    best = int(np.argmax(lengths))  # first maximum
    accepted = b.retrieve_indices[best, : lengths[best] + 1].copy()
    return Acceptance(accepted, int(node_argmax[accepted[-1]]), best)


def sample_topk(topk_ids: np.ndarray, topk_logprobs: np.ndarray, rng: np.random.Generator) -> int:
    """Sample one token among the k best, with probabilities exp(logprob) renormalised.

    Args:
        topk_ids: int [k] candidate tokens.
        topk_logprobs: float [k] their log-probabilities (at the sampling temperature).
        rng: the generator (reproducible for a fixed seed).
    """
    lp = np.asarray(topk_logprobs, dtype=np.float64)
    p = np.exp(lp - lp.max())
    return int(topk_ids[rng.choice(len(p), p=p / p.sum())])


def accept_typical(
    tree: Tree,
    tokens: np.ndarray,
    token_logprobs: np.ndarray,
    entropy: np.ndarray,
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    config: TypicalConfig,
    rng: np.random.Generator,
) -> Acceptance:
    """Typical acceptance (seeds/001 §2.3.1): lossy, temperature > 0.

    Node x under parent p is accepted when its ancestors are and
    ``P_T(x | p) > min(epsilon, delta * exp(-H(P_T(. | p))))`` with ``P_T`` the softmax at
    ``config.temperature`` and H its entropy in nats (FasterDecoding/Medusa ``utils.py``
    computes H with log(p + 1e-5); the step computes it exactly). The longest accepted
    path wins; ties are broken by the larger summed log-probability of the accepted
    tokens, then by the first row. The bonus token is *sampled* with ``rng`` among the k
    best at the last accepted node (:func:`sample_topk`), so runs are reproducible for a
    fixed seed.

    Args:
        tree: the tree (T nodes).
        tokens: int [T], the token at each node.
        token_logprobs: float [T, T]; ``[i, j]`` = log P_T(tokens[j] | node i) (step output).
        entropy: float [T], entropy of P_T at each node.
        topk_ids, topk_logprobs: [T, k] the k best next tokens at each node and their log P_T.
        config: the thresholds (the step must have been run at ``config.temperature``).
        rng: the generator used for the bonus token.
    """
    b = tree.buffers()
    token_logprobs = np.asarray(token_logprobs, dtype=np.float64)
    threshold = np.minimum(config.posterior_threshold, config.posterior_alpha * np.exp(-np.asarray(entropy, np.float64)))
    ok = np.zeros(tree.size, dtype=bool)
    child_logp = np.zeros(tree.size, dtype=np.float64)
    if tree.size > 1:
        nodes = np.arange(1, tree.size)
        par = b.parent[1:]
        child_logp[1:] = token_logprobs[par, nodes]
        ok[1:] = np.exp(child_logp[1:]) > threshold[par]
    lengths = _prefix_lengths(ok, b.retrieve_indices)
    best_len = lengths.max()
    cand = np.flatnonzero(lengths == best_len)
    if len(cand) > 1 and best_len > 0:
        scores = [child_logp[b.retrieve_indices[r, 1 : best_len + 1]].sum() for r in cand]
        best = int(cand[int(np.argmax(scores))])
    else:
        best = int(cand[0])
    accepted = b.retrieve_indices[best, : best_len + 1].copy()
    last = int(accepted[-1])
    return Acceptance(accepted, sample_topk(topk_ids[last], topk_logprobs[last], rng), best)

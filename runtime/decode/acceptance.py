"""Host-side acceptance of a verified tree: greedy, exact sampling and typical (Medusa paper §2.3.1).

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

Sampling (``acceptance="sample"`` and the bonus token of ``"typical"``) draws tokens by
inverse CDF from the backbone's distribution at each node, truncated the way plain
sampling truncates it (:func:`truncated_probs`), with one uniform per *generated position*
(:class:`PositionUniforms`): see :func:`accept_sample` for why this is exact.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import InvalidSettingError, UnsupportedSamplingError
from ..trees.tree import Tree

#: Largest accepted sampling temperature. The step computes log-softmax(logits / T) in float32, whose
#: spacing near a log-probability of -log(V) (about -7 to -12 for vocabularies of 1e3 to 2e5 tokens, binade
#: [4, 16)) is 2^-21 to 2^-20, about 1e-6 (IEEE 754 binary32: 24-bit significand). A logit gap d becomes a
#: log-probability gap d / T; at T = 1e4 a gap of 0.01 is still 1e-6 apart, while at T ~ 1e6 (issue 27,
#: item 8) every gap below ~1 rounds to a tie and the top-k falls back to the lowest token ids (special
#: tokens). Above 1e4 the distribution is uniform to within float32 anyway, so nothing is lost by refusing it.
MAX_TEMPERATURE = 1e4


@dataclass(frozen=True)
class TypicalConfig:
    """Typical acceptance parameters; the one place their defaults are defined.

    Attributes:
        temperature: softmax temperature (> 0) for the posterior and for sampling the
            bonus token.
        posterior_threshold: epsilon, the hard probability threshold (Medusa paper §2.3.1;
            FasterDecoding/Medusa ``medusa_generate`` default 0.09).
        posterior_alpha: delta, the entropy-dependent threshold factor (Medusa default 0.3);
            the threshold is min(epsilon, delta * exp(-H)).

    Raises:
        InvalidSettingError: a value out of its range (the message names it).
    """

    temperature: float = 0.7
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise InvalidSettingError(f"typical acceptance needs temperature > 0, got {self.temperature}")
        if not 0 < self.posterior_threshold <= 1:
            raise InvalidSettingError(
                f"posterior_threshold (epsilon) must be in (0, 1], got {self.posterior_threshold}")
        if not (self.posterior_alpha > 0 and math.isfinite(self.posterior_alpha)):
            raise InvalidSettingError(f"posterior_alpha (delta) must be > 0, got {self.posterior_alpha}")


#: Wire dtypes a sampling setting may have (numpy / Triton names): how a request's value is parsed.
SETTING_DTYPES = ("float32", "int32", "int64", "string")


def _setting(default, dtype: str, help: str, choices: Callable[[], tuple[str, ...]] | None = None):
    """A :class:`SamplingConfig` field with what every entry point needs to offer it.

    Args:
        default: the setting's default (the one place it is written).
        dtype: its wire dtype, one of :data:`SETTING_DTYPES` (the Triton input's type, the request parser).
        help: the CLI help text; ``{default}`` is replaced by the default.
        choices: the valid values of a string setting, looked up when asked (e.g. the acceptance rules).
    """
    assert dtype in SETTING_DTYPES, dtype
    return dataclasses.field(default=default, metadata={"dtype": dtype, "help": help, "choices": choices})


@dataclass(frozen=True)
class SamplingConfig:
    """How a generation picks its tokens; the one place the defaults of every sampling setting live
    (the CLIs, :class:`~medusa_runtime.front.session.MedusaSession` and the Triton request parser read them here).

    Attributes:
        temperature: 0 = greedy decoding; > 0 = sample from softmax(logits / temperature).
        acceptance: "greedy" (temperature 0), "sample" (exact: the output is distributed as
            plain sampling with the same temperature/top-k/top-p, see :func:`accept_sample`) or
            "typical" (Medusa paper §2.3.1, lossy); None picks greedy at temperature 0 and
            sample above.
        top_k: keep the k most likely tokens (0 = the whole vocabulary). The default, 10, is
            the step graphs' k (manifest ``step_topk``), so the default is exact on every artifact;
            larger values and 0 need the in-graph sampler (docs/sampling.md) unless the step's
            top-k already covers the vocabulary.
        top_p: nucleus sampling inside the top-k, as transformers applies it (1.0 = off).
        posterior_threshold: typical acceptance's epsilon (default: :class:`TypicalConfig`'s).
        posterior_alpha: typical acceptance's delta (default: :class:`TypicalConfig`'s).
        seed: seeds the generation's one random stream (reproducible).

    Every field is a setting of every entry point, declared once here with :func:`_setting`: the
    CLI's ``--name-with-dashes`` option (``add_sampling_args``), the serving request field of the
    same name (``medusa_runtime.front.serving``) and the Triton model's input (``medusa-export triton``)
    are made from :data:`SAMPLING_SETTINGS`, so a setting added here (e.g. a new rule's parameter)
    reaches all of them.

    Raises:
        InvalidSettingError: a value out of its range, or an acceptance rule that contradicts the
            temperature; the message names the setting and the valid range.
    """

    temperature: float = _setting(0.0, "float32", "0 = greedy decoding (lossless); > 0 = sample at this temperature "
                                  "(default: {default:g})")
    acceptance: str | None = _setting(None, "string", "how tree candidates are accepted: greedy (temperature 0), sample "
                                      "(exact: the output is distributed as plain sampling) or typical (Medusa paper "
                                      "§2.3.1, lossy) (default: greedy at --temperature 0, sample above)",
                                      choices=lambda: tuple(ACCEPTANCE_RULES))
    top_k: int = _setting(10, "int32", "sample among the k most likely tokens; 0 = the whole vocabulary, which needs an "
                          "artifact with the in-graph sampler (default: {default}, the step graphs' k: exact everywhere)")
    top_p: float = _setting(1.0, "float32", "nucleus sampling inside the top-k, in (0, 1] (default: {default:g} = off)")
    posterior_threshold: float = _setting(TypicalConfig.posterior_threshold, "float32",
                                          "typical acceptance epsilon, in (0, 1] (default: {default})")
    posterior_alpha: float = _setting(TypicalConfig.posterior_alpha, "float32",
                                      "typical acceptance delta, > 0 (default: {default})")
    seed: int = _setting(0, "int64", "seed of the sampling, >= 0 (reproducible) (default: {default})")

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidSettingError(f"temperature must be a finite number >= 0 (0 = greedy decoding), got {t!r}")
        if t > MAX_TEMPERATURE:
            raise InvalidSettingError(f"temperature must be at most {MAX_TEMPERATURE:g}, got {t:g}: above it float32 "
                                      "log-probabilities round into ties (the top-k becomes the lowest token ids); "
                                      f"give 0 (greedy) up to {MAX_TEMPERATURE:g}")
        if self.acceptance is not None and self.acceptance not in ACCEPTANCE_RULES:
            raise InvalidSettingError(f"unknown acceptance {self.acceptance!r}; choose one of "
                                      f"{', '.join(ACCEPTANCE_RULES)}")
        rule = ACCEPTANCE_RULES.get(self.acceptance)
        if rule is not None and not rule.sampled and t > 0:
            raise InvalidSettingError(f"{self.acceptance} acceptance decodes the argmax: it needs temperature 0, got "
                                      f"{t} (use acceptance 'sample' to sample at this temperature)")
        if rule is not None and rule.sampled and t == 0:
            raise InvalidSettingError(f"{self.acceptance} acceptance needs temperature > 0 (temperature 0 is greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise InvalidSettingError(f"top_k must be an integer >= 0 (0 = the whole vocabulary), got {self.top_k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise InvalidSettingError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise InvalidSettingError(f"seed must be an integer >= 0, got {self.seed!r}")
        TypicalConfig(1.0, self.posterior_threshold, self.posterior_alpha)  # checks epsilon and delta

    @property
    def mode(self) -> str:
        """The acceptance rule in force: the given one, else greedy at temperature 0 and sample above."""
        return self.acceptance or ("greedy" if self.temperature == 0 else "sample")

    @property
    def rule(self) -> "AcceptanceRule":
        """The :class:`AcceptanceRule` of :attr:`mode` (from :data:`ACCEPTANCE_RULES`)."""
        return ACCEPTANCE_RULES[self.mode]

    @property
    def typical(self) -> TypicalConfig:
        """Typical acceptance's parameters at this temperature.

        Raises:
            InvalidSettingError: the temperature is 0.
        """
        return TypicalConfig(self.temperature, self.posterior_threshold, self.posterior_alpha)

    def describe(self) -> str:
        """Short text for logs: "greedy", "sample T=0.7 top-k 10 top-p 0.9 seed 0", ..."""
        if not self.rule.sampled:
            return self.mode
        s = f"{self.mode} T={self.temperature:g} top-k {self.top_k or 'off'}" + (
            f" top-p {self.top_p:g}" if self.top_p < 1 else "")
        if self.rule.describe is not None:
            s += self.rule.describe(self)
        return s + f" seed {self.seed}"


def sampling_config(base: SamplingConfig | None = None, **overrides) -> SamplingConfig:
    """``base`` (default: :class:`SamplingConfig`'s defaults) with the overrides that are not None.

    Raises:
        InvalidSettingError: a resulting value out of its range.
        TypeError: an override that is not a :class:`SamplingConfig` field (None or not; the message
            names the fields).
    """
    names = [f.name for f in dataclasses.fields(SamplingConfig)]
    unknown = [k for k in overrides if k not in names]
    if unknown:
        raise TypeError(f"unexpected keyword argument {', '.join(map(repr, unknown))}: not a sampling setting "
                        f"(SamplingConfig's fields: {', '.join(names)})")
    given = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(base or SamplingConfig(), **given) if given else (base or SamplingConfig())


@dataclass(frozen=True)
class SamplingSetting:
    """One :class:`SamplingConfig` field as the entry points offer it (CLI option, request field, Triton input).

    Attributes:
        name: the field's name (the request field and Triton input; the CLI option is ``--`` + it with dashes).
        dtype: its wire dtype, one of :data:`SETTING_DTYPES`.
        default: :class:`SamplingConfig`'s default.
        help: the CLI help text, the default written in.
    """

    name: str
    dtype: str
    default: object
    help: str
    _choices: Callable[[], tuple[str, ...]] | None = None

    @property
    def option(self) -> str:
        """The CLI option: ``--top-k`` for ``top_k``."""
        return "--" + self.name.replace("_", "-")

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The valid values of a string setting now (e.g. the acceptance rules' names), or None: any value."""
        return self._choices() if self._choices is not None else None


#: Every :class:`SamplingConfig` setting, in its field order: what the CLI, serving and Triton offer.
SAMPLING_SETTINGS: tuple[SamplingSetting, ...] = tuple(
    SamplingSetting(f.name, f.metadata["dtype"], f.default, f.metadata["help"].format(default=f.default),
                    f.metadata["choices"])
    for f in dataclasses.fields(SamplingConfig))


def sampling_route(config: SamplingConfig, *, step_topk: int, vocab_size: int | None, graph_sampler: bool) -> str:
    """Where tokens are drawn: "greedy" (argmax), "host" (from the step's top-k outputs) or "graph".

    The step returns the ``step_topk`` best tokens per position and their log-probabilities at
    the temperature over the whole vocabulary. Renormalising the best ``top_k <= step_topk`` of
    them is exactly transformers' temperature + top-k (and top-p applies inside that top-k, as
    transformers applies it after top-k). Anything wider (``top_k`` 0 or > ``step_topk``) needs
    the whole distribution, which only the in-graph sampler (``sampled_ids``, docs/sampling.md)
    sees, unless the top-k outputs already cover the vocabulary.

    Args:
        config: the settings.
        step_topk: k of the step's ``topk_ids`` / ``topk_logprobs`` outputs.
        vocab_size: the vocabulary size (None: unknown, taken as larger than ``step_topk``).
        graph_sampler: the step graph has the in-graph sampler.

    Raises:
        UnsupportedSamplingError: the settings need the whole distribution and the graph has no
            sampler; the message names the settings that are exact here.
    """
    if not config.rule.sampled:
        return "greedy"
    covers_vocab = vocab_size is not None and step_topk >= vocab_size
    if covers_vocab or 1 <= config.top_k <= step_topk:
        return "host"
    if graph_sampler:
        return "graph"
    asked = "the whole vocabulary (top_k 0)" if config.top_k == 0 else f"top_k {config.top_k}"
    raise UnsupportedSamplingError(
        f"sampling from {asked}{' with top_p ' + format(config.top_p, 'g') if config.top_p < 1 else ''} is not "
        f"exact with this step graph: it returns only its {step_topk} best tokens per position and has no "
        f"in-graph sampler (sampled_ids; docs/sampling.md). Exact here: top_k 1..{step_topk}, with any top_p "
        f"in (0, 1] applied inside it; or temperature 0 (greedy)")


class PositionUniforms:
    """The uniforms of one generation: ``u[n]`` in [0, 1) drives the token at generated position n.

    ``u`` is the stream of one ``numpy.random.Generator`` seeded with the generation's seed
    (PCG64 ``random()``, float64), drawn ahead as positions are asked for; its values do not
    depend on how it is chunked, so the uniform of a position does not depend on the tree.
    """

    def __init__(self, seed: int):
        self._rng = np.random.default_rng(seed)
        self._u = np.empty(0, dtype=np.float64)

    def at(self, positions: np.ndarray) -> np.ndarray:
        """float64 [n] the uniforms of the given generated positions (int, >= 0)."""
        positions = np.asarray(positions, dtype=np.int64)
        need = int(positions.max()) + 1 if positions.size else 0
        if need > len(self._u):
            self._u = np.concatenate([self._u, self._rng.random(max(need - len(self._u), 64))])
        return self._u[positions]


def truncated_probs(sorted_logprobs: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The sampling distribution over a row's best tokens, truncated as plain sampling truncates it.

    transformers' order (``generation/utils.py`` ``_get_logits_processor`` and
    ``generation/logits_process.py``, 4.57): ``TemperatureLogitsWarper`` (the log-probs here
    are already at the temperature), then ``TopKLogitsWarper`` (keep the k best), then
    ``TopPLogitsWarper`` over the softmax of what is left: sorted ascending, a token is removed
    when the cumulative probability up to it is <= 1 - top_p, the most likely token always
    kept. In descending order that keeps token j iff the renormalised mass of the tokens
    before it is < top_p. The result is renormalised. (transformers' top-k also keeps tokens
    tied with the k-th; ties between distinct float logits do not occur in practice.)

    Args:
        sorted_logprobs: float [R, n], each row's log-probabilities in descending order
            (the step's ``topk_logprobs``, or a whole sorted vocabulary); -inf allowed.
        top_k: keep the first ``top_k`` columns (0 or >= n: all n).
        top_p: nucleus mass in (0, 1] (1: off).

    Returns:
        float64 [R, n], each row a probability vector, zero outside the kept set.
    """
    lp = np.asarray(sorted_logprobs, dtype=np.float64)
    n = lp.shape[-1]
    k = n if top_k <= 0 else min(top_k, n)
    p = np.exp(lp[..., :k] - lp[..., :1])
    p /= p.sum(axis=-1, keepdims=True)
    if top_p < 1:
        before = np.cumsum(p, axis=-1) - p
        p = np.where(before < top_p, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    if k < n:
        p = np.concatenate([p, np.zeros(p.shape[:-1] + (n - k,))], axis=-1)
    return p


def inverse_cdf(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Per row, the first column whose cumulative probability exceeds ``u * total``.

    Args:
        probs: float [R, n] non-negative rows (renormalisation not required).
        uniforms: float [R] in [0, 1).

    Returns:
        int64 [R] column indices, always of a column with positive probability.
    """
    c = np.cumsum(np.asarray(probs, dtype=np.float64), axis=-1)
    target = np.asarray(uniforms, dtype=np.float64) * c[:, -1]
    idx = (c <= target[:, None]).sum(axis=-1)
    pos = np.asarray(probs) > 0
    last = pos.shape[-1] - 1 - np.argmax(pos[:, ::-1], axis=-1)  # the last column with positive probability
    return np.minimum(idx, last).astype(np.int64)


def draw_tokens(sorted_ids: np.ndarray, sorted_logprobs: np.ndarray, uniforms: np.ndarray, top_k: int,
                top_p: float) -> np.ndarray:
    """One token per row: inverse CDF over :func:`truncated_probs`, the kept tokens in increasing id order.

    The order fixes which token a given uniform yields. Increasing token id is the order the
    in-graph sampler (docs/sampling.md) can follow over the whole vocabulary without sorting it
    (a cumulative sum in vocabulary order), so the host (from the step's top-k outputs) and the
    graph draw the same token from the same uniform wherever both are exact (up to float
    rounding near a CDF boundary).

    Args:
        sorted_ids: int [R, n] tokens, best first (``topk_ids``).
        sorted_logprobs: float [R, n] their log-probabilities at the temperature.
        uniforms: float [R] in [0, 1).
        top_k, top_p: as :func:`truncated_probs`.

    Returns:
        int64 [R] the drawn tokens.
    """
    ids = np.asarray(sorted_ids)
    probs = truncated_probs(sorted_logprobs, top_k, top_p)
    by_id = np.argsort(ids, axis=-1, kind="stable")
    col = inverse_cdf(np.take_along_axis(probs, by_id, axis=-1), uniforms)
    return np.take_along_axis(np.take_along_axis(ids, by_id, axis=-1), col[:, None], axis=-1)[:, 0].astype(np.int64)


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
    same tokens, since the accepted tokens are the argmax chain itself. (:func:`accept_sample`
    with the argmax as each node's draw accepts the same tokens.)

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


def accept_sample(tree: Tree, tokens: np.ndarray, drawn: np.ndarray) -> Acceptance:
    """Exact sampling acceptance: the output is distributed exactly as plain sampling.

    Walk from the root: at the current node take the token ``drawn`` there (sampled from the
    backbone's distribution at that node, truncated as plain sampling truncates it); if it
    equals one of the node's children's tokens, move to that child and repeat; otherwise it
    is the bonus token and the step ends. The root is sampled too (FasterDecoding/Medusa
    takes the argmax there even at temperature > 0).

    Why the output is distributed as plain sampling. Write q(. | prefix) for the backbone's
    next-token distribution at the temperature, truncated by top-k / top-p
    (:func:`truncated_probs`), and F^-1(u; q) for the inverse-CDF draw (:func:`draw_tokens`; any
    fixed order of the tokens would do, the code uses increasing id).
    The loop draws the token of generated position m with the m-th uniform u_m of the
    generation's stream (:class:`PositionUniforms`), at whichever node and step position m
    falls. Claim: every emitted token is x_m = F^-1(u_m; q(. | x_<m)), which is exactly
    plain sampling (the uniforms are i.i.d. on [0, 1) and x_<m depends on u_0 .. u_m-1 only).

    Proof, by induction over the walk within a step. Let the root hold x_n (chosen at the
    previous step). The tree's tokens are a deterministic function of x_1 .. x_n (the heads'
    top-k at the last accepted hidden state, gathered by the tree), so conditioning on them
    conditions on nothing beyond the prefix. The step computes, at each node v, the causal
    model's distribution on the prefix x_1 .. x_n, path(v): the tree mask lets v attend to
    the past, its ancestors and itself only, with position ids n + depth. At depth d the walk
    stands on the node whose path is the d tokens already emitted in this step (true for the
    root; if the draw there equals a child's token, that child's path is the true prefix
    one token longer). So the draw at the current node, with the uniform of its position
    n + 1 + d, is F^-1(u_{n+1+d}; q(. | true prefix)); when no child carries it, it is emitted
    as the bonus token and the next step's root. Draws at nodes the walk does not visit are
    discarded: they influence nothing emitted (a later step may use the same position's
    uniform again, for the one token it emits there). Hence the claim.

    Consequently Medusa sampling and plain sampling with the same seed (the root-only tree)
    produce the same tokens, not only the same distribution; the tests check this token for
    token, besides the distribution itself. The one caveat is floating point: a tree step's
    logits differ from a one-token step's by ~1e-6, which moves a token only when a uniform
    falls that close to a CDF boundary.

    Args:
        tree: the tree (T nodes).
        tokens: int [T], the token at each node.
        drawn: int [T], the token drawn at each node (:func:`draw_tokens` on the step's
            top-k outputs, or the in-graph sampler's ``sampled_ids``), node v with the
            uniform of its generated position.

    Returns:
        The :class:`Acceptance`: the walked path (root first), the draw at its last node as
        ``next_token``, and the first ``retrieve_indices`` row of that length that contains it.
    """
    # The walk is greedy acceptance's rule with each node's draw in place of its argmax: a child is taken when
    # its token equals its parent's draw, and the longest such path wins (siblings carry distinct tokens, a
    # head's top-k; were two equal, both would continue the same prefix with the same uniforms).
    return accept_greedy(tree, tokens, drawn)


def accept_typical(
    tree: Tree,
    tokens: np.ndarray,
    token_logprobs: np.ndarray,
    entropy: np.ndarray,
    config: TypicalConfig,
    drawn: np.ndarray,
) -> Acceptance:
    """Typical acceptance (Medusa paper §2.3.1): lossy, temperature > 0.

    Node x under parent p is accepted when its ancestors are and
    ``P_T(x | p) > min(epsilon, delta * exp(-H(P_T(. | p))))`` with ``P_T`` the softmax at
    ``config.temperature`` and H its entropy in nats (FasterDecoding/Medusa ``utils.py``
    computes H with log(p + 1e-5); the step computes it exactly). The longest accepted
    path wins; ties are broken by the larger summed log-probability of the accepted
    tokens, then by the first row. The bonus token is the token ``drawn`` at the last
    accepted node (sampled there as :func:`accept_sample` samples, so runs are reproducible
    for a fixed seed).

    Args:
        tree: the tree (T nodes).
        tokens: int [T], the token at each node.
        token_logprobs: float [T, T]; ``[i, j]`` = log P_T(tokens[j] | node i) (step output).
        entropy: float [T], entropy of P_T at each node.
        config: the thresholds (the step must have been run at ``config.temperature``).
        drawn: int [T], a token sampled at each node (see :func:`accept_sample`).
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
    return Acceptance(accepted, int(np.asarray(drawn)[accepted[-1]]), best)


# ---------------------------------------------------------------------------
# The rules, as data
# ---------------------------------------------------------------------------


def _greedy(tree: Tree, tokens: np.ndarray, drawn: np.ndarray, step, params: None) -> Acceptance:
    return accept_greedy(tree, tokens, drawn)


def _sample(tree: Tree, tokens: np.ndarray, drawn: np.ndarray, step, params: None) -> Acceptance:
    return accept_sample(tree, tokens, drawn)


def _typical(tree: Tree, tokens: np.ndarray, drawn: np.ndarray, step, params: TypicalConfig) -> Acceptance:
    return accept_typical(tree, tokens, step.token_logprobs, step.entropy, params, drawn)


@dataclass(frozen=True)
class AcceptanceRule:
    """One acceptance rule: how the decode loop accepts a verified tree step.

    Attributes:
        accept: ``(tree, tokens int [T], drawn int [T], step, params) -> Acceptance``; ``drawn`` holds the
            token drawn at each node (the argmax when not :attr:`sampled`), ``step`` the engine's
            :class:`~medusa_runtime.engines.base.StepResult` (read only the fields in :attr:`needs`).
        params: builds the rule's parameter dataclass from a :class:`SamplingConfig` (None: no parameters).
        needs: the step outputs it reads besides the draws (StepResult field names).
        sampled: True when the rule samples (temperature > 0, tokens drawn by inverse CDF); False when it
            runs at temperature 0 on the argmax.
        describe: the rule's own parameters for :meth:`SamplingConfig.describe` (e.g. " epsilon 0.09
            delta 0.3"), written after the sampling settings; None: none.
    """

    accept: Callable[..., Acceptance]
    params: Callable[[SamplingConfig], object] | None = None
    needs: tuple[str, ...] = ()
    sampled: bool = True
    describe: Callable[[SamplingConfig], str] | None = None


#: Acceptance rules by name (``--acceptance``, ``SamplingConfig.acceptance``): adding a rule is one entry here.
ACCEPTANCE_RULES: dict[str, AcceptanceRule] = {
    "greedy": AcceptanceRule(_greedy, sampled=False),
    "sample": AcceptanceRule(_sample),
    "typical": AcceptanceRule(_typical, params=lambda cfg: cfg.typical, needs=("token_logprobs", "entropy"),
                              describe=lambda cfg: f" epsilon {cfg.posterior_threshold:g} delta {cfg.posterior_alpha:g}"),
}
#: Their names, in table order.
ACCEPTANCES = tuple(ACCEPTANCE_RULES)

"""The in-graph sampler of the step graphs (docs/sampling.md, step contract ``step_sampler`` version 1).

Whole-vocabulary sampling without returning [S, V] logits: the step draws the token itself from
its own next-token probabilities. :func:`write_sampler` adds the nodes to a step graph being
written; it reads the step's probabilities (the ``Exp`` of its log-softmax, which the entropy output
computes anyway) and the three sampler inputs, and writes ``sampled_ids``:

    sample_uniforms float32 [1, S]   row i's uniform in [0, 1); < 0: row i is not sampled
    sample_top_k    int64   [1]      -1 = sampler off; 0 = the whole vocabulary; k > 0 = top-k
    sample_top_p    float32 [1]      (0, 1]; 1 = off
    sampled_ids     int64   [1, S]   row i's token; -1 where the sampler is off or the row not sampled

Structure (every shape written for rows = B * S, so a leading batch axis changes nothing here):

* ``If(sample_top_k >= 0)``: ONNX Runtime runs every node of a graph whatever outputs are fetched,
  so the sampler is a branch; an off step pays one comparison and a ``ConstantOfShape``.
* Only the rows whose uniform is >= 0 are gathered (``NonZero``; a prefill samples its last row).
* The kept set K = {t : p_t >= tau} of the contract (transformers' top-k, then top-p inside it),
  without sorting the vocabulary, by the cheapest exact route for the step's setting (nested Ifs):

  - top_k <= C = 256 (top-p inside it or not), and whole-vocabulary top-p when every sampled row's
    nucleus closes within C tokens: a sorted prefix, ``TopK`` with the build-time K = C on the row
    padded with C zeros (TensorRT's parser needs a constant K < 3840); tau_k = its k-th value,
    tau_p = the smallest value with cumsum(q) - q < top_p (the contract's arithmetic);
  - wider top-k, wider nuclei: tau is the *largest float32 threshold t for which a monotone sum
    over {p >= t} still reaches a target* (:func:`_largest_threshold`):

      tau_k = max{t : #{j : p_j >= t} >= k}                       (the k-th largest p, ties kept)
      tau_p = max{t : sum_{p_j >= t} p_j >= top_p * S_top}         (S_top: the mass of the k largest)

    tau_p is the contract's "smallest nucleus value": sorted descending, position i is in the
    nucleus iff the mass before it is < top_p * S_top, i.e. the nucleus ends at the first position
    whose inclusive cumulative mass reaches top_p * S_top, whose value is the largest t above.
    The threshold is found bit by bit over the float32 bit patterns of [0, 2) (7 exponent bits,
    then 23 mantissa bits: 30 passes of a compare and a sum), each candidate an exact float, so
    tau_k is exactly the k-th largest p; tau_p is the contract's up to float32 rounding of the
    sums (a row whose nucleus mass lies within ~1e-6 of top_p's boundary may keep one token more
    or less), the same order as the step's logits differ between a tree step and a one-token step;
  - whole vocabulary without top-p: tau = 0.
* The draw is the contract's: the first kept id, in increasing id order, whose cumulative kept
  mass exceeds u * (the kept mass), clamped to the largest kept id (one ``CumSum`` over the vocabulary).

Masks are products with a 0/1 float rather than ``Where`` (ONNX Runtime's ``Where`` dominated the
profile). A ``TopK`` with K = ``sample_top_k`` (the first reference, grafted onto built graphs by a
test helper) would need a run-time K up to V, which TensorRT's parser refuses, and a full sort of
the vocabulary for whole-vocabulary top-p (8.5 ms per row on ONNX Runtime's CPU). Cost:
docs/sampling.md. Standard opset-18 ops only, all in TensorRT 10's parser table.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from .graph import GraphBuilder

_F32 = np.float32
#: Exponent bits searched: float32 exponents 0..127 cover [0, 2), probabilities are <= 1.
_EXPONENT_BITS = 7
_MANTISSA_BITS = 23
#: The smallest positive float32 (a subnormal): the mantissa step of exponent 0.
_TINY = _F32(2.0 ** -149)
_MINUS_ONE = helper.make_tensor("value", TensorProto.INT64, [1], [-1])
#: Width of the sorted prefix (a TopK with this build-time K; TensorRT's parser needs K < 3840) from which
#: top-k <= C, top-p inside it, and whole-vocabulary top-p whose nucleus closes inside it are read directly.
_PREFIX = 256


def _largest_threshold(b: GraphBuilder, p: str, weight: str | None, target: str, name: str) -> str:
    """The largest float32 t >= 0 with ``sum_j weight_j * [p_j >= t] >= target``, per row.

    The sum is non-increasing in t and reaches the target at t = 0 (the caller's guarantee), so
    the answer is found bit by bit over the float32 bit patterns of [0, 2) (non-negative floats
    are ordered as their bit patterns): each candidate sets the next bit when the sum at the
    candidate still reaches the target. Candidates are computed exactly: while the exponent
    bits are searched they are powers of two (2^(e - 127)); then the mantissa step is
    ulp = 2^(e - 150) (2^-149 when e = 0) and a candidate is x + 2^b * ulp, a representable float.
    The result is therefore one of the ``p_j`` whenever the target is crossed at a value of p.

    Args:
        b: the builder (nodes go to its current branch).
        p: float32 [R, V] probabilities.
        weight: float32 [R, V] weights of the sum (the probabilities themselves), or None to count.
        target: float32 [R, 1] or [1].
        name: node name prefix.

    Returns:
        float32 [R, 1] the threshold.
    """
    x = b.const(np.zeros((1, 1), _F32))  # the answer so far (broadcasts to [R, 1] after the first bit)
    zero = b.const(_F32(0.0))
    axes = b.const([-1], "int64")

    def reaches(t: str, n: str) -> str:
        kept = b.cast(b.op("GreaterOrEqual", [p, t], f"{n}/kept"), "float32", f"{n}/kept_f")  # [R, V] 0 / 1
        w = kept if weight is None else b.op("Mul", [kept, weight], f"{n}/mass")  # Mul: ONNX Runtime's Where is slower
        return b.op("GreaterOrEqual", [b.op("ReduceSum", [w, axes], f"{n}/sum", keepdims=1), target], f"{n}/reaches")

    for i in range(_EXPONENT_BITS):  # candidate exponent e + 2^bit: 2^(e - 127) * 2^(2^bit), or 2^(2^bit - 127) from 0
        bit, n = _EXPONENT_BITS - 1 - i, f"{name}/e{_EXPONENT_BITS - 1 - i}"
        first = b.const(np.full((1, 1), 2.0 ** (2 ** bit - 127), _F32))
        if i == 0:
            cand = first
        else:
            scaled = b.op("Mul", [x, b.const(_F32(2.0 ** (2 ** bit)))], f"{n}/scaled")
            cand = b.op("Where", [b.op("Greater", [x, zero], f"{n}/set"), scaled, first], f"{n}/cand")
        x = b.op("Where", [reaches(cand, n), cand, x], f"{n}/x")
    ulp = b.op("Where", [b.op("Greater", [x, zero], f"{name}/normal"),
                         b.op("Mul", [x, b.const(_F32(2.0 ** -_MANTISSA_BITS))], f"{name}/ulp_normal"),
                         b.const(_TINY)], f"{name}/ulp")
    for bit in range(_MANTISSA_BITS - 1, -1, -1):
        n = f"{name}/m{bit}"
        cand = b.op("Add", [x, b.op("Mul", [ulp, b.const(_F32(2.0 ** bit))], f"{n}/step")], f"{n}/cand")
        x = b.op("Where", [reaches(cand, n), cand, x], f"{n}/x")
    return x


def _zeros_like_rows(b: GraphBuilder, rows: str, name: str) -> str:
    """float32 zeros shaped like ``rows`` (a [R, 1] tensor)."""
    return b.op("ConstantOfShape", [b.op("Shape", [rows], f"{name}/shape")], name,
                value=helper.make_tensor("value", TensorProto.FLOAT, [1], [0.0]))


def _prefix(b: GraphBuilder, p: str, name: str) -> str:
    """float32 [R, C] the C = :data:`_PREFIX` largest probabilities of each row, descending (a build-time TopK K;
    the row is padded with C zeros first, so a vocabulary smaller than C works and its padding is never above a p)."""
    pad = b.op("ConstantOfShape", [b.op("Concat", [b.op("Shape", [p], f"{name}/rows", end=1), b.const([_PREFIX], "int64")],
                                        f"{name}/pad_shape", axis=0)], f"{name}/pad",
               value=helper.make_tensor("value", TensorProto.FLOAT, [1], [0.0]))
    padded = b.op("Concat", [p, pad], f"{name}/padded", axis=-1)  # [R, V + C]
    return b.op("TopK", [padded, b.const([_PREFIX], "int64")], f"{name}/topk", n_out=2, axis=-1, largest=1,
                sorted=1)[0]


def _nucleus_floor(b: GraphBuilder, top: str, mass: str, in_top: str | None, name: str) -> str:
    """[R, 1] the smallest value of ``top`` [R, C] (descending) in the nucleus: position i is in it when
    ``cumsum(q) - q < top_p`` with q = top / ``mass`` (transformers' ``TopPLogitsWarper`` on sorted values),
    restricted to ``in_top`` ([C] bool) when given."""
    q = b.op("Div", [top, mass], f"{name}/q")
    before = b.op("Sub", [b.op("CumSum", [q, b.const(np.int64(-1))], f"{name}/q_cum"), q], f"{name}/before")
    keep = b.op("Less", [before, "sample_top_p"], f"{name}/in_nucleus")
    if in_top is not None:
        keep = b.op("And", [keep, in_top], f"{name}/in_top_k")
    return b.op("ReduceMin", [b.op("Where", [keep, top, b.const(_F32(np.inf))], f"{name}/nucleus"),
                              b.const([-1], "int64")], f"{name}/floor", keepdims=1)


def _prefix_top_k(b: GraphBuilder, p: str, k: str, p_given: str, name: str) -> str:
    """tau for 1 <= top_k <= C from the sorted prefix: the k-th value, or with top-p the nucleus floor inside it."""
    top = _prefix(b, p, name)
    tau_k = b.op("Gather", [top, b.op("Sub", [k, b.const([1], "int64")], f"{name}/k_minus_1")], f"{name}/kth",
                 axis=1)  # [R, 1]
    positions = b.op("Range", [b.const(np.int64(0)), b.const(np.int64(_PREFIX)), b.const(np.int64(1))],
                     f"{name}/positions")  # [C] (made, not stored: inline constants stay a few bytes)
    in_top = b.op("Less", [positions, k], f"{name}/in_top")  # [C]

    def nucleus() -> str:
        top_k = b.op("Where", [in_top, top, b.const(_F32(0.0))], f"{name}/top_k")
        mass = b.op("ReduceSum", [top_k, b.const([-1], "int64")], f"{name}/mass", keepdims=1)
        return _nucleus_floor(b, top_k, mass, in_top, f"{name}/p")

    return b.if_(p_given, f"{name}/tau", nucleus, lambda: b.op("Identity", [tau_k], f"{name}/tau_k"), "float32",
                 rank=2)


def _searched(b: GraphBuilder, p: str, k: str, k_given: str, p_given: str, rows: str, name: str) -> str:
    """tau by :func:`_largest_threshold`: tau_k (top-k; 0 without), then tau_p inside the top-k (with top-p)."""
    tau_k = b.if_(k_given, f"{name}/tau_k",
                  lambda: _largest_threshold(b, p, None, b.cast(k, "float32", f"{name}/k/k_f"), f"{name}/k"),
                  lambda: _zeros_like_rows(b, rows, f"{name}/no_k"), "float32", rank=2)
    # k_f cast inside the branches (outside, ONNX Runtime warns at load that it cannot rename it in subgraphs)
    return b.if_(p_given, f"{name}/tau",
                 lambda: _searched_top_p(b, p, tau_k, b.cast(k, "float32", f"{name}/p/k_f"), f"{name}/p"),
                 lambda: b.op("Identity", [tau_k], f"{name}/tau_k_only"), "float32", rank=2)


def _searched_top_p(b: GraphBuilder, p: str, tau_k: str, k_f: str, name: str) -> str:
    """tau_p >= tau_k: the smallest probability top-p keeps inside the top-k, by :func:`_largest_threshold`."""
    above = b.op("Greater", [p, tau_k], f"{name}/above")  # [R, V]: in the top-k for sure (ties at tau_k aside)
    axes = b.const([-1], "int64")
    above_f = b.cast(above, "float32", f"{name}/above_f")
    count = b.op("ReduceSum", [above_f, axes], f"{name}/count", keepdims=1)
    mass = b.op("ReduceSum", [b.op("Mul", [above_f, p], f"{name}/above_p"), axes], f"{name}/mass", keepdims=1)
    ties = b.op("Mul", [b.op("Sub", [k_f, count], f"{name}/ties"), tau_k], f"{name}/ties_mass")  # k - count values = tau_k
    top_mass = b.op("Add", [mass, ties], f"{name}/top_mass")  # S_top: the mass of exactly k values
    target = b.op("Mul", [top_mass, "sample_top_p"], f"{name}/target")
    return _largest_threshold(b, p, p, target, name)


def _vocabulary_prefix(b: GraphBuilder, p: str, name: str) -> str:
    """tau for top_k 0 with top_p < 1 from the sorted prefix: per row the nucleus floor where the row's nucleus
    closes inside it (its C values hold at least top_p of the mass), -1 (search) where it does not."""
    top = _prefix(b, p, name)
    axes = b.const([-1], "int64")
    mass = b.op("ReduceSum", [p, axes], f"{name}/mass", keepdims=1)  # [R, 1]
    covered = b.op("Div", [b.op("ReduceSum", [top, axes], f"{name}/prefix_mass", keepdims=1), mass], f"{name}/covered")
    closes = b.op("GreaterOrEqual", [covered, "sample_top_p"], f"{name}/closes")
    return b.op("Where", [closes, _nucleus_floor(b, top, mass, None, f"{name}/prefix"), b.const(_F32(-1.0))],
                f"{name}/tau")


def _sample_rows(b: GraphBuilder, probs: str) -> str:
    """The then-branch: ``sampled_ids`` flattened to [N] (N = every row of the step), int64, -1 where not sampled."""
    n = "sampler"
    flat = b.const([-1], "int64")
    u_all = b.op("Reshape", ["sample_uniforms", flat], f"{n}/u_all")  # [N]
    wanted = b.cast(b.op("GreaterOrEqual", [u_all, b.const(_F32(0.0))], f"{n}/wanted"), "float32",
                    f"{n}/wanted_f")  # TensorRT's NonZero takes FP32 / FP16 only
    sel = b.op("Reshape", [b.op("NonZero", [wanted], f"{n}/nonzero"), flat], f"{n}/rows")  # [R]
    p = b.op("Gather", [probs, sel], f"{n}/p", axis=0)  # [R, V]
    u = b.op("Unsqueeze", [b.op("Gather", [u_all, sel], f"{n}/u_rows", axis=0), b.const([1], "int64")], f"{n}/u")
    vocab_i = b.op("Shape", [probs], f"{n}/vocab", start=-1)  # [1]: V
    zero_i = b.const([0], "int64")
    k_given = b.op("Greater", ["sample_top_k", zero_i], f"{n}/k_given")  # [1]
    p_given = b.op("Less", ["sample_top_p", b.const([1.0], "float32")], f"{n}/p_given")  # [1]
    k = b.op("Where", [k_given, b.op("Min", ["sample_top_k", vocab_i], f"{n}/k_capped"), vocab_i], f"{n}/k")

    # tau from the sorted prefix where it holds the answer; -1: searched; 0: the whole vocabulary is kept
    small_k = b.op("And", [k_given, b.op("LessOrEqual", [k, b.const([_PREFIX], "int64")], f"{n}/k_small")],
                   f"{n}/small_k")
    vocab_p = b.op("And", [b.op("Equal", ["sample_top_k", zero_i], f"{n}/whole"), p_given], f"{n}/vocab_p")
    fixed = b.op("Where", [k_given, b.const([-1.0], "float32"), b.const([0.0], "float32")], f"{n}/fixed")  # [1]
    tau0 = b.if_(small_k, f"{n}/tau0", lambda: _prefix_top_k(b, p, k, p_given, f"{n}/prefix_top_k"),
                 lambda: b.if_(vocab_p, f"{n}/tau0/vocab", lambda: _vocabulary_prefix(b, p, f"{n}/vocab_top_p"),
                               lambda: b.op("Add", [_zeros_like_rows(b, u, f"{n}/tau0/rows"), fixed], f"{n}/tau0/fixed"),
                               "float32", rank=2),
                 "float32", rank=2)  # [R, 1]
    lowest = b.op("ReduceMin", [b.op("Concat", [b.op("Reshape", [tau0, flat], f"{n}/tau0_flat"),
                                                b.const([0.0], "float32")], f"{n}/tau0_or_0", axis=0)],
                  f"{n}/lowest", keepdims=0)  # a scalar, 0 when no row is sampled
    search = b.op("Less", [lowest, b.const(_F32(0.0))], f"{n}/search")
    tau = b.if_(search, f"{n}/tau", lambda: _searched(b, p, k, k_given, p_given, u, f"{n}/search"),
                lambda: b.op("Identity", [tau0], f"{n}/tau/prefix"), "float32", rank=2)

    # the draw: inverse CDF over the kept set in increasing id order (the contract's rule)
    kept = b.cast(b.op("GreaterOrEqual", [p, tau], f"{n}/kept"), "float32", f"{n}/kept_f")  # [R, V] 0 / 1
    cdf = b.op("CumSum", [b.op("Mul", [kept, p], f"{n}/p_kept"), b.const(np.int64(-1))], f"{n}/cdf")
    total = b.op("Slice", [cdf, b.const([-1], "int64"), b.const([np.iinfo(np.int64).max], "int64"),
                           b.const([-1], "int64")], f"{n}/total")  # [R, 1]: the kept mass
    below = b.op("LessOrEqual", [cdf, b.op("Mul", [u, total], f"{n}/target")], f"{n}/below")
    count = b.op("ReduceSum", [b.cast(below, "float32", f"{n}/below_f"), b.const([-1], "int64")], f"{n}/count",
                 keepdims=1)  # exact: counts < 2^24
    ids = b.op("Range", [b.const(_F32(0.0)), b.cast(b.op("Squeeze", [vocab_i, zero_i], f"{n}/vocab_scalar"), "float32",
                                                     f"{n}/vocab_f"), b.const(_F32(1.0))], f"{n}/ids")  # [V], exact < 2^24
    last = b.op("ReduceMax", [b.op("Mul", [kept, ids], f"{n}/kept_ids"), b.const([-1], "int64")], f"{n}/last_kept",
                keepdims=1)  # [R, 1]: the largest kept id (K is never empty)
    token = b.cast(b.op("Min", [count, last], f"{n}/token_f"), "int64", f"{n}/token")
    none = b.op("ConstantOfShape", [b.op("Shape", [u_all], f"{n}/n")], f"{n}/none",
                value=_MINUS_ONE)
    return b.op("ScatterElements", [none, sel, b.op("Reshape", [token, flat], f"{n}/tokens")], f"{n}/ids_flat", axis=0)


def write_sampler(b: GraphBuilder, probs: str) -> str:
    """Add the in-graph sampler to a step graph: ``sampled_ids`` from the step's probabilities.

    Args:
        b: the step's builder.
        probs: float32 [N, V] the step's next-token probabilities at ``temperature``, one row
            per new token in the order of ``sample_uniforms`` (the ``Exp`` of its log-softmax).

    Returns:
        "sampled_ids" (int64, the shape of ``sample_uniforms``).
    """
    on = b.op("GreaterOrEqual", ["sample_top_k", b.const([0], "int64")], "sampler/on")

    def off() -> str:
        return b.op("ConstantOfShape", [b.op("Shape", ["sample_uniforms"], "sampler/off/shape", start=0)],
                    "sampler/off", value=_MINUS_ONE)

    ids = b.if_(on, "sampler/if", lambda: _sample_rows(b, probs),
                lambda: b.op("Reshape", [off(), b.const([-1], "int64")], "sampler/off/flat"), "int64", rank=1)
    return b.op("Reshape", [ids, b.op("Shape", ["sample_uniforms"], "sampler/shape")], "sampler/out",
                outputs=["sampled_ids"])

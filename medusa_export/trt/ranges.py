"""Calibration for quantized typed graphs (int8 / fp8 W8A8, int4 activation-aware scales), streamed one decoder layer
at a time from the artifact's weights (or the checkpoint's).

What is collected, at the input ``x`` of every weight product (MatMul / Gemm on an initializer) of the artifact's
step and heads graphs, over every token of every calibration prompt (a prefill of the prompt, chat template applied):

* ``amax``: max |x| over the tensor (float): the per-tensor activation scale of W8A8 is ``amax / qmax``
  (TensorRT's "max" calibration; NVIDIA, *Working with Quantized Types*, explicit quantization);
* ``channel_max``: float [K], max |x| per input channel: SmoothQuant's migration strength (Xiao et al., *SmoothQuant*,
  ICML 2023, §4: ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``);
* ``mean_abs``: float32 [K], mean |x| per input channel: AWQ's activation salience (Lin et al., *AWQ*, MLSys 2024,
  §3.2: ``s = mean|x|^alpha``);
* ``gram``: float32 [K / B, B, B], the block diagonal of ``X^T X / N`` in the int4 blocks B of the product's K
  (:data:`~.typed.INT4_BLOCKS`): with it the output error of a quantized block, ``||X_b (W_b - Q(W_b))||^2 / N``,
  is ``dW_b^T G_b dW_b`` for each output column; the clip search of AWQ (its ``auto_clip``, §3.3 "we further apply
  weight clipping ... minimizing the MSE of the output") evaluates exactly this per block, so the search needs no
  activations kept.

How (the export's streaming, :mod:`medusa_export.export.writer`): the prompts' token rows are embedded (one read of
the embedding table), then for each decoder layer its tensors are read one at a time (from the artifact's own
``weights.bin`` by default, :func:`artifact_sources`, so the engine machine needs no checkpoint; or from the checkpoint's
:class:`~medusa_export.loading.checkpoint.TensorSource`), made a :class:`~medusa_export.model.backbone.Block` in
float32 (the PyTorch reference's own layer, the one validation checks against transformers), run on every prompt's
hidden states (a causal prefill, empty past) with forward pre-hooks on its four product inputs (q/k/v share one,
gate/up one, o, down), and freed; the final norm gives the lm_head's input and the heads' residual blocks (Medusa
§2.1.1) theirs. Peak memory: one layer in float32 plus the prompts' hidden states (tokens x d x 4 bytes) plus the
statistics (~12 MB a layer at 7B), never the model.

The statistics are keyed, per graph, by the ONNX weight initializer the product reads (``layers.0.attn.q_proj.weight``,
``0.0.linear.weight``, the tied table ``model.embed_tokens.weight`` of the lm_head / heads projection), found through
the manifest's weight records (each initializer's checkpoint key): the mapping checks that every product of every graph
got a statistic.

What the prompts reach: a prefill covers every product; the tree steps and one-token decodes of generation run the
same products on further tokens of the same distribution (their ranges are not covered exactly: a token later in a
reply may exceed them; W8A8's quantize then saturates at qmax, which TensorRT's Q does too).
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch

from ..errors import MedusaError
from ..loading.checkpoint import backbone_shapes
from ..model.backbone import Block, RMSNorm, window_biases
from ..model.config import rope_cos_sin

#: Calibration method names (the manifest's ``calibration.method``).
METHOD = "streamed: max |x|, mean |x| per input channel and the int4-block Gram of every weight product's input, " \
         "over a causal prefill of each calibration prompt, the weights read one decoder layer at a time (float32)"
#: The least calibration tokens (all prompts together) the statistics are computed from: below it the per-channel
#: means and the block Grams of a 4096-wide product are estimated from fewer rows than a block has columns.
MIN_TOKENS = 32


class CalibrationError(MedusaError):
    """Calibration cannot run: no prompts, too few tokens, a product the prompts do not reach, a head type the
    streamed pass does not compute (the message names the fix)."""


@dataclass
class ProductStats:
    """Statistics of one product input (shared by the products that read the same tensor: q/k/v, gate/up).

    Attributes:
        amax: max |x| over every element seen (float, >= 0).
        abs_sum: float64 [K], the sum of |x| per input channel.
        channel_max: float64 [K], max |x| per input channel (SmoothQuant's ``max(|X_j|)``).
        gram: float64 [K / B, B, B] block diagonal of sum x^T x (None where no int4 block divides K).
        block: B of ``gram`` (0 when None).
        tokens: rows seen (N).
    """

    amax: float = 0.0
    abs_sum: np.ndarray | None = None
    channel_max: np.ndarray | None = None
    gram: np.ndarray | None = None
    block: int = 0
    tokens: int = 0

    def add(self, x: torch.Tensor) -> None:
        """Accumulate rows ``x`` (float32 [..., K])."""
        x = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        k = x.shape[1]
        if self.abs_sum is None:
            from .typed import INT4_BLOCKS

            self.abs_sum = np.zeros(k)
            self.channel_max = np.zeros(k)
            self.block = next((b for b in INT4_BLOCKS if k % b == 0), 0)
            if self.block:
                self.gram = np.zeros((k // self.block, self.block, self.block))
        self.amax = max(self.amax, float(x.abs().max()))
        self.abs_sum += x.abs().sum(0).numpy()
        self.channel_max = np.maximum(self.channel_max, x.abs().amax(0).numpy())
        if self.block:
            xb = x.reshape(x.shape[0], k // self.block, self.block)  # [N, K/B, B]
            self.gram += torch.einsum("njb,njc->jbc", xb, xb).numpy()
        self.tokens += x.shape[0]

    @property
    def mean_abs(self) -> np.ndarray:
        """float32 [K]: mean |x| per input channel."""
        return (self.abs_sum / max(self.tokens, 1)).astype(np.float32)

    @property
    def gram_mean(self) -> np.ndarray | None:
        """float64 [K / B, B, B]: the block diagonal of X^T X / N."""
        return None if self.gram is None else self.gram / max(self.tokens, 1)


@dataclass
class Calibration:
    """Per graph (``model``, ``heads``), the statistics of each product by its ONNX weight initializer name.

    Attributes:
        stats: {graph: {weight initializer: ProductStats}}.
        record: method, prompts, their SHA-256, token counts, seconds (the manifest's ``calibration``).
    """

    stats: dict[str, dict[str, ProductStats]] = field(default_factory=dict)
    record: dict = field(default_factory=dict)

    def amax(self) -> dict[str, dict[str, float]]:
        """{graph: {weight initializer: max |x| of its input}}: what W8A8's per-tensor activation scales need."""
        return {g: {w: s.amax for w, s in by.items()} for g, by in self.stats.items()}


# -- the streamed forward ------------------------------------------------------------------------------------------

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight$")
#: The product inputs of a decoder layer: which linear's input each site is, and the linears that read it.
_SITES = {"attn_in": ("self_attn.q_proj", ("q_proj", "k_proj", "v_proj")), "o_in": ("self_attn.o_proj", ("o_proj",)),
          "mlp_in": ("mlp.gate_proj", ("gate_proj", "up_proj")), "down_in": ("mlp.down_proj", ("down_proj",))}
_SITE_OF = {lin: site for site, (_, lins) in _SITES.items() for lin in lins}


def site_of(graph: str, source: str, key: str, lm_head: str, num_layers: int) -> tuple | None:
    """Which activation a product reads, from its weight's checkpoint key (the manifest's weight recipe).

    Returns:
        ("layer", i, site) for a decoder layer's linear, ("final",) for the step graph's vocabulary projection,
        ("head", h, l) for block l of head h, ("head_out", h) for head h's own projection, ("heads_out",) for the
        shared projection of the stacked heads, None for a key this calibration does not know.
    """
    if source == "backbone":
        m = _LAYER.match(key)
        if m and int(m.group(1)) < num_layers and m.group(3) in _SITE_OF:
            return ("layer", int(m.group(1)), _SITE_OF[m.group(3)])
        if key == lm_head:
            return ("final",) if graph == "model" else ("heads_out",)
        return None
    parts = key.split(".")
    if source == "heads" and len(parts) == 4 and parts[2] == "linear" and parts[3] == "weight":
        return ("head", int(parts[0]), int(parts[1]))
    if source == "heads" and len(parts) == 3 and parts[2] == "weight":
        return ("head_out", int(parts[0]))
    return None


def _layer_block(sources, cfg, i: int) -> Block:
    """Decoder layer ``i`` in float32, its tensors read from the checkpoint one at a time (strict: every key)."""
    prefix = f"model.layers.{i}."
    state = {k.removeprefix(prefix): sources.backbone.read(k).to(torch.float32)
             for k in backbone_shapes(cfg) if k.startswith(prefix)}
    with torch.device("meta"):
        block = Block(cfg)
    block.load_state_dict(state, strict=True, assign=True)
    return block.eval()


@torch.no_grad()
def streamed_statistics(sources, prompts: list[list[int]], *, progress: bool = False) -> dict[tuple, ProductStats]:
    """Run the calibration prompts through the model one decoder layer at a time (module docstring).

    Args:
        sources: :class:`~medusa_export.loading.sources.ModelSources` (backbone and Medusa heads, read lazily).
        prompts: token ids of each prompt (int, >= 1 each), each run as its own causal prefill.
        progress: print a line per 8 layers.

    Returns:
        {site (as :func:`site_of`): ProductStats} for every product input of the model.

    Raises:
        CalibrationError: an empty prompt, or path-conditioned (hydra) heads, whose inputs this pass does not compute.
    """
    cfg, hc = sources.config, sources.heads_config
    if hc.head_type != "medusa":
        raise CalibrationError(f"the streamed calibration computes Medusa heads only (these are {hc.head_type!r}): "
                               f"build --precision fp16 engines for them")
    if any(len(p) == 0 for p in prompts):
        raise CalibrationError("a calibration prompt has no token: give non-empty prompts (--prompt-file)")
    stats: dict[tuple, ProductStats] = {}

    def stat(site: tuple) -> ProductStats:
        return stats.setdefault(site, ProductStats())

    table = sources.backbone.read("model.embed_tokens.weight")  # [V, d] stored dtype; only the prompts' rows kept
    xs = [table[torch.tensor(p)].to(torch.float32)[None] for p in prompts]  # each [1, S, d]
    del table
    geom = []
    for p in prompts:
        s = len(p)
        pos = torch.arange(s)[None]
        cos, sin = rope_cos_sin(pos, cfg, torch.float32)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        geom.append((pos, mask, cos, sin))
    empty = torch.zeros(1, 0, cfg.num_key_value_heads, cfg.head_dim)
    for i in range(cfg.num_hidden_layers):
        block = _layer_block(sources, cfg, i)
        hooks = []
        for site, (path, _) in _SITES.items():
            module = block.get_submodule(path)
            hooks.append(module.register_forward_pre_hook(
                lambda _m, args, _s=("layer", i, site): stat(_s).add(args[0])))
        for j, (pos, mask, cos, sin) in enumerate(geom):
            bias_past, bias_new = window_biases(pos, mask, 0, cfg.window(i))
            xs[j] = block(xs[j], cos, sin, bias_past, bias_new, empty, empty)[0]
        for h in hooks:
            h.remove()
        del block
        if progress and (i % 8 == 7 or i == cfg.num_hidden_layers - 1):
            print(f"    calibrated layers 0-{i}", flush=True)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.data = sources.backbone.read("model.norm.weight").to(torch.float32)
    hidden = torch.cat([norm(x)[0] for x in xs])  # [N, d]: the lm_head's input and the heads' (Medusa §2.1.1)
    stat(("final",)).add(hidden)
    finals = []
    for h in range(hc.num_heads):
        y = hidden
        for layer in range(hc.num_layers):
            stat(("head", h, layer)).add(y)
            w = sources.heads.read(f"{h}.{layer}.linear.weight").to(torch.float32)  # [d, d] (nn.Linear [out, in])
            b = sources.heads.read(f"{h}.{layer}.linear.bias").to(torch.float32)
            y = y + torch.nn.functional.silu(y @ w.T + b)
        if hc.own_projection:
            stat(("head_out", h)).add(y)
        finals.append(y)
    if not hc.own_projection:
        stat(("heads_out",)).add(torch.cat(finals))  # one Gemm over the K heads' stacked rows
    return stats


# -- the artifact's own weights as a source -------------------------------------------------------------------------

class ArtifactSource:
    """An artifact's ``weights.bin`` read back under the checkpoint names its weight records give (each record's
    ``recipe``: source, key, layout ``rows`` as stored or ``cols`` transposed), one tensor at a time by a positioned
    read; what :func:`calibrate` streams when no checkpoint source is given (the artifact is the contract: the engine
    machine needs no checkpoint). Float records only (``portable`` fp32 / fp16 artifacts)."""

    def __init__(self, folder: Path, records: list[dict], source: str):
        self.path = Path(folder) / "weights.bin"
        self.description = f"{self.path} ({source} tensors)"
        self._rec = {r["recipe"]["keys"][0]: r for r in records if r["recipe"]["source"] == source
                     and len(r["recipe"]["keys"]) == 1 and r["recipe"].get("output", 0) == 0
                     and r["dtype"] in ("float32", "float16")}

    def keys(self) -> list[str]:
        return list(self._rec)

    def __contains__(self, key: str) -> bool:
        return key in self._rec

    def read(self, key: str) -> torch.Tensor:
        """float [out, in] (as the checkpoint) of ``key``.

        Raises:
            CalibrationError: no float record of ``key`` (a quantized ``ort-contrib`` artifact).
        """
        r = self._rec.get(key)
        if r is None:
            raise CalibrationError(f"{self.description} has no float tensor {key!r}: calibrate a portable fp32 / fp16 "
                                   f"artifact")
        dtype = np.float32 if r["dtype"] == "float32" else np.float16
        with open(self.path, "rb") as fh:
            fh.seek(int(r["offset"]))
            arr = np.frombuffer(fh.read(int(r["length"])), dtype).reshape(r["shape"])
        t = torch.from_numpy(arr.copy())
        return t.T.contiguous() if r["recipe"]["layout"] == "cols" else t


def artifact_sources(folder: Path):
    """The artifact's weights as :class:`~medusa_export.loading.sources.ModelSources`: :class:`ArtifactSource` per
    source and the backbone's config rebuilt from the manifest (geometry, switches) and the step graph (RMSNorm's eps,
    the constant of ``layers.0.input_norm/rmsnorm/add_eps``).

    Raises:
        CalibrationError: RoPE scaling or sliding windows (not recorded in the manifest: pass the checkpoint's
            sources), or no float weights.
    """
    from medusa_runtime.contract.artifact import load_artifact
    from onnx import numpy_helper

    from ..export.graph import RMSNORM_MARK
    from ..loading.sources import ModelSources
    from ..model.config import BackboneConfig
    from ..model.heads import HeadsConfig

    art = load_artifact(folder)
    m = art.model
    feats = set(m.features)
    odd = [f for f in feats if f.startswith(("rope_scaling", "sliding_window"))]
    if odd:
        raise CalibrationError(f"the manifest does not record {', '.join(odd)}: calibrate from the checkpoint "
                               f"(ranges.calibrate(..., sources=open_model(...).sources))")
    records = art.manifest.weights.to_json()["records"]
    backbone, heads = ArtifactSource(folder, records, "backbone"), ArtifactSource(folder, records, "heads")
    step = onnx.load(str(Path(folder) / art.manifest.graphs["model"].file), load_external_data=False)
    consts = {t.name: t for t in step.graph.initializer}
    node = next(n for n in step.graph.node if n.name == f"layers.0.input_norm{RMSNORM_MARK}add_eps")
    eps = float(numpy_helper.to_array(consts[node.input[1]]))
    gate = backbone.read("model.layers.0.mlp.gate_proj.weight")
    cfg = BackboneConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=gate.shape[0],
                         num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
                         num_key_value_heads=m.num_kv_heads, head_dim=m.head_dim, rms_norm_eps=eps,
                         rope_theta=m.rope_theta, tie_word_embeddings="tied_embeddings" in feats,
                         model_type=m.architecture, **{f: f in feats for f in ("qkv_bias", "o_bias", "mlp_bias",
                                                                                  "qk_norm")})
    hc = HeadsConfig(m.medusa_heads, m.medusa_layers, m.hidden_size, m.vocab_size, m.medusa_own_projection,
                     art.manifest.heads.type)
    return ModelSources(backbone, heads, cfg, hc)


# -- on an artifact ------------------------------------------------------------------------------------------------

def product_weights(model: onnx.ModelProto) -> list[str]:
    """The weight initializer (input 1) of every MatMul / Gemm whose second input is one, in graph order, each once."""
    inits = {t.name for t in model.graph.initializer}
    out = []
    for n in model.graph.node:
        if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in inits and n.input[1] not in out:
            out.append(n.input[1])
    return out


def prompt_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn through the artifact's chat template (its plain encoding without one)."""
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) if tokenizer.has_chat_template
            else tokenizer.encode(t) for t in prompts]


def calibrate(folder: Path, files: dict[str, str], prompts: list[str], *, sources=None,
              progress: bool = True) -> Calibration:
    """Calibrate an artifact's graphs: the statistics of every weight product's input, streamed from its checkpoint.

    Args:
        folder: the artifact (its manifest's weight records map initializers to checkpoint keys).
        files: graph name -> artifact-relative ONNX (the ``model`` and ``heads`` graphs).
        prompts: calibration prompts (user messages): the project's own (:func:`default_calibration_prompts`) or a
            user's ``--prompt-file``; never the evaluation prompts.
        sources: the model's :class:`~medusa_export.loading.sources.ModelSources` (the checkpoint's, e.g.
            ``open_model(...).sources``); default: the artifact's own ``weights.bin`` (:func:`artifact_sources`), read
            one tensor at a time as well.
        progress: print progress lines.

    Returns:
        The :class:`Calibration`: per graph, each product's weight initializer -> its input's statistics; the record
        has the method, the prompts' count and SHA-256 (of the texts joined by newlines), the token count and seconds.

    Raises:
        CalibrationError: no prompt, fewer than :data:`MIN_TOKENS` tokens, a product whose input this pass does not
            compute (named), or hydra heads.
    """
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.contract.tokenizer import RuntimeTokenizer

    if not prompts or not any(p.strip() for p in prompts):
        raise CalibrationError("calibration needs at least one non-empty prompt (--prompt-file FILE with one or more "
                               "records, or none for the project's own calibration prompts)")
    t0 = time.perf_counter()
    folder = Path(folder).resolve()
    art = load_artifact(folder)
    if sources is None:
        sources = artifact_sources(folder)
    ids = prompt_ids(RuntimeTokenizer.from_artifact(art), prompts)
    tokens = sum(map(len, ids))
    if tokens < MIN_TOKENS:
        raise CalibrationError(f"the calibration prompts give {tokens} tokens; at least {MIN_TOKENS} are needed: give "
                               f"more or longer prompts")
    by_site = streamed_statistics(sources, ids, progress=progress)
    records = {r["name"]: r["recipe"] for r in art.manifest.weights.to_json()["records"]}
    from ..export.portable import lm_head_key

    lm_head = lm_head_key(sources.config)
    cal = Calibration()
    for graph, rel in files.items():
        model = onnx.load(str(folder / rel), load_external_data=False)
        cal.stats[graph] = {}
        for w in product_weights(model):
            recipe = records.get(w)
            site = recipe and site_of(graph, recipe["source"], recipe["keys"][0], lm_head,
                                      sources.config.num_hidden_layers)
            if not site or site not in by_site:
                raise CalibrationError(f"{rel}: the product on {w} reads an activation the streamed calibration does not "
                                       f"compute (recipe {recipe}); this graph cannot be quantized")
            cal.stats[graph][w] = by_site[site]
    cal.record = {"method": METHOD, "prompts": len(prompts),
                  "prompts_sha256": hashlib.sha256("\n".join(prompts).encode()).hexdigest(),
                  "tokens": tokens, "tokens_per_prompt": [len(p) for p in ids],
                  "seconds": round(time.perf_counter() - t0, 1)}
    return cal


def activation_ranges(folder: Path, files: dict[str, str], prompts: list[str], *, sources=None,
                      progress: bool = True) -> tuple[dict[str, dict[str, float]], dict]:
    """W8A8's per-tensor ranges: :func:`calibrate`'s max |x| by graph and weight initializer, and its record."""
    cal = calibrate(folder, files, prompts, sources=sources, progress=progress)
    return cal.amax(), cal.record


def default_calibration_prompts() -> list[str]:
    """The project's own quantization calibration prompts (``models/quant_calibration_prompts.jsonl``: ten prompts
    written for this project; none is a validation or an evaluation prompt, nor the heads' tree calibration set)."""
    from importlib import resources

    from ..validation.validate import read_prompts

    return read_prompts(Path(str(resources.files("medusa_models"))) / "quant_calibration_prompts.jsonl")

"""Batched decoding for self-distillation: an own decode loop with continuous batching.

transformers ``generate`` on this CPU spends most of a batched step outside the GEMMs: the
SDPA kernel for one query token and the dynamic cache's per-step ``cat`` (61% and 21% of a step in a
profile taken on the 2-core development machine; the profile itself is not in the repository). This loop
avoids both:

* one preallocated KV buffer per layer, ``[B, H_kv, C, D]``: a step writes each row's new K/V
  into its own slot (no concatenation), and attention reads ``[:, :, :L]`` with L the longest
  row (a view, no copy);
* attention for one query token per row as two batched matmuls with the query heads grouped
  by KV head (``[B, H_kv, G, D] @ [B, H_kv, D, L]``), no repeat of K/V, and a per-row length
  mask;
* continuous batching: a row whose reply ends (EOS or ``max_new_tokens``) is refilled at once
  with the next prompt (prefilled alone, its K/V written into the row), so the batch never
  waits for its longest reply; when the prompts run out, finished rows are dropped
  (the cache rows are gathered) once fewer than half of them are busy;
* q/k/v and gate/up projections fused into one matmul each, weights in ``dtype`` (bf16 by
  default: oneDNN's AVX512-BF16 kernels; 4.4x fp32 on a teacher-forced forward here).

It reads the weights of a transformers causal LM of the Llama family (Llama, Mistral, Qwen2,
Qwen3: ``model.layers[i].self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj`` + ``act_fn``,
``model.rotary_emb`` for RoPE with its scaling). Which biases and q/k norms a layer has, and which layers
slide, come from the family table (:data:`~medusa_export.model.families.FAMILIES`: ``switches`` and
``window_layers``, as for the reference and both graph writers), not from probing the modules; a sliding
layer's query at position q sees the keys at q - W < p <= q (transformers
``masking_utils.sliding_window_overlay``).
Greedy replies in fp32 equal transformers ``generate``'s (tested); in bf16 they drift from the
fp32 ones after some tokens, which is fine for training text (hidden states and teacher targets
are recomputed from the token ids, :mod:`medusa_export.training.features`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from torch.nn import functional as F

from ..errors import MedusaError, UnsupportedModelError
from ..model.families import FAMILIES

#: The KV buffers grow and shrink in steps of this many slots (a whole-buffer copy each time).
SLOT_CHUNK = 64


@dataclass(frozen=True)
class DecodeRequest:
    """One reply to generate.

    Attributes:
        id: the reply's id (seeds sampling, names the result).
        prompt: the prompt's token ids (chat template applied), length >= 1.
        temperature: 0 for greedy, else sampling from the full distribution at this temperature.
        seed: sampling seed; the noise is hashed from ``seed ^ crc32(id)`` and the position
            (:func:`hashed_uniform`), so a reply does not depend on the batch it ran in or the
            device (up to their rounding).
    """

    id: str
    prompt: tuple[int, ...]
    temperature: float = 0.0
    seed: int = 0


def family_of_config(cfg):
    """The :class:`~medusa_export.model.families.Family` that computes a transformers config's model (by its
    ``hf_model_type``; a variant that renames a model reads as the original).

    Raises:
        UnsupportedModelError: a ``model_type`` no family computes (the supported families named).
    """
    kind = getattr(cfg, "model_type", None)
    fam = next((f for f in FAMILIES.values() if f.hf_model_type == kind), None)
    if fam is None:
        families = ", ".join(f"{f.name} ({f.hf_model_type})" for f in FAMILIES.values())
        raise UnsupportedModelError(f"batched decoding runs the {families} families; this model is {kind!r}")
    return fam


def layer_windows(cfg) -> list[int | None]:
    """The sliding window of each layer of a transformers config (None: the whole past), as the family table says
    (:meth:`~medusa_export.model.families.Family.window_layers`, the same windows the reference and both graph
    writers apply).

    Raises:
        UnsupportedModelError: a family the table lacks, or a layer type other than full or sliding attention (the
            valid ones are named).
    """
    other = sorted(set(getattr(cfg, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if other:
        raise UnsupportedModelError(f"batched decoding runs full_attention and sliding_attention layers; this "
                                    f"model has {', '.join(other)}")
    window, types = family_of_config(cfg).window_layers(cfg.to_dict())
    if not types:
        return [window or None] * cfg.num_hidden_layers
    return [window if t == "sliding_attention" else None for t in types]


def check_decodable(hf_model) -> None:
    """Refuse, by name, a transformers model :class:`BatchedDecoder` cannot run.

    Raises:
        UnsupportedModelError: a ``model_type`` outside the supported families
            (:data:`~medusa_export.model.families.FAMILIES`, by their transformers ``hf_model_type``), or a model of one without the
            Llama-style modules the loop reads (``model.rotary_emb``, ``model.layers[i].self_attn.q_proj``...).
    """
    try:
        family_of_config(hf_model.config)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{exc} ({type(hf_model).__name__})") from None
    families = ", ".join(f"{f.name} ({f.hf_model_type})" for f in FAMILIES.values())
    inner = getattr(hf_model, "model", None)
    layer = getattr(inner, "layers", [None])[0]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    needs = {"model.rotary_emb": getattr(inner, "rotary_emb", None), "self_attn.q_proj": getattr(attn, "q_proj", None),
             "mlp.gate_proj": getattr(mlp, "gate_proj", None), "lm_head": getattr(hf_model, "lm_head", None)}
    missing = [k for k, v in needs.items() if v is None]
    if missing:
        raise UnsupportedModelError(f"batched decoding reads the Llama-style modules of the {families} families; "
                                    f"this {type(hf_model).__name__} has no {', '.join(missing)}")


@dataclass
class _Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv: torch.Tensor  # [d, (H + 2 H_kv) D]
    bqkv: torch.Tensor | None
    wo: torch.Tensor  # [H D, d]
    bo: torch.Tensor | None
    w_gate_up: torch.Tensor  # [d, 2 I]
    w_down: torch.Tensor  # [I, d]
    b_gate_up: torch.Tensor | None  # [2 I] (mlp_bias)
    b_down: torch.Tensor | None  # [d]
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    window: int | None = None


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) on int64 values in [0, 2^32); products wrap, the low bits stay exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def hashed_uniform(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) noise, float32 [B, vocab], a pure function of (key, position, token id).

    Args:
        keys: int64 [B] in [0, 2^32), one per reply (its seed and id).
        positions: int64 [B], the slot of the token being sampled.
        vocab: V.
    """
    tok = torch.arange(vocab, device=keys.device, dtype=torch.long)
    x = _mix32((keys * 0x9E3779B1 + positions * 0x85EBCA77) & _MASK32)[:, None]
    x = _mix32((x ^ _mix32(tok)[None]) & _MASK32)
    return (x.float() + 0.5) / 4294967296.0


class BatchedDecoder:
    """Greedy or sampled replies of many prompts, ``batch_size`` rows at a time.

    Args:
        hf_model: a transformers causal LM of the Llama family (see the module docstring), eval mode.
        batch_size: rows decoded together.
        capacity: KV slots per row; a prompt longer than ``capacity - max_new_tokens`` is refused.
        dtype: compute and KV dtype (bf16 or fp32); the norms and softmax run in fp32.

    Raises:
        UnsupportedModelError: a model this loop cannot run (:func:`check_decodable`; the message names the
            supported families).
    """

    def __init__(self, hf_model, *, batch_size: int = 64, capacity: int = 1152, dtype: torch.dtype = torch.bfloat16):
        check_decodable(hf_model)
        cfg = hf_model.config
        inner = hf_model.model
        self.device = next(hf_model.parameters()).device
        self.dtype = dtype
        self.batch_size = batch_size
        self.capacity = capacity
        self.num_heads = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.rotary = inner.rotary_emb
        self.embed = inner.embed_tokens.weight.detach().to(dtype)
        self.norm = inner.norm.weight.detach().to(dtype)
        self.lm_head = hf_model.lm_head.weight.detach().to(dtype)
        self.act = inner.layers[0].mlp.act_fn
        #: The family's feature switches (biases, q/k norms) of this config (:data:`~medusa_export.model.families.SWITCHES`).
        self.switches = family_of_config(cfg).switches(cfg.to_dict())
        self.layers = [self._layer(layer, w) for layer, w in zip(inner.layers, layer_windows(cfg))]
        self.keys: list[torch.Tensor] = []  # per layer [B, H_kv, slots, D] while decoding
        self.values: list[torch.Tensor] = []

    def _layer(self, layer, window: int | None) -> _Layer:
        """One layer's weights, fused, with the biases and q/k norms the family's switches turn on
        (:meth:`~medusa_export.model.families.Family.switches`, as the reference and the graph writers read them)."""
        a, m, dt, on = layer.self_attn, layer.mlp, self.dtype, self.switches

        def t(w):
            return w.detach().to(dt)

        def cat_bias(*projections):
            return torch.cat([t(p.bias) for p in projections])

        return _Layer(
            t(layer.input_layernorm.weight), t(layer.post_attention_layernorm.weight),
            torch.cat([t(a.q_proj.weight), t(a.k_proj.weight), t(a.v_proj.weight)]).T.contiguous(),
            cat_bias(a.q_proj, a.k_proj, a.v_proj) if on["qkv_bias"] else None,
            t(a.o_proj.weight).T.contiguous(), t(a.o_proj.bias) if on["o_bias"] else None,
            torch.cat([t(m.gate_proj.weight), t(m.up_proj.weight)]).T.contiguous(), t(m.down_proj.weight).T.contiguous(),
            cat_bias(m.gate_proj, m.up_proj) if on["mlp_bias"] else None, t(m.down_proj.bias) if on["mlp_bias"] else None,
            t(a.q_norm.weight) if on["qk_norm"] else None, t(a.k_norm.weight) if on["qk_norm"] else None,
            window if window is not None and window < self.capacity else None)

    # -- the model ----------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int64 [N] -> (cos, sin) [N, 1, D] in the compute dtype (the model's own RoPE)."""
        cos, sin = self.rotary(self.embed[:1], positions[None])  # [1, N, D]
        return cos[0, :, None].to(self.dtype), sin[0, :, None].to(self.dtype)

    def _qkv(self, lay: _Layer, x: torch.Tensor, cos, sin):
        """x [N, d] -> q [N, H, D], k [N, H_kv, D], v [N, H_kv, D] (normed and rotated)."""
        n, h, hk, dh = x.shape[0], self.num_heads, self.num_kv, self.head_dim
        qkv = _rms(x, lay.ln1, self.eps) @ lay.wqkv
        if lay.bqkv is not None:
            qkv = qkv + lay.bqkv
        q, k, v = qkv.split([h * dh, hk * dh, hk * dh], dim=-1)
        q, k, v = q.view(n, h, dh), k.view(n, hk, dh), v.view(n, hk, dh)
        if lay.q_norm is not None:
            q, k = _rms(q, lay.q_norm, self.eps), _rms(k, lay.k_norm, self.eps)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _finish_layer(self, lay: _Layer, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        o = attn @ lay.wo
        if lay.bo is not None:
            o = o + lay.bo
        x = x + o
        gu = _rms(x, lay.ln2, self.eps) @ lay.w_gate_up
        if lay.b_gate_up is not None:
            gu = gu + lay.b_gate_up
        g, u = gu.chunk(2, dim=-1)
        down = (self.act(g) * u) @ lay.w_down
        return x + (down if lay.b_down is None else down + lay.b_down)

    def forward(self, tokens: torch.Tensor, *, cache_row: int | None = None) -> torch.Tensor:
        """Teacher-forced causal pass: tokens int64 [B, S] (row b at positions 0..S-1) -> hidden [B, S, d].

        Rows are independent (right padding is harmless: causal attention never looks ahead).
        With ``cache_row`` (B = 1), the K/V are written into that cache row's slots 0..S-1 (prefill).
        """
        bsz, s = tokens.shape
        x = self.embed[tokens].reshape(bsz * s, -1)  # [B S, d]
        cos, sin = self._rope(torch.arange(s, device=self.device).repeat(bsz))
        windowed = {}  # window -> bool [S, S]: causal and within the window
        for lay in self.layers:
            if lay.window is not None and lay.window not in windowed:
                i = torch.arange(s, device=self.device)
                windowed[lay.window] = (i[None] <= i[:, None]) & (i[None] > i[:, None] - lay.window)
        for lay, kc, vc in zip(self.layers, self.keys or [None] * len(self.layers), self.values or [None] * len(self.layers)):
            q, k, v = self._qkv(lay, x, cos, sin)  # [B S, H, D], [B S, Hkv, D]
            q, k, v = (t.view(bsz, s, t.shape[1], -1).transpose(1, 2) for t in (q, k, v))  # [B, heads, S, D]
            if cache_row is not None:
                kc[cache_row, :, :s] = k[0]
                vc[cache_row, :, :s] = v[0]
            if lay.window is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, H, S, D]
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=windowed[lay.window], enable_gqa=True)
            x = self._finish_layer(lay, x, o.transpose(1, 2).reshape(bsz * s, -1))
        return _rms(x, self.norm, self.eps).view(bsz, s, -1)

    def prefill(self, row: int, prompt: torch.Tensor) -> torch.Tensor:
        """Run one prompt (int64 [S]) into cache row ``row`` (slots 0..S-1); returns its last hidden state [d]."""
        return self.forward(prompt[None], cache_row=row)[0, -1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> float32 logits [..., V] (the LM head in the compute dtype)."""
        return (hidden.to(self.dtype) @ self.lm_head.T).float()

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row: tokens/positions int64 [B] (the row's slot for this token) -> hidden [B, d].

        Row b attends to its slots 0..positions[b] (the rest of the buffer is masked); the new K/V
        go into slot positions[b]. The buffers must hold more than ``positions.max()`` slots.
        """
        b = tokens.shape[0]
        hk, g, dh = self.num_kv, self.num_heads // self.num_kv, self.head_dim
        slots = self.keys[0].shape[2]
        slot = torch.arange(slots, device=self.device)[None]
        seen = slot <= positions[:, None]
        bias = torch.where(seen, 0.0, float("-inf"))[:, None, None, :]  # [B, 1, 1, C]
        biases = {lay.window: torch.where(seen & (slot > positions[:, None] - lay.window), 0.0, float("-inf"))
                  [:, None, None, :] for lay in self.layers if lay.window is not None}
        flat = (torch.arange(b * hk, device=self.device) * slots).view(b, hk) + positions[:, None]  # [B, H_kv]
        x = self.embed[tokens]  # [B, d]
        cos, sin = self._rope(positions)
        scale = dh ** -0.5
        for lay, kc, vc in zip(self.layers, self.keys, self.values):
            q, k, v = self._qkv(lay, x, cos, sin)
            kc.view(-1, dh).index_copy_(0, flat.view(-1), k.reshape(-1, dh))
            vc.view(-1, dh).index_copy_(0, flat.view(-1), v.reshape(-1, dh))
            # Whole contiguous buffers: a matmul on a [:, :, :L] slice was 4-10x slower (a strided copy).
            mask = bias if lay.window is None else biases[lay.window]
            scores = torch.matmul(q.view(b, hk, g, dh), kc.transpose(-1, -2)).float() * scale + mask  # [B, Hkv, G, C]
            attn = torch.matmul(torch.softmax(scores, dim=-1).to(self.dtype), vc)  # [B, Hkv, G, D]
            x = self._finish_layer(lay, x, attn.reshape(b, -1))
        return _rms(x, self.norm, self.eps)

    def _resize(self, slots: int) -> None:
        """Give every row's K/V buffer about ``slots`` slots (rounded up to :data:`SLOT_CHUNK`), keeping the
        first ones. Steps read the whole buffer, so it follows the longest busy row, up and down."""
        want = min(self.capacity, -(-max(slots, 1) // SLOT_CHUNK) * SLOT_CHUNK)
        have = self.keys[0].shape[2]
        if have >= slots and have - want < 2 * SLOT_CHUNK:
            return
        keep = min(have, want)

        def grow(t):
            out = torch.zeros(t.shape[0], t.shape[1], want, t.shape[3], dtype=t.dtype, device=t.device)
            out[:, :, :keep] = t[:, :, :keep]
            return out

        self.keys = [grow(t) for t in self.keys]
        self.values = [grow(t) for t in self.values]

    # -- the loop -----------------------------------------------------------------------------

    def _alloc(self, rows: int) -> None:
        shape = (rows, self.num_kv, SLOT_CHUNK, self.head_dim)
        self.keys = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.values = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.layers]

    def _next_token(self, hidden: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        """hidden [B, d] -> int64 [B]: the argmax, or a sample at the row's temperature (temps float32 [B]).

        Sampling is Gumbel-max with noise hashed from (the row's key, the position, the token id)
        (:func:`hashed_uniform`): exact sampling from softmax(logits / T), the same on any device
        and in any batch, and one vectorised op for the whole batch.
        """
        logits = self.logits(hidden)  # [B, V]
        sampled = temps > 0
        if bool(sampled.any()):
            u = hashed_uniform(keys, positions, logits.shape[-1])
            gumbel = -torch.log(-torch.log(u))
            noisy = logits / temps.clamp(min=1e-6)[:, None] + gumbel
            logits = torch.where(sampled[:, None], noisy, logits)
        return logits.argmax(-1)

    @torch.no_grad()
    def run(self, requests: Iterable[DecodeRequest], *, max_new_tokens: int, eos_token_ids: Sequence[int],
            on_reply: Callable[[DecodeRequest, list[int]], None]) -> None:
        """Answer every request; ``on_reply(request, tokens)`` as each reply ends (in completion order).

        A reply is r_0..r_{n-1}, at most ``max_new_tokens`` tokens, ending with the first EOS
        (included) when one is generated.

        Raises:
            MedusaError: a prompt that leaves fewer than ``max_new_tokens`` free slots, or an empty one.
        """
        queue = iter(requests)
        eos = set(int(e) for e in eos_token_ids)
        self._alloc(self.batch_size)
        reqs: list[DecodeRequest | None] = [None] * self.batch_size
        replies: list[list[int]] = [[] for _ in range(self.batch_size)]
        temps = torch.zeros(self.batch_size, dtype=torch.float32, device=self.device)
        keys = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        tokens = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        positions = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        exhausted = False

        def fill(row: int) -> bool:
            nonlocal exhausted
            while not exhausted:
                req = next(queue, None)
                if req is None:
                    exhausted = True
                    break
                n = len(req.prompt)
                if n < 1 or n + max_new_tokens > self.capacity:
                    raise MedusaError(f"reply {req.id}: a prompt of {n} tokens plus {max_new_tokens} new tokens "
                                      f"does not fit {self.capacity} KV slots (and must not be empty)")
                reqs[row], replies[row] = req, []
                temps[row] = float(req.temperature)
                keys[row] = (int(req.seed) ^ zlib.crc32(req.id.encode())) & 0xFFFFFFFF
                self._resize(max(n + 1, int(positions.max()) + 2))
                h = self.prefill(row, torch.tensor(req.prompt, dtype=torch.long, device=self.device))
                tok = self._next_token(h[None], temps[row:row + 1], keys[row:row + 1],
                                       torch.tensor([n], device=self.device))[0]
                tokens[row], positions[row] = tok, n
                replies[row].append(int(tok))
                if self._done(replies[row], eos, max_new_tokens):
                    on_reply(req, replies[row])
                    reqs[row] = None
                    continue
                return True
            return False

        for row in range(self.batch_size):
            if not fill(row):
                break
        while True:
            active = [r for r in range(len(reqs)) if reqs[r] is not None]
            if not active:
                self.keys, self.values = [], []
                return
            if exhausted and len(active) <= len(reqs) // 2:  # drop the idle rows: gather the busy ones
                idx = torch.tensor(active, device=self.device)
                self.keys = [k[idx] for k in self.keys]
                self.values = [v[idx] for v in self.values]
                tokens, positions = tokens[idx].clone(), positions[idx].clone()
                temps, keys = temps[idx].clone(), keys[idx].clone()
                reqs, replies = [reqs[r] for r in active], [replies[r] for r in active]
            self._resize(int(positions.max()) + 1)
            hidden = self.step(tokens, positions)
            nxt = self._next_token(hidden, temps, keys, positions + 1)
            positions += 1
            tokens = nxt
            for row, tok in enumerate(nxt.tolist()):
                req = reqs[row]
                if req is None:
                    continue
                replies[row].append(tok)
                if self._done(replies[row], eos, max_new_tokens):
                    on_reply(req, replies[row])
                    reqs[row] = None
                    if fill(row):
                        continue
                    tokens[row], positions[row] = 0, 0  # idle row: a harmless token at slot 0

    @staticmethod
    def _done(reply: list[int], eos: set[int], max_new_tokens: int) -> bool:
        return len(reply) >= max_new_tokens or reply[-1] in eos

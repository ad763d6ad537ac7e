"""The independent reference of validation: plain greedy decoding in PyTorch that shares no code with the runtime.

``build``'s validation and ``verify`` used to compare ONNX Runtime with the PyTorch reference driven by the
runtime's own decode loop (:func:`medusa_runtime.decode.loop.generate`): the same KV cache and compaction, tree buffers
and acceptance on both sides, so a bug in that shared code passed. The tokens both sides must equal now come from
here, computed once per prompt, with none of ``medusa_runtime``'s loop, cache, trees or acceptance:

* ``transformers-generate``: transformers' own ``generate`` (greedy, its own KV cache and attention code) on the
  reference's tensors (:func:`~medusa_export.loading.transformers_twin.transformers_twin`, no copy), for every
  model transformers can express (Llama, Mistral, Qwen2, Qwen3 and their switches);
* ``full-recompute``: otherwise, a loop over the reference backbone without any KV cache: every token is the argmax
  of the last position of a forward pass over the whole sequence so far (quadratic in the length, exact by
  construction).

Both stop as the runtime's contract says: at EOS (not emitted), after ``max_new_tokens``, and when the context is
full (a prompt of n tokens in a cache of C slots gets at most C - n + 1 tokens: the last one is never fed back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..errors import MedusaError

#: How each kind of reference is named in reports (the manifest's ``validation.reference``, the summary).
REFERENCE_TEXT = {
    "transformers-generate": "transformers generate (greedy, its own KV cache), PyTorch fp32, same weights",
    "full-recompute": "full-recompute greedy, PyTorch fp32, no KV cache",
}


@dataclass
class IndependentRun:
    """One prompt's plain greedy decoding by the independent reference.

    Attributes:
        tokens: the generated token ids (EOS not included).
        margins: float64 [len(tokens) + 1] or [len(tokens)]: top-1 minus top-2 log-probability of the prediction of
            generated token j (the entry after the last token, when present, is that of the EOS that stopped it).
        kind: which reference made it (a key of :data:`REFERENCE_TEXT`).
    """

    tokens: list[int]
    margins: np.ndarray
    kind: str


def token_budget(prompt_len: int, max_new_tokens: int, max_context: int | None) -> int:
    """Tokens a greedy decoding may emit: ``max_new_tokens``, or fewer when the context fills first.

    The runtime's cache of ``max_context`` slots holds the prompt and every emitted token but the last (which is
    never fed back), so at most ``max_context - prompt_len + 1`` tokens are emitted.

    Args:
        prompt_len: tokens in the prompt (> 0).
        max_new_tokens: the budget asked for (>= 0).
        max_context: the KV capacity in tokens, or None for no limit.

    Returns:
        The number of tokens, >= 0.
    """
    if max_context is None:
        return max_new_tokens
    return max(0, min(max_new_tokens, max_context - prompt_len + 1))


def _margins(logits: torch.Tensor) -> np.ndarray:
    """float64 [N] top-1 minus top-2 log-probability of each row of ``logits`` [N, V]."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    if lp.shape[-1] < 2:
        return np.full(lp.shape[0], np.inf)
    top = torch.topk(lp, 2, dim=-1).values
    return (top[:, 0] - top[:, 1]).cpu().numpy()


def _cut_at_eos(tokens: list[int], eos: set[int]) -> int:
    """Index of the first EOS in ``tokens`` (its length when there is none)."""
    return next((i for i, t in enumerate(tokens) if t in eos), len(tokens))


@torch.no_grad()
def full_recompute_greedy(backbone, prompt_ids: Sequence[int], *, max_new_tokens: int,
                          eos_token_ids: Sequence[int] = (), max_context: int | None = None) -> IndependentRun:
    """Plain greedy decoding without a KV cache: each token is the argmax of the last position of a forward pass over
    the whole sequence (prompt + tokens so far), recomputed from scratch.

    Args:
        backbone: the reference :class:`~medusa_export.model.backbone.Backbone` (fp32, any device).
        prompt_ids: the prompt's token ids.
        max_new_tokens: tokens to generate at most.
        eos_token_ids: ids that end the generation (not emitted).
        max_context: the artifact's KV capacity (:func:`token_budget`).

    Returns:
        The tokens and their top-2 margins.
    """
    device = backbone.embed_tokens.weight.device
    eos = {int(t) for t in eos_token_ids}
    seq = [int(t) for t in prompt_ids]
    tokens, margins = [], []
    for _ in range(token_budget(len(prompt_ids), max_new_tokens, max_context)):
        n = len(seq)
        ids = torch.tensor([seq], dtype=torch.int64, device=device)
        causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
        hidden, _ = backbone(ids, torch.arange(n, device=device)[None], causal, backbone.empty_past(0))
        logits = backbone.lm_head(hidden[:, -1])
        margins.append(float(_margins(logits)[0]))
        token = int(logits[0].argmax())
        if token in eos:
            break
        tokens.append(token)
        seq.append(token)
    return IndependentRun(tokens, np.asarray(margins, np.float64), "full-recompute")


@torch.no_grad()
def transformers_greedy(hf_model, prompt_ids: Sequence[int], *, max_new_tokens: int,
                        eos_token_ids: Sequence[int] = (), max_context: int | None = None) -> IndependentRun:
    """Plain greedy decoding by transformers' ``generate`` (no sampling, no logits processors).

    Args:
        hf_model: a transformers ``*ForCausalLM`` (e.g. :func:`~medusa_export.loading.transformers_twin.
            transformers_twin` of the reference backbone).
        prompt_ids, max_new_tokens, eos_token_ids, max_context: as :func:`full_recompute_greedy`.

    Returns:
        The tokens (cut before the first EOS) and their top-2 margins from the raw logits of each step.
    """
    n = token_budget(len(prompt_ids), max_new_tokens, max_context)
    if n == 0:
        return IndependentRun([], np.zeros(0), "transformers-generate")
    device = next(hf_model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.int64, device=device)
    eos = [int(t) for t in eos_token_ids]
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=0,
                            do_sample=False, num_beams=1, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                            output_logits=True, return_dict_in_generate=True, use_cache=True)
    generated = out.sequences[0, ids.shape[1]:].tolist()
    margins = _margins(torch.cat(out.logits, dim=0))
    cut = _cut_at_eos(generated, set(eos))
    return IndependentRun(generated[:cut], margins[: cut + 1], "transformers-generate")


class IndependentReference:
    """Plain greedy decoding of a reference model's backbone, independent of the runtime (module docstring).

    Args:
        model: the fp32 PyTorch reference (:class:`~medusa_export.model.medusa.MedusaModel`; only its backbone is
            used), on any device.
        kind: "auto" (transformers' ``generate`` where transformers can express the model, else full recompute),
            "transformers-generate" or "full-recompute".

    Raises:
        MedusaError: an unknown ``kind``.
        UnsupportedModelError: ``kind="transformers-generate"`` for a model transformers cannot express.
    """

    def __init__(self, model, kind: str = "auto"):
        from ..errors import UnsupportedModelError

        if kind not in ("auto", *REFERENCE_TEXT):
            raise MedusaError(f"unknown independent reference {kind!r}; known: auto, {', '.join(REFERENCE_TEXT)}")
        self.backbone = model.backbone
        self.hf = None
        if kind != "full-recompute":
            from ..loading.transformers_twin import transformers_twin

            try:
                self.hf = transformers_twin(self.backbone)
                self.hf.model.rotary_emb.to(self.backbone.embed_tokens.weight.device)  # its buffer is made on the CPU
            except UnsupportedModelError:
                if kind != "auto":
                    raise
        self.kind = "transformers-generate" if self.hf is not None else "full-recompute"

    @property
    def description(self) -> str:
        """How reports name this reference (:data:`REFERENCE_TEXT`)."""
        return REFERENCE_TEXT[self.kind]

    def greedy(self, prompt_ids: Sequence[int], *, max_new_tokens: int, eos_token_ids: Sequence[int] = (),
               max_context: int | None = None) -> IndependentRun:
        """Plain greedy decoding of one prompt (see :func:`transformers_greedy`, :func:`full_recompute_greedy`).

        Args:
            prompt_ids: the prompt's token ids (at least one).
            max_new_tokens: tokens to generate at most.
            eos_token_ids: ids that end the generation (not emitted).
            max_context: the artifact's KV capacity (:func:`token_budget`), or None.

        Returns:
            The :class:`IndependentRun` (tokens, top-2 margins, which reference ran).

        Raises:
            MedusaError: an empty prompt.
        """
        if len(prompt_ids) == 0:
            raise MedusaError("the independent reference needs a prompt of at least one token")
        kw = dict(max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, max_context=max_context)
        if self.hf is not None:
            return transformers_greedy(self.hf, prompt_ids, **kw)
        return full_recompute_greedy(self.backbone, prompt_ids, **kw)

"""The PyTorch reference Medusa decode loop, batch size 1 (Medusa paper, Algorithm).

The loop itself is ``medusa_runtime.decode.loop.generate`` (written once, shared with the
deployed runtime); here it drives a :class:`TorchEngine`, which runs
:meth:`MedusaModel.step` and the heads in PyTorch. Tree buffers, acceptance, KV
compaction and stops are the pure functions of ``medusa_runtime``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from medusa_runtime.decode.acceptance import SamplingConfig, draw_tokens
from medusa_runtime.trees.dynamic import StepTree
from medusa_runtime.engines.base import Capabilities, SamplerInputs, StepResult
from medusa_runtime.engines.kvcache import KVCache
from medusa_runtime.decode.loop import GenerationResult, causal_mask, generate
from medusa_runtime.trees.tree import Tree

from .medusa import STEP_TOPK, MedusaModel, acceptance_outputs

__all__ = ["GenerationResult", "KVCache", "TorchEngine", "causal_mask", "medusa_generate"]

_NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


class TorchEngine:
    """:class:`medusa_runtime.engines.base.Engine` over the PyTorch reference model.

    Args:
        model: the reference model.
        k: k of the step's top-k outputs (``step_topk``).
        max_context: the context it reports to the loop (default: the backbone's
            ``max_position_embeddings``).
        sampler: also act as a step graph with the in-graph sampler (docs/sampling.md): ``step``
            then takes ``sampling=SamplerInputs(...)`` and returns ``sampled_ids``, drawn from the
            whole vocabulary with :func:`medusa_runtime.decode.acceptance.draw_tokens` (rows with a negative
            uniform, or every row at top_k -1, give -1): the reference of the graph contract.
        device: where the model is (a torch device name): numpy inputs are moved there and outputs back.
    """

    def __init__(self, model: MedusaModel, k: int = STEP_TOPK, *, max_context: int | None = None,
                 sampler: bool = False, device: str = "cpu"):
        c = model.config
        self.model = model
        self.device = device
        self.k = k
        self.num_layers = c.num_hidden_layers
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.num_heads = model.num_heads
        self.kv_dtype = np.dtype(_NP_DTYPES[model.backbone.embed_tokens.weight.dtype])
        self.capabilities = Capabilities(
            head_type=model.head_type, heads_logprobs=model.head_type == "medusa", sampler=sampler,
            max_context=int(max_context or c.max_position_embeddings), step_topk=min(k, c.vocab_size),
            vocab_size=c.vocab_size)

    def _in(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device)

    @staticmethod
    def _out(t: torch.Tensor) -> np.ndarray:
        return t.detach().cpu().numpy()

    def _result(self, topk_ids, topk_lp, entropy, token_lp, hidden, new_kv, sampled=None) -> StepResult:
        o = self._out
        return StepResult(o(topk_ids[0]), o(topk_lp[0]), o(entropy[0]), o(token_lp[0]), o(hidden[0]),
                          [(o(k), o(v)) for k, v in new_kv], *(() if sampled is None else (sampled,)))

    @torch.no_grad()
    def step(self, input_ids, position_ids, mask, temperature, past, sampling: SamplerInputs | None = None) -> StepResult:
        if sampling is not None:
            return self._sampling_step(input_ids, position_ids, mask, temperature, past, sampling)
        out = self.model.step(
            self._in(input_ids), self._in(position_ids), self._in(mask),
            [(self._in(k), self._in(v)) for k, v in past],
            torch.tensor([temperature], dtype=torch.float32, device=self.device), self.k,
        )
        return self._result(out.topk_ids, out.topk_logprobs, out.entropy, out.token_logprobs, out.hidden, out.new_kv)

    def _sampling_step(self, input_ids, position_ids, mask, temperature, past, sampling: SamplerInputs) -> StepResult:
        if not self.capabilities.sampler:
            raise ValueError("this TorchEngine has no in-graph sampler (TorchEngine(..., sampler=True))")
        ids, t = self._in(input_ids), torch.tensor([temperature], dtype=torch.float32, device=self.device)
        logits, hidden, new_kv = self.model(ids, self._in(position_ids), self._in(mask),
                                            [(self._in(k), self._in(v)) for k, v in past])
        topk_ids, topk_lp, entropy, token_lp = acceptance_outputs(logits, ids, t, self.k)
        u = np.asarray(sampling.uniforms)
        rows = np.flatnonzero(u >= 0) if sampling.top_k >= 0 else np.zeros(0, np.int64)  # the contract's skips
        sampled = np.full(len(u), -1, np.int64)
        if rows.size:
            logp, order = torch.sort(torch.log_softmax(logits[0, rows].float() / t, dim=-1), dim=-1, descending=True,
                                     stable=True)
            sampled[rows] = draw_tokens(self._out(order), self._out(logp), u[rows], sampling.top_k, sampling.top_p)
        return self._result(topk_ids, topk_lp, entropy, token_lp, hidden, new_kv, sampled)

    def close(self) -> None:
        """Nothing to free (the Engine protocol's close): the model's tensors belong to whoever made it, and
        the KV caches are the loop's numpy caches."""

    @torch.no_grad()
    def heads(self, hidden: np.ndarray, topk: int) -> np.ndarray:
        return self._out(self.model.heads_topk(self._in(hidden), topk).transpose(0, 1))

    @torch.no_grad()
    def heads_logprobs(self, hidden: np.ndarray, topk: int) -> tuple[np.ndarray, np.ndarray]:
        ids, lp = self.model.heads_topk_logprobs(self._in(hidden), topk)
        return self._out(ids.transpose(0, 1)), self._out(lp.transpose(0, 1))

    @torch.no_grad()
    def heads_level(self, depth: int, hidden: np.ndarray, path_ids: np.ndarray, topk: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        ids, lp = self.model.level_topk(depth, self._in(hidden), self._in(path_ids), topk)
        return self._out(ids), self._out(lp)


def medusa_generate(
    model: MedusaModel,
    prompt_ids: Sequence[int],
    tree: StepTree,
    *,
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
    max_context: int | None = None,
    sampling: SamplingConfig | None = None,
    on_tokens: Callable[[list[int]], bool | int | None] | None = None,
    sampler: bool = False,
) -> GenerationResult:
    """Generate with the PyTorch reference; see :func:`medusa_runtime.decode.loop.generate`.

    Greedy by default: the output equals plain greedy decoding of the backbone. With
    ``sampling`` at temperature > 0, exact sampling (or typical acceptance).

    Args:
        max_context: KV capacity (default: the backbone's ``max_position_embeddings``; the reference
            itself has no hard limit).
        sampler: the engine acts as a step graph with the in-graph sampler (whole-vocabulary sampling).

    Raises:
        InvalidSettingError: empty prompt, negative max_new_tokens, bad sampling settings.
        UnsupportedSamplingError: settings that need the in-graph sampler without ``sampler``.
        InvalidTreeError: a tree deeper than the heads.
        ContextOverflowError: the prompt alone exceeds ``max_context``.
    """
    engine = TorchEngine(model, max_context=max_context, sampler=sampler)  # its context: max_context
    return generate(engine, prompt_ids, tree, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                    max_context=max_context, sampling=sampling, on_tokens=on_tokens)

"""Medusa heads (Medusa paper §2.1.1) and writing them in our file format.

Head k (1-based) maps the backbone's last hidden state h_t to logits for token t+k+1::

    p^(k) = softmax(W2^(k) (SiLU(W1^(k) h) + h))        (one residual block; N blocks chain)

Each head has N residual SiLU blocks (distinct modules) and either its own vocab
projection W2^(k) or, when the file has none, the backbone's ``lm_head``
(FasterDecoding's legacy heads). Initialisation as in §2.1.1: W1 = 0 (and its bias),
W2 = a copy of the LM head, so a fresh head reproduces the base next-token prediction.

Key layout of the state dict (FasterDecoding's; h = head, l = block, N = blocks):
    ``{h}.{l}.linear.weight`` [d, d], ``{h}.{l}.linear.bias`` [d], optional ``{h}.{N}.weight`` [V, d]

Our file format: ``heads.safetensors`` + ``heads.json`` (:data:`HEADS_FORMAT`, :func:`save_heads`).
The loaders of every supported format are in :mod:`medusa_export.loading.heads_formats`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

HEADS_FORMAT = "medusa-export-heads"
HEADS_FILE = "heads.safetensors"
HEADS_CONFIG = "heads.json"
#: Head types of our heads file (``heads.json`` ``head_type``; absent = "medusa"): "medusa" heads read
#: h_t alone (Medusa paper §2.1.1); "hydra" heads also read the path's tokens
#: (:mod:`medusa_export.model.hydra_heads`).
HEAD_TYPES = ("medusa", "hydra")


@dataclass(frozen=True)
class HeadsConfig:
    """Shape of a set of Medusa heads.

    Attributes:
        num_heads: K.
        num_layers: residual blocks per head (N).
        hidden_size: d, must equal the backbone's.
        vocab_size: V, must equal the backbone's.
        own_projection: True when each head has its own [V, d] projection; False to use
            the backbone's lm_head.
        head_type: one of :data:`HEAD_TYPES`.
    """

    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    own_projection: bool
    head_type: str = "medusa"


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W and b start at zero so the block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads. ``state_dict`` keys follow the FasterDecoding layout above."""

    #: Whether the heads read the path's tokens (they do not: :mod:`.hydra_heads` heads do).
    conditioned = False

    def __init__(self, config: HeadsConfig, lm_head: nn.Linear):
        super().__init__()
        if config.head_type != "medusa":
            raise ValueError(f"MedusaHeads needs head_type 'medusa', got {config.head_type!r}")
        self.config = config
        heads = []
        for _ in range(config.num_heads):
            blocks: list[nn.Module] = [ResBlock(config.hidden_size) for _ in range(config.num_layers)]
            if config.own_projection:
                proj = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                with torch.no_grad():
                    proj.weight.copy_(lm_head.weight)
                blocks.append(proj)
            heads.append(nn.Sequential(*blocks))
        self.heads = nn.ModuleList(heads)
        # Not registered as a submodule: the backbone owns it and it is never saved here.
        self._shared = [lm_head]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits [K, ..., V].

        With the shared lm_head, the K heads' states are stacked and projected by one
        matmul ([K, ..., d] @ [d, V]): the [V, d] weight is read once per call instead of
        K times (on a CPU the heads graph of the embedded model took ~half a T=1 step
        with K separate projections).
        """
        if self.config.own_projection:
            return torch.stack([head(hidden) for head in self.heads])  # [K, ..., V]
        return project_stacked(self.head_states(hidden), self._shared[0].weight)

    def head_states(self, hidden: torch.Tensor, path_ids: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., d] -> [K, ..., d]: each head's state after its residual blocks, before the projection.

        ``path_ids`` (the tokens on the path, read by path-conditioned heads) is ignored: a Medusa
        head sees h_t alone.
        """
        n = self.config.num_layers
        return torch.stack([head[:n](hidden) for head in self.heads])

    def projection_weights(self) -> list[torch.Tensor]:
        """The vocabulary projections' weights, each [V, d]: the K heads' own, or the shared lm_head's once."""
        if self.config.own_projection:
            return [head[-1].weight for head in self.heads]
        return [self._shared[0].weight]

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors in the FasterDecoding key layout (``heads.`` prefix removed)."""
        return {k.removeprefix("heads."): v for k, v in self.state_dict().items()}


def save_heads(heads: nn.Module, out_dir: str | Path, extra: dict | None = None) -> None:
    """Write our format: ``heads.safetensors`` + ``heads.json`` in ``out_dir``.

    Args:
        heads: the heads to save (:class:`MedusaHeads` or :class:`~.hydra_heads.HydraHeads`;
            ``heads.json`` records their ``head_type``).
        out_dir: existing or new directory.
        extra: more JSON fields (e.g. training recipe, backbone name).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in heads.head_state_dict().items()}
    save_file(tensors, str(out / HEADS_FILE))
    meta = {"format": HEADS_FORMAT, "version": 1, **asdict(heads.config), **(extra or {})}
    (out / HEADS_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")


def project_stacked(states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[K, ..., d] states through one shared projection ``weight`` [N, d] -> logits [K, ..., N].

    The states are flattened to 2-D, so the projection is one Gemm on ``weight`` itself: the
    weight is read once for all K heads, and the exported graph shares that tensor (with the
    backbone's lm_head, when it is that) instead of storing a transposed copy, as a 3-D
    MatMul would.
    """
    logits = nn.functional.linear(states.reshape(-1, states.shape[-1]), weight)
    return logits.reshape(*states.shape[:-1], logits.shape[-1])

"""Path-conditioned ("Hydra") heads: head k also reads the tokens on the path to its parent.

A Medusa head k predicts token t+k+1 from the backbone's last hidden state h_t alone, although
the root t+1 (and, deeper in the tree, every token between) is already chosen when it runs
(Medusa paper §2.1.1). A Hydra head (Ankner et al. 2024, arXiv 2402.05109; zankner/Hydra
``hydra/model/hydra_heads/mlp_head.py``, written anew here) reads them too::

    x_k = [h_t, n(e(x_{t+1})), ..., n(e(x_{t+k}))]                width (k + 1) d
    y_k = R_k x_k + SiLU(W_k x_k + b_k)                           first block: (k + 1) d -> d
    y_k = y_k + SiLU(W x + b)  (N - 1 more blocks, distinct)      as Medusa's residual blocks
    p^(k) = softmax(lm_head(y_k))                                 the backbone's shared, frozen projection

where x_{t+1} is the root (the backbone's own next token), x_{t+2..t+k} the candidates on the
path from the root to the node's parent, e() the backbone's frozen input embedding and
n(e) = e / rms(e) (mine, not in Hydra's reference: SmolLM2's embedding rows have an RMS of ~0.13
against ~1.9 for h_t, which made the path weights learn ~15x slower than the others; with n()
both inputs have a comparable scale). So candidates are produced level by level: head 1 on the
root, head 2 on each chosen child, ...

Initialisation (mine; Hydra's reference uses a default-initialised R_k): R_k = [I | 0],
W_k = [W_medusa | 0], b_k = b_medusa, and later blocks copied, so a Hydra head made from
trained Medusa heads (:meth:`HydraHeads.from_medusa`) starts *equal* to them, and training
can only improve on them; fresh heads start as the identity like Medusa's (§2.1.1).

State dict (our heads file; h = head 0-based, l = block): ``{h}.0.res.weight`` [d, (h+2) d],
``{h}.0.res.bias`` [d], ``{h}.0.linear.weight`` [d, (h+2) d], ``{h}.0.linear.bias`` [d],
``{h}.{l}.linear.weight`` [d, d] and ``.bias`` [d] for l >= 1. ``heads.json`` says
``"head_type": "hydra"`` (:data:`medusa_export.model.heads.HEAD_TYPES`).
"""

from __future__ import annotations

import torch
from torch import nn

from .heads import HeadsConfig, MedusaHeads, ResBlock, project_stacked


#: Added to the mean square before the root in :func:`rms_normalized`.
PATH_NORM_EPS = 1e-6


def rms_normalized(e: torch.Tensor) -> torch.Tensor:
    """e / sqrt(mean(e^2) + eps) over the last axis (float32 inside), in e's dtype."""
    x = e.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + PATH_NORM_EPS)).to(e.dtype)


class PathBlock(nn.Module):
    """R x + SiLU(W x + b) on x = [h, e_1 .. e_m] (width (m + 1) d) -> [.., d]; starts as x[..., :d]."""

    def __init__(self, hidden_size: int, inputs: int):
        super().__init__()
        width = inputs * hidden_size
        self.res = nn.Linear(width, hidden_size)
        self.linear = nn.Linear(width, hidden_size)
        with torch.no_grad():
            self.res.weight.zero_()
            self.res.weight[:, :hidden_size].copy_(torch.eye(hidden_size))
            self.res.bias.zero_()
            self.linear.weight.zero_()
            self.linear.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.res(x) + nn.functional.silu(self.linear(x))


class HydraHeads(nn.Module):
    """K path-conditioned heads sharing the backbone's frozen lm_head and input embedding.

    Args:
        config: ``head_type`` "hydra", ``own_projection`` False.
        lm_head: the backbone's LM head (the shared projection; not saved here).
        embed_tokens: the backbone's input embedding [V, d] (not saved here).

    Raises:
        ValueError: a config of another type or with its own projection.
    """

    conditioned = True

    def __init__(self, config: HeadsConfig, lm_head: nn.Linear, embed_tokens: nn.Embedding):
        super().__init__()
        if config.head_type != "hydra" or config.own_projection:
            raise ValueError(f"HydraHeads needs head_type 'hydra' without own projections, got {config}")
        self.config = config
        d = config.hidden_size
        self.heads = nn.ModuleList(
            nn.Sequential(PathBlock(d, k + 2), *[ResBlock(d) for _ in range(config.num_layers - 1)])
            for k in range(config.num_heads))
        # Not registered as submodules: the backbone owns them and they are never saved here.
        self._shared = [lm_head]
        self._embed = [embed_tokens]

    @classmethod
    def from_medusa(cls, medusa: MedusaHeads, embed_tokens: nn.Embedding) -> "HydraHeads":
        """Hydra heads that compute exactly what ``medusa`` computes (path weights zero), see the module docstring.

        Raises:
            ValueError: Medusa heads with their own projections (Hydra heads share the lm_head).
        """
        c = medusa.config
        if c.own_projection:
            raise ValueError("Hydra heads share the backbone's lm_head; these Medusa heads have their own projections")
        cfg = HeadsConfig(c.num_heads, c.num_layers, c.hidden_size, c.vocab_size, False, head_type="hydra")
        out = cls(cfg, medusa._shared[0], embed_tokens).to(next(medusa.parameters()).dtype)
        d = c.hidden_size
        with torch.no_grad():
            for src, dst in zip(medusa.heads, out.heads):
                dst[0].linear.weight[:, :d].copy_(src[0].linear.weight)
                dst[0].linear.bias.copy_(src[0].linear.bias)
                for lay in range(1, c.num_layers):
                    dst[lay].load_state_dict(src[lay].state_dict())
        return out

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """int64 [...] -> [..., d] the backbone's input embeddings, each scaled to RMS 1 (n() above)."""
        return rms_normalized(self._embed[0](ids))

    def head_state(self, k: int, hidden: torch.Tensor, path_ids: torch.Tensor) -> torch.Tensor:
        """Head k's (0-based) state before the projection.

        Args:
            k: the head (it predicts the token k + 2 positions after h's).
            hidden: [..., d] the backbone's hidden state h_t.
            path_ids: int64 [..., >= k + 1]; the root and the path's tokens (only the first k + 1 are read).

        Returns:
            [..., d].
        """
        e = self.embed(path_ids[..., :k + 1]).to(hidden.dtype)  # [..., k+1, d]
        x = torch.cat([hidden, e.flatten(-2)], dim=-1)  # [..., (k+2) d]
        return self.heads[k](x)

    def head_states(self, hidden: torch.Tensor, path_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Every head on the same rows, teacher-forced: hidden [..., d], path_ids int64 [..., K] -> [K, ..., d].

        Raises:
            ValueError: no ``path_ids`` (path-conditioned heads need the path).
        """
        if path_ids is None:
            raise ValueError("path-conditioned heads need path_ids (the root and the path's tokens)")
        return torch.stack([self.head_state(k, hidden, path_ids) for k in range(self.config.num_heads)])

    def forward(self, hidden: torch.Tensor, path_ids: torch.Tensor) -> torch.Tensor:
        """hidden [..., d], path_ids [..., K] -> logits [K, ..., V] (teacher-forced: head k reads path_ids[..., :k+1])."""
        return project_stacked(self.head_states(hidden, path_ids), self._shared[0].weight)

    def level_logits(self, k: int, hidden: torch.Tensor, path_ids: torch.Tensor) -> torch.Tensor:
        """One level of the tree: head k (0-based) on R paths. hidden [R, d] (or [1, d]), path_ids [R, k+1] -> [R, V]."""
        hidden = hidden.expand(path_ids.shape[0], -1)
        return nn.functional.linear(self.head_state(k, hidden, path_ids), self._shared[0].weight)

    def projection_weights(self) -> list[torch.Tensor]:
        """The shared lm_head's weight [V, d] (one projection for every head)."""
        return [self._shared[0].weight]

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """Tensors in our key layout (module docstring; ``heads.`` prefix removed)."""
        return {k.removeprefix("heads."): v for k, v in self.state_dict().items()}

"""Medusa-1 head training on a frozen backbone with self-distillation (Medusa paper §2.2.1, §2.3.2).

Stages, each resumable from its cache directory:

1. **Prompts** (:func:`load_prompts`): JSONL files in the formats of ``../shared/data``
   (``messages``, ``turns``, ``prompt``, ``instruction``/``instances``, OASST ``### Human:``)
   become chat message lists ending with a user turn. ``--cap SOURCE=N`` subsamples a
   source (GSM8K dominates train_mix); a fixed seed orders everything.
2. **Self-distillation** (:mod:`medusa_export.training.replies`): the backbone answers every
   prompt (greedy, plus sampled variants) with an own batched decode loop
   (:mod:`medusa_export.training.batch_decode`); the replies are stored as token ids
   (:mod:`medusa_export.training.reply_store`).
3. **Features** (:mod:`medusa_export.training.features`): hidden states and the teacher's top-S
   recomputed from the ids in batched teacher-forced passes (cached per reply set).
4. **Training** (:func:`train_heads`): heads initialised as in §2.1.1 (zero residual
   block, projection shared with the frozen ``lm_head``), loss
   ``sum_k 0.8^k * CE(head k, token t+k+1)`` (app. B.2), with hard labels (the reply's
   tokens) or soft targets (the backbone's own top-S distribution at that position), over
   the whole vocabulary or the draft vocabulary's top N ids (``train_vocab``).

Alignment (one reply r_0..r_{n-1}, EOS included when generated): ``hidden[i]`` is the
final-norm output at the position *before* r_i (``hidden[0]`` is the prompt's last
token), so the backbone's ``lm_head(hidden[i])`` predicts r_i and head k (1-based)
at ``hidden[i]`` predicts r_{i+k}. r_i is the root of a decode step at position i.
"""

from __future__ import annotations

import math
import random
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from medusa_runtime.front.prompts import jsonl_records

from ..model.heads import HeadsConfig, MedusaHeads

#: Loss weight decay per head (app. B.2): lambda_k = LOSS_DECAY ** k.
LOSS_DECAY = 0.8

# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One conversation to answer: ``messages`` ends with a user turn."""

    id: str
    source: str
    messages: tuple[dict, ...]


_OASST_TURN = re.compile(r"### (Human|Assistant):")


def _oasst_messages(text: str) -> list[dict]:
    parts = _OASST_TURN.split(text)
    msgs = []
    for role, content in zip(parts[1::2], parts[2::2]):
        content = content.strip()
        if content:
            msgs.append({"role": "user" if role == "Human" else "assistant", "content": content})
    return msgs


def record_messages(rec: dict) -> list[dict]:
    """Chat messages of one prompt record (first turn only for multi-turn benchmarks).

    Formats: ``messages`` (train_mix), ``turns`` (MT-Bench: first turn), ``prompt`` (Koala),
    ``instruction`` + ``instances[0].input`` (self-instruct), ``input`` with
    ``### Human:`` / ``### Assistant:`` turns (OASST/qlora), ``question`` (GSM8K).
    Returns [] when the record has none of these or does not end with a user turn.
    """
    if "messages" in rec:
        msgs = [{"role": m["role"], "content": m["content"]} for m in rec["messages"]]
    elif "turns" in rec:
        msgs = [{"role": "user", "content": rec["turns"][0]}]
    elif "prompt" in rec:
        msgs = [{"role": "user", "content": rec["prompt"]}]
    elif "instruction" in rec:
        inst = rec.get("instances") or [{}]
        extra = (inst[0].get("input") or "").strip()
        msgs = [{"role": "user", "content": rec["instruction"] + ("\n\n" + extra if extra else "")}]
    elif "input" in rec and "### Human:" in rec["input"]:
        msgs = _oasst_messages(rec["input"])
    elif "question" in rec:
        msgs = [{"role": "user", "content": rec["question"]}]
    else:
        return []
    return msgs if msgs and msgs[-1]["role"] == "user" else []


def load_prompts(path: str | Path) -> list[Prompt]:
    """Read a prompt JSONL file (see :func:`record_messages`); unusable records are skipped.

    A record's source is its ``source`` field, else the file's stem; its id its ``id`` or
    ``question_id`` field, else its 0-based line index. Lines are read by the shared
    :func:`medusa_runtime.front.prompts.jsonl_records`.

    Raises:
        PromptFileError: the file is missing, or a line is not a JSON object (names file and line).
    """
    path = Path(path)
    out = []
    for line_no, rec in jsonl_records(path):
        msgs = record_messages(rec)
        if msgs:
            src = str(rec.get("source", path.stem))
            rid = str(rec.get("id", rec.get("question_id", line_no - 1)))
            out.append(Prompt(f"{src}/{rid}", src, tuple(msgs)))
    return out


def select_prompts(prompts: Sequence[Prompt], *, caps: dict[str, int] | None = None, seed: int = 0,
                   holdout: int = 0) -> tuple[list[Prompt], list[Prompt]]:
    """Shuffle (fixed seed), cap sources and split off a held-out set for calibration.

    Args:
        prompts: all prompts.
        caps: max prompts per source (e.g. ``{"gsm8k_train": 400}``); others are kept whole.
        seed: shuffle seed.
        holdout: prompts taken (after capping) for held-out calibration.

    Returns:
        (train, held_out), both in the shuffled order.
    """
    order = list(prompts)
    random.Random(seed).shuffle(order)
    caps = caps or {}
    counts: dict[str, int] = {}
    kept = []
    for p in order:
        counts[p.source] = counts.get(p.source, 0) + 1
        if p.source in caps and counts[p.source] > caps[p.source]:
            continue
        kept.append(p)
    return kept[holdout:], kept[:holdout]

# ---------------------------------------------------------------------------
# Loading the generator (transformers) for a registered model
# ---------------------------------------------------------------------------


@dataclass
class Generator:
    """A transformers causal LM with what batched self-distillation needs.

    Attributes:
        hf_model: the transformers model (eval mode, no grad).
        tokenizer, chat_template: to render prompts (None: the tokenizer's own, or plain text
            for a base model).
        eos_token_ids, pad_token_id: stop tokens and the left-padding token.
        source: where the weights came from.
        loaded: the registry's loaded backbone it shares its tensors with (its heads stored in
            the checkpoint, notes), or None for a model made in a test.
    """

    hf_model: object
    tokenizer: object
    chat_template: str | None
    eos_token_ids: list[int]
    pad_token_id: int
    source: str
    loaded: object = None

    @property
    def lm_head(self) -> nn.Linear:
        return self.hf_model.lm_head


def load_generator(model: str, *, model_path: str | None = None, dtype: torch.dtype = torch.float32,
                   device: str = "cpu") -> Generator:
    """Load a registered model (or a path) as a transformers LM for batched generation.

    The checkpoint is read by the registry's strict loader (every family and layout it reads:
    medusa-1.0 folders, modelopt FP8, GGUF) and handed to the family's transformers model
    without a copy (:func:`~medusa_export.loading.transformers_twin.transformers_twin`).

    Args:
        device: where it runs (``cpu``, ``cuda``, ``cuda:1``): generation, teacher targets and
            head training all follow it.

    Raises:
        UnknownModelError, WeightsNotFoundError, UnsupportedModelError: as
            :func:`medusa_export.loading.registry.load_model`.
    """
    from ..loading.transformers_twin import load_transformers_model

    hf_model, loaded = load_transformers_model(model, model_path, dtype=dtype, device=device)
    tokenizer, eos = loaded.tokenizer, loaded.eos_token_ids
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return Generator(hf_model, tokenizer, loaded.chat_template, eos, int(pad), loaded.source, loaded)


# ---------------------------------------------------------------------------
# Training data: positions, targets (hard or soft)
# ---------------------------------------------------------------------------


def future_index(lengths: Sequence[int], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the target position of every (position, head) and whether it exists.

    For a reply of length n, position i's head k (1-based) target is position i + k of the
    same reply (valid when i + k < n). Positions are the concatenation of all replies.

    Returns:
        (index int64 [N, K] into the concatenation (clamped where invalid), valid bool [N, K]).
    """
    idx, val = [], []
    start = 0
    ks = torch.arange(1, num_heads + 1)
    for n in lengths:
        i = torch.arange(n)[:, None]
        tgt = i + ks[None]
        val.append(tgt < n)
        idx.append(start + tgt.clamp(max=max(n - 1, 0)))
        start += n
    if not idx:
        return torch.zeros(0, num_heads, dtype=torch.long), torch.zeros(0, num_heads, dtype=torch.bool)
    return torch.cat(idx), torch.cat(val)


class Batch(tuple):
    """One training batch: (hidden, path_ids, target_ids, target_p, valid).

    * hidden [B, d] (the data's dtype);
    * path_ids int64 [B, K]: ``path_ids[:, j]`` is the token j positions after the root
      (``[:, 0]`` = the root r_i), so head k (1-based) may read ``path_ids[:, :k]``;
    * target_ids int64 [B, K, S] and target_p float32 [B, K, S] (sum 1 over S where valid);
    * valid bool [B, K].
    """

    def __new__(cls, hidden, path_ids, target_ids, target_p, valid):
        return super().__new__(cls, (hidden, path_ids, target_ids, target_p, valid))


@dataclass
class TrainData:
    """Every position of a set of replies (concatenated); a training row is a position where head 1 has a target.

    Attributes:
        hidden: [N, d] (bf16 or fp32); hidden[i] predicts tokens[i].
        tokens: int64 [N], r_i at each position (the root of a decode step there).
        future: int64 [N, K], the position of head k's target (i + k; clamped where invalid).
        valid: bool [N, K], head k has a target (i + k inside the reply).
        rows: int64 [M], the training rows' positions.
        teacher_ids: int64 [N, S] the backbone's top-S at each position (soft targets), or None (hard labels).
        teacher_p: float32 [N, S] their probabilities (sum 1), or None.
    """

    hidden: torch.Tensor
    tokens: torch.Tensor
    future: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor
    teacher_ids: torch.Tensor | None = None
    teacher_p: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Training rows M."""
        return int(self.rows.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.future.shape[1])

    def to(self, device) -> "TrainData":
        """The same data on ``device``."""
        return TrainData(*(None if t is None else t.to(device) for t in (
            self.hidden, self.tokens, self.future, self.valid, self.rows, self.teacher_ids, self.teacher_p)))

    def batch(self, idx: torch.Tensor) -> Batch:
        """Training rows ``idx`` (int64 [B], indices into :attr:`rows`) with their paths and targets."""
        pos = self.rows[idx]
        fut = self.future[pos]  # [B, K]
        path = self.tokens[torch.cat([pos[:, None], fut[:, :-1]], dim=1)]  # r_i .. r_{i+K-1}
        valid = self.valid[pos]
        if self.teacher_ids is None:
            ids, p = self.tokens[fut][..., None], valid[..., None].float()
        else:
            ids, p = self.teacher_ids[fut], self.teacher_p[fut] * valid[..., None]
        return Batch(self.hidden[pos], path, ids, p, valid)


def train_data(hidden: torch.Tensor, replies: Sequence[Sequence[int]], num_heads: int, *,
               teacher: tuple[torch.Tensor, torch.Tensor] | None = None) -> TrainData:
    """Positions and targets of a set of replies (alignment in the module docstring).

    Args:
        hidden: [N, d], every reply's hidden states concatenated (N = total reply tokens).
        replies: each reply's tokens r_0..r_{n-1}.
        num_heads: K.
        teacher: the backbone's top-S (ids int64 [N, S], probs [N, S]) at every position, for soft
            targets (:mod:`medusa_export.training.features`); None for hard labels (the reply's tokens).

    Raises:
        ValueError: ``hidden`` (or the teacher) does not have one row per reply token.
    """
    lengths = [len(t) for t in replies]
    n = sum(lengths)
    if hidden.shape[0] != n or (teacher is not None and teacher[0].shape[0] != n):
        raise ValueError(f"{n} reply tokens but {hidden.shape[0]} hidden states"
                         + (f" and {teacher[0].shape[0]} teacher rows" if teacher is not None else ""))
    future, valid = future_index(lengths, num_heads)
    tokens = torch.tensor([int(t) for seq in replies for t in seq], dtype=torch.long)
    rows = torch.nonzero(valid[:, 0]).flatten() if n else torch.zeros(0, dtype=torch.long)
    t_ids, t_p = (teacher[0].long(), teacher[1].float()) if teacher is not None else (None, None)
    return TrainData(hidden, tokens, future, valid, rows, t_ids, t_p)


def vocab_remap(vocab_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [V]: the index of each token id in ``vocab_ids`` (int64 [N]), -1 for ids outside it."""
    remap = torch.full((vocab_size,), -1, dtype=torch.long)
    remap[vocab_ids.long()] = torch.arange(vocab_ids.numel())
    return remap


def restrict_targets(target_ids: torch.Tensor, target_p: torch.Tensor, valid: torch.Tensor,
                     remap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Targets over a vocabulary subset (FR-Spec: the draft vocabulary's top N ids).

    Target ids are renumbered into the subset; probability on ids outside it is dropped and the
    rest renormalised; a head whose whole target lies outside becomes invalid for that row.

    Args:
        target_ids: int64 [B, K, S]; target_p: float32 [B, K, S]; valid: bool [B, K].
        remap: int64 [V] (:func:`vocab_remap`).

    Returns:
        (ids int64 [B, K, S] in [0, N), p float32 [B, K, S], valid bool [B, K]).
    """
    sub = remap[target_ids]
    p = target_p * (sub >= 0)
    mass = p.sum(-1, keepdim=True)
    valid = valid & (mass[..., 0] > 0)
    return sub.clamp(min=0), p / mass.clamp(min=1e-12), valid


# ---------------------------------------------------------------------------
# Loss and training loop
# ---------------------------------------------------------------------------


class ProjectedCE(torch.autograd.Function):
    """Cross-entropy of ``states @ weight.T`` against sparse soft targets, with a hand-written backward.

    The logits [M, N] are the largest tensors of head training (N = the vocabulary or its subset);
    autograd's logsumexp / gather / casts made ~6 passes over them in fp32, more time than the two
    bf16 matmuls on a CPU. Here the forward keeps them once, in bf16, with their logsumexp, and
    the backward forms (softmax - target) * dCE in one pass and multiplies by the weight.

    forward(states float32 [M, d], weight bf16 [N, d] (frozen), target_ids int64 [M, S],
    target_p float32 [M, S]) -> (ce float32 [M], argmax int64 [M]) where
    ce = logsumexp(z) - sum_s p_s z[id_s] and z = states @ weight.T (bf16 product, fp32 softmax).
    """

    #: Rows per chunk: a chunk's fp32 logits (256 x 8192 x 4 B = 8 MB at N = 8192) stay in cache between passes.
    CHUNK = 256

    @staticmethod
    def forward(ctx, states, weight, target_ids, target_p):
        m = states.shape[0]
        logits = torch.empty(m, weight.shape[0], dtype=weight.dtype, device=states.device)  # [M, N] bf16
        lse = torch.empty(m, device=states.device)
        ce = torch.empty(m, device=states.device)
        top = torch.empty(m, dtype=torch.long, device=states.device)
        x = states.to(weight.dtype)
        for s in range(0, m, ProjectedCE.CHUNK):
            e = min(m, s + ProjectedCE.CHUNK)
            torch.mm(x[s:e], weight.T, out=logits[s:e])
            z = logits[s:e].float()
            lse[s:e] = torch.logsumexp(z, -1)
            ce[s:e] = lse[s:e] - (z.gather(1, target_ids[s:e]) * target_p[s:e]).sum(-1)
            top[s:e] = z.argmax(-1)
        ctx.save_for_backward(logits, lse, weight, target_ids, target_p)
        return ce, top

    @staticmethod
    def backward(ctx, grad_ce, _grad_argmax):
        logits, lse, weight, target_ids, target_p = ctx.saved_tensors
        m = logits.shape[0]
        grad_states = torch.empty(m, weight.shape[1], device=logits.device)
        for s in range(0, m, ProjectedCE.CHUNK):
            e = min(m, s + ProjectedCE.CHUNK)
            g = torch.exp(logits[s:e].float() - lse[s:e, None])  # softmax
            g.scatter_add_(1, target_ids[s:e], -target_p[s:e])
            g.mul_(grad_ce[s:e, None])
            grad_states[s:e] = g.to(weight.dtype) @ weight
        return grad_states, None, None, None


def heads_loss(heads: nn.Module, proj_bf16: torch.Tensor, batch: Batch, *, decay: float = LOSS_DECAY
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Medusa-1 loss sum_k decay^k * CE(head k, targets) (Medusa paper eq. 1, app. B.2).

    The vocabulary projection is frozen and shared, run in bf16 (fast on CPUs with
    AVX512-BF16/AMX) as one matmul for all K heads (:class:`ProjectedCE`); the residual blocks and
    the softmax run in fp32. With soft targets the CE is against the teacher's top-S distribution
    (Medusa paper §2.3.2).

    Args:
        heads: heads without their own projection (``head_states(hidden, path_ids)`` -> [K, B, d]).
        proj_bf16: [V', d] the projection (the LM head, or its rows of a vocabulary subset), bf16, no grad.
        batch: a :class:`Batch` whose target ids index ``proj_bf16``'s rows.
        decay: head k's weight is decay^k (1.0: equal weights, as Hydra).

    Returns:
        (loss scalar, per-head mean CE [K] (detached), per-head top-1 hits vs the first
        target [K] (detached counts)).
    """
    hidden, path_ids, target_ids, target_p, valid = batch
    states = heads.head_states(hidden.float(), path_ids)  # [K, B, d]
    k_heads, b, d = states.shape
    ids = target_ids.transpose(0, 1).reshape(k_heads * b, -1)  # [K B, S], head-major like the states
    ce, top = ProjectedCE.apply(states.reshape(-1, d), proj_bf16, ids, target_p.transpose(0, 1).reshape(k_heads * b, -1))
    ce, top = ce.view(k_heads, b).T, top.view(k_heads, b).T  # [B, K]
    m = valid.float()
    ce_k = (ce * m).sum(0) / m.sum(0).clamp(min=1)  # [K]
    weights = decay ** torch.arange(1, k_heads + 1, dtype=torch.float32, device=ce.device)
    hits = ((top == target_ids[..., 0]) & valid).sum(0)
    return (weights * ce_k).sum(), ce_k.detach(), hits.detach()


@dataclass
class TrainConfig:
    """Head training settings (defaults = the shipped recipe)."""

    num_heads: int = 4
    num_layers: int = 1
    epochs: float = 2.0
    batch_tokens: int = 512
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 40
    soft_topk: int = 16
    loss_decay: float = LOSS_DECAY
    train_vocab: int = 0
    seed: int = 0


@dataclass
class TrainResult:
    heads: nn.Module
    steps: int
    seconds: float
    history: list[dict] = field(default_factory=list)


def train_heads(data: TrainData, lm_head: nn.Linear, config: TrainConfig, *, progress: bool = True,
                checkpoint: str | Path | None = None, log: Callable[[dict], None] | None = None,
                heads: nn.Module | None = None, vocab_ids: torch.Tensor | None = None) -> TrainResult:
    """Train heads on ``data`` (AdamW, linear warmup then cosine decay, shuffled rows, fixed seed).

    Args:
        data: the training rows.
        lm_head: the backbone's frozen LM head (the heads' shared projection).
        config: settings; ``train_vocab`` > 0 needs ``vocab_ids``.
        heads: the heads to train (e.g. initialised from others); None: fresh Medusa heads
            (§2.1.1 init: zero residual blocks, shared frozen LM head).
        vocab_ids: int64 [N]: train the projection on these token ids only (the draft vocabulary's
            top N, FR-Spec): logits over N instead of V, targets restricted (:func:`restrict_targets`).
        checkpoint: the heads, optimiser and step are saved there every 200 steps and at the
            end, and a run with the same data and config resumes from it.

    Training runs on ``lm_head``'s device (the data is moved there once); the heads come back on the CPU.
    """
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    vocab, hidden = lm_head.weight.shape
    device = lm_head.weight.device
    if heads is None:
        cfg = HeadsConfig(config.num_heads, config.num_layers, hidden, vocab, own_projection=False)
        heads = MedusaHeads(cfg, lm_head)
    heads = heads.float().train().to(device)
    proj = lm_head.weight.detach()
    remap = None
    if vocab_ids is not None:
        vocab_ids = vocab_ids.to(device)
        proj = proj[vocab_ids]
        remap = vocab_remap(vocab_ids, vocab).to(device)
    proj = proj.to(torch.bfloat16).contiguous()
    if device.type != "cpu":
        data = data.to(device)
    opt = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    n = data.num_tokens
    steps_per_epoch = max(1, n // config.batch_tokens)
    total = max(1, int(round(config.epochs * steps_per_epoch)))

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return config.lr * (step + 1) / config.warmup_steps
        t = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
        return config.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    step = 0
    ckpt = Path(checkpoint) if checkpoint else None
    if ckpt and ckpt.is_file():
        state = torch.load(str(ckpt), weights_only=True, map_location=device)
        if state["total"] == total and state["n"] == n:
            heads.load_state_dict(state["heads"])
            opt.load_state_dict(state["opt"])
            step = int(state["step"])

    def save_ckpt() -> None:
        if ckpt:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "step": step, "total": total, "n": n},
                       str(ckpt) + ".tmp")
            Path(str(ckpt) + ".tmp").replace(ckpt)

    gen = torch.Generator().manual_seed(config.seed)
    perms = [torch.randperm(n, generator=gen) for _ in range(math.ceil(total / steps_per_epoch))]
    history: list[dict] = []
    t0 = time.perf_counter()
    bar = tqdm(total=total, initial=step, desc="train heads", unit="step", disable=not progress, dynamic_ncols=True)
    run_ce, run_hits, run_valid = None, None, None
    while step < total:
        epoch, j = divmod(step, steps_per_epoch)
        idx = perms[epoch][j * config.batch_tokens:(j + 1) * config.batch_tokens].to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        batch = data.batch(idx)
        if remap is not None:
            ids, p, valid = restrict_targets(batch[2], batch[3], batch[4], remap)
            batch = Batch(batch[0], batch[1], ids, p, valid)
        loss, ce, hits = heads_loss(heads, proj, batch, decay=config.loss_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        nvalid = batch[4].sum(0)
        run_ce = ce if run_ce is None else 0.95 * run_ce + 0.05 * ce
        run_hits = hits.float() if run_hits is None else run_hits + hits.float()
        run_valid = nvalid.float() if run_valid is None else run_valid + nvalid.float()
        bar.update(1)
        if step % 20 == 0 or step == total:
            acc = (run_hits / run_valid.clamp(min=1)).tolist()
            rec = {"step": step, "epoch": step / steps_per_epoch, "lr": lr_at(step - 1), "loss": float(loss.detach()),
                   "ce": [round(float(c), 4) for c in run_ce], "train_top1": [round(a, 4) for a in acc]}
            history.append(rec)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1_h1=f"{acc[0]:.3f}")
            run_hits, run_valid = None, None
            if log:
                log(rec)
        if step % 200 == 0:
            save_ckpt()
    bar.close()
    save_ckpt()
    return TrainResult(heads.eval().cpu(), step, time.perf_counter() - t0, history)

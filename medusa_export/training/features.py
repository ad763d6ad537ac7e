"""Hidden states and teacher targets of stored replies, recomputed in batched teacher-forced passes.

The reply store (:mod:`medusa_export.training.reply_store`) keeps token ids only. Training needs,
at every reply position i, the backbone's final-norm hidden state ``hidden[i]`` (the state that
predicts r_i, alignment of :mod:`medusa_export.training.distill`) and, for soft targets, the
backbone's own next-token distribution there, truncated to its top-S. Both come from one causal
pass over prompt + reply[:-1] per reply, run in batches of similar length (right padding, which
causal attention never reads) with :meth:`BatchedDecoder.forward`, so generation and
recomputation share one implementation and one set of numerics.

The result can be cached in one safetensors file keyed by a fingerprint of the replies and the
settings (:func:`features_fingerprint`), so ablations on the same replies compute it once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from .batch_decode import BatchedDecoder
from .reply_store import StoredReply

#: Rows of logits turned into top-S targets at a time ([rows, V] float32 each).
_LOGIT_ROWS = 1024


@dataclass
class ReplyFeatures:
    """Per-position training inputs of a list of replies, concatenated in the list's order.

    Attributes:
        hidden: [N, d] (the pass's dtype); row ``offsets[j] + i`` is reply j's hidden[i].
        lengths: reply lengths (sum N).
        teacher_ids: int64 [N, S], the backbone's top-S next tokens at each position, or None.
        teacher_p: float32 [N, S], their probabilities renormalised over the S (sum 1), or None.
    """

    hidden: torch.Tensor
    lengths: list[int]
    teacher_ids: torch.Tensor | None = None
    teacher_p: torch.Tensor | None = None

    @property
    def teacher(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.teacher_ids is None else (self.teacher_ids, self.teacher_p)


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Group indices into batches of similar length with (rows x longest) <= ``batch_tokens``.

    Args:
        lengths: sequence lengths.
        batch_tokens: padded tokens per batch (a longer sequence gets a batch of its own).

    Returns:
        index lists, shortest sequences first; every index exactly once.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


@torch.no_grad()
def compute_features(decoder: BatchedDecoder, replies: Sequence[StoredReply], *, soft_topk: int = 0,
                     batch_tokens: int = 8192, progress: bool = False) -> ReplyFeatures:
    """Teacher-forced hidden states (and the teacher's top-S) of every reply position.

    Args:
        decoder: the backbone (its dtype is the pass's and the hidden states' dtype).
        replies: replies with their prompts; a reply of n tokens gives n positions.
        soft_topk: S > 0 also returns the backbone's top-S distribution at each position.
        batch_tokens: padded tokens per forward pass.
        progress: show a progress bar.

    Returns:
        :class:`ReplyFeatures`, on the CPU.
    """
    from tqdm import tqdm

    seqs = [(list(map(int, r.prompt)) + list(map(int, r.reply[:-1]))) for r in replies]
    lengths = [len(r.reply) for r in replies]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    d = decoder.embed.shape[1]
    hidden = torch.zeros(starts[-1], d, dtype=decoder.dtype)
    t_ids = torch.zeros(starts[-1], soft_topk, dtype=torch.long) if soft_topk else None
    t_p = torch.zeros(starts[-1], soft_topk, dtype=torch.float32) if soft_topk else None
    batches = length_batches([len(s) for s in seqs], batch_tokens)
    bar = tqdm(total=starts[-1], desc="hidden states", unit="tok", disable=not progress, dynamic_ncols=True)
    for batch in batches:
        width = max(len(seqs[j]) for j in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for b, j in enumerate(batch):
            ids[b, :len(seqs[j])] = torch.tensor(seqs[j])
        out = decoder.forward(ids.to(decoder.device))  # [B, width, d]
        rows = []
        for b, j in enumerate(batch):
            p = len(replies[j].prompt)
            h = out[b, p - 1:p - 1 + lengths[j]].cpu()
            hidden[starts[j]:starts[j + 1]] = h
            rows.append(h)
        if soft_topk:
            flat = torch.cat(rows)
            dst = torch.cat([torch.arange(starts[j], starts[j + 1]) for j in batch])
            for s in range(0, flat.shape[0], _LOGIT_ROWS):
                logits = decoder.logits(flat[s:s + _LOGIT_ROWS].to(decoder.device))
                prob, idx = torch.softmax(logits, dim=-1).topk(soft_topk, dim=-1)
                t_ids[dst[s:s + _LOGIT_ROWS]] = idx.cpu()
                t_p[dst[s:s + _LOGIT_ROWS]] = (prob / prob.sum(-1, keepdim=True)).cpu()
        bar.update(sum(lengths[j] for j in batch))
    bar.close()
    return ReplyFeatures(hidden, lengths, t_ids, t_p)


def features_fingerprint(replies: Sequence[StoredReply], **settings) -> str:
    """A hex digest of the replies (ids, prompt and reply tokens) and ``settings`` (model, dtype, S)."""
    h = hashlib.sha256(repr(sorted(settings.items())).encode())
    for r in replies:
        h.update(r.id.encode() + b"\0")
        h.update(r.prompt.astype("<u4").tobytes() + b"\1")
        h.update(r.reply.astype("<u4").tobytes() + b"\2")
    return h.hexdigest()[:16]


def save_features(feats: ReplyFeatures, path: str | Path) -> None:
    """Write ``feats`` to one safetensors file (temporary name, then renamed)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"hidden": feats.hidden.contiguous(), "lengths": torch.tensor(feats.lengths, dtype=torch.long)}
    if feats.teacher_ids is not None:
        tensors["teacher_ids"] = feats.teacher_ids.to(torch.int32).contiguous()
        tensors["teacher_p"] = feats.teacher_p.contiguous()
    tmp = path.with_name(f".tmp-{path.name}")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def load_features(path: str | Path) -> ReplyFeatures:
    """Read what :func:`save_features` wrote."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    ids = t.get("teacher_ids")
    return ReplyFeatures(t["hidden"], t["lengths"].tolist(), ids.long() if ids is not None else None, t.get("teacher_p"))


#: Replies per cached features file: the unit of resuming and of splitting the work between processes.
CHUNK_REPLIES = 256


def feature_chunks(replies: Sequence[StoredReply], chunk: int = CHUNK_REPLIES) -> list[range]:
    """The reply index ranges cached as one file each (consecutive, ``chunk`` replies, the last shorter)."""
    return [range(s, min(len(replies), s + chunk)) for s in range(0, len(replies), chunk)]


def cached_features(decoder: BatchedDecoder, replies: Sequence[StoredReply], cache_dir: str | Path, *,
                    soft_topk: int = 0, batch_tokens: int = 8192, source: str = "", progress: bool = False,
                    part: tuple[int, int] = (0, 1), chunk: int = CHUNK_REPLIES) -> ReplyFeatures | None:
    """:func:`compute_features`, cached in ``cache_dir`` one file per chunk of ``chunk`` replies.

    A chunk's file is ``features-<fingerprint>.safetensors`` (:func:`features_fingerprint` of its
    replies, ``source``, the dtype and S): a rerun on the same replies, an interrupted run, or a
    run on a prefix of them (data-scaling) computes only the chunks not cached yet.

    Args:
        part: (i, n): compute only chunks i, i + n, ... (n processes side by side, one thread
            each) and return None; with n = 1 every chunk is computed or read and the whole
            result returned.

    Returns:
        The features of ``replies`` in order (None for a part of n > 1).
    """
    from tqdm import tqdm

    i_part, n_part = part
    chunks = feature_chunks(replies, chunk)
    out: list[ReplyFeatures] = []
    bar = tqdm(total=len(chunks), desc="feature chunks", unit="chunk", disable=not progress, dynamic_ncols=True)
    for j, rng in enumerate(chunks):
        sub = [replies[i] for i in rng]
        key = features_fingerprint(sub, source=source, dtype=str(decoder.dtype), soft_topk=soft_topk)
        path = Path(cache_dir) / f"features-{key}.safetensors"
        if n_part > 1 and j % n_part != i_part:
            continue
        if path.is_file():
            feats = load_features(path) if n_part == 1 else None
        else:
            feats = compute_features(decoder, sub, soft_topk=soft_topk, batch_tokens=batch_tokens)
            save_features(feats, path)
        if feats is not None:
            out.append(feats)
        bar.update(1)
    bar.close()
    if n_part > 1:
        return None
    return concat_features(out, soft_topk)


def concat_features(parts: Sequence[ReplyFeatures], soft_topk: int) -> ReplyFeatures:
    """The features of consecutive reply sets, concatenated."""
    if not parts:
        return ReplyFeatures(torch.zeros(0, 0), [], None, None)
    teacher = bool(soft_topk) and parts[0].teacher_ids is not None
    return ReplyFeatures(torch.cat([f.hidden for f in parts]), [n for f in parts for n in f.lengths],
                         torch.cat([f.teacher_ids for f in parts]) if teacher else None,
                         torch.cat([f.teacher_p for f in parts]) if teacher else None)

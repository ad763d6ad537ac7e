"""Medusa-1 head training on a frozen backbone with self-distillation (seeds/001 §2.2.1, §2.3.2).

Three stages, each resumable from its cache directory:

1. **Prompts** (:func:`load_prompts`): JSONL files in the formats of ``../shared/data``
   (``messages``, ``turns``, ``prompt``, ``instruction``/``instances``, OASST ``### Human:``)
   become chat message lists ending with a user turn. ``--cap SOURCE=N`` subsamples a
   source (GSM8K dominates train_mix); a fixed seed orders everything.
2. **Self-distillation** (:func:`generate_replies`): the backbone answers every prompt
   greedily (batched, left padding, transformers' ``generate``). A forward hook on the
   final norm captures the hidden states as they are computed, so no second pass is
   needed. Each batch is one ``shard-XXXXX.safetensors`` (hidden states, bf16) plus one
   JSONL line per reply in ``replies.jsonl``; a restart skips prompts already answered.
3. **Training** (:func:`train_heads`): heads initialised as in §2.1.1 (zero residual
   block, projection shared with the frozen ``lm_head``), loss
   ``sum_k 0.8^k * CE(head k, token t+k+1)`` (app. B.2), with hard labels (the greedy
   reply) or soft targets (the backbone's own distribution at that position).

Alignment (one reply r_0..r_{n-1}, EOS included when generated): ``hidden[i]`` is the
final-norm output at the position *before* r_i (``hidden[0]`` is the prompt's last
token), so the backbone's ``lm_head(hidden[i])`` predicts r_i and head k (1-based)
at ``hidden[i]`` predicts r_{i+k}.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from ..model.heads import HeadsConfig, MedusaHeads

#: Loss weight decay per head (app. B.2): lambda_k = LOSS_DECAY ** k.
LOSS_DECAY = 0.8

REPLIES_FILE = "replies.jsonl"


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

    A record's source is its ``source`` field, else the file's stem.
    """
    path = Path(path)
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").split("\n")):  # not splitlines(): U+2028 in strings
        if not line.strip():
            continue
        rec = json.loads(line)
        msgs = record_messages(rec)
        if msgs:
            src = str(rec.get("source", path.stem))
            rid = str(rec.get("id", rec.get("question_id", n)))
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
# Self-distillation: batched greedy generation with hidden-state capture
# ---------------------------------------------------------------------------


@dataclass
class Reply:
    """A generated reply and where its hidden states live.

    Attributes:
        id: the prompt id.
        tokens: r_0..r_{n-1} (the EOS is included when the reply ended with one).
        shard: the shard file name; ``key`` the tensor inside it (bf16 [n, d]).
    """

    id: str
    tokens: list[int]
    shard: str
    key: str
    prompt_tokens: int = 0


def reply_id(prompt_id: str, variant: int) -> str:
    """The cache id of a prompt's reply: the prompt id for the greedy one (variant 0), else ``<id>~s<j>``."""
    return prompt_id if variant == 0 else f"{prompt_id}~s{variant}"


def is_sampled(rid: str) -> bool:
    """Whether a cache id (:func:`reply_id`) names a sampled reply rather than the greedy one."""
    return "~s" in rid


def read_replies(cache_dir: str | Path) -> list[Reply]:
    """The replies cached so far (lines whose shard file exists)."""
    path = Path(cache_dir) / REPLIES_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").split("\n"):
        if line.strip():
            rec = json.loads(line)
            if (Path(cache_dir) / rec["shard"]).is_file():
                out.append(Reply(rec["id"], rec["tokens"], rec["shard"], rec["key"], rec.get("prompt_tokens", 0)))
    return out


class _NormCapture:
    """Forward hook collecting the final norm's output [B, s, d] of every forward call."""

    def __init__(self, module: nn.Module):
        self.outputs: list[torch.Tensor] = []
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, _module, _inputs, output):
        self.outputs.append(output.detach()[:, -1:] if not self.outputs else output.detach())

    def remove(self) -> None:
        self.handle.remove()


@torch.no_grad()
def generate_batch(hf_model, tokenizer, prompt_ids: list[list[int]], *, max_new_tokens: int,
                   eos_token_ids: Sequence[int], pad_token_id: int, hidden_dtype: torch.dtype = torch.bfloat16,
                   temperature: float = 0.0, seed: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    """Replies of a batch (left padding) with their aligned hidden states (``hidden_dtype``, on the CPU).

    Runs on the model's device. ``temperature`` 0 is greedy; above 0 the replies are sampled
    from the backbone's full distribution at that temperature, seeded with ``seed`` (the
    hidden states, and so the soft targets, are the backbone's own whatever the tokens).

    Returns:
        per prompt: (tokens r_0..r_{n-1}, hidden [n, d] where hidden[i] predicts r_i).
    """
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for b, p in enumerate(prompt_ids):
        ids[b, width - len(p):] = torch.tensor(p)
        att[b, width - len(p):] = 1
    device = next(hf_model.parameters()).device
    ids, att = ids.to(device), att.to(device)
    sampling = {"do_sample": False, "temperature": None}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": float(temperature)}
        torch.manual_seed(seed)  # seeds the CPU and every CUDA device
    capture = _NormCapture(hf_model.model.norm)
    try:
        # The default dynamic cache: a static one made transformers' repeat_kv expand the whole
        # preallocated cache every step (69% of the time on long chat prompts, batch 32).
        out = hf_model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new_tokens,
                                eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id,
                                top_p=None, top_k=None, **sampling)
    finally:
        capture.remove()
    hidden = torch.cat(capture.outputs, dim=1)  # [B, steps, d]: hidden[:, i] predicts generated token i
    gen = out[:, width:].cpu()
    hidden = hidden.cpu()
    eos = set(int(e) for e in eos_token_ids)
    results = []
    for b in range(len(prompt_ids)):
        toks = [int(t) for t in gen[b]]
        n = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
        results.append((toks[:n], hidden[b, :n].to(hidden_dtype).clone()))
    return results


def generate_replies(hf_model, tokenizer, chat_template: str | None, prompts: Sequence[Prompt],
                     cache_dir: str | Path, *, batch_size: int = 32, max_new_tokens: int = 384,
                     max_prompt_tokens: int = 768, eos_token_ids: Sequence[int], pad_token_id: int,
                     progress: bool = True, budget_tokens: int | None = None,
                     hidden_dtype: torch.dtype = torch.bfloat16, sort_window: int = 2,
                     part: tuple[int, int] = (0, 1), samples: int = 1, temperature: float = 0.7,
                     seed: int = 0) -> list[Reply]:
    """Answer every prompt not yet in the cache; append shards and reply lines as batches finish.

    Args:
        hf_model: a transformers causal LM (eval mode) whose ``.model.norm`` is the final norm.
        tokenizer, chat_template: to render the prompts.
        prompts: in order; they are answered in that order (so a partial cache is a prefix).
        cache_dir: where ``replies.jsonl`` and the shards go.
        batch_size, max_new_tokens: generation settings (greedy).
        max_prompt_tokens: longer prompts are skipped.
        eos_token_ids, pad_token_id: stop tokens and the left-padding token.
        budget_tokens: stop once the cache holds this many reply tokens (None: all prompts).
        sort_window: prompts are sorted by length inside windows of this many batches (less
            padding; a small window keeps a partial cache a fair sample of the order).
        hidden_dtype: storage dtype of the hidden states (bf16 for training; fp32 where top-k
            ties matter, as in calibration).
        part: (i, n): answer only the prompts at positions i, i + n, i + 2n, ... of ``prompts``
            (the full list, so the split never depends on what is cached), so that n processes
            (one thread each) can fill the same cache side by side; their shards are named by
            part and each batch's reply lines go to the file in one append.
        samples: replies per prompt: the greedy one (id = the prompt's id) and ``samples - 1``
            sampled at ``temperature`` (ids ``<prompt id>~s<j>``), more training text per
            prompt (self-distillation data, seeds/001 §2.3.2). Each pass over the prompts is
            one variant; a sampled batch is seeded from ``seed`` and its reply ids, so a
            restart draws the same replies.

    Returns:
        All cached replies.

    Raises:
        ValueError: a bad ``part`` or ``samples`` < 1.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    from ..chat import apply_chat_template

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    done = read_replies(cache)
    have = {r.id for r in done}
    total = sum(len(r.tokens) for r in done)
    i_part, n_part = part
    if not 0 <= i_part < n_part:
        raise ValueError(f"part must be i/n with 0 <= i < n, got {i_part}/{n_part}")
    if samples < 1:
        raise ValueError(f"samples must be at least 1 (the greedy reply), got {samples}")
    mine = []
    for p in list(prompts)[i_part::n_part]:  # split the full list, so parts never depend on what is cached
        if all(reply_id(p.id, j) in have for j in range(samples)):
            continue  # every variant cached: no need to render it
        ids = apply_chat_template(tokenizer, chat_template, list(p.messages))
        if len(ids) <= max_prompt_tokens:
            mine.append((p, ids))
    window = batch_size * max(1, sort_window)
    batches = []  # (variant j, [(reply id, prompt ids)]); variant 0 is greedy, one pass per variant
    for j in range(samples):
        todo = [(reply_id(p.id, j), ids) for p, ids in mine if reply_id(p.id, j) not in have]
        for w in range(0, len(todo), window):
            todo[w:w + window] = sorted(todo[w:w + window], key=lambda e: len(e[1]))
        batches += [(j, todo[b:b + batch_size]) for b in range(0, len(todo), batch_size)]
    tag = f"p{i_part}of{n_part}-" if n_part > 1 else ""
    shard_no = len(list(cache.glob(f"shard-{tag}[0-9]*.safetensors")))
    bar = tqdm(total=len(done) + sum(len(b) for _, b in batches), initial=len(done), desc="self-distillation",
               unit="reply", disable=not progress, dynamic_ncols=True)
    t0, new_tokens = time.perf_counter(), 0
    for j, batch in batches:
        if budget_tokens is not None and total >= budget_tokens:
            break
        batch_seed = zlib.crc32("|".join(rid for rid, _ in batch).encode("utf-8")) ^ seed
        results = generate_batch(hf_model, tokenizer, [ids for _, ids in batch], max_new_tokens=max_new_tokens,
                                 eos_token_ids=eos_token_ids, pad_token_id=pad_token_id, hidden_dtype=hidden_dtype,
                                 temperature=temperature if j else 0.0, seed=batch_seed)
        name = f"shard-{tag}{shard_no:05d}.safetensors"
        shard_no += 1
        save_file({f"r{i}": h for i, (_, h) in enumerate(results)}, str(cache / name))
        lines = []
        for i, ((rid, ids), (toks, _)) in enumerate(zip(batch, results)):
            rep = Reply(rid, toks, name, f"r{i}", len(ids))
            done.append(rep)
            lines.append(json.dumps(asdict(rep)) + "\n")
            total += len(toks)
            new_tokens += len(toks)
        data = "".join(lines).encode("utf-8")
        fd = os.open(cache / REPLIES_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # one O_APPEND write per batch: parts writing the same file never interleave lines
            while data:
                data = data[os.write(fd, data):]
        finally:
            os.close(fd)
        bar.update(len(batch))
        bar.set_postfix(tokens=total, tok_s=f"{new_tokens / (time.perf_counter() - t0):.0f}")
    bar.close()
    return done


def load_hidden(cache_dir: str | Path, replies: Sequence[Reply]) -> list[torch.Tensor]:
    """The hidden states (bf16 [n, d]) of each reply, read from the shards."""
    from safetensors import safe_open

    out: list[torch.Tensor | None] = [None] * len(replies)
    by_shard: dict[str, list[int]] = {}
    for i, r in enumerate(replies):
        by_shard.setdefault(r.shard, []).append(i)
    for shard, idx in by_shard.items():
        with safe_open(str(Path(cache_dir) / shard), framework="pt") as f:
            for i in idx:
                out[i] = f.get_tensor(replies[i].key)
    return out  # type: ignore[return-value]


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
    from ..loading.registry import entry_for, load_entry_backbone
    from ..loading.transformers_twin import transformers_twin

    entry, local = entry_for(model)
    loaded = load_entry_backbone(entry, local or model_path, dtype=dtype)
    hf_model = transformers_twin(loaded.backbone).to(device)
    tokenizer, eos = loaded.tokenizer, loaded.eos_token_ids
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    hf_model.requires_grad_(False)
    return Generator(hf_model, tokenizer, loaded.chat_template, eos, int(pad), loaded.source, loaded)


# ---------------------------------------------------------------------------
# Training data: positions, targets (hard or soft)
# ---------------------------------------------------------------------------


@dataclass
class TrainData:
    """Every training position of a set of replies.

    Attributes:
        hidden: bf16 [N, d], the hidden state at each position (all replies concatenated).
        target_ids: int64 [N, K, S]; for head k (column k-1), the target token(s) at the
            position (S = 1 for hard labels, the teacher's top-S for soft targets).
        target_p: float32 [N, K, S]; their weights (sum 1 per row; 0 where invalid).
        valid: bool [N, K]; head k has a target (the reply is long enough).
    """

    hidden: torch.Tensor
    target_ids: torch.Tensor
    target_p: torch.Tensor
    valid: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.hidden.shape[0])


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


@torch.no_grad()
def teacher_topk(hidden: torch.Tensor, lm_weight: torch.Tensor, k: int, *, chunk: int = 2048,
                 progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The backbone's own next-token distribution at each position, truncated to its top-k.

    Args:
        hidden: [N, d] final-norm hidden states.
        lm_weight: [V, d] the frozen LM head; the product runs on its device.
        k: how many tokens to keep; the kept probabilities are renormalised to sum 1.

    Returns:
        (ids int64 [N, k], probs float32 [N, k]), on the CPU.
    """
    from tqdm import tqdm

    w = lm_weight.to(torch.bfloat16)
    ids, probs = [], []
    for s in tqdm(range(0, hidden.shape[0], chunk), desc="teacher top-k", disable=not progress, dynamic_ncols=True):
        logits = (hidden[s:s + chunk].to(w.device, torch.bfloat16) @ w.T).float()
        p, i = torch.softmax(logits, dim=-1).topk(k, dim=-1)
        ids.append(i.cpu())
        probs.append((p / p.sum(-1, keepdim=True)).cpu())
    return torch.cat(ids), torch.cat(probs)


def build_train_data(tokens: Sequence[Sequence[int]], hiddens: Sequence[torch.Tensor], num_heads: int, *,
                     lm_weight: torch.Tensor | None = None, soft_topk: int = 0,
                     teacher: tuple[torch.Tensor, torch.Tensor] | None = None) -> TrainData:
    """Positions and targets of a set of replies (alignment in the module docstring).

    Args:
        tokens: each reply's tokens r_0..r_{n-1}.
        hiddens: each reply's hidden states [n, d] (hidden[i] predicts r_i).
        num_heads: K.
        lm_weight: the frozen LM head (needed for soft targets unless ``teacher`` is given).
        soft_topk: 0 for hard labels (the reply's tokens); S > 0 for the teacher's top-S
            distribution at the target position (seeds/001 §2.3.2 self-distillation).
        teacher: precomputed :func:`teacher_topk` output for the concatenated positions.

    Returns:
        :class:`TrainData`, positions with no valid target dropped.
    """
    lengths = [len(t) for t in tokens]
    hidden = torch.cat(list(hiddens)) if hiddens else torch.zeros(0, 0)
    index, valid = future_index(lengths, num_heads)
    if soft_topk:
        if teacher is None:
            teacher = teacher_topk(hidden, lm_weight, soft_topk)
        t_ids, t_p = teacher
        target_ids, target_p = t_ids[index], t_p[index].float()  # [N, K, S]
    else:
        flat = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long)
        target_ids, target_p = flat[index][..., None], torch.ones(index.shape + (1,))
    target_p = target_p * valid[..., None]
    keep = valid[:, 0]
    return TrainData(hidden[keep], target_ids[keep], target_p[keep], valid[keep])


# ---------------------------------------------------------------------------
# Loss and training loop
# ---------------------------------------------------------------------------


def medusa_loss(heads: MedusaHeads, lm_weight_bf16: torch.Tensor, hidden: torch.Tensor, target_ids: torch.Tensor,
                target_p: torch.Tensor, valid: torch.Tensor, *, decay: float = LOSS_DECAY
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Medusa-1 loss sum_k decay^k * CE(head k, targets) (seeds/001 eq. 1, app. B.2).

    The vocab projection is the frozen, shared LM head, run in bf16 (fast on CPUs with
    AVX512-BF16/AMX); the residual blocks and the softmax run in fp32.

    Args:
        heads: heads without their own projection.
        lm_weight_bf16: [V, d] the LM head weight in bf16 (no grad).
        hidden: [B, d]; target_ids int64 [B, K, S]; target_p [B, K, S]; valid bool [B, K].

    Returns:
        (loss scalar, per-head mean CE [K] (detached), per-head top-1 hits vs the first
        target [K] (detached counts)).
    """
    h = hidden.float()
    loss = h.new_zeros(())
    ces, hits = [], []
    for k, head in enumerate(heads.heads):
        y = head(h)
        logits = nn.functional.linear(y.to(torch.bfloat16), lm_weight_bf16).float()
        ce = torch.logsumexp(logits, -1) - (logits.gather(1, target_ids[:, k]) * target_p[:, k]).sum(-1)
        m = valid[:, k].float()
        ce_k = (ce * m).sum() / m.sum().clamp(min=1)
        loss = loss + decay ** (k + 1) * ce_k
        ces.append(ce_k.detach())
        hits.append(((logits.argmax(-1) == target_ids[:, k, 0]) & valid[:, k]).sum().detach())
    return loss, torch.stack(ces), torch.stack(hits)


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
    seed: int = 0


@dataclass
class TrainResult:
    heads: MedusaHeads
    steps: int
    seconds: float
    history: list[dict] = field(default_factory=list)


def train_heads(data: TrainData, lm_head: nn.Linear, config: TrainConfig, *, progress: bool = True,
                checkpoint: str | Path | None = None, log: Callable[[dict], None] | None = None) -> TrainResult:
    """Train fresh heads (§2.1.1 init: zero residual blocks, shared frozen LM head).

    AdamW, linear warmup then cosine decay, shuffled positions (fixed seed). With
    ``checkpoint``, the heads, optimiser and step are saved there every 200 steps and at
    the end, and a run with the same data and config resumes from it. Training runs on
    ``lm_head``'s device (the data is moved there once); the heads come back on the CPU.
    """
    from tqdm import tqdm

    torch.manual_seed(config.seed)
    vocab, hidden = lm_head.weight.shape
    device = lm_head.weight.device
    cfg = HeadsConfig(config.num_heads, config.num_layers, hidden, vocab, own_projection=False)
    heads = MedusaHeads(cfg, lm_head).float().train().to(device)
    w_bf16 = lm_head.weight.detach().to(torch.bfloat16)
    if device.type != "cpu":
        data = TrainData(data.hidden.to(device), data.target_ids.to(device), data.target_p.to(device),
                         data.valid.to(device))
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
        loss, ce, hits = medusa_loss(heads, w_bf16, data.hidden[idx], data.target_ids[idx], data.target_p[idx],
                                     data.valid[idx], decay=config.loss_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        nvalid = data.valid[idx].sum(0)
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

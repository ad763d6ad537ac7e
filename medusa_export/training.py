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
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from .heads import HeadsConfig, MedusaHeads

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
    for n, line in enumerate(path.read_text().splitlines()):
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


def read_replies(cache_dir: str | Path) -> list[Reply]:
    """The replies cached so far (lines whose shard file exists)."""
    path = Path(cache_dir) / REPLIES_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
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
                   eos_token_ids: Sequence[int], pad_token_id: int) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy replies of a batch (left padding) with their aligned hidden states.

    Returns:
        per prompt: (tokens r_0..r_{n-1}, hidden [n, d] where hidden[i] predicts r_i).
    """
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    att = torch.zeros_like(ids)
    for b, p in enumerate(prompt_ids):
        ids[b, width - len(p):] = torch.tensor(p)
        att[b, width - len(p):] = 1
    capture = _NormCapture(hf_model.model.norm)
    try:
        out = hf_model.generate(input_ids=ids, attention_mask=att, do_sample=False, max_new_tokens=max_new_tokens,
                                eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id,
                                temperature=None, top_p=None, top_k=None)
    finally:
        capture.remove()
    hidden = torch.cat(capture.outputs, dim=1)  # [B, steps, d]: hidden[:, i] predicts generated token i
    gen = out[:, width:]
    eos = set(int(e) for e in eos_token_ids)
    results = []
    for b in range(len(prompt_ids)):
        toks = [int(t) for t in gen[b]]
        n = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
        results.append((toks[:n], hidden[b, :n].to(torch.bfloat16).clone()))
    return results


def generate_replies(hf_model, tokenizer, chat_template: str | None, prompts: Sequence[Prompt],
                     cache_dir: str | Path, *, batch_size: int = 32, max_new_tokens: int = 384,
                     max_prompt_tokens: int = 768, eos_token_ids: Sequence[int], pad_token_id: int,
                     progress: bool = True, budget_tokens: int | None = None) -> list[Reply]:
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

    Returns:
        All cached replies.
    """
    from safetensors.torch import save_file
    from tqdm import tqdm

    from .chat import apply_chat_template

    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    done = read_replies(cache)
    have = {r.id for r in done}
    total = sum(len(r.tokens) for r in done)
    todo = [p for p in prompts if p.id not in have]
    shard_no = len(list(cache.glob("shard-*.safetensors")))
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="self-distillation", unit="prompt",
               disable=not progress, dynamic_ncols=True)
    t0, new_tokens = time.perf_counter(), 0
    for start in range(0, len(todo), batch_size):
        if budget_tokens is not None and total >= budget_tokens:
            break
        batch = todo[start:start + batch_size]
        encoded = [(p, apply_chat_template(tokenizer, chat_template, list(p.messages))) for p in batch]
        encoded = [(p, ids) for p, ids in encoded if len(ids) <= max_prompt_tokens]
        bar.update(len(batch) - len(encoded))
        if not encoded:
            continue
        results = generate_batch(hf_model, tokenizer, [ids for _, ids in encoded], max_new_tokens=max_new_tokens,
                                 eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        name = f"shard-{shard_no:05d}.safetensors"
        shard_no += 1
        save_file({f"r{i}": h for i, (_, h) in enumerate(results)}, str(cache / name))
        with (cache / REPLIES_FILE).open("a") as f:
            for i, ((p, ids), (toks, _)) in enumerate(zip(encoded, results)):
                rep = Reply(p.id, toks, name, f"r{i}", len(ids))
                done.append(rep)
                f.write(json.dumps(asdict(rep)) + "\n")
                total += len(toks)
                new_tokens += len(toks)
        bar.update(len(encoded))
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

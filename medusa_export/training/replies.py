"""Self-distillation replies: prompts -> decode requests -> the reply store (Medusa paper §2.3.2).

The backbone answers every training prompt greedily, plus ``samples - 1`` replies sampled at a
temperature (more text from few prompts), with :class:`~medusa_export.training.batch_decode.BatchedDecoder`;
replies go to a :class:`~medusa_export.training.reply_store.ReplyStore` as token ids, a chunk at a
time, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Iterator, Sequence

from .batch_decode import BatchedDecoder, DecodeRequest
from .reply_store import ReplyStore, StoredReply, reply_token_count


def reply_id(prompt_id: str, variant: int) -> str:
    """The id of a prompt's reply: the prompt id for the greedy one (variant 0), else ``<id>~s<j>``."""
    return prompt_id if variant == 0 else f"{prompt_id}~s{variant}"


def is_sampled(rid: str) -> bool:
    """Whether a reply id (:func:`reply_id`) names a sampled reply rather than the greedy one."""
    return "~s" in rid


def decode_requests(tokenizer, chat_template: str | None, prompts: Sequence, *, have: set[str] = frozenset(),
                    samples: int = 1, temperature: float = 0.7, seed: int = 0, max_prompt_tokens: int = 768,
                    part: tuple[int, int] = (0, 1), sort_window: int = 0) -> list[DecodeRequest]:
    """The replies still to generate, in order: every prompt's greedy reply, then each sampled pass.

    Args:
        tokenizer, chat_template: render the prompts (:func:`medusa_export.chat.apply_chat_template`).
        prompts: :class:`~medusa_export.training.distill.Prompt` list, in the order to answer them.
        have: reply ids already stored (skipped).
        samples: replies per prompt, the greedy one included.
        temperature: of the sampled replies.
        seed: sampling seed (each reply's generator also mixes in its id).
        max_prompt_tokens: longer prompts are skipped.
        part: (i, n): only the prompts at positions i, i + n, ... of the full list (n processes
            filling one store side by side).
        sort_window: sort by prompt length within windows of this many requests (0: no sorting);
            neighbours of similar length keep the decoder's KV buffers short, and a window keeps a
            partly filled store a fair sample of the order.

    Raises:
        ValueError: a bad ``part`` or ``samples`` < 1.
    """
    from ..chat import apply_chat_template

    i_part, n_part = part
    if not 0 <= i_part < n_part:
        raise ValueError(f"part must be i/n with 0 <= i < n, got {i_part}/{n_part}")
    if samples < 1:
        raise ValueError(f"samples must be at least 1 (the greedy reply), got {samples}")
    mine = []
    for p in list(prompts)[i_part::n_part]:
        if all(reply_id(p.id, j) in have for j in range(samples)):
            continue
        ids = apply_chat_template(tokenizer, chat_template, list(p.messages))
        if len(ids) <= max_prompt_tokens:
            mine.append((p, tuple(ids)))
    out: list[DecodeRequest] = []
    for j in range(samples):
        todo = [DecodeRequest(reply_id(p.id, j), ids, temperature if j else 0.0, seed)
                for p, ids in mine if reply_id(p.id, j) not in have]
        if sort_window > 1:
            for w in range(0, len(todo), sort_window):
                todo[w:w + sort_window] = sorted(todo[w:w + sort_window], key=lambda r: len(r.prompt))
        out += todo
    return out


def generate_to_store(decoder: BatchedDecoder, requests: Sequence[DecodeRequest], store: ReplyStore, *,
                      max_new_tokens: int, eos_token_ids: Sequence[int], budget_tokens: int | None = None,
                      flush_replies: int = 256, flush_seconds: float = 120.0, progress: bool = True) -> dict:
    """Answer ``requests`` with ``decoder`` and append the replies to ``store`` as they end.

    Replies are flushed as one chunk every ``flush_replies`` replies or ``flush_seconds`` seconds,
    and at the end, also when interrupted: Ctrl-C, or SIGTERM (a deadline's ``timeout``), which
    is turned into ``SystemExit`` while this runs in the main thread.

    Args:
        budget_tokens: stop starting new replies once the store would hold this many reply
            tokens (the replies under way are finished).

    Returns:
        {"replies": new replies, "tokens": new reply tokens, "seconds": wall time,
         "tokens_per_second": new reply tokens per second}.
    """
    from tqdm import tqdm

    stored = reply_token_count(store.read()) if budget_tokens is not None else 0
    pending: list[StoredReply] = []
    state = {"replies": 0, "tokens": 0, "last_flush": time.perf_counter()}
    bar = tqdm(total=len(requests), desc="self-distillation", unit="reply", disable=not progress, dynamic_ncols=True)
    t0 = time.perf_counter()

    def flush() -> None:
        store.append(pending)
        pending.clear()
        state["last_flush"] = time.perf_counter()

    def feed() -> Iterator[DecodeRequest]:
        for req in requests:
            if budget_tokens is not None and stored + state["tokens"] >= budget_tokens:
                return
            yield req

    def on_reply(req: DecodeRequest, tokens: list[int]) -> None:
        import numpy as np

        pending.append(StoredReply(req.id, np.asarray(req.prompt), np.asarray(tokens), req.temperature))
        state["replies"] += 1
        state["tokens"] += len(tokens)
        bar.update(1)
        bar.set_postfix(tok_s=f"{state['tokens'] / (time.perf_counter() - t0):.0f}")
        if len(pending) >= flush_replies or time.perf_counter() - state["last_flush"] > flush_seconds:
            flush()

    def stop(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through ``finally``: the replies so far are flushed

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        decoder.run(feed(), max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids, on_reply=on_reply)
    finally:
        flush()
        bar.close()
        if main:
            signal.signal(signal.SIGTERM, previous)
    dt = time.perf_counter() - t0
    return {"replies": state["replies"], "tokens": state["tokens"], "seconds": round(dt, 2),
            "tokens_per_second": round(state["tokens"] / dt, 1) if dt > 0 else 0.0}

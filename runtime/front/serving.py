"""Serving one request over a :class:`~.session.MedusaSession`: request checking and per-step streaming.

A server (the Triton Python-backend model written by ``medusa-export triton``, or any
other) hands over the request's fields as plain values; :func:`merge_fields` joins the
ones given as tensors and as request parameters, :func:`parse_request` checks them and
encodes the prompt, and :func:`serve` runs the Medusa loop, calling back once per tree
step with that step's token ids and newly printable text; :class:`BatchServer` serves
requests from many threads together, up to ``batch_size`` of them sharing each step
(in-flight batching), each with the tokens :func:`serve` would give it alone. Every malformed field raises
:class:`RequestError` naming the field, so a server can answer with an error and keep
serving. Torch-free (numpy + the session's engine and tokenizer).

Request fields (all optional but the prompt):

=================  ===============================  ============================================
field              value                            meaning
=================  ===============================  ============================================
``text_input``     str                              a user message (chat template applied) or,
                                                    with ``raw``, text encoded as is
``messages``       str (JSON list) or list          ``[{"role", "content"}, ...]`` through the
                                                    chat template
``input_ids``      ints                             prompt token ids, used as is
``max_new_tokens`` int, 1 .. limit                  reply budget (default
                                                    :data:`DEFAULT_MAX_NEW_TOKENS`)
``temperature``    float >= 0                       0: greedy (lossless); > 0: sample
``acceptance``     "greedy", "sample", "typical"    default: greedy at temperature 0, sample
                                                    (exact) above
``top_k``          int >= 0                         0 = whole vocabulary (needs the in-graph
                                                    sampler); default 10
``top_p``          float in (0, 1]                  nucleus inside the top-k; 1 = off
``posterior_threshold``  float in (0, 1]            typical acceptance epsilon
``posterior_alpha``      float > 0                  typical acceptance delta
``seed``           int >= 0                         sampling seed (reproducible)
``stop``           str or list of str               stop strings (the text is cut where one starts)
``stream``         bool                             one response per tree step (decoupled mode)
``raw``            bool                             ``text_input`` without the chat template
=================  ===============================  ============================================

Exactly one of ``text_input``, ``messages`` and ``input_ids`` is given. The sampling
settings' defaults are :class:`~medusa_runtime.decode.acceptance.SamplingConfig`'s.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from ..decode.acceptance import SAMPLING_SETTINGS, SamplingConfig
from ..errors import ChatTemplateError, InvalidSettingError, MedusaError
from ..decode.batch import DEFAULT_BATCH_SIZE, Scheduler, SequenceRequest
from ..decode.loop import generate
from .session import DEFAULT_MAX_NEW_TOKENS, Completion, MedusaSession, ReplyText

PROMPT_FIELDS = ("text_input", "messages", "input_ids")
#: The request fields that are :class:`SamplingConfig` settings (same names, read from :data:`SAMPLING_SETTINGS`).
SAMPLING_FIELDS = tuple(setting.name for setting in SAMPLING_SETTINGS)
FIELDS = PROMPT_FIELDS + ("max_new_tokens",) + SAMPLING_FIELDS + ("stop", "stream", "raw")
#: Request parameters with this prefix belong to the server or client library, not to us.
RESERVED_PREFIX = "triton_"


class RequestError(MedusaError, ValueError):
    """A malformed request (missing/empty prompt, wrong type, out-of-range value); the message names the field."""


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request.

    Attributes:
        prompt_ids: the prompt's token ids (chat template applied), length >= 1.
        max_new_tokens: reply budget (>= 1).
        sampling: temperature, acceptance, top-k/top-p, typical's thresholds, seed (checked
            against the session's artifact).
        stop: stop strings.
        stream: answer once per tree step.
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sampling: SamplingConfig = SamplingConfig()
    stop: tuple[str, ...] = ()
    stream: bool = False


def merge_fields(inputs: Mapping[str, object], parameters: Mapping[str, object]) -> dict:
    """Join the fields given as input tensors and as request parameters.

    Args:
        inputs: field -> value of the request's input tensors.
        parameters: the request's parameters (keys starting with :data:`RESERVED_PREFIX` are ignored).

    Raises:
        RequestError: an unknown field, or a field given both ways.
    """
    fields = dict(inputs)
    for key, value in parameters.items():
        if key.startswith(RESERVED_PREFIX):
            continue
        if key not in FIELDS:
            raise RequestError(f"unknown request parameter {key!r}; known: {', '.join(FIELDS)}")
        if key in fields:
            raise RequestError(f"{key} is given both as an input tensor and as a request parameter; give it once")
        fields[key] = value
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise RequestError(f"unknown request field {unknown[0]!r}; known: {', '.join(FIELDS)}")
    return fields


def _scalar(name: str, value):
    """One value from a scalar, a 1-element list or a 1-element array."""
    if isinstance(value, np.ndarray):
        if value.size != 1:
            raise RequestError(f"{name} must hold one value, got shape {list(value.shape)}")
        value = value.reshape(-1)[0]
    elif isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise RequestError(f"{name} must hold one value, got {len(value)}")
        value = value[0]
    return value.item() if isinstance(value, np.generic) else value


def _text(name: str, value) -> str:
    value = _scalar(name, value)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"{name} is not valid UTF-8") from None
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {type(value).__name__}")
    return value


def _int(name: str, value, lo: int, hi: int | None = None) -> int:
    value = _scalar(name, value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < lo or (hi is not None and value > hi):
        span = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
        raise RequestError(f"{name} must be {span}, got {value}")
    return value


def _bool(name: str, value) -> bool:
    value = _scalar(name, value)
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r} ({type(value).__name__})")
    return value


def _float(name: str, value) -> float:
    value = _scalar(name, value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _stop(value) -> tuple[str, ...]:
    items = value.reshape(-1).tolist() if isinstance(value, np.ndarray) else value
    if isinstance(items, (str, bytes)):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise RequestError(f"stop must be a string or a list of strings, got {type(value).__name__}")
    out = tuple(_text("stop", s) for s in items)
    if any(not s for s in out):
        raise RequestError("stop contains an empty string")
    return out


def _messages(value) -> list[dict]:
    if not isinstance(value, list):
        try:
            value = json.loads(_text("messages", value))
        except json.JSONDecodeError as exc:
            raise RequestError(f"messages is not valid JSON: {exc}") from None
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty JSON list of {\"role\", \"content\"} objects")
    for i, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise RequestError(f"messages[{i}] must be an object with string 'role' and 'content'")
    return value


def _input_ids(value, vocab_size: int) -> tuple[int, ...]:
    arr = np.asarray(value)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise RequestError(f"input_ids must be integers, got {arr.dtype}")
    ids = tuple(int(t) for t in arr.reshape(-1))
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"input_ids holds {bad[0]}, outside the vocabulary 0..{vocab_size - 1}")
    return ids


#: How a sampling setting's value is read from a request, by its wire dtype (runtime.acceptance.SETTING_DTYPES):
#: the type here, the range by :class:`SamplingConfig` (integers: >= 0 here; an int64 fits its dtype).
_SETTING_PARSERS = {
    "float32": _float,
    "int32": lambda name, value: _int(name, value, 0),
    "int64": lambda name, value: _int(name, value, 0, 2**63 - 1),
    "string": _text,
}


def _sampling(fields: Mapping[str, object], session: MedusaSession) -> SamplingConfig:
    """The request's :class:`SamplingConfig` (types checked here, ranges by the dataclass, exactness by the session)."""
    given = {s.name: _SETTING_PARSERS[s.dtype](s.name, fields[s.name]) for s in SAMPLING_SETTINGS if s.name in fields}
    try:
        return session.sampling(**given)
    except InvalidSettingError as exc:
        raise RequestError(str(exc)) from None


def parse_request(fields: Mapping[str, object], session: MedusaSession, *,
                  max_new_tokens_limit: int | None = None) -> GenerationRequest:
    """Check a request's fields and encode its prompt.

    Args:
        fields: field -> value (see the module docstring; :func:`merge_fields` output).
        session: the loaded session (tokenizer, vocabulary, context).
        max_new_tokens_limit: the largest ``max_new_tokens`` accepted (default: the session's context).

    Raises:
        RequestError: no prompt or several, an empty prompt, a prompt longer than the
            context, a wrong type or an out-of-range value; the message names the field.
    """
    given = [f for f in PROMPT_FIELDS if f in fields]
    if len(given) != 1:
        raise RequestError(f"give exactly one of {', '.join(PROMPT_FIELDS)} (got {', '.join(given) or 'none'})")
    limit = max_new_tokens_limit or session.max_context
    sampling = _sampling(fields, session)
    raw = _bool("raw", fields["raw"]) if "raw" in fields else False
    try:
        if "input_ids" in fields:
            ids = _input_ids(fields["input_ids"], int(session.artifact.model.vocab_size))
        elif "messages" in fields:
            ids = tuple(session.encode(_messages(fields["messages"])))
        else:
            text = _text("text_input", fields["text_input"])
            if not text:
                raise RequestError("text_input is empty")
            ids = tuple(session.encode(text, raw=raw))
    except ChatTemplateError as exc:
        raise RequestError(f"the chat template rejects the prompt: {exc}") from None
    if not ids:
        raise RequestError(f"the prompt ({given[0]}) is empty: give at least one token")
    if len(ids) > session.max_context:
        raise RequestError(f"the prompt has {len(ids)} tokens; the context holds {session.max_context}")
    return GenerationRequest(
        prompt_ids=ids,
        max_new_tokens=_int("max_new_tokens", fields["max_new_tokens"], 1, limit)
        if "max_new_tokens" in fields else min(DEFAULT_MAX_NEW_TOKENS, limit),
        sampling=sampling,
        stop=_stop(fields["stop"]) if "stop" in fields else (),
        stream=_bool("stream", fields["stream"]) if "stream" in fields else False,
    )


def serve(session: MedusaSession, req: GenerationRequest,
          on_step: Callable[[list[int], str], None] | None = None,
          cancelled: Callable[[], bool] | None = None) -> Completion:
    """Generate the reply to one checked request, alone (batch size 1; :class:`BatchServer` batches).

    Args:
        session: the loaded session (engine, tree, tokenizer, context).
        req: the request (:func:`parse_request`).
        on_step: called after each step that emitted something with the step's token ids
            (EOS excluded, cut at a stop string) and the newly printable text; a last call
            with no ids may carry text held back until the end.
        cancelled: polled after each step; True ends the generation (finish reason "cancelled").

    Returns:
        The :class:`Completion`, as :meth:`MedusaSession.generate` returns it (same tokens
        for the same request).
    """
    reply = ReplyText(session.tokenizer, req.stop, on_step)
    state = {"cancelled": False}

    def on_tokens(tokens: list[int]) -> bool | int | None:
        kept = reply.feed(tokens)
        if kept is not None:
            return kept
        if cancelled is not None and cancelled():
            state["cancelled"] = True
            return True
        return None

    t = time.perf_counter()
    res = generate(session.engine, req.prompt_ids, session.tree, max_new_tokens=req.max_new_tokens,
                   eos_token_ids=session.eos_token_ids, max_context=session.max_context, sampling=req.sampling,
                   on_tokens=on_tokens)
    return reply.completion(res, len(req.prompt_ids), 0, time.perf_counter() - t,
                            "cancelled" if state["cancelled"] else None)


@dataclass(eq=False)
class _Job:
    """A request handed to :class:`BatchServer`, with its callbacks."""

    req: GenerationRequest
    reply: ReplyText
    on_done: Callable[[Completion | None, BaseException | None], None]
    cancelled: Callable[[], bool] | None


class BatchServer:
    """Checked requests from any thread, served together: one :class:`~medusa_runtime.decode.batch.Scheduler`
    on a background thread runs up to ``batch_size`` of them in each step (in-flight batching).

    Each request decodes exactly as :func:`serve` decodes it alone (its own seed, stops and KV
    row). Every callback runs on the background thread; one that raises ends its own request
    (``on_done`` gets the exception), never the others.

    Args:
        session: the loaded session (its batch engine, tree, tokenizer, context).
        batch_size: at most this many requests share a step (>= 1).
        log: called with a line when more requests than ever before share a step (default: silent).

    Raises:
        InvalidSettingError: ``batch_size`` < 1.
    """

    def __init__(self, session: MedusaSession, batch_size: int = DEFAULT_BATCH_SIZE,
                 log: Callable[[str], None] | None = None):
        self.session = session
        self.scheduler = Scheduler(session.batch_engine, session.tree, max_batch=batch_size,
                                   capacity=session.max_context, eos_token_ids=session.eos_token_ids)
        self.max_batch_seen = 0
        self._log = log
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="medusa-batch", daemon=True)
        self._thread.start()

    def submit(self, req: GenerationRequest, on_step: Callable[[list[int], str], None] | None,
               on_done: Callable[[Completion | None, BaseException | None], None],
               cancelled: Callable[[], bool] | None = None) -> None:
        """Queue a checked request; it joins the next step with a free row.

        Args:
            req: the request (:func:`parse_request`).
            on_step: as :func:`serve`'s (each step's ids and text), or None.
            on_done: called once at the end with (the :class:`Completion`, None), its finish
                reason "cancelled" when ``cancelled`` said so; or (None, the exception) when the
                request failed (a :class:`~medusa_runtime.errors.MedusaError` for a request the
                scheduler refused, anything a callback raised).
            cancelled: polled at each step boundary; True ends the request.

        Raises:
            RuntimeError: the server is closed.
        """
        if self._closed:
            raise RuntimeError("the batch server is closed")
        self._queue.put(_Job(req, ReplyText(self.session.tokenizer, req.stop, on_step), on_done, cancelled))

    def close(self, timeout: float = 30.0) -> None:
        """Stop the background thread after the current step; requests not finished get
        ``on_done(None, RuntimeError)``."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    # -- the background thread ---------------------------------------------------------

    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            jobs = [self._queue.get()] if sched.idle else []  # block only when there is nothing to do
            while True:
                try:
                    jobs.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if None in jobs or self._closed:
                self._abort([j for j in jobs if j is not None])
                return
            for job in jobs:
                self._admit(job)
            for s in list(sched.running) + list(sched.waiting):
                job = s.request.tag
                if job.cancelled is not None and self._safe(job, job.cancelled):
                    s.cancel()
            n = len(sched.running) + min(len(sched.waiting), sched.max_batch - len(sched.running))
            if n > self.max_batch_seen:
                self.max_batch_seen = n
                if self._log is not None and n > 1:
                    self._log(f"medusa: {n} sequences share a step (the most so far)")
            for s in sched.step():
                self._finish(s)

    def _admit(self, job: _Job) -> None:
        req = job.req
        try:
            # on_tokens is None when the request neither streams nor has stop strings: no per-step text decoding
            self.scheduler.submit(SequenceRequest(req.prompt_ids, req.max_new_tokens, req.sampling,
                                                  job.reply.on_tokens, tag=job))
        except MedusaError as exc:
            self._done(job, None, exc)

    def _finish(self, s) -> None:
        job: _Job = s.request.tag
        if s.error is not None:
            self._done(job, None, s.error)
            return
        try:
            out = job.reply.completion(s.result, len(job.req.prompt_ids), 0, s.seconds)
        except Exception as exc:  # noqa: BLE001 - on_step raised on the last piece
            self._done(job, None, exc)
            return
        self._done(job, out, None)

    @staticmethod
    def _done(job: _Job, out: Completion | None, exc: BaseException | None) -> None:
        try:
            job.on_done(out, exc)
        except Exception:  # noqa: BLE001 - the client is gone: nothing left to tell it
            pass

    def _safe(self, job: _Job, fn: Callable[[], bool]) -> bool:
        try:
            return bool(fn())
        except Exception:  # noqa: BLE001 - cannot ask: treat as cancelled
            return True

    def _abort(self, jobs: list[_Job]) -> None:
        pending = jobs + [s.request.tag for s in self.scheduler.abort()]  # their KV rows are released
        for job in pending:
            self._done(job, None, RuntimeError("the server is shutting down"))

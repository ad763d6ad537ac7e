"""Command line of the runtime (torch-free): ``python -m medusa_runtime generate|chat --artifact DIR``.

``medusa-export generate --artifact DIR`` and ``medusa-export chat --artifact DIR`` use the
same functions; this entry point exists for machines where only the runtime's
dependencies (numpy, onnxruntime, tokenizers, jinja2) are installed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import TextIO

from ..decode.acceptance import SAMPLING_SETTINGS, SamplingConfig
from ..engines import BACKENDS, DEFAULT_BACKEND
from ..engines.trt_plan import ENGINE_PRECISIONS
from ..decode.batch import DEFAULT_BATCH_SIZE
from ..errors import (EXIT_CODES_HELP, EXIT_INTERRUPTED, ChatTemplateError, ContextOverflowError, InvalidSettingError,
                     MedusaError)
from .prompts import PROMPT_FILE_FORMAT, read_prompt_file
from ..contract.tokenizer import NO_TEMPLATE_MESSAGE

#: The argparse type of each sampling setting's wire dtype (runtime.acceptance.SETTING_DTYPES).
_CLI_TYPES = {"float32": float, "int32": int, "int64": int, "string": str}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """--max-new-tokens and one option per sampling setting (:data:`SAMPLING_SETTINGS`: names, types, defaults
    and help read from :class:`SamplingConfig`)."""
    from .session import DEFAULT_MAX_NEW_TOKENS

    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"maximum new tokens, >= 0 (0: none, and no forward pass runs) "
                        f"(default: {DEFAULT_MAX_NEW_TOKENS})")
    for setting in SAMPLING_SETTINGS:
        p.add_argument(setting.option, type=_CLI_TYPES[setting.dtype], choices=setting.choices,
                       default=setting.default, help=setting.help)


def sampling_from_args(args) -> SamplingConfig:
    """The :class:`SamplingConfig` of parsed :func:`add_sampling_args` options.

    Raises:
        InvalidSettingError: a value out of its range (named with the valid range), before any
            model is loaded; also a negative --max-new-tokens.
    """
    from ..errors import InvalidSettingError

    if args.max_new_tokens < 0:
        raise InvalidSettingError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    return SamplingConfig(**{setting.name: getattr(args, setting.name) for setting in SAMPLING_SETTINGS})


def add_runtime_args(p: argparse.ArgumentParser, *, artifact_required: bool) -> None:
    """--artifact, --backend, --threads, --spin, --device-id, --stop, --vanilla (the runtime's own options)."""
    p.add_argument("--artifact", required=artifact_required, metavar="DIR",
                   help="run an artifact (medusa-export build output) with the torch-free runtime")
    p.add_argument("--backend", choices=sorted(BACKENDS), default=DEFAULT_BACKEND,
                   help=f"engine backend for --artifact (default: {DEFAULT_BACKEND})")
    p.add_argument("--threads", type=int, metavar="N",
                   help=f"CPU threads for --artifact, 1..{MAX_THREADS} (default: ONNX Runtime's choice)")
    p.add_argument("--spin", action="store_true",
                   help="onnxruntime backend: let the step's idle CPU threads busy-wait between operators instead of "
                        "sleeping: faster on a machine running nothing else (the embedded int4 model's decode step "
                        "7.5-8.0 ms against 11.2-11.7 on a 2-core VM, scripts/bench_step_overhead.py), slower on a "
                        "busy one or beside other spinning processes, and it keeps a core busy while decoding "
                        "(default: off)")
    p.add_argument("--device-id", type=int, metavar="N",
                   help="GPU for the onnxruntime-cuda and tensorrt backends (default: 0)")
    p.add_argument("--engine-precision", choices=ENGINE_PRECISIONS,
                   help="--backend tensorrt: which built plans to run (as built with "
                        "`medusa-export engine --precision`; default: the first built)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable); the reply is cut where it starts")
    p.add_argument("--vanilla", action="store_true", help="one token per step (no Medusa), same engine")
    p.add_argument("--tree", help="the tree to run (default: 'auto', cached: the tree fastest on this machine and "
                                  "engine, timed once per artifact, machine and backend, a few seconds and a one-line "
                                  "notice the first time; TensorRT engines default to the tree they were built for; "
                                  "$MEDUSA_EXPORT_TREE changes the default). Or: 'artifact' (the tree it was built "
                                  "with); N (the greedy N-node tree from the heads' calibrated accuracies); 'root' "
                                  "(plain decoding), 'chain' or 'chain:N' (the first N nodes of the chain, root "
                                  "included: what int4/int8 artifacts with int8 activations take); a JSON file of "
                                  "medusa_choices; 'auto' (time now, "
                                  "uncached, and print the table); 'dynamic:T' (a T-node tree chosen every step); "
                                  "'auto:dynamic'")


#: ``--threads`` takes 1..MAX_THREADS: ONNX Runtime starts every intra-op thread when a session is made (100000
#: hung there, -1 was passed on); above the machine's CPU count it runs, with a note (threads then share cores).
MAX_THREADS = 256


def check_threads(threads: int | None, err: TextIO | None = None) -> int | None:
    """``--threads``: None (ONNX Runtime's choice) or 1..:data:`MAX_THREADS`; a note on ``err`` (default: the
    current sys.stderr) when it exceeds ``os.cpu_count()``.

    Raises:
        InvalidSettingError: outside 1..MAX_THREADS (the message gives the range and this machine's CPUs).
    """
    import os

    cpus = os.cpu_count() or 1
    if threads is None:
        return None
    if not 1 <= threads <= MAX_THREADS:
        raise InvalidSettingError(f"--threads must be in 1..{MAX_THREADS} (this machine has {cpus} CPUs), got "
                                  f"{threads}; leave it out for ONNX Runtime's choice")
    if threads > cpus:
        print(f"[note: --threads {threads} is more than this machine's {cpus} CPUs: the threads share cores]",
              file=err or sys.stderr)
    return threads


def _session(args, prompts=None):
    """The session ``args`` ask for; ``prompts`` (generate's) are checked to fit the context first, before the engine
    is made and the tree timed (:func:`~.session.check_prompts_fit`)."""
    from ..contract.artifact import load_artifact
    from .session import MedusaSession, check_prompts_fit

    check_threads(args.threads)

    from ..tuning.autotree import format_table

    tree = getattr(args, "tree", None)
    device = {} if getattr(args, "device_id", None) is None else {"device_id": args.device_id}
    precision = getattr(args, "engine_precision", None)
    if precision is not None:
        if args.backend != "tensorrt":
            raise InvalidSettingError(f"--engine-precision picks TensorRT plans: use it with --backend tensorrt "
                                      f"(got --backend {args.backend})")
        device["precision"] = precision
    if getattr(args, "spin", False):
        if args.backend != "onnxruntime":
            raise InvalidSettingError(f"--spin sets the onnxruntime backend's CPU threads: use it with --backend "
                                      f"onnxruntime (got --backend {args.backend})")
        device["spin"] = True
    artifact = load_artifact(args.artifact)
    max_context = getattr(args, "max_context", None)
    if prompts is not None:
        check_prompts_fit(artifact, prompts, raw=getattr(args, "raw", False), max_context=max_context,
                          batched=getattr(args, "prompt_file", None) is not None)
    session = MedusaSession(artifact, backend=args.backend, threads=args.threads, max_context=max_context, tree=tree,
                            **device)
    if session.tree_resolution.timed_now:
        print(format_table(session.tree_timings, session.tree.size), file=sys.stderr)
        print(f"{session.tree_source.split(',')[0]} chose {session.tree.size} nodes (* above: most expected tokens/s)",
              file=sys.stderr)
    return session


def check_utf8(texts, flag: str) -> None:
    """Command-line text must be UTF-8: Python hands bytes that are not as lone surrogates (PEP 383), which
    the tokenizer refused with a TypeError.

    Args:
        texts: a string, a list of strings, or None.
        flag: the option, for the message.

    Raises:
        InvalidSettingError: a text holds such bytes (the message gives the first byte and its offset).
    """
    for text in [texts] if isinstance(texts, str) else (texts or []):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            byte = text[exc.start].encode("utf-8", "surrogateescape")[0]
            raise InvalidSettingError(f"{flag} is not valid UTF-8 (byte {byte:#04x} at character {exc.start}); "
                                      "give the text in UTF-8 (check the terminal's or the script's encoding)") \
                from None


def check_stops(stops: list[str]) -> list[str]:
    """``--stop`` values: each must hold at least one character (an empty one was silently ignored).

    Raises:
        InvalidSettingError: an empty stop string.
    """
    check_utf8(stops, "--stop")
    if any(not s for s in stops):
        raise InvalidSettingError("--stop '' is empty: a stop string needs at least one character (leave --stop out "
                                  "to stop at EOS and --max-new-tokens only)")
    return stops


def _gen_kwargs(args, session) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, sampling=session.sampling(sampling_from_args(args)),
                stop=args.stop, vanilla=args.vanilla)


def nothing_asked(finish_reason: str) -> str:
    """The summary of a reply of ``--max-new-tokens 0``: the loop runs no forward pass for it (not even the prefill,
    whose only use is the first new token), so there are no timings to report."""
    return f"[0 tokens: --max-new-tokens 0 asks for none, so no forward pass ran; finish: {finish_reason}]"


def summary(c, mode: str) -> str:
    """One line after a reply: tokens, steps, tokens per step, tokens/s, finish reason.

    A reply that ended on a stop token says that token's step emitted it but it is not counted (the reply leaves it
    out; :attr:`~.session.Completion.tokens_per_step`), so plain decoding's 0.91 tokens/step does not read as lost
    tokens.
    """
    r = c.result
    if not r.forward_passes:
        return nothing_asked(c.finish_reason)
    host = r.host_seconds / c.seconds if c.seconds else 0.0
    reused = (f"; {c.reused_tokens} of {c.prompt_tokens} prompt tokens reused from the last turn"
              if c.reused_tokens else "")
    uncounted = " (the stop token or string not counted)" if c.finish_reason == "stop" else ""
    return (f"[{len(c.token_ids)} tokens in {r.forward_passes} forward passes (prefill + {r.steps} steps); "
            f"{c.tokens_per_step:.2f} tokens/step{uncounted}; {c.tokens_per_second:.1f} tokens/s ({mode}; host work "
            f"{100 * host:.1f}%); finish: {c.finish_reason}{reused}]")


def _mode(session, args) -> str:
    tree = session.vanilla_tree if args.vanilla else session.tree
    source = "" if args.vanilla else f" ({session.tree_source})"
    nodes = "1 node = plain decoding" if tree.size == 1 and not args.vanilla else \
        f"{tree.size} node{'' if tree.size == 1 else 's'}"
    # the test double of tests/emulated marks its module EMULATED: its runs never read as TensorRT's (issue 40)
    emulated = session.backend == "tensorrt" and getattr(sys.modules.get("tensorrt"), "EMULATED", False)
    backend = "tensorrt (emulated)" if emulated else session.backend
    return (f"{backend}, {'vanilla' if args.vanilla else 'Medusa'} tree of {nodes}{source}, "
            f"{sampling_from_args(args).describe()}")


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    """``--prompt`` or ``--prompt-file`` (one of them required) and ``--batch-size`` (generate)."""
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--prompt", help="the user message")
    group.add_argument("--prompt-file", metavar="FILE",
                       help=f"generate a reply to every prompt of FILE, printed as one JSON line each in the file's "
                            f"order (index, token_ids, text, finish_reason, tokens_per_step, ...); {PROMPT_FILE_FORMAT}")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"with --prompt-file: at most B sequences share each step (in-flight batching) "
                        f"(default: {DEFAULT_BATCH_SIZE})")


def run_generate_batch(args, out: TextIO, err: TextIO) -> int:
    """``generate --artifact A --prompt-file F [--batch-size B]``: one JSON line per prompt, in the file's order."""
    batch = DEFAULT_BATCH_SIZE if args.batch_size is None else args.batch_size
    if batch < 1:
        raise InvalidSettingError(f"--batch-size must be >= 1, got {batch}")
    records = read_prompt_file(args.prompt_file)
    base = sampling_from_args(args)
    session = _session(args, [r.prompt for r in records])
    try:
        samplings = [session.sampling(base, seed=r.seed) for r in records]  # before any work
        budgets = [args.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens for r in records]
        ready: dict[int, dict] = {}
        printed = 0

        def on_done(i: int, c) -> None:
            nonlocal printed
            ready[i] = {"index": i, "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason,
                        "tokens_per_step": round(c.tokens_per_step, 4), "prompt_tokens": c.prompt_tokens,
                        "steps": c.result.steps}
            while printed in ready:  # in the file's order, each line as soon as the ones before it are out
                out.write(json.dumps(ready.pop(printed), ensure_ascii=False) + "\n")
                out.flush()
                printed += 1

        t = time.perf_counter()
        done = session.generate_batch([r.prompt for r in records], max_new_tokens=budgets, sampling=samplings,
                                      stop=args.stop, vanilla=args.vanilla, raw=getattr(args, "raw", False),
                                      batch_size=batch, on_done=on_done)
        wall = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for c in done)
        steps = [n for c in done for n in c.result.step_tokens]
        per_seq = [c.tokens_per_second for c in done if c.seconds > 0]
        print(f"[{len(done)} prompt{'' if len(done) == 1 else 's'}, batch size {batch}: {tokens} tokens in {wall:.2f}s = {tokens / wall:.1f} tokens/s "
              f"in all, {sum(per_seq) / max(len(per_seq), 1):.1f} tokens/s per sequence; "
              f"{(sum(steps) / len(steps)) if steps else 0.0:.2f} tokens/step ({_mode(session, args)})]", file=err)
        return 0
    finally:
        session.close()  # frees a device backend's memory


def run_generate(args, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """``generate --artifact``: one prompt, streamed to ``out``; the summary to ``err``.

    ``out`` / ``err`` default to the *current* sys.stdout / sys.stderr (looked up per call, not
    bound when this module is imported, so redirections made later are honoured).
    """
    out, err = out or sys.stdout, err or sys.stderr
    sampling_from_args(args)  # bad values fail before the artifact is loaded
    check_stops(args.stop)
    check_utf8(getattr(args, "prompt", None), "--prompt")
    if getattr(args, "prompt_file", None):
        return run_generate_batch(args, out, err)
    if getattr(args, "batch_size", None) is not None:
        raise InvalidSettingError("--batch-size needs --prompt-file (a single --prompt runs alone)")
    session = _session(args, [args.prompt])
    try:
        if not session.tokenizer.has_chat_template and not getattr(args, "raw", False):
            print("[note: this artifact has no chat template (a base model): the prompt is encoded as plain text and "
                  "the model continues it; it is not answered as a chat message]", file=err)
        kwargs = _gen_kwargs(args, session)  # and settings this artifact cannot sample exactly, before any work
        if session.artifact.model.heads_source.startswith("init"):
            print("[note: this artifact's Medusa heads are untrained (they repeat the base model's next-token "
                  "guess), so few candidates are accepted]", file=err)

        def write(text: str) -> None:
            out.write(text)
            out.flush()

        c = session.generate(args.prompt, raw=getattr(args, "raw", False), stream=write, **kwargs)
        out.write("\n")
        print(summary(c, _mode(session, args)), file=err)
        return 0
    finally:
        session.close()  # frees a device backend's memory


#: chat's commands: a line that is exactly one of these runs it instead of going to the model.
CHAT_COMMANDS = {"/reset": "starts a new conversation", "/exit": "quits (as Ctrl-D does)"}
CHAT_COMMANDS_HELP = ", ".join(f"{name} {what}" for name, what in CHAT_COMMANDS.items())


def _looks_like_command(message: str) -> bool:
    """Whether a chat line is a mistyped command: one word that starts with a single ``/`` (``/bogus``, ``/rest``)
    and is not in :data:`CHAT_COMMANDS`; ``/usr/bin is what?`` (several words) and ``//x`` go to the model."""
    word = message.strip()
    return word.startswith("/") and not word.startswith("//") and len(word.split()) == 1 and word not in CHAT_COMMANDS


def run_chat(args, inp: TextIO | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """``chat --artifact``: read user turns from ``inp`` until EOF or /exit; /reset starts over.

    A line that is one unknown ``/word`` is refused with the commands (it is a typo far more often than a message);
    ``//word`` sends ``/word`` to the model.

    The streams default to the current sys.stdin / sys.stdout / sys.stderr, looked up per call.
    """
    inp, out, err = inp or sys.stdin, out or sys.stdout, err or sys.stderr
    sampling_from_args(args)
    check_stops(args.stop)
    check_utf8(args.system, "--system")
    session = _session(args)
    try:
        if not session.tokenizer.has_chat_template:
            raise ChatTemplateError(f"{NO_TEMPLATE_MESSAGE}; chat needs one: use `generate --artifact "
                                    f"{args.artifact} --prompt TEXT` to continue a text")
        kwargs = _gen_kwargs(args, session)
        session.reset(args.system)
        interactive = inp.isatty()
        print(f"chat with {session.artifact.model.name} ({_mode(session, args)}); {CHAT_COMMANDS_HELP}",
              file=err)

        def write(text: str) -> None:
            out.write(text)
            out.flush()

        while True:
            if interactive:
                err.write("\n> ")
                err.flush()
            line = inp.readline()
            if not line or line.strip() == "/exit":
                return 0
            message = line.rstrip("\n")
            if message.strip() == "/reset":
                session.reset(args.system)
                print("[new conversation]", file=err)
                continue
            if not message.strip():
                continue
            if _looks_like_command(message):
                print(f"[unknown command {message.strip()}: {CHAT_COMMANDS_HELP}; a message that is one word "
                      "starting with / goes to the model as //word]", file=err)
                continue
            if message.strip().startswith("//"):
                message = message.replace("/", "", 1)
            try:
                c = session.chat(message, stream=write, **kwargs)
            except ContextOverflowError as exc:
                print(f"[{exc}; the conversation is full: /reset to start a new one]", file=err)
                continue
            out.write("\n")
            out.flush()
            print(summary(c, _mode(session, args)), file=err)
    finally:
        session.close()  # frees a device backend's memory


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m medusa_runtime",
                                     description="Run a medusa-export artifact without torch or transformers.",
                                     epilog=EXIT_CODES_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("generate", help="generate a reply to one prompt, or to every prompt of a file (batched)")
    add_runtime_args(p, artifact_required=True)
    add_prompt_args(p)
    p.add_argument("--raw", action="store_true", help="encode --prompt as is, without the chat template")
    p.add_argument("--max-context", type=int, help="KV capacity in tokens (default: the artifact's)")
    add_sampling_args(p)
    p.set_defaults(func=run_generate)
    p = sub.add_parser("chat", help="interactive multi-turn chat (streaming)")
    add_chat_args(p)
    p.set_defaults(func=run_chat)
    return parser


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """Everything ``chat`` takes."""
    add_runtime_args(p, artifact_required=True)
    p.add_argument("--system", help="system message (default: the chat template's own)")
    p.add_argument("--max-context", type=int, help="KV capacity in tokens (default: the artifact's)")
    add_sampling_args(p)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised in the main thread by :func:`signals_as_interrupt`'s handler.

    A :class:`KeyboardInterrupt`, so every clean-up written for Ctrl-C (a build's temporary folder removed,
    its lock released) runs for a ``kill``, a ``timeout`` or a CI cancel too.

    Attributes:
        signum: the signal's number; the command lines exit with ``128 + signum`` (143 for SIGTERM, the
            shells' convention).
    """

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


#: The signals :func:`signals_as_interrupt` turns into :class:`Terminated`.
TERMINATING_SIGNALS = ("SIGTERM", "SIGHUP")


@contextmanager
def signals_as_interrupt():
    """While inside: SIGTERM and SIGHUP raise :class:`Terminated` in the main thread, as Ctrl-C raises
    KeyboardInterrupt; the previous handlers are restored on leaving. Outside the main thread (where Python
    cannot install handlers) nothing changes. As for Ctrl-C, Python runs the handler between bytecodes: a
    process stuck inside one native call handles the signal when the call returns (SIGKILL stops it anyway);
    a second SIGTERM / SIGHUP kills at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signum, signal.SIG_DFL)  # a second one kills at once, clean-up or not
        raise Terminated(signum)

    sigs = [signal.Signals[name] for name in TERMINATING_SIGNALS if name in signal.Signals.__members__]  # no SIGHUP on Windows
    previous = {s: signal.signal(s, handler) for s in sigs}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_command(args, prog: str) -> int:
    """Run ``args.func(args)``; a :class:`MedusaError` becomes a one-line message and its ``exit_code``.

    SIGTERM and SIGHUP are handled as Ctrl-C is (:func:`signals_as_interrupt`), so the command cleans up.

    Returns:
        The command's exit code; :attr:`MedusaError.exit_code` (2 for bad input, 3 for a
        backend not available here, see :mod:`medusa_runtime.errors`), 130 on Ctrl-C, ``128 + signum``
        on SIGTERM (143) or SIGHUP (129).
    """
    try:
        with signals_as_interrupt():
            return args.func(args)
    except MedusaError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Terminated as exc:
        print(f"{prog}: terminated ({signal.Signals(exc.signum).name})", file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv), "medusa_runtime")

#!/usr/bin/env python
"""Our runtime against the decoders people use: same prompts, same threads, interleaved rounds.

    python scripts/bench_peers.py --artifact artifacts/smollm2-135m-t16-fp32 --threads 2 --rounds 3

Every system decodes the same MT-Bench first turns (``--prompts``, chat template applied once,
by our runtime's tokenizer, so every system is handed the same prompt token ids), greedy, up
to ``--max-new-tokens`` new tokens, stopping at the same EOS ids:

* ``medusa-export``: our runtime (``MedusaSession``), vanilla (one token per step) and Medusa
  (the artifact's tree), for each ``--artifact`` (its precision comes from its manifest);
* ``transformers`` ``generate``, fp32 (the backbone loaded as ``scripts/bench.py`` loads it);
* ``optimum`` ``ORTModelForCausalLM``, fp32 (exported once with ``export=True``, cached);
* ``onnxruntime-genai``, fp32 and int4 for CPU, built once by its own model builder
  (``python -m onnxruntime_genai.models.builder``) from an HF-format folder;
* ``llama-cpp-python`` on the shipped GGUF (Q4_1), and on an f32 GGUF dequantized from it
  by llama.cpp's own quantizer (the same weights our fp32 artifact holds).

A peer whose package is not installed, or that cannot be prepared, is skipped with a printed
note. The HF-format folder (``save_pretrained`` of the GGUF-loaded model), the optimum and
ONNX Runtime GenAI exports and the f32 GGUF are made once under ``--cache-dir`` and reused.

Round r runs every system once on every prompt; the order of the systems rotates from one
(round, prompt) to the next so that load drift on a shared machine hits all alike. Each system
is warmed up once before the first round. Reported per system (markdown table, JSON, PNG bar
chart, written to ``--out-dir``): median and min-max of tokens/s over all runs (new tokens over
wall time, prefill included), median time to the first token (prefill plus one token; for our
runtime the prefill graph run, which yields the first token), Medusa's tokens per step, and
agreement with the reference output, our fp32 vanilla greedy decoding: prompts with identical
tokens, and the tokens identical before the first divergence.

Threads: every system gets ``--threads`` intra-op threads and waits passively: ONNX Runtime
sessions without spinning (``session.intra_op.allow_spinning=0``, also for ONNX Runtime GenAI
through its config), OpenMP (torch, llama.cpp) with ``OMP_WAIT_POLICY=PASSIVE`` unless set;
see ``scripts/bench.py`` for why. ``--spin`` runs the ONNX Runtime systems with busy-waiting threads instead
(ONNX Runtime's default; ours: ``MedusaSession(spin=True)``, the step session's threads only), what a machine
running nothing else would use; OpenMP systems keep ``OMP_WAIT_POLICY`` as the environment sets it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when an OpenMP runtime starts (torch, llama.cpp)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/bench.py, scripts/bench_limit.py
from bench_limit import artifact_traffic, graph_traffic, limit_tokens_per_second, machine_limits  # noqa: E402
PEERS = ("ours", "transformers", "optimum", "genai-fp32", "genai-int4", "llama-q4_1", "llama-f32")
NO_SPIN = {"session.intra_op.allow_spinning": "0", "session.inter_op.allow_spinning": "0"}


# -- pure logic (tests/test_bench_peers.py) ----------------------------------------------------------------


def schedule(num_systems: int, num_prompts: int, rounds: int) -> list[tuple[int, int, int]]:
    """The run order: (round, prompt, system) triples.

    Round r runs every system once on every prompt; the systems' order rotates by one at each
    (round, prompt), so each system takes each position in the order equally often.
    """
    order = []
    for r in range(rounds):
        for p in range(num_prompts):
            shift = (r * num_prompts + p) % num_systems if num_systems else 0
            order += [(r, p, (shift + k) % num_systems) for k in range(num_systems)]
    return order


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens two outputs share (the index of the first divergence)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def agreement(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict:
    """How one system's outputs (one per prompt) agree with the reference outputs.

    Returns:
        ``identical`` (prompts with the same tokens), ``prompts``, ``prefix_tokens`` (per prompt,
        tokens identical before the first divergence) and ``prefix_fraction`` (their sum over the
        reference's total tokens).
    """
    prefix = [common_prefix(o, r) for o, r in zip(outputs, reference)]
    total = sum(len(r) for r in reference)
    return {"identical": sum(list(o) == list(r) for o, r in zip(outputs, reference)), "prompts": len(reference),
            "prefix_tokens": prefix, "prefix_fraction": sum(prefix) / total if total else 1.0}


def aggregate(runs: Sequence[dict]) -> dict:
    """Median and range of one system's runs (dicts with ``tokens``, ``seconds``, ``ttft_seconds``)."""
    tps = [len(r["tokens"]) / r["seconds"] if r["seconds"] > 0 else 0.0 for r in runs]
    ttft = [r["ttft_seconds"] for r in runs if r.get("ttft_seconds") is not None]
    steps = [r["tokens_per_step"] for r in runs if r.get("tokens_per_step") is not None]
    return {"runs": len(runs), "median_tokens_per_second": statistics.median(tps) if tps else None,
            "min_tokens_per_second": min(tps, default=None), "max_tokens_per_second": max(tps, default=None),
            "median_ttft_ms": 1e3 * statistics.median(ttft) if ttft else None,
            "mean_tokens_per_step": statistics.fmean(steps) if steps else None,
            "new_tokens": sum(len(r["tokens"]) for r in runs)}


def deterministic(runs: Sequence[dict]) -> bool:
    """Whether every round gave the same tokens on each prompt (runs carry ``prompt``)."""
    first: dict[int, list[int]] = {}
    for r in runs:
        if first.setdefault(r["prompt"], r["tokens"]) != r["tokens"]:
            return False
    return True


def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def agreement_cell(a: dict | None) -> str:
    """Table cell: identical prompts, and the share of tokens before the first divergence."""
    if a is None:
        return "–"
    cell = f"{a['identical']}/{a['prompts']}"
    if a["identical"] < a["prompts"]:
        cell += f" ({100 * a['prefix_fraction']:.0f}% of tokens before divergence)"
    return cell


def limit_cell(summary: dict) -> str:
    """Table cell: measured tokens/s as a fraction of the bandwidth limit, and the limit."""
    if summary.get("limit_tokens_per_second") is None:
        return "–"
    return f"{summary['fraction_of_limit']:.2f} of {summary['limit_tokens_per_second']:.0f}"


def markdown_table(report: dict) -> str:
    """The results as a markdown table, systems fastest first, then notes and skipped peers."""
    rows = sorted(report["systems"], key=lambda s: -(s["summary"]["median_tokens_per_second"] or 0))
    lines = ["| system | precision | tokens/s (median) | range | first token ms | tokens/step | MB/step | "
             "of the bandwidth limit | same tokens as fp32 greedy | Medusa = own plain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for s in rows:
        m = s["summary"]
        mb = s.get("bytes_per_step")
        lines.append(f"| {s['name']} | {s['precision']} | {_fmt(m['median_tokens_per_second'], '.1f')} | "
                     f"{_fmt(m['min_tokens_per_second'], '.1f')}-{_fmt(m['max_tokens_per_second'], '.1f')} | "
                     f"{_fmt(m['median_ttft_ms'], '.0f')} | {_fmt(m['mean_tokens_per_step'], '.2f')} | "
                     f"{_fmt(mb / 1e6 if mb else None, '.0f')} | {limit_cell(m)} | "
                     f"{agreement_cell(s.get('agreement'))} | {agreement_cell(s.get('equals_own_plain'))} |")
    cfg = report["config"]
    notes = [f"{cfg['prompts']} MT-Bench first turns x {cfg['max_new_tokens']} new tokens, greedy, "
             f"{cfg['rounds']} interleaved round(s), {cfg['threads']} threads, "
             f"{'ONNX Runtime threads spinning (--spin)' if cfg.get('spin') else 'passive waiting'}; "
             f"reference: {report['reference'] or 'none'}."]
    lim = report.get("limits")
    if lim:
        h = lim["host"]
        notes.append(f"bandwidth limit: STREAM-like triad {lim['bandwidth'] / 1e9:.1f} GB/s at {lim['threads']} threads "
                     f"(copy {lim['bandwidth_bytes_per_s']['copy'] / 1e9:.1f}); a plain decoder cannot beat "
                     f"bandwidth / MB per step tokens/s, Medusa's ceiling is that times its tokens/step "
                     f"(scripts/bench_limit.py; {h['cpu']}, {h['date']}).")
    if report.get("machine"):
        notes.append(f"load average before / after: {report['machine']['load_average_before'][0]:.2f} / "
                     f"{report['machine']['load_average_after'][0]:.2f}")
    notes += [f"{s['name']}: {s['note']}" for s in rows if s.get("note")]
    notes += [f"{s['name']}: outputs differ between rounds" for s in rows if not s.get("deterministic", True)]
    notes += [f"skipped {name}: {why}" for name, why in report["skipped"].items()]
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


# -- systems -------------------------------------------------------------------------------------------------


class Skip(Exception):
    """A peer that cannot run here; the message says why."""


@dataclass
class System:
    """One decoder under test.

    Attributes:
        name: label in the table.
        precision: weight precision ("fp32", "int4", "q4_1", ...).
        run: ``run(prompt_ids, max_new_tokens)`` -> dict with ``tokens`` (EOS excluded), ``seconds``
            (wall time, prefill included), ``ttft_seconds`` (or None) and optionally ``tokens_per_step``.
        note: a remark for the table's notes.
        bytes_per_step: bytes of weights one step reads (``scripts/bench_limit.py``'s rules), or None if unknown.
        plain_of: for a Medusa system, the name of the same artifact's vanilla system (its outputs must be equal).
    """

    name: str
    precision: str
    run: Callable[[list[int], int], dict]
    note: str = ""
    runs: list = field(default_factory=list)
    bytes_per_step: float | None = None
    plain_of: str | None = None


@dataclass
class Context:
    """What the peers share: settings, EOS ids and lazily made cache entries."""

    model: str
    threads: int
    eos: list[int]
    cache_dir: Path
    max_context: int = 2048
    spin: bool = False  # ONNX Runtime sessions busy-wait (--spin)
    _hf_model: object = None

    def hf_model(self):
        """The backbone as a transformers model (loaded once, as ``scripts/bench.py`` loads it)."""
        if self._hf_model is None:
            from bench import load_transformers_model

            self._hf_model = load_transformers_model(self.model, self.threads)
        return self._hf_model

    def hf_dir(self) -> Path:
        """An HF-format folder of the backbone (config, fp32 safetensors, tokenizer), made once."""
        out = self.cache_dir / f"hf-{self.model}"
        if not (out / "DONE").exists():
            from medusa_export.loading.backbone import find_package_file
            from medusa_export.loading.registry import get_entry
            from transformers import AutoTokenizer

            print(f"  writing the HF-format folder {out} ...", file=sys.stderr)
            src = get_entry(self.model).backbone
            self.hf_model().save_pretrained(out)
            if src["source"] == "package":
                path = find_package_file(src["package"], src["file"])
                tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
            else:
                tok = AutoTokenizer.from_pretrained(str(self.hf_model().name_or_path))
            tok.save_pretrained(out)
            (out / "DONE").write_text("")
        return out

    def gguf(self) -> Path:
        """The GGUF file the registry's backbone ships as."""
        from medusa_export.loading.backbone import find_package_file
        from medusa_export.loading.registry import get_entry

        src = get_entry(self.model).backbone
        if src["source"] != "package" or not src["file"].endswith(".gguf"):
            raise Skip(f"{self.model} is not shipped as a GGUF file")
        return find_package_file(src["package"], src["file"])


def _strip_eos(tokens, eos: Sequence[int]) -> list[int]:
    out = []
    for t in tokens:
        if int(t) in eos:
            break
        out.append(int(t))
    return out


def _require(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Skip(f"{package} is not installed (pip install -e '.[peers]'): {exc}") from None


def ours(artifacts: Sequence[str], threads: int, spin: bool = False
         ) -> tuple[list[System], Callable[[str], list[int]], list[int]]:
    """Vanilla and Medusa systems for each artifact; also the first one's prompt encoder and EOS ids."""
    from medusa_runtime.front.session import MedusaSession

    systems, encoder, eos = [], None, []
    for path in artifacts:
        session = MedusaSession(path, threads=threads, tree="artifact", spin=spin)  # the artifact's tree: what it was built for
        precision = session.artifact.manifest.precision_name
        encoder = encoder or session.encode
        eos = eos or session.eos_token_ids

        def run(ids, n, session=session, vanilla=False):
            c = session.generate(prompt_ids=ids, max_new_tokens=n, vanilla=vanilla)
            return {"tokens": list(c.token_ids), "seconds": c.seconds, "ttft_seconds": c.result.prefill_seconds,
                    "tokens_per_step": c.tokens_per_step}

        label = Path(path).name
        traffic = artifact_traffic(path)
        step = traffic["model"].weight_bytes
        vanilla = System(f"medusa-export vanilla ({label})", precision, lambda ids, n, run=run: run(ids, n, vanilla=True),
                         bytes_per_step=step)
        systems.append(vanilla)
        heads = traffic["heads"].weight_bytes if "heads" in traffic and session.tree.size > 1 else 0.0
        systems.append(System(f"medusa-export Medusa, tree {session.tree.size} ({label})", precision, run,
                              bytes_per_step=step + heads, plain_of=vanilla.name))
    return systems, encoder, eos


class _FirstToken:
    """A transformers StoppingCriteria that only records when the first new token came."""

    def __init__(self):
        self.at = None

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        if self.at is None:
            self.at = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _hf_generate(model, eos: list[int]) -> Callable[[list[int], int], dict]:
    """A runner over a transformers-style ``generate`` (transformers, optimum)."""
    import torch
    from transformers import StoppingCriteriaList

    def run(ids, n):
        first = _FirstToken()
        x = torch.tensor([ids])
        with torch.no_grad():
            start = time.perf_counter()
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0], stopping_criteria=StoppingCriteriaList([first]))
            seconds = time.perf_counter() - start
        return {"tokens": _strip_eos(out[0, len(ids):].tolist(), eos), "seconds": seconds,
                "ttft_seconds": first.at - start if first.at else None}

    return run


def transformers_peer(ctx: Context) -> list[System]:
    """transformers ``generate``, fp32."""
    _require("torch", "torch")
    step = float(sum(p.numel() * p.element_size() for p in ctx.hf_model().parameters()))
    return [System("transformers generate", "fp32", _hf_generate(ctx.hf_model(), ctx.eos), bytes_per_step=step)]


def optimum_peer(ctx: Context) -> list[System]:
    """optimum ``ORTModelForCausalLM``, fp32, exported once from the HF-format folder."""
    _require("optimum.onnxruntime", "optimum[onnxruntime]")
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForCausalLM

    out = ctx.cache_dir / f"optimum-{ctx.model}-fp32"
    if not (out / "DONE").exists():
        print(f"  exporting with optimum to {out} ...", file=sys.stderr)
        ORTModelForCausalLM.from_pretrained(str(ctx.hf_dir()), export=True, use_cache=True).save_pretrained(out)
        (out / "DONE").write_text("")
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = ctx.threads, 1
    for k, v in ({} if ctx.spin else NO_SPIN).items():
        so.add_session_config_entry(k, v)
    model = ORTModelForCausalLM.from_pretrained(str(out), session_options=so, provider="CPUExecutionProvider",
                                                use_cache=True)
    step = float(sum(f.stat().st_size for f in out.iterdir() if f.suffix in (".onnx", ".onnx_data", ".data")))
    return [System("optimum ORTModelForCausalLM", "fp32", _hf_generate(model, ctx.eos), bytes_per_step=step)]


def genai_peer(ctx: Context, precision: str) -> list[System]:
    """ONNX Runtime GenAI on a model its own builder made (``-e cpu -p fp32|int4``)."""
    og = _require("onnxruntime_genai", "onnxruntime-genai")
    out = ctx.cache_dir / f"genai-{ctx.model}-{precision}"
    if not (out / "DONE").exists():
        print(f"  building the ONNX Runtime GenAI {precision} model in {out} ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ctx.hf_dir()), "-o", str(out),
               "-p", precision, "-e", "cpu", "-c", str(ctx.cache_dir / "genai-tmp")]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise Skip(f"the model builder failed ({' '.join(cmd[1:])}): {done.stderr.strip()[-400:]}")
        (out / "DONE").write_text("")
    config = og.Config(str(out))
    config.clear_providers()  # CPU
    # Unknown session_options keys are passed to ONNX Runtime as session config entries.
    config.overlay(json.dumps({"model": {"eos_token_id": ctx.eos, "decoder": {"session_options": {
        "intra_op_num_threads": ctx.threads, "inter_op_num_threads": 1, **({} if ctx.spin else NO_SPIN)}}}}))
    model = og.Model(config)

    def run(ids, n):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + n, batch_size=1)
        start = time.perf_counter()
        gen = og.Generator(model, params)
        gen.append_tokens(ids)
        tokens, ttft = [], None
        while not gen.is_done() and len(tokens) < n:
            gen.generate_next_token()
            t = int(gen.get_next_tokens()[0])
            if ttft is None:
                ttft = time.perf_counter() - start
            if t in ctx.eos:
                break
            tokens.append(t)
        seconds = time.perf_counter() - start
        del gen
        return {"tokens": tokens, "seconds": seconds, "ttft_seconds": ttft}

    note = "int4 weights (MatMulNBits, builder defaults)" if precision == "int4" else ""
    import onnx

    step = graph_traffic(onnx.load(str(out / "model.onnx"), load_external_data=False)).weight_bytes
    return [System(f"onnxruntime-genai {og.__version__}", precision, run, note, bytes_per_step=step)]


def _f32_gguf(ctx: Context, llama_cpp) -> Path:
    """An f32 GGUF of the shipped one, dequantized by llama.cpp's quantizer (made once)."""
    out = ctx.cache_dir / f"{ctx.gguf().stem}.f32.gguf"
    if not out.exists():
        print(f"  dequantizing {ctx.gguf().name} to {out} ...", file=sys.stderr)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
        params.allow_requantize = True
        params.nthread = ctx.threads
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(ctx.gguf()).encode(), str(tmp).encode(), params) != 0:
            raise Skip("llama.cpp could not dequantize the GGUF to f32")
        tmp.rename(out)
    return out


def llama_peer(ctx: Context, precision: str) -> list[System]:
    """llama-cpp-python on the shipped GGUF (q4_1) or its f32 dequantization."""
    llama_cpp = _require("llama_cpp", "llama-cpp-python")
    path = ctx.gguf() if precision == "q4_1" else _f32_gguf(ctx, llama_cpp)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=ctx.max_context, n_threads=ctx.threads,
                          n_threads_batch=ctx.threads, verbose=False)

    def run(ids, n):
        llm.reset()  # no prompt-prefix reuse between runs: every run prefills
        tokens, ttft = [], None
        start = time.perf_counter()
        for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if ttft is None:
                ttft = time.perf_counter() - start
            if int(t) in ctx.eos:
                break
            tokens.append(int(t))
            if len(tokens) >= n:
                break
        return {"tokens": tokens, "seconds": time.perf_counter() - start, "ttft_seconds": ttft}

    note = "the shipped GGUF's Q4_1 weights" if precision == "q4_1" else "f32 GGUF dequantized from the shipped Q4_1"
    return [System(f"llama-cpp-python {llama_cpp.__version__}", "fp32" if precision == "f32" else precision, run, note,
                   bytes_per_step=float(path.stat().st_size))]


PEER_FACTORIES = {
    "transformers": transformers_peer,
    "optimum": optimum_peer,
    "genai-fp32": lambda ctx: genai_peer(ctx, "fp32"),
    "genai-int4": lambda ctx: genai_peer(ctx, "int4"),
    "llama-q4_1": lambda ctx: llama_peer(ctx, "q4_1"),
    "llama-f32": lambda ctx: llama_peer(ctx, "f32"),
}


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("onnxruntime", "torch", "transformers", "optimum", "optimum-onnx", "onnxruntime-genai",
                "llama-cpp-python", "numpy"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def hf_encoder(ctx: Context) -> tuple[Callable[[str], list[int]], list[int]]:
    """Without an artifact: the HF tokenizer's chat template and the loader's EOS ids."""
    from medusa_export.loading.backbone import eos_ids  # the loader's EOS rule (GGUF tokenizers report a wrong one)

    tok = _require("transformers", "transformers").AutoTokenizer.from_pretrained(str(ctx.hf_dir()))
    encode = lambda text: tok.apply_chat_template([{"role": "user", "content": text}],  # noqa: E731
                                                  add_generation_prompt=True)
    return encode, eos_ids(ctx.hf_model(), tok)


def run(args) -> dict:
    """Prepare every system, run the interleaved rounds, aggregate."""
    from medusa_runtime.front.prompts import read_first_turns

    wanted = [p for p in args.systems.split(",") if p]
    unknown = sorted(set(wanted) - set(PEERS))
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {', '.join(PEERS)}")
    texts = read_first_turns(Path(args.questions), args.prompts)
    systems, skipped = [], {}
    encode, eos = None, []
    if "ours" in wanted and args.artifact:
        systems, encode, eos = ours(args.artifact, args.threads, args.spin)
    elif "ours" in wanted:
        skipped["medusa-export"] = "no --artifact given"
    ctx = Context(args.model, args.threads, eos, Path(args.cache_dir), spin=args.spin)
    ctx.cache_dir.mkdir(parents=True, exist_ok=True)
    if not eos:
        encode, ctx.eos = hf_encoder(ctx)
    prompt_ids = [list(encode(t)) for t in texts]
    for name in wanted:
        if name == "ours":
            continue
        print(f"preparing {name} ...", file=sys.stderr)
        try:
            systems += PEER_FACTORIES[name](ctx)
        except Skip as exc:
            skipped[name] = str(exc)
            print(f"  skipped {name}: {exc}", file=sys.stderr)
        except Exception as exc:  # a peer that breaks is reported, never fatal
            skipped[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
            print(f"  skipped {name}: {skipped[name]}", file=sys.stderr)
    for s in list(systems):  # warm-up; a system that fails here is dropped with a note
        try:
            s.run(prompt_ids[0], min(8, args.max_new_tokens))
        except Exception as exc:
            skipped[s.name] = f"failed in warm-up: {type(exc).__name__}: {str(exc)[:300]}"
            systems.remove(s)
    load_before = os.getloadavg()
    limits = None
    if args.limit:
        print("measuring the memory bandwidth and GEMM peak (scripts/bench_limit.py) ...", file=sys.stderr)
        limits = machine_limits(args.threads)
    order = schedule(len(systems), len(prompt_ids), args.rounds)
    for i, (r, p, k) in enumerate(order):
        s = systems[k]
        out = s.run(prompt_ids[p], args.max_new_tokens)
        s.runs.append({"round": r, "prompt": p, **out})
        print(f"[{i + 1}/{len(order)}] round {r + 1} prompt {p + 1} {s.name} ({s.precision}): "
              f"{len(out['tokens']) / out['seconds']:.1f} tokens/s", file=sys.stderr)
    ref = next((s for s in systems if s.name.startswith("medusa-export vanilla") and s.precision == "fp32"), None)
    ref = ref or next((s for s in systems if s.name == "transformers generate"), None)

    def outputs(s: System) -> list[list[int]]:
        return [next(r["tokens"] for r in s.runs if r["prompt"] == p) for p in range(len(prompt_ids))]

    report = {
        "config": {"model": args.model, "prompts": len(texts), "max_new_tokens": args.max_new_tokens,
                   "rounds": args.rounds, "threads": args.threads, "spin": args.spin,
                   "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "artifacts": args.artifact or []},
        "machine": {"cpus": os.cpu_count(), "load_average_before": load_before,
                    "load_average_after": os.getloadavg(), "platform": platform.platform()},
        "versions": _versions(), "prompts": texts, "prompt_tokens": [len(ids) for ids in prompt_ids],
        "reference": ref.name if ref else None, "skipped": skipped, "systems": [], "limits": limits,
    }
    by_name = {s.name: s for s in systems}
    for s in systems:
        summary = aggregate(s.runs)
        if limits and s.bytes_per_step:
            summary["limit_tokens_per_second"] = limit_tokens_per_second(limits["bandwidth"], s.bytes_per_step)
            summary["fraction_of_limit"] = (summary["median_tokens_per_second"] or 0) / summary["limit_tokens_per_second"]
        own = by_name.get(s.plain_of) if s.plain_of else None
        report["systems"].append({
            "bytes_per_step": s.bytes_per_step,
            "equals_own_plain": agreement(outputs(s), outputs(own)) if own else None,
            "name": s.name, "precision": s.precision, "note": s.note, "summary": summary,
            "deterministic": deterministic(s.runs),
            "agreement": agreement(outputs(s), outputs(ref)) if ref else None,
            "outputs": outputs(s),
            "runs": [{k: v for k, v in r.items() if k != "tokens"} | {"new_tokens": len(r["tokens"])} for r in s.runs],
        })
    return report


def chart(report: dict, path: Path) -> None:
    """Horizontal bars: median tokens/s per system, min-max whiskers, fp32 and quantized coloured apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(report["systems"], key=lambda s: s["summary"]["median_tokens_per_second"] or 0)
    if not rows:
        return
    med = [s["summary"]["median_tokens_per_second"] or 0 for s in rows]
    lo = [m - (s["summary"]["min_tokens_per_second"] or m) for m, s in zip(med, rows)]
    hi = [(s["summary"]["max_tokens_per_second"] or m) - m for m, s in zip(med, rows)]
    colors = ["C0" if s["precision"] == "fp32" else "C1" for s in rows]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.8))
    y = range(len(rows))
    ax.barh(y, med, xerr=[lo, hi], color=colors, capsize=3)
    ax.set_yticks(list(y), [f"{s['name']} [{s['precision']}]" for s in rows], fontsize="small")
    for i, (m, s) in enumerate(zip(med, rows)):
        a = s.get("agreement")
        label = f"{m:.1f}" + (f"  ({a['identical']}/{a['prompts']} = fp32)" if a else "")
        ax.text(m + max(hi[i], 0) + max(med) * 0.01, i, label, va="center", fontsize="small")
    ax.set_xlim(0, max(med) * 1.35)
    cfg = report["config"]
    ref = report["reference"] or "no reference"
    ref = "our fp32 vanilla greedy" if ref.startswith("medusa-export vanilla") else ref
    ax.set(xlabel="tokens/s (median, min-max whiskers; prefill included)")
    fig.suptitle(f"{cfg['model']}: {cfg['prompts']} MT-Bench prompts x {cfg['max_new_tokens']} tokens, greedy, "
                 f"{cfg['threads']} threads, {cfg['rounds']} round(s)\nblue: fp32, orange: quantized; "
                 f"(n/N = fp32): prompts identical to {ref}", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", action="append", default=[],
                   help="artifact directory for our runtime (repeat for several precisions)")
    p.add_argument("--model", default="smollm2-135m", help="registered model the peers load (default: smollm2-135m)")
    p.add_argument("--systems", default=",".join(PEERS),
                   help=f"comma-separated systems to run (default: all of {','.join(PEERS)})")
    p.add_argument("--prompts", type=int, default=5, help="MT-Bench first turns to use (default: 5)")
    p.add_argument("--questions", default=None, help="MT-Bench question.jsonl (default: data/eval/mt_bench in $MEDUSA_EXPORT_SHARED, "
                   "else in ../shared)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per reply (default: 128)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument("--threads", type=int, default=2, help="threads for every system (default: 2)")
    p.add_argument("--spin", action="store_true",
                   help="ONNX Runtime systems' threads busy-wait (ONNX Runtime's default; ours: the step session's "
                        "only) instead of sleeping between operators (default: off, every system waits passively)"),
    p.add_argument("--no-limit", dest="limit", action="store_false",
                   help="skip measuring the bandwidth limit (scripts/bench_limit.py) before the rounds")
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "peers"),
                   help="where peer models are made once and reused (default: .cache/peers)")
    p.add_argument("--out-dir", default=str(ROOT / "docs" / "benchmark"), help="output folder (default: docs/benchmark)")
    p.add_argument("--name", default="peers", help="output file stem: NAME.md, NAME.json, NAME.png (default: peers)")
    args = p.parse_args(argv)
    if args.questions is None:
        from medusa_runtime.front.prompts import mt_bench_questions

        args.questions = str(mt_bench_questions())
    report = run(args)
    table = markdown_table(report)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.md").write_text(table)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    chart(report, out / f"{args.name}.png")
    print("\n" + table)
    print(f"wrote {out / args.name}.md, .json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())

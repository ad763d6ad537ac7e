#!/usr/bin/env python
"""Step time at T = 1..64 tree nodes beside the expected Medusa speedup (issue 24 item 4; scripts/gpu_check.sh).

    python scripts/step_time.py --artifact ART --backend tensorrt --precision fp16   # an artifact's engine
    python scripts/step_time.py --torch 7b --device cuda                            # PyTorch, 7B-shaped fp16

For each tree size T the table gives the median wall time of one tree step of T nodes after
``--past`` cached tokens, its ratio to a one-token (vanilla) step, the tree's expected tokens per
step (Medusa paper §2.3.3: the greedy tree's expected accepted length under the head accuracies;
the artifact's calibrated ones, else ``default_accuracies``) and the expected speedup, expected
tokens per step over the step-time ratio (heads and host time left out: an upper bound).

``--torch SHAPE`` times a transformers Llama of that shape (``7b``: hidden 4096, 32 layers, 32 heads,
MLP 11008, vocab 32000; ``tiny``: for tests) with random weights, made on the device directly; its
tree step is T tokens after a DynamicCache of ``--past`` tokens, cropped back after each run.

NOT RUN ON A GPU: this project's machines have none; CI runs it on the CPU (``--torch tiny
--device cpu``) and against the EMULATED TensorRT (tests/test_trt_emulated.py). The emulation runs the
ONNX on ONNX Runtime on the CPU, so its times are not a GPU's: every size is still stepped (the engine's
bindings and profiles are exercised), but no time, ratio or speedup is printed or written, only
"emulated: no GPU timing" and the expected tokens per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from medusa_runtime.tuning.autotree import expected_tokens, time_tree_steps
from medusa_runtime.trees.tree import default_accuracies, greedy_tree

SIZES = (1, 2, 4, 8, 16, 32, 64)
#: --torch shapes: transformers LlamaConfig fields.
TORCH_SHAPES = {
    "7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
               intermediate_size=11008, vocab_size=32000),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=320),
}


def table(step_ms: dict[int, float], accuracies: np.ndarray) -> list[dict]:
    """One row per tree size: step ms, ratio to T = 1, expected tokens per step, expected speedup."""
    rows = []
    for t in sorted(step_ms):
        tree = greedy_tree(t, accuracies, topk=accuracies.shape[1])
        ratio = step_ms[t] / step_ms[min(step_ms)]
        tokens = expected_tokens(tree, accuracies)
        rows.append({"tree_size": t, "step_ms": round(step_ms[t], 3), "step_ratio": round(ratio, 3),
                     "expected_tokens_per_step": round(tokens, 3), "expected_speedup": round(tokens / ratio, 3)})
    return rows


#: What an emulated run prints and writes in place of its times (they are the CPU's, not a GPU's).
NO_GPU_TIMING = "emulated: no GPU timing"


def artifact_step_ms(path: str, backend: str, precision: str | None, device_id: int, past: int,
                     repeats: int) -> tuple[dict[int, float], np.ndarray, str, bool]:
    """Tree-step times of an artifact's engine (:func:`~medusa_runtime.tuning.autotree.time_tree_steps`), its head
    accuracies, what ran, and whether that was the emulated TensorRT (its times are not to be reported)."""
    from medusa_runtime.contract.artifact import load_artifact
    from medusa_runtime.engines import backend_spec, create_engine

    art = load_artifact(path)
    options = {"device_id": device_id} if backend_spec(backend).gpu else {}
    if precision:
        options["precision"] = precision
    engine = create_engine(art, backend, **options)
    acc = art.head_accuracies if art.head_accuracies is not None else default_accuracies(art.model.medusa_heads)
    try:
        trees = {t: greedy_tree(t, acc, topk=acc.shape[1]) for t in SIZES}
        step_ms, _ = time_tree_steps(engine, trees, past_length=past, repeats=repeats)
    finally:
        engine.close()
    emulated = False
    if backend == "tensorrt":
        import tensorrt

        emulated = bool(getattr(tensorrt, "EMULATED", False))
    label = " (EMULATED TensorRT: tests/emulated, ONNX Runtime on the CPU)" if emulated else ""
    return step_ms, acc, f"{art.model.name} on {backend}{' ' + precision if precision else ''}{label}", emulated


def torch_step_ms(shape: str, device: str, dtype: str, past: int, repeats: int) -> dict[int, float]:
    """Tree-step times of a random-weight transformers Llama of ``shape`` (T tokens after ``past`` cached)."""
    import torch
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    cfg = LlamaConfig(**TORCH_SHAPES[shape], max_position_embeddings=past + max(SIZES) + 1)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(torch_dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for name, b in model.named_buffers():
            if "inv_freq" in name:
                b.copy_(1.0 / (cfg.rope_theta ** (torch.arange(0, b.numel() * 2, 2, device=device).float()
                                                  / (b.numel() * 2))))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    gen = torch.Generator(device="cpu").manual_seed(0)
    cache = DynamicCache()
    with torch.no_grad():
        if past:
            model(torch.randint(0, cfg.vocab_size, (1, past), generator=gen).to(device), past_key_values=cache,
                  use_cache=True)
        out = {}
        for t in SIZES:
            ids = torch.randint(0, cfg.vocab_size, (1, t), generator=gen).to(device)
            times = []
            for r in range(repeats + 1):  # run 0 warms up
                sync()
                start = time.perf_counter()
                model(ids, past_key_values=cache, use_cache=True)
                sync()
                if r:
                    times.append(time.perf_counter() - start)
                cache.crop(past)
            out[t] = 1e3 * statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--artifact", metavar="DIR", help="time this artifact's engine")
    src.add_argument("--torch", choices=sorted(TORCH_SHAPES), help="time a random-weight PyTorch Llama of this shape")
    p.add_argument("--backend", default="onnxruntime", help="medusa_runtime backend for --artifact")
    p.add_argument("--precision", help="TensorRT plans for --backend tensorrt (default: the first built)")
    p.add_argument("--device-id", type=int, default=0, help="GPU for the device backends (default: 0)")
    p.add_argument("--device", default="cuda", help="torch device for --torch (default: cuda)")
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32"), help="--torch weights (default: fp16)")
    p.add_argument("--past", type=int, default=128, help="cached tokens before each step (default: 128)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per size (default: 5)")
    p.add_argument("--accuracies-from", metavar="DIR",
                   help="--torch: the head accuracies of this artifact's tree.json (default: default_accuracies)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    emulated = False
    if args.artifact:
        step_ms, acc, what, emulated = artifact_step_ms(args.artifact, args.backend, args.precision, args.device_id,
                                                        args.past, args.repeats)
    else:
        step_ms = torch_step_ms(args.torch, args.device, args.dtype, args.past, args.repeats)
        acc = default_accuracies(3)
        if args.accuracies_from:
            from medusa_runtime.contract.artifact import load_artifact

            shipped = load_artifact(args.accuracies_from).head_accuracies
            acc = acc if shipped is None else shipped
        what = f"PyTorch Llama {args.torch} ({args.dtype}, {args.device})"
    rows = table(step_ms, acc)
    if emulated:  # the CPU's times under a GPU backend's name: none of them is printed or written
        rows = [{"tree_size": r["tree_size"], "expected_tokens_per_step": r["expected_tokens_per_step"]} for r in rows]
        print(f"step time: {NO_GPU_TIMING} ({what}); every size stepped, expected tokens per step only:")
        print(f"{'T':>4s} {'exp. tokens':>12s}")
        for r in rows:
            print(f"{r['tree_size']:4d} {r['expected_tokens_per_step']:12.2f}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"what": what, "emulated": True, "timing": NO_GPU_TIMING, "past": args.past, "rows": rows},
                          fh, indent=2)
        return 0
    print(f"step time after {args.past} cached tokens: {what}")
    print(f"{'T':>4s} {'step ms':>10s} {'ratio':>7s} {'exp. tokens':>12s} {'exp. speedup':>13s}")
    for r in rows:
        print(f"{r['tree_size']:4d} {r['step_ms']:10.3f} {r['step_ratio']:7.2f} {r['expected_tokens_per_step']:12.2f} "
              f"{r['expected_speedup']:13.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"what": what, "past": args.past, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

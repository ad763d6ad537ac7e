#!/usr/bin/env bash
# GPU check: build an artifact, build TensorRT engines (where TensorRT is installed), check parity against
# ONNX Runtime, time the decode loop, time one tree step at T = 1..64 nodes (scripts/step_time.py: the
# artifact's engines, and a 7B-shaped fp16 PyTorch Llama where PyTorch has CUDA) beside the expected Medusa
# speedup, and print a short table last. Prints what it skips and why. NEVER RUN ON A GPU so far.
#
#   bash scripts/gpu_check.sh                  # tiny random model (fast), fp32 artifact
#   MODEL=smollm2-135m TREE=16 bash scripts/gpu_check.sh
#   ART=/path/to/artifact bash scripts/gpu_check.sh   # reuse an artifact
#
# Env: OUT (work folder, default /tmp/medusa_gpu_check), PRECISIONS (engine precisions, default "fp16 fp32"),
#      NEW_TOKENS (default 64), PYTHON (default python3).
set -euo pipefail

OUT="${OUT:-/tmp/medusa_gpu_check}"
PYTHON="${PYTHON:-python3}"
PRECISIONS="${PRECISIONS:-fp16 fp32}"
NEW_TOKENS="${NEW_TOKENS:-64}"
mkdir -p "$OUT"
ROWS="$OUT/rows.tsv"
: > "$ROWS"
row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$ROWS"; }   # step, result, detail
skip() { echo "SKIP: $1: $2"; row "$1" "skipped" "$2"; }
STEP="start"
# The summary prints however the script ends (a failed step included: set -e stops at it, this trap still runs);
# the exit code is 1 when a step failed or a row says FAIL.
summary() {
  rc=$?
  trap - EXIT
  if [ "$rc" -ne 0 ]; then row "$STEP" "FAIL" "the step exited $rc (its output is above)"; fi
  echo
  echo "== summary"
  column -t -s $'\t' "$ROWS" 2>/dev/null || cat "$ROWS"
  if [ "$rc" -ne 0 ] || grep -q $'\tFAIL' "$ROWS"; then exit 1; fi
  exit 0
}
trap summary EXIT

echo "== doctor"
STEP="doctor"
medusa-export doctor || true
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  GPU="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)"
  row "gpu" "ok" "$GPU"
else
  GPU=""
  skip "gpu" "no NVIDIA GPU visible (nvidia-smi missing or failing): engine build and GPU timing skipped"
fi
HAVE_TRT=0
if "$PYTHON" -c "import tensorrt" >/dev/null 2>&1; then HAVE_TRT=1; else
  skip "tensorrt" "TensorRT's Python package does not import: engines are not built (trtexec commands are written)"
fi

echo "== artifact"
STEP="artifact"
if [ -n "${ART:-}" ]; then
  row "artifact" "given" "$ART"
elif [ -n "${MODEL:-}" ]; then
  ART="$OUT/art-$MODEL"
  t0=$(date +%s)
  medusa-export build --model "$MODEL" --tree "${TREE:-16}" --out "$ART" --max-new-tokens 16 --force
  row "artifact" "built" "$MODEL in $(( $(date +%s) - t0 ))s"
else
  ART="$OUT/art-tiny"
  t0=$(date +%s)
  "$PYTHON" - "$ART" <<'PY'
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from medusa_export.pipeline import BuildConfig, build_artifact
from medusa_export.loading.backbone import backbone_from_hf_model
from medusa_export.loading.registry import LoadedMedusa
from medusa_export.model.medusa import MedusaModel
from medusa_runtime.trees.treespec import tree_from_spec

class Tok:  # the loop is driven with token ids; no tokenizer is needed
    def save_pretrained(self, d):
        import os
        os.makedirs(d, exist_ok=True)
        open(os.path.join(d, "tokenizer.json"), "w").write("{}")

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=1001, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2)
model = MedusaModel.with_initial_heads(backbone_from_hf_model(LlamaForCausalLM(cfg).eval()), 3)
lm = LoadedMedusa(model, Tok(), [2], None, "tiny", "random", "init", "16", 512)
build_artifact(lm, tree_from_spec("16", num_heads=3), sys.argv[1], BuildConfig(validate=False), progress=False)
PY
  row "artifact" "built" "tiny random model in $(( $(date +%s) - t0 ))s"
fi
READY="$("$PYTHON" -c "import json,sys; r=json.load(open(sys.argv[1]+'/manifest.json')).get('trt_readiness') or {}; print('PASSED: ops, opset, shapes, weight paths' if r.get('passed') else 'FAILED: ' + '; '.join(r.get('errors', ['not checked']))[:200])" "$ART")"
row "trt readiness" "${READY%%:*}" "${READY#*: }"

echo "== engines"
STEP="engines"
BUILT=""
for p in $PRECISIONS; do
  set +e
  medusa-export engine --artifact "$ART" --precision "$p"
  rc=$?
  set -e
  case $rc in
    0) row "engine $p" "built" "$(ls -sh "$ART/engines/model.$p.plan" | cut -d' ' -f1)"; BUILT="$BUILT $p" ;;
    3) if [ -n "$GPU" ] && command -v "${TRTEXEC:-trtexec}" >/dev/null 2>&1; then
         if bash "$ART/engines/build_engine.sh" "$p"; then row "engine $p" "built (trtexec)" "no TensorRT Python: not timed"
         else row "engine $p" "FAILED" "trtexec build failed: see $ART/engines/build.model.$p.log"; fi
       else
         skip "engine $p" "no TensorRT here; wrote $ART/engines/trtexec.$p.txt and build_engine.sh"
       fi ;;
    *) row "engine $p" "FAILED" "medusa-export engine exited $rc" ;;
  esac
done

echo "== parity and timing"
STEP="parity and timing"
set +e  # the summary prints whatever this step does
"$PYTHON" - "$ART" "$NEW_TOKENS" "$ROWS" $BUILT <<'PY'
import sys, time
import numpy as np
from medusa_runtime.contract.artifact import load_artifact
from medusa_runtime.decode.loop import generate
from medusa_runtime.engines.ort import OrtEngine

art, new_tokens, rows, precisions = load_artifact(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4:]
ctx = art.model.max_context
vocab = art.model.vocab_size
rng = np.random.default_rng(0)
prompts = [list(rng.integers(3, vocab, size=n)) for n in (8, 32, 96)]

def out(step, result, detail):
    with open(rows, "a") as fh:
        fh.write(f"{step}\t{result}\t{detail}\n")
    print(f"{step}: {result} {detail}")

def run(engine, tree):
    t0, toks, res = time.perf_counter(), 0, []
    for p in prompts:
        r = generate(engine, p, tree, max_new_tokens=new_tokens, max_context=ctx)
        res.append(r)
        toks += len(r.tokens)
    return res, toks / (time.perf_counter() - t0)

ref, tps = run(OrtEngine(art), art.tree)
out("onnxruntime cpu", "ref", f"{tps:.1f} tok/s, {np.mean([r.mean_accepted for r in ref]):.2f} tokens/step")
engines = []
try:
    from medusa_runtime.engines.ort_cuda import OrtCudaEngine
    engines.append(("onnxruntime cuda", lambda: OrtCudaEngine(art)))
except ImportError:
    pass
for p in precisions:
    def make(p=p):
        from medusa_runtime.engines.trt import TrtEngine
        return TrtEngine(art, precision=p)
    import tensorrt
    emulated = " (EMULATED: tests/emulated, not TensorRT)" if getattr(tensorrt, "EMULATED", False) else ""
    engines.append((f"tensorrt {p}{emulated}", make))
for name, make in engines:
    eng = None
    try:  # the whole run of one engine: a failure anywhere is that engine's row, and the others still run
        eng = make()
        res, tps = run(eng, art.tree)
        same = sum(a.tokens == b.tokens for a, b in zip(ref, res))
        first = next((i for a, b in zip(ref, res) for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
        reduced = "fp16" in name or "bf16" in name  # token-exact only up to near-ties (DESIGN: precision and parity)
        verdict = "PASS" if same == len(prompts) else ("DIFF" if reduced else "FAIL")
        speed = "emulated: no GPU timing" if "EMULATED" in name else f"{tps:.1f} tok/s"  # the CPU's, not a GPU's
        out(name, verdict, f"{same}/{len(prompts)} prompts token-identical"
            + (f" (first divergence at token {first})" if first is not None else "") + f"; {speed}")
    except Exception as exc:  # noqa: BLE001 - report and go on with the others
        out(name, "skipped" if eng is None else "FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}")
    finally:
        if eng is not None and hasattr(eng, "close"):
            eng.close()
PY
rc=$?
set -e
if [ "$rc" -ne 0 ]; then row "parity and timing" "FAIL" "the step exited $rc (its traceback is above)"; fi

echo "== step time (T = 1..64 nodes) and expected speedup"
STEP="step time"
HERE="$(cd "$(dirname "$0")" && pwd)"
steptime() {  # name, step_time.py arguments...: a row with T = 16's step-time ratio and expected speedup
  local name="$1"; shift  # (under the emulated TensorRT: no figure, its times are the CPU's, not a GPU's)
  if "$PYTHON" "$HERE/step_time.py" --json "$OUT/step_time.json" "$@"; then
    if "$PYTHON" -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get('emulated') else 1)" "$OUT/step_time.json"; then
      row "step time $name" "emulated" "emulated: no GPU timing (T = 1..64 stepped through the emulated engine)"
      return
    fi
    row "step time $name" "ok" "$("$PYTHON" -c "import json,sys; r=[x for x in json.load(open(sys.argv[1]))['rows'] if x['tree_size']==16][0]; print(f\"T=16: step {r['step_ratio']:.2f}x a 1-token step, {r['expected_tokens_per_step']:.2f} expected tokens/step, expected speedup {r['expected_speedup']:.2f}x\")" "$OUT/step_time.json")"
  else
    row "step time $name" "FAIL" "scripts/step_time.py $* exited non-zero (its output is above)"
  fi
}
steptime "onnxruntime cpu" --artifact "$ART" --backend onnxruntime
for p in $BUILT; do steptime "tensorrt $p" --artifact "$ART" --backend tensorrt --precision "$p"; done
if [ -n "$GPU" ] && "$PYTHON" -c "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()" 2>/dev/null; then
  steptime "onnxruntime cuda" --artifact "$ART" --backend onnxruntime-cuda
fi
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  steptime "pytorch 7b fp16" --torch 7b --device cuda --dtype fp16 --accuracies-from "$ART"
else
  skip "step time pytorch 7b fp16" "no PyTorch with CUDA here"
fi
STEP="summary"

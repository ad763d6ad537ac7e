#!/usr/bin/env bash
# Train the embedded model's heads on a CPU: PARTS one-thread processes answer the training prompts
# and then recompute the features side by side, then one process trains (and the heads are calibrated).
#
#   1. greedy replies to every training prompt (GSM8K capped), until BUDGET reply tokens are stored;
#   2. sampled replies to the chat prompts (SAMPLES per prompt), when BUDGET is not reached yet;
#   3. features (hidden states, teacher top-16) of the stored replies, in feature chunks shared by the parts;
#   4. training (HEAD_TYPE, LAYERS, TRAIN_VOCAB, ...) and calibration on the calibration prompts.
#
# Every stage resumes from CACHE (replies as token ids, features per chunk, training checkpoints), so a
# stopped run continues where it stopped and ablations on the same replies skip stages 1-3.
#
#   OUT=/work/scratch/heads bash scripts/cpu_train_heads.sh
#
# Env: OUT (heads go to OUT/heads), CACHE (OUT/cache), PARTS (2), BUDGET (820000 reply tokens), DATA
# ($MEDUSA_EXPORT_SHARED/data/train, else ../shared/data/train), GSM8K (1500), SAMPLES (8), TEMPERATURE (0.7), MAX_NEW (320), BATCH (64),
# HEAD_TYPE (hydra), INIT (models/smollm2-135m when HEAD_TYPE is hydra: start equal to the shipped Medusa
# heads, which have 1 block; "" for fresh heads, e.g. with LAYERS=2), LAYERS (1), SOFT (16; 0 = hard labels), TRAIN_VOCAB (8192), EPOCHS (2),
# LR (2e-3), THREADS (training threads, 1), MAX_TOKENS (train on a prefix; data scaling), PYTHON (python3).
set -uo pipefail

OUT="${OUT:-/tmp/cpu-heads}"
CACHE="${CACHE:-$OUT/cache}"
DATA="${DATA:-${MEDUSA_EXPORT_SHARED:-../shared}/data/train}"
PYTHON="${PYTHON:-python3}"
PARTS="${PARTS:-2}"
HEAD_TYPE="${HEAD_TYPE:-hydra}"
if [ "$HEAD_TYPE" = hydra ]; then INIT="${INIT-models/smollm2-135m}"; else INIT="${INIT-}"; fi
START=$(date +%s)
mkdir -p "$OUT"

files=(--data "$DATA/train_mix/prompts.jsonl"
       --data "$DATA/self_instruct_user_oriented/user_oriented_instructions.jsonl"
       --data "$DATA/koala/koala_test_set.jsonl")
common=(--model smollm2-135m "${files[@]}" --holdout 0 --exclude models/smollm2-135m/calibration_prompts.jsonl
        --cache "$CACHE" --max-new-tokens "${MAX_NEW:-320}" --batch-size "${BATCH:-64}" --threads 1)
parts() {  # parts ARGS...: PARTS processes side by side, one thread each
  local pids=() i rc=0
  for ((i = 0; i < PARTS; i++)); do
    "$PYTHON" -m medusa_export.cli train-heads "${common[@]}" --part "$i/$PARTS" --out "$OUT/unused" "$@" &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || rc=$?; done
  return $rc
}
stamp() { echo "== $1 at $(( $(date +%s) - START )) s"; }

stamp "greedy replies (GSM8K capped at ${GSM8K:-1500})"
parts --cap "gsm8k_train=${GSM8K:-1500}" --generate-only --budget-tokens "${BUDGET:-820000}" || exit 1
stamp "sampled replies to the chat prompts (${SAMPLES:-8} per prompt, temperature ${TEMPERATURE:-0.7})"
parts --cap gsm8k_train=0 --cap mbpp_train_val_prompt=0 --samples "${SAMPLES:-8}" \
  --temperature "${TEMPERATURE:-0.7}" --generate-only --budget-tokens "${BUDGET:-820000}" || exit 1
train=(--cap "gsm8k_train=${GSM8K:-1500}" --samples "${SAMPLES:-8}" --budget-tokens 1 --head-type "$HEAD_TYPE"
       --num-layers "${LAYERS:-1}" --soft-topk "${SOFT:-16}" --train-vocab "${TRAIN_VOCAB:-8192}"
       --epochs "${EPOCHS:-2}" --lr "${LR:-2e-3}" ${INIT:+--init-heads "$INIT"} ${MAX_TOKENS:+--max-tokens "$MAX_TOKENS"})
stamp "features (hidden states, teacher top-16)"
parts "${train[@]}" --features-only || exit 1
stamp "training $HEAD_TYPE heads"
"$PYTHON" -m medusa_export.cli train-heads "${common[@]}" "${train[@]}" --out "$OUT/heads" \
  ${THREADS:+--threads "$THREADS"} || exit 1
stamp "calibration"
"$PYTHON" -m medusa_export.cli calibrate --model smollm2-135m --heads "$OUT/heads" --heads-vocab "${TRAIN_VOCAB:-8192}" \
  --data models/smollm2-135m/calibration_prompts.jsonl --cache "$CACHE" --batch-size 16 || exit 1
stamp "done"

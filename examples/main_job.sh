#!/usr/bin/env bash
# The main job, end to end on this machine: train a tiny model for a few real steps, and refit a
# receiver step by step with deltas.
#   examples/main_job.sh            (work files go to runs/main-job/, which is recreated)
# Environment: STEPS (default 3), WORK (default runs/main-job).
set -euo pipefail
cd "$(dirname "$0")/.."
.ci/setup
export PATH="$PWD/.venv/bin:$PATH"

STEPS=${STEPS:-3}
WORK=${WORK:-runs/main-job}
rm -rf "$WORK"
mkdir -p "$WORK"

echo "== train: $STEPS AdamW steps of a tiny Qwen3, BF16 checkpoint after each"
python examples/train_tiny.py "$WORK/trainer" --steps "$STEPS"

for step in $(seq 1 "$STEPS"); do
  prev=$((step - 1))
  echo "== step $step: diff step-$prev -> step-$step"
  dcr diff "$WORK/trainer/step-$prev" "$WORK/trainer/step-$step" -o "$WORK/deltas/step-$step" \
    --base-version "step-$prev" --target-version "step-$step"
  dcr inspect "$WORK/deltas/step-$step"
done
echo "== done: deltas in $WORK/deltas"

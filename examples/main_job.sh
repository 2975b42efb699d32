#!/usr/bin/env bash
# The main job, end to end on this machine: train a tiny model for a few real steps, and refit a
# receiver step by step with deltas; then keep training and refit from the live weights (no
# checkpoint per step); then a late receiver joins from a keyframe and catches up by a shortcut.
#   examples/main_job.sh            (work files go to runs/main-job/, which is recreated)
# Environment: STEPS (default 3), LIVE_STEPS (default 2), WORK (default runs/main-job),
# DCR_SKIP_SETUP=1 (the suite: .venv is already set up).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "${DCR_SKIP_SETUP:-}" = 1 ] || .ci/setup
export PATH="$PWD/.venv/bin:$PATH"

STEPS=${STEPS:-3}
LIVE_STEPS=${LIVE_STEPS:-2}
WORK=${WORK:-runs/main-job}
rm -rf "$WORK"
mkdir -p "$WORK"

echo "== train: $STEPS AdamW steps of a tiny Qwen3, BF16 checkpoint after each"
python examples/train_tiny.py "$WORK/trainer" --steps "$STEPS"

STORE="$WORK/store"          # any fsspec URL works here: s3://bucket/run, gs://..., memory://...
RECEIVER="$WORK/rollout"      # the rollout node's local checkpoint, at step 0 like the trainer
cp -r "$WORK/trainer/step-0" "$RECEIVER"

for step in $(seq 1 "$STEPS"); do
  prev=$((step - 1))
  echo "== trainer, step $step: diff against the committed base, push"
  base=$(dcr status "$STORE" --json 2>/dev/null | python -c 'import json,sys; print(json.load(sys.stdin).get("diff_base",{}).get("version") or "")' || true)
  echo "   committed base on the store: ${base:-none yet (first push creates the store)}"
  dcr diff "$WORK/trainer/step-$prev" "$WORK/trainer/step-$step" -o "$WORK/deltas/step-$step" \
    --base-version "step-$prev" --target-version "step-$step"
  dcr inspect "$WORK/deltas/step-$step"
  dcr push "$WORK/deltas/step-$step" "$STORE"

  echo "== rollout node: pull, apply in place, verify, acknowledge"
  dcr pull "$STORE" --version "step-$step" -o "$WORK/pulled/step-$step"
  dcr apply "$WORK/pulled/step-$step" --into "$RECEIVER" --ack "$STORE" --receiver rollout-0
  dcr verify "$RECEIVER" --against "$WORK/pulled/step-$step"

  echo "== trainer: commit step $step once the receiver has acknowledged it"
  dcr commit "$STORE" "step-$step" --receiver rollout-0
done

echo "== trainer, live: $LIVE_STEPS more steps diffed straight from the weights in memory (dcr_cli.Producer)"
python examples/live_producer.py "$WORK" --steps "$LIVE_STEPS" --store "$STORE" --receiver "$RECEIVER"
LAST=$((STEPS + LIVE_STEPS))

echo "== store: a keyframe of step-$STEPS for new receivers, and a squashed shortcut every 2 versions after it"
dcr compact "$STORE" --keyframe "$WORK/trainer/step-$STEPS" --version "step-$STEPS" --every 2

echo "== a late receiver: join from the newest keyframe (one download), then follow the cheapest path"
dcr pull "$STORE" --join -o "$WORK/late"
dcr apply "$STORE" --since "step-$STEPS" --into "$WORK/late"
dcr verify "$WORK/late"

echo "== the store's history"
dcr log "$STORE"
# An independent check besides dcr verify's digests: the files are byte-identical to the trainer's.
cmp "$RECEIVER/model.safetensors" "$WORK/trainer/step-$LAST/model.safetensors"
cmp "$WORK/late/model.safetensors" "$WORK/trainer/step-$LAST/model.safetensors"
echo "== done: $RECEIVER and the late receiver $WORK/late hold exactly the bits of $WORK/trainer/step-$LAST"

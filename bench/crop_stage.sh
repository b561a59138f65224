#!/usr/bin/env bash
# bench/crop_stage.sh: the CPU demo's crop GRPO stage alone, from a demo run's crop SFT checkpoint (issue 76's loop:
# minutes a try, not a whole run.sh). run.sh's own crop-stage flags, greedy evals every 10 steps; extra flags go to
# train_grpo.py after them (argparse: the last wins). At the end one line of numbers (bench/RESULTS.md, issue 76).
#
#   NAME=base bash run.sh           # once (it may be stopped once stages.tsv lists sft_crop): runs/base/sft_crop/iter_0000256
#   bash bench/crop_stage.sh runs/base runs/try-iou --box-iou-coef 0.5
#   WARM=<checkpoint> DATA=<crop set> bash bench/crop_stage.sh runs/base runs/try-x ...   # another warm start or set
#   bash bench/crop_stage.sh --line runs/try-iou            # the line again
set -e
cd "$(dirname "$0")/.."
line() {  # per 10 training steps: crop calls an episode, hit share, reward; each greedy eval: accuracy/hit/calls
  .venv/bin/python - "$1" <<'EOF'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1] + "/metrics.jsonl")]
train = [r for r in rows if "reward" in r]
def tens(k):
    return ", ".join(f"{sum(r.get(k, 0) for r in train[i:i + 10]) / len(train[i:i + 10]):.2f}" for i in range(0, len(train), 10))
evals = [f"{r['step']}: {r['eval_multi_turn_accuracy']:.3f}/{r.get('eval_multi_turn_crop_hit_frac', 0):.3f}/"
         f"{r.get('eval_multi_turn_tool_calls_image_zoom_in_tool', 0):.2f}" for r in rows if "eval_multi_turn_accuracy" in r]
print(f"{sys.argv[1]}: calls {tens('tool_calls_image_zoom_in_tool')} | hit {tens('crop_hit_frac')} | reward "
      f"{tens('reward')} | greedy acc/hit/calls {'; '.join(evals)}")
EOF
}
if [[ "$1" == --line ]]; then line "$2"; exit 0; fi
RUN=$1 OUT=$2 && shift 2
[[ -d "$RUN/crop" ]] || { echo "crop_stage.sh: $RUN has no crop set (NAME=... bash run.sh first)" >&2; exit 2; }
[[ ! -e "$OUT" ]] || { echo "crop_stage.sh: $OUT exists: pick another folder" >&2; exit 2; }
WARM=${WARM:-$RUN/sft_crop/iter_0000256} DATA=${DATA:-$RUN/crop}
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
t=$SECONDS
.venv/bin/python train_grpo.py --hf-checkpoint "$WARM" --save "$OUT" --prompt-data "$DATA" --eval-prompt-data "$DATA" \
    --eval-split test --eval-samples 64 --rollout-engine local --rollout-batch-size 8 --n-samples-per-prompt 8 \
    --rollout-temperature 1.0 --lr 1e-4 --decoupled-lr 3e-3 --seed "${SEED:-1234}" --max-turns 3 \
    --rollout-max-response-len 192 --max-tokens-per-gpu 4096 --num-rollout 20 --lr-warmup-iters 10 \
    --eval-interval 10 --save-interval 1000 "$@" > "$OUT.log" 2>&1
echo "$(line "$OUT") | $((SECONDS - t)) s, load $(cut -d' ' -f1-3 /proc/loadavg) | $*"

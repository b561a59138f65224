#!/usr/bin/env bash
# run.sh: the whole recipe, top to bottom.
#
#   bash run.sh --help     this text
#
#   bash run.sh
#       CPU demo (no GPU, no network): a tiny random Qwen3-VL goes through the whole pipeline on
#       synthetic polygons: SFT warm-up (the answer format only: chance, 1 in 4) -> GRPO single-turn
#       (reads the number of sides from the picture, from the reward alone: greedy 0.27-0.30 -> 1.0)
#       -> SFT on zoom-tool episodes (the call) -> GRPO multi-turn on the crop task (two polygons on a
#       1,024-px canvas, the question names one's box): greedy, it crops the named box 0.000 -> 1.000 and
#       multi-turn accuracy goes 0.19-0.31 -> 1.000 (3 GRPO x 2 data seeds; bench/RESULTS.md, "Issue 76").
#       SEED (GRPO), DATA_SEED (data and SFT); RUN=<folder> instead of runs/$NAME. No arguments, no MODE.
#       Writes runs/cpu-demo/: each stage's metrics.jsonl and checkpoints, summary.md, reward_curve.png;
#       a folder that holds a run is kept: NAME=<other> writes runs/<other>, OVERWRITE=1 deletes it first.
#
#   MODEL=Qwen/Qwen3-VL-2B-Instruct DATA=hiyouga/geometry3k NUM_GPUS=4 MODE=multi_turn bash run.sh
#       The published geo3k recipe on GPUs: SGLang rollouts on rank 0, Megatron on every rank.
#       MODEL and DATA may be hub ids (fetched where the network allows) or local folders.
#       MODE=single_turn|multi_turn; TP=2 sets tensor parallel; NUM_ROLLOUT, NAME as you like.
#       Placement: SGLang shares the NUM_GPUS training GPUs (--colocate, released while training),
#       or ROLLOUT_GPUS=2 gives it 2 GPUs of its own on each node (NUM_GPUS - 2 train there).
#       MAX_TOKENS: tokens per packed micro-batch (2048 fits a 2B model in fp32 on 80 GB: README).
#       Several nodes: NNODES=2 NODE_RANK=<r> MASTER_ADDR=<host> on every node.
#       GPUS_PER_ENGINE=2: a node's serving GPUs split into SGLang servers of 2 (behind SGLang's router).
#
#   MODEL=Qwen/Qwen3.5-35B-A3B NUM_GPUS=8 MODE=single_turn bash run.sh
#       Qwen3.5 MoE in the reference layout: TP=2 with sequence parallel, EP=8 (expert-TP 1), full
#       recompute, alltoall dispatcher, fp32 router, no aux loss; TP, EP, DISPATCHER override them.
#       On GPUs under 100 GiB, Adam runs on the CPU (--optimizer-cpu-offload; CPU_ADAM=0|1 forces it).
#       Dense Qwen3.5 (0.8B-27B) takes TP as the other families (sequence parallel when TP > 1).
#       Extra arguments go to train_grpo.py as they are (e.g. --sglang-mem-fraction-static 0.5).
#
#   Preemption (GPU recipe, --exit-signal-handler): a SIGTERM to torchrun reaches every rank, the step in flight
#       ends and is saved; torchrun kills what still runs SHUTDOWN_TIMEOUT seconds (default 600; 30 s fixed on
#       torch < 2.12) after the signal, then exits 1 even when every rank exited 0. Rerun the same command: it resumes.
cd "$(dirname "$0")"
die() { echo "run.sh: $*" >&2; exit 2; }
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then sed -n '2,/^[^#]/s/^# \{0,1\}//p' run.sh; exit 0; fi
MODEL=${MODEL:-tiny}
DATA=${DATA:-synth}
NUM_GPUS=${NUM_GPUS:-0}

if [[ "$NUM_GPUS" == 0 ]]; then
  # ---------------------------------------------------------------- the CPU demo
  [[ "$MODEL" == tiny && "$DATA" == synth ]] || die "MODEL=$MODEL DATA=$DATA needs GPUs: set NUM_GPUS (the CPU demo uses MODEL=tiny DATA=synth)"
  for v in MODE TP EP DISPATCHER CPU_ADAM ROLLOUT_GPUS GPUS_PER_ENGINE NUM_ROLLOUT MAX_TOKENS; do
    [[ -z "${!v:-}" ]] || die "$v=${!v} is for the GPU recipe (NUM_GPUS > 0); the CPU demo runs as it is (bash run.sh --help)"
  done
  (( $# == 0 )) || die "$*: arguments go to train_grpo.py in the GPU recipe only; the CPU demo takes none (bash run.sh --help)"
  RUN=${RUN:-runs/${NAME:-cpu-demo}}   # RUN: any folder (tests/test_learning.py)
  SEED=${SEED:-1234} DATA_SEED=${DATA_SEED:-0}   # GRPO's seed; the data's and SFT's (bench/RESULTS.md: both varied)
  [[ "${OVERWRITE:-0}" == 1 ]] && rm -rf "$RUN"
  # A stage is done once it is in $RUN/stages.tsv (name, seconds); a rerun on the folder skips it, and the stage
  # that was in flight resumes from its checkpoint (each trainer runs with --load its own folder) or restarts.
  next_stage() {  # what a rerun does with the first stage not done
    local s
    for s in data sft grpo sft_crop grpo_mt report; do
      grep -q "^$s	" "$RUN/stages.tsv" 2>/dev/null && continue
      [[ -f "$RUN/$s/latest" ]] && echo "$s resumes from $RUN/$s/$(cat "$RUN/$s/latest")" || echo "$s starts from its beginning"
      return
    done
    echo "nothing: the demo is finished"
  }
  if [[ -n "$(ls -A "$RUN" 2>/dev/null)" ]]; then
    [[ "$(cat "$RUN/seeds" 2>/dev/null)" == "SEED=$SEED DATA_SEED=$DATA_SEED" ]] || die "$RUN holds a run of $(cat \
      "$RUN/seeds" 2>/dev/null || echo "no CPU demo") (here SEED=$SEED DATA_SEED=$DATA_SEED): NAME=<other> writes runs/<other>, OVERWRITE=1 deletes it first"
    echo "run.sh: $RUN holds this demo; done: $(cut -f1 "$RUN/stages.tsv" 2>/dev/null | xargs echo) (kept); $(next_stage)"
  fi
  mkdir -p "$RUN" && echo "SEED=$SEED DATA_SEED=$DATA_SEED" > "$RUN/seeds"
  STAGE=
  trap 'echo "run.sh: interrupted in stage $STAGE; \`bash run.sh\` on $RUN (same seeds) goes on: $(next_stage)" >&2; exit 130' INT
  stage() {  # stage NAME COMMAND...: COMMAND, unless NAME is done; its seconds to stages.tsv (summary.md shows them)
    grep -q "^$1	" "$RUN/stages.tsv" 2>/dev/null && return
    STAGE=$1 && shift && local t=$SECONDS
    "$@" || die "stage $STAGE failed (exit $?); \`bash run.sh\` on $RUN goes on: $(next_stage)"
    printf '%s\t%s\n' "$STAGE" $((SECONDS - t)) >> "$RUN/stages.tsv"
  }
  source setup.sh
  export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  PY=.venv/bin/python
  data() {
    $PY tools/synth.py --n 1024 --n-test 64 --seed "$DATA_SEED" --out "$RUN/data" --kinds sides &&  # regular 3-6-gons: how many sides?
    $PY tools/synth.py --n 384 --seed $((DATA_SEED + 1)) --out "$RUN/warmup" --kinds sides &&     # other problems, for SFT
    # the crop task: two polygons on a 1,024-px canvas, the question names one's box (bench/RESULTS.md, "Tool learning")
    $PY tools/synth.py --n 512 --n-test 64 --seed $((DATA_SEED + 2)) --out "$RUN/crop" --kinds crop &&
    $PY tools/tiny.py --arch qwen3_vl --out "$RUN/base" &&                     # random weights, real tokenizer
    # SFT episodes zooming in the model's own grounding frame (Qwen3-VL's: relative 0-1000)
    $PY tools/synth.py --n 512 --n-test 8 --seed $((DATA_SEED + 3)) --out "$RUN/crop_warm" --kinds crop --warm-start 0.5 \
        --hf-checkpoint "$RUN/base"
  }
  stage data data
  EVAL=(--eval-prompt-data "$RUN/data" --eval-split test --eval-samples 64)
  # SFT warm-up, 24 steps: the format. A random tiny model wants a fast embedding/output layer and
  # a slow body (README, "Known limits"); it reads the picture only after ~60 steps of SFT.
  SFT=(--decoupled-lr 1e-2 --seed $((1234 + DATA_SEED)))
  stage sft $PY sft.py --hf-checkpoint "$RUN/base" --prompt-data "$RUN/warmup" --save "$RUN/sft" --load "$RUN/sft" \
      "${EVAL[@]}" "${SFT[@]}" --lr 1e-4 --lr-warmup-iters 3 --lr-decay-style constant --global-batch-size 16 \
      --num-epoch 1 --max-tokens-per-gpu 1024
  GRPO=(--rollout-engine local --rollout-batch-size 8 --n-samples-per-prompt 8 --rollout-temperature 1.0
        --lr 1e-4 --decoupled-lr 3e-3 --seed "$SEED")
  stage grpo $PY train_grpo.py --hf-checkpoint "$RUN/sft/iter_0000024" --save "$RUN/grpo" --load "$RUN/grpo" \
      --prompt-data "$RUN/data" "${EVAL[@]}" "${GRPO[@]}" --rollout-max-response-len 48 --max-tokens-per-gpu 1024 \
      --num-rollout 100 --eval-interval 50 --save-interval 50 --dynamic-sampling   # all-equal groups replaced: bench/RESULTS.md, "CPU demo"
  # the tool call: SFT on crop-task episodes, half of which zoom into the named box (tools/synth.py --warm-start); 4
  # epochs: at 2 the call's box ignores the question (bench/RESULTS.md, issue 76); greedy, it then answers at once
  stage sft_crop $PY sft.py --hf-checkpoint "$RUN/grpo/iter_0000100" --prompt-data "$RUN/crop_warm" --save "$RUN/sft_crop" \
      --load "$RUN/sft_crop" "${SFT[@]}" --lr 3e-4 --lr-warmup-iters 10 --lr-decay-style cosine --global-batch-size 8 \
      --num-epoch 4 --max-tokens-per-gpu 4096 --save-interval 128
  # multi-turn GRPO on the crop task, lr warmed up: it learns to call image_zoom_in_tool on the named box (greedy: every
  # problem from step 10 at 3 x 2 seeds, so 20 steps, not 30: bench/RESULTS.md, "Issue 76")
  stage grpo_mt $PY train_grpo.py --hf-checkpoint "$RUN/sft_crop/iter_0000256" --save "$RUN/grpo_mt" --load "$RUN/grpo_mt" \
      --prompt-data "$RUN/crop" --eval-prompt-data "$RUN/crop" --eval-split test --eval-samples 64 "${GRPO[@]}" \
      --max-turns 3 --rollout-max-response-len 192 --max-tokens-per-gpu 4096 --num-rollout 20 \
      --lr-warmup-iters 10 --eval-interval 10 --save-interval 20
  stage report $PY tools/report.py "$RUN"
  echo "final Hugging Face checkpoint: $RUN/grpo_mt/$(cat "$RUN/grpo_mt/latest")"
  exit 0
fi

# -------------------------------------------------------------------- the GPU recipe
source setup.sh
MODE=${MODE:-}
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 || die "NUM_GPUS=$NUM_GPUS but no NVIDIA GPU is visible (nvidia-smi failed)"
have=$(nvidia-smi -L | wc -l)
(( have >= NUM_GPUS )) || die "NUM_GPUS=$NUM_GPUS but this node has $have GPU(s)"
.venv/bin/python -c "import sglang" 2>/dev/null || die "SGLang is not installed: GPU=1 bash setup.sh"
[[ "$MODE" == single_turn || "$MODE" == multi_turn ]] || die "MODE=$MODE: use single_turn or multi_turn on GPUs"
[[ "$DATA" != synth ]] || DATA=hiyouga/geometry3k
if [[ ! -d "$MODEL" ]]; then  # a hub id: fetch it once (needs the network)
  MODEL=$(.venv/bin/python -c "import sys; from huggingface_hub import snapshot_download as s; print(s(sys.argv[1]))" "$MODEL") \
    || die "cannot fetch MODEL from the hub; download it and set MODEL=<local folder>"
fi
family=$(.venv/bin/python -c "import json,sys; print(json.load(open(sys.argv[1] + '/config.json'))['model_type'])" "$MODEL") \
  || die "$MODEL has no readable config.json"
[[ "$family" =~ ^(qwen3_vl|qwen2_5_vl|qwen3_5|qwen3_5_moe)$ ]] \
  || die "model family '$family' is not supported (qwen3_vl, qwen2_5_vl, qwen3_5, qwen3_5_moe)"
PARALLEL=(--tensor-model-parallel-size "${TP:-1}")
# bf16 with fp32 masters and gradients, the optimizer sharded over DP (README, "Precision"); --colocate
# turns --offload-train on (the trainer waits in host memory while SGLang generates at 0.7)
PRECISION=(--bf16 --accumulate-allreduce-grads-in-fp32 --use-distributed-optimizer)
if [[ "$family" == qwen3_5_moe ]]; then  # the reference layout on 8 GPUs
  PARALLEL=(--tensor-model-parallel-size "${TP:-2}" --sequence-parallel --expert-model-parallel-size "${EP:-8}"
            --moe-token-dispatcher-type "${DISPATCHER:-alltoall}" --moe-router-dtype fp32 --moe-aux-loss-coeff 0
            --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
  # the experts' Adam states are not sharded at expert-DP 1 (49.7 GiB a GPU): under 100 GiB GPUs they
  # live on the host, with megatron's CPU Adam (bench/memory.py; README, "Precision"). CPU_ADAM=0|1 forces it.
  gpu_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
  if [[ "${CPU_ADAM:-auto}" == 1 || ( "${CPU_ADAM:-auto}" == auto && "$gpu_mib" -lt 100000 ) ]]; then
    PRECISION+=(--optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d)
  fi
elif [[ "$family" == qwen3_5 ]] && (( ${TP:-1} > 1 )); then
  PARALLEL+=(--sequence-parallel)
fi
TURNS=1; TEMP=0.8
[[ "$MODE" == multi_turn ]] && { TURNS=3; TEMP=1.0; }
RUN=runs/${NAME:-geo3k-$MODE}
TRAIN_GPUS=$NUM_GPUS; PLACE=(--colocate)
if (( ${ROLLOUT_GPUS:-0} > 0 )); then
  TRAIN_GPUS=$((NUM_GPUS - ROLLOUT_GPUS)); PLACE=(--rollout-num-gpus "$ROLLOUT_GPUS")
  (( TRAIN_GPUS > 0 )) || die "ROLLOUT_GPUS=$ROLLOUT_GPUS leaves no training GPU of NUM_GPUS=$NUM_GPUS"
fi
[[ -n "${GPUS_PER_ENGINE:-}" ]] && PLACE+=(--rollout-num-gpus-per-engine "$GPUS_PER_ENGINE")
# torchrun SIGKILLs its workers --shutdown-timeout seconds after passing a SIGTERM on (torch's default 30 s,
# launcher/api.py:148-151): too short for a step and its checkpoint (tests/test_console.py runs these lines).
# torch 2.12.0 added the flag (run.py:689) and TORCH_ELASTIC_SHUTDOWN_TIMEOUT, read where no flag is given
# (launcher/api.py:144-147; any elastic launch in this job); 2.11 has neither: its agent's 30 s are fixed
# (multiprocessing/api.py:649) and the variable is ignored
TORCHRUN=(.venv/bin/torchrun --shutdown-timeout "${SHUTDOWN_TIMEOUT:-600}")
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-600}
.venv/bin/torchrun --help | grep -q -- --shutdown-timeout || { TORCHRUN=(.venv/bin/torchrun)
  echo "run.sh: this torchrun has no --shutdown-timeout (torch < 2.12): a preempted step has 30 s to end and save" >&2; }
exec "${TORCHRUN[@]}" --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
    --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" --nproc-per-node "$TRAIN_GPUS" \
  train_grpo.py --hf-checkpoint "$MODEL" --prompt-data "$DATA" --eval-prompt-data "$DATA" --eval-split test \
    --save "$RUN" --load "$RUN" --exit-signal-handler --rollout-engine sglang "${PLACE[@]}" "${PARALLEL[@]}" \
    "${PRECISION[@]}" --rollout-batch-size 64 --n-samples-per-prompt 8 --rollout-max-response-len 4096 \
    --rollout-temperature "$TEMP" --max-turns "$TURNS" --lr 1e-6 --eps-clip 0.2 --eps-clip-high 0.28 \
    --kl-loss-coef 0 --entropy-coef 0 --adam-beta1 0.9 --adam-beta2 0.98 --weight-decay 0.1 \
    --max-tokens-per-gpu "${MAX_TOKENS:-2048}" --num-rollout "${NUM_ROLLOUT:-300}" --save-interval 20 --eval-interval 10 \
    "$@"

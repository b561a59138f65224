#!/usr/bin/env bash
# The GPU smoke test: one command on a machine with one CUDA GPU, under 10 minutes, one PASS/FAIL
# line per check. It covers what the CPU suite cannot reach: NCCL's rules (CUDA tensors in every
# collective, even in a world of one), the loss on CUDA, Transformer Engine's layer spec and THD
# packing, tools/check.py on one device, the local engine on CUDA, and stock SGLang on a GPU.
#
#   GPU=1 bash setup.sh          # once: requirements + sglang + Transformer Engine (README)
#   bash bench/gpu_smoke.sh      # logs in $SMOKE_DIR (default: a new temporary folder)
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DIR=${SMOKE_DIR:-$(mktemp -d /tmp/gpu_smoke.XXXX)}
mkdir -p "$DIR"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
failed=0

check() {  # check NAME CMD...: runs CMD, logs to $DIR/NAME.log, prints PASS/FAIL with the last line
  local name=$1 start=$SECONDS
  shift
  if "$@" >"$DIR/$name.log" 2>&1; then
    echo "PASS $name ($((SECONDS - start)) s): $(tail -n 1 "$DIR/$name.log")"
  else
    failed=$((failed + 1))
    echo "FAIL $name ($((SECONDS - start)) s), log $DIR/$name.log:"
    grep -vE '^\s*$' "$DIR/$name.log" | tail -n 6 | sed 's/^/    /'
  fi
}

metric() {  # metric RUN_DIR: the last step's failed_frac, logprob gap and grad norm, or exit 1
  "$PY" - "$1" <<'EOF'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1] + "/metrics.jsonl") if '"reward"' in x]
last = rows[-1]
mem = "".join(f" {k}={last[k]:.2f}" for k in ("gpu_train_peak_gib", "gpu_held_at_resume_gib") if k in last)
mem += "".join(f" routing_mismatch={r['routing_mismatch']:.4f}" for r in rows[-1:] if "routing_mismatch" in r)
print(f"steps={len(rows)} failed_frac={last['failed_frac']} reward={last['reward']:.3f} sync_s={last.get('sync_s', 0):.2f} "
      f"logprob_diff_mean={last.get('logprob_diff_mean', float('nan')):.2e} grad_norm={last.get('grad_norm', 0):.3g}{mem}")
sys.exit(0 if rows and all(r["failed_frac"] == 0 for r in rows) and last.get("grad_norm", 0) > 0
         and last.get("logprob_diff_mean", 1) < 1e-2 else 1)
EOF
}

steps_of() { grep -c '"reward"' "$1/metrics.jsonl" 2>/dev/null; }  # GRPO steps logged in RUN_DIR

preempt_run() {  # preempt_run RUN_DIR ARGS...: run.sh's torchrun SIGTERMed once step 1 is logged, then rerun
  local run=$1 pid rc k end=$((SECONDS + 600)) TORCHRUN
  shift
  eval "$(sed -n '/^TORCHRUN=/,/^exec /{/^exec /!p}' run.sh)"  # its --shutdown-timeout where torchrun has it
  "${TORCHRUN[@]}" --standalone --nproc_per_node 1 train_grpo.py "$@" --save "$run" --load "$run" --exit-signal-handler &
  pid=$!
  until [ "$(steps_of "$run")" -ge 1 ] || ! kill -0 $pid 2>/dev/null || ((SECONDS > end)); do sleep 0.2; done
  kill -TERM $pid
  wait $pid
  rc=$? k=$(steps_of "$run")
  echo "torchrun exit $rc after step $k; latest $(cat "$run/latest" 2>/dev/null)"
  [ "$rc" = 1 ] && [ "$(cat "$run/latest")" = "$(printf 'iter_%07d' "$k")" ] || return 1
  "${TORCHRUN[@]}" --standalone --nproc_per_node 1 train_grpo.py "$@" --save "$run" --load "$run" --exit-signal-handler \
    || return 1
  echo "preempted after step $k (torchrun exit 1, iter_$k saved); resumed: steps $(steps_of "$run") of 3, none twice"
  [ "$(steps_of "$run")" = 3 ]
}

restart_run() {  # restart_run RUN_DIR ARGS...: the server's group SIGKILLed in step 2's rollout; one restart in all
  local run=$1 watcher rc end=$((SECONDS + 600))
  shift
  (until [ "$(steps_of "$run")" -ge 1 ] || ((SECONDS > end)); do sleep 0.2; done
   n=$(grep -c "POST /generate" "$run/sglang.log")  # one of step 2's requests answered: the others generate
   until [ "$(grep -c "POST /generate" "$run/sglang.log")" -gt "$n" ] || ((SECONDS > end)); do sleep 0.05; done
   ((SECONDS > end)) || kill -KILL -- "-$(grep -o '=== pid [0-9]*' "$run/sglang.log" | tail -n 1 | cut -d' ' -f3)") &
  watcher=$!
  "${TR[@]}" train_grpo.py "$@" --save "$run"
  rc=$?
  kill $watcher 2>/dev/null
  echo "exit $rc; server starts: $(grep -c 'starting:' "$run/sglang.log") (one restart: 2)"
  [ "$rc" = 0 ] && [ "$(grep -c 'starting:' "$run/sglang.log")" = 2 ]
}

lm_heads() {  # lm_heads RUN_DIR ARGS...: GRPO with the fp32 LM head (the engine's default), then without it
  "${TR[@]}" train_grpo.py "${@:2}" --save "$1/fp32_head" || return 1
  cat > "$1/bf16_head.py" <<'EOF'
import os, runpy, sys
sys.path.insert(0, os.getcwd())
import sglang_engine as E
S = E.Server  # the same run with the flag taken out of the server's command line
E.Server = lambda path, run, args, *a, **k: S(path, run, [x for x in args if x != "--enable-fp32-lm-head"], *a, **k)
runpy.run_path("train_grpo.py", run_name="__main__")
EOF
  "${TR[@]}" "$1/bf16_head.py" "${@:2}" --save "$1/bf16_head" || return 1
  grep -q -- "--enable-fp32-lm-head" "$1/fp32_head/sglang.log" && ! grep -q -- "--enable-fp32-lm-head" \
    "$1/bf16_head/sglang.log" || { echo "the servers' flags are not as asked"; return 1; }
  "$PY" - "$1" <<'EOF'
import json, statistics, sys
diff = {h: [json.loads(x)["logprob_diff_mean"] for x in open(f"{sys.argv[1]}/{h}_head/metrics.jsonl") if '"reward"' in x]
        for h in ("fp32", "bf16")}
print("logprob_diff_mean by step, fp32 LM head:", diff["fp32"], "bf16 LM head:", diff["bf16"])
sys.exit(0 if statistics.mean(diff["fp32"]) < statistics.mean(diff["bf16"]) else 1)
EOF
}

check environment "$PY" -c "
import torch, transformers, megatron.core
assert torch.cuda.is_available(), 'no CUDA device'
try:
    import transformer_engine, transformer_engine.pytorch
    te = transformer_engine.__version__
except Exception as e:
    te = f'NOT IMPORTABLE ({type(e).__name__}: {e})'
print(f'{torch.cuda.get_device_name()} torch {torch.__version__} cuda {torch.version.cuda} '
      f'transformers {transformers.__version__} megatron-core {megatron.core.__version__} TE {te}')"
check tiny_checkpoints bash -c "$PY tools/tiny.py --arch qwen3_vl --out $DIR/tiny && $PY tools/tiny.py --arch qwen2_5_vl --out $DIR/tiny25 \
  && $PY tools/synth.py --n 64 --n-test 8 --kinds sides --out $DIR/data && echo made"
# Logits of Megatron (TE spec, THD packing) vs transformers, both on cuda:0; fp32, so 1e-4 holds
# where TE keeps fp32 (unfused attention); a FAIL here with a small diff is TE's kernel choice.
check check_te_qwen3_vl "$PY" tools/check.py --hf-checkpoint "$DIR/tiny" --transformer-impl transformer_engine
check check_te_qwen2_5_vl "$PY" tools/check.py --hf-checkpoint "$DIR/tiny25" --transformer-impl transformer_engine
check check_local_spec "$PY" tools/check.py --hf-checkpoint "$DIR/tiny" --transformer-impl local
# Qwen3.5: Gated DeltaNet through FLA's varlen kernel and causal-conv1d (check_kernels stops the build if
# FLA is missing), then with causal-conv1d taken away: FLA's delta rule after the torch conv. fp32 at 1e-4
# needs fp32 products: FLA 0.6.0's kernels call tl.dot without a precision (fla/ops/common/chunk_o.py:128-154,
# chunk_delta_h.py:214-295; only fla/ops/utils/solve_tril.py:19 has a switch, FLA_TRIL_PRECISION, default ieee),
# which Triton 3.8 computes in TF32 on NVIDIA unless TRITON_F32_DEFAULT says otherwise (language/core.py:2385-2388,
# knobs.py:496; the variable is part of its kernel cache key)
F32=(env TRITON_F32_DEFAULT=ieee "$PY")
check tiny_qwen3_5 bash -c "$PY tools/tiny.py --arch qwen3_5 --out $DIR/tiny35 && echo made"
check check_te_qwen3_5 "${F32[@]}" tools/check.py --hf-checkpoint "$DIR/tiny35"
check check_qwen3_5_torch_conv "${F32[@]}" -c "import runpy, sys, qwen3_5; qwen3_5.causal_conv1d_fn = None
sys.argv = ['tools/check.py', '--hf-checkpoint', '$DIR/tiny35']; runpy.run_path('tools/check.py', run_name='__main__')"
# in a bf16 model FLA's delta rule takes q, k and v in bf16 (not promoted to fp32)
check qwen3_5_fla_bf16 "$PY" -c "
import torch, model as M, qwen3_5
seen, fla = [], qwen3_5.chunk_gated_delta_rule
def recorded(q, k, v, *a, **kw):
    seen.append((q.dtype, k.dtype, v.dtype))
    return fla(q, k, v, *a, **kw)
qwen3_5.chunk_gated_delta_rule = recorded
m = M.load_model('$DIR/tiny35', M.ModelOptions(bf16=True))
with torch.no_grad():
    m([torch.arange(100, 164, device=m.par.device)])
assert seen and all(s == (torch.bfloat16,) * 3 for s in seen), seen
print('FLA q, k, v dtypes', seen[0])"
# torchrun with one process: the NCCL backend, so every collective must take CUDA tensors.
TR=("$PY" -m torch.distributed.run --standalone --nproc_per_node 1)
check sft_4_steps "${TR[@]}" sft.py --hf-checkpoint "$DIR/tiny" --prompt-data "$DIR/data" --save "$DIR/sft" \
  --global-batch-size 16 --lr 1e-4 --num-epoch 1 --eval-prompt-data "$DIR/data" --eval-samples 8
check sft_4_steps_metrics "$PY" -c "
import json; rows = [json.loads(x) for x in open('$DIR/sft/metrics.jsonl') if '\"loss\"' in x]
assert len(rows) >= 3 and all(r['grad_norm'] > 0 for r in rows), rows; print(rows[-1])"
GRPO=(--hf-checkpoint "$DIR/tiny" --prompt-data "$DIR/data" --rollout-batch-size 4 --n-samples-per-prompt 4
      --rollout-max-response-len 32 --num-rollout 3 --lr 1e-5 --entropy-coef 0.01 --save-interval 2)
check grpo_local_engine "${TR[@]}" train_grpo.py "${GRPO[@]}" --rollout-engine local --save "$DIR/grpo_local"
check grpo_local_engine_metrics metric "$DIR/grpo_local"
check grpo_multi_turn "${TR[@]}" train_grpo.py "${GRPO[@]}" --rollout-engine local --max-turns 3 --save "$DIR/grpo_multi"
check grpo_multi_turn_metrics metric "$DIR/grpo_multi"
# bf16 with fp32 master weights and gradients through megatron-core's DDP and distributed optimizer
# (optim.megatron_optimizer), activation recompute (selective: Megatron's; full: model.py's chunks),
# a checkpoint at step 2 resumed to the end
BF16=(--bf16 --accumulate-allreduce-grads-in-fp32 --use-distributed-optimizer)
check sft_bf16_distopt_selective "${TR[@]}" sft.py --hf-checkpoint "$DIR/tiny" --prompt-data "$DIR/data" \
  --save "$DIR/sft_bf16" --global-batch-size 16 --lr 1e-4 --num-epoch 1 "${BF16[@]}" --recompute-granularity selective
check grpo_bf16_distopt_full_recompute "${TR[@]}" train_grpo.py "${GRPO[@]}" --rollout-engine local "${BF16[@]}" \
  --recompute-granularity full --save "$DIR/grpo_bf16"
check grpo_bf16_resume "${TR[@]}" train_grpo.py "${GRPO[@]}" --rollout-engine local "${BF16[@]}" \
  --recompute-granularity full --num-rollout 4 --save "$DIR/grpo_bf16" --load "$DIR/grpo_bf16"
check grpo_bf16_metrics metric "$DIR/grpo_bf16"
# preemption through run.sh's torchrun line (its --shutdown-timeout): SIGTERM to torchrun after step 1, the step in
# flight saved (the stop agreed over NCCL), torchrun exit 1; the same command resumes with no step lost or twice
check grpo_preempted_torchrun preempt_run "$DIR/grpo_preempt" "${GRPO[@]}" --rollout-engine local "${BF16[@]}"
# --offload-train (offload.py): a release frees >= 90% of what the trainer holds (memory_allocated) into
# host buffers page-locked at their exact size, the restore is bit-exact; then with megatron's CPU Adam
# (HybridDeviceOptimizer), and a GRPO run with it
check offload_bf16_distopt "$PY" bench/offload_check.py "$DIR/tiny" "${BF16[@]}"
check offload_cpu_adam "$PY" bench/offload_check.py "$DIR/tiny" "${BF16[@]}" --optimizer-cpu-offload
check grpo_cpu_adam "${TR[@]}" train_grpo.py "${GRPO[@]}" --rollout-engine local "${BF16[@]}" --optimizer-cpu-offload \
  --overlap-cpu-optimizer-d2h-h2d --offload-train --save "$DIR/grpo_cpu_adam"
check grpo_cpu_adam_metrics metric "$DIR/grpo_cpu_adam"
# Qwen3.5-MoE in bf16 with the distributed optimizer: the routed experts get an optimizer of their own
# (megatron's ChainedOptimizer: optim.Schedule over every group, state saved and resumed per part)
check tiny_moe bash -c "$PY tools/tiny.py --arch qwen3_5_moe --out $DIR/tiny_moe && echo made"
MOE=(--hf-checkpoint "$DIR/tiny_moe" --prompt-data "$DIR/data" --rollout-batch-size 4 --n-samples-per-prompt 4
     --rollout-max-response-len 32 --lr 1e-5 --save-interval 2 --rollout-engine local "${BF16[@]}" --save "$DIR/grpo_moe")
check grpo_moe_bf16_distopt "${TR[@]}" train_grpo.py "${MOE[@]}" --num-rollout 2
check grpo_moe_bf16_resume "${TR[@]}" train_grpo.py "${MOE[@]}" --num-rollout 3 --load "$DIR/grpo_moe"
check grpo_moe_bf16_metrics metric "$DIR/grpo_moe"
check offload_moe_bf16_distopt "$PY" bench/offload_check.py "$DIR/tiny_moe" "${BF16[@]}"
# R3: the routers replay the local engine's experts (transformers' routers on the GPU, bf16 trainer)
check grpo_moe_r3_local "${TR[@]}" train_grpo.py "${MOE[@]/grpo_moe/grpo_moe_r3}" --num-rollout 2 --use-rollout-routing-replay
check grpo_moe_r3_local_metrics metric "$DIR/grpo_moe_r3"
# --colocate --no-offload-train, "tensor" sync: a parameter exported without a copy (convert.full's "rep") must
# not be what CUDA IPC shares: each share wraps its storage in one more ref-counted context that lives as long as
# the storage (torch/csrc/StorageSharing.cpp THPStorage_shareCuda: set_data_ptr, set_original_ptr), each holding
# an IPC event until 1,000 are held (CUDA_IPC_MAXIMUM_EVENTS_TO_USE, torch/csrc/CudaIPCTypes.h:62), then a
# stream sync. SGLangEngine.update_weights 1,100 times, each blob released as SGLang releases it: with a copy
# per sync every share still gets its event (no server needed)
check tensor_sync_shares_copies "$PY" - <<'EOF'
import base64, io, pickle, types, torch
import sglang_engine as E
class Peek(pickle.Unpickler):  # a blob's CUDA IPC arguments as rebuild_cuda_tensor would get them, not opened
    def find_class(self, module, name):
        return (lambda *a: a) if name == "rebuild_cuda_tensor" else super().find_class(module, name)
events = []
def call(path, body):  # the server's side: it releases each tensor's counter once it has copied it
    for blob in body.get("serialized_named_tensors", []):
        for _, a in Peek(io.BytesIO(base64.b64decode(blob))).load():
            torch.UntypedStorage._release_ipc_counter_cuda(a[11], a[12])
            events.append(a[14])  # event_sync_required
    return {"success": True}
eng = E.SGLangEngine.__new__(E.SGLangEngine)
eng.weight_sync, eng.dtype, eng.server_tp, eng.stale = "tensor", torch.float32, 1, False
eng.server = types.SimpleNamespace(call=call)
w = torch.nn.Parameter(torch.randn(16, device="cuda"))
for _ in range(1100):
    eng.update_weights([[("w", w.detach())]])
assert len(events) == 1100 and all(events), f"an IPC event for {sum(events)} of {len(events)} shares: a chain"
print("1100 tensor syncs of one parameter, each share with its own IPC event")
EOF
if "$PY" -c "import sglang" 2>/dev/null; then
  # Hopper: SGLang picks fa3 for text and vision attention (srt/arg_groups/model_override_base.py:303-311,
  # layers/attention/vision.py:1304-1307), which takes fp16, bf16 and fp8 only (sgl_kernel: "FlashAttention only
  # supports fp16, bf16, and fp8_e4m3"); these checkpoints are fp32 and served in fp32, so the trainer-vs-server
  # logprob gap stays at fp32's level: Triton attention and torch's SDPA for the vision tower instead
  SGL=(--rollout-engine sglang --sglang-attention-backend triton --sglang-mm-attention-backend sdpa)
  # and fp32 products in it: SGLang's Triton attention calls tl.dot without a precision (sglang/kernels/ops/
  # attention/decode_attention.py:690-762, extend_attention.py), TF32 on NVIDIA unless TRITON_F32_DEFAULT says
  # otherwise (see check_te_qwen3_5); the server inherits the trainer's environment
  TRS=(env TRITON_F32_DEFAULT=ieee "${TR[@]}")
  # stock SGLang on the same GPU as training: the memory saver releases it while training; weights
  # go over CUDA IPC (/update_weights_from_tensor, devices named by UUID), then by the disk. --colocate
  # turns --offload-train on: the trainer parks in host memory during rollouts and the server resumes
  # in two parts (weights for the sync, then KV cache and CUDA graphs); the _resident run turns it off
  check grpo_sglang_colocated "${TRS[@]}" train_grpo.py "${GRPO[@]}" "${SGL[@]}" --colocate \
    --weight-sync tensor --sglang-mem-fraction-static 0.3 --save "$DIR/grpo_sglang"
  # the release -> train -> resume cycle: metrics carry the training peak and what PyTorch still held at the resume
  check grpo_sglang_colocated_metrics metric "$DIR/grpo_sglang"
  check grpo_sglang_colocated_resident "${TRS[@]}" train_grpo.py "${GRPO[@]}" "${SGL[@]}" --colocate \
    --no-offload-train --weight-sync tensor --sglang-mem-fraction-static 0.3 --save "$DIR/grpo_sglang_resident"
  check grpo_sglang_colocated_resident_metrics metric "$DIR/grpo_sglang_resident"
  # the same image before and after a vision-only weight update: the answer must change (SGLang's
  # vision-feature cache would keep the old features; the engine starts it with SGLANG_VLM_CACHE_SIZE_MB=0)
  check sglang_vision_update_reaches_seen_image "${F32[@]}" bench/vision_cache_check.py --hf-checkpoint "$DIR/tiny" \
    --weight-sync tensor --mem-fraction-static 0.3 --attention-backend triton --mm-attention-backend sdpa
  # a float32 checkpoint is served in float32 (the engine passes --dtype; SGLang's auto would pick float16)
  check sglang_dtype_of_fp32_checkpoint grep -m1 -o -- "--dtype float32" "$DIR/grpo_sglang/sglang.log"
  check grpo_sglang_disk_sync "${TRS[@]}" train_grpo.py "${GRPO[@]}" "${SGL[@]}" --colocate \
    --weight-sync disk --sglang-mem-fraction-static 0.3 --save "$DIR/grpo_sglang_disk"
  check grpo_sglang_disk_sync_metrics metric "$DIR/grpo_sglang_disk"
  check grpo_sglang_multi_turn "${TRS[@]}" train_grpo.py "${GRPO[@]}" "${SGL[@]}" --colocate \
    --sglang-mem-fraction-static 0.3 --max-turns 3 --save "$DIR/grpo_sglang_multi"
  check grpo_sglang_multi_turn_metrics metric "$DIR/grpo_sglang_multi"
  # a bf16 server's LM head in fp32 (the engine passes --enable-fp32-lm-head; SGLang rounds the logits to bf16
  # without it: docs/sglang.md): the trainer-vs-server gap, logprob_diff_mean, must be lower with it than with
  # the flag taken out of the server's command line
  check grpo_sglang_bf16_lm_head lm_heads "$DIR/grpo_sglang_bf16" "${GRPO[@]}" "${SGL[@]}" "${BF16[@]}" --colocate \
    --sglang-dtype bfloat16 --sglang-mem-fraction-static 0.3
  # the server's process group SIGKILLed in step 2's rollout: the episode whose request failed restarts it, and the
  # restarted server outlives the pause that ends the rollout (proc.popen): the run ends with one restart
  check grpo_sglang_restart restart_run "$DIR/grpo_sglang_restart" "${GRPO[@]}" "${SGL[@]}" --colocate \
    --weight-sync disk --sglang-mem-fraction-static 0.3
  # R3 against the real server: --enable-return-routed-experts, each turn's routes from where the last
  # stopped (a sample whose routes do not cover it fails: failed_frac 0 says they did); routing_mismatch printed
  check grpo_sglang_moe_r3 "${TR[@]}" train_grpo.py "${MOE[@]/grpo_moe/grpo_sglang_moe_r3}" "${SGL[@]}" \
    --colocate --sglang-mem-fraction-static 0.3 --max-turns 2 --num-rollout 2 --use-rollout-routing-replay
  check grpo_sglang_moe_r3_metrics metric "$DIR/grpo_sglang_moe_r3"
  # NEXTN speculative decoding from the checkpoint's own MTP head (tools/tiny.py --mtp): the draft loads
  # mtp.*, every sync reaches target and draft; logprob_diff_mean says whether the logprobs are the target's
  check tiny_moe_mtp bash -c "$PY tools/tiny.py --arch qwen3_5_moe --mtp --out $DIR/tiny_moe_mtp && echo made"
  check grpo_sglang_nextn "${TR[@]}" train_grpo.py "${MOE[@]/grpo_moe/grpo_sglang_nextn}" --hf-checkpoint "$DIR/tiny_moe_mtp" \
    "${SGL[@]}" --colocate --sglang-mem-fraction-static 0.3 --num-rollout 2 \
    --sglang-speculative-algorithm NEXTN --sglang-speculative-num-steps 1 --sglang-speculative-eagle-topk 1 \
    --sglang-speculative-num-draft-tokens 2
  check grpo_sglang_nextn_metrics metric "$DIR/grpo_sglang_nextn"
else
  echo "SKIP grpo_sglang: sglang is not installed (GPU=1 bash setup.sh)"
fi
# Context parallelism: Transformer Engine's THD attention with its CP group (Megatron hands it
# cu_seqlens_*_padded, multiples of 2 x CP: model.py) and Gated DeltaNet's head all-to-all over NCCL;
# then GRPO at CP2, whose logprob gap to the local engine must stay at the one-GPU level. All in bf16: TE
# has no fp32 attention under CP (the model refuses it at build)
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$GPUS" -ge 2 ]; then
  TR2=("$PY" -m torch.distributed.run --standalone --nproc_per_node 2)
  check check_te_cp2_qwen3_vl "${TR2[@]}" tools/check.py --hf-checkpoint "$DIR/tiny" --context-parallel-size 2 --bf16
  check check_te_cp2_qwen3_5 "${TR2[@]}" tools/check.py --hf-checkpoint "$DIR/tiny35" --context-parallel-size 2 --bf16
  check grpo_cp2 "${TR2[@]}" train_grpo.py "${GRPO[@]}" --rollout-engine local --context-parallel-size 2 "${BF16[@]}" \
    --save "$DIR/grpo_cp2"
  check grpo_cp2_metrics metric "$DIR/grpo_cp2"
  # Pipeline parallelism over NCCL (batched p2p): a tied Qwen3-VL, Qwen3.5-MoE with the alltoall
  # dispatcher (its DtoH copies on a real side stream, token_dispatcher.py:445, 871-894; a stand-in on
  # CPU) and an MTP head (its mtp.* tensors, read on the CPU, broadcast to the other stage), SFT and GRPO
  # at PP2, and SFT of the MoE split 3 + 1 (expert_load adds each layer's counts to its own)
  check tiny_pp bash -c "$PY tools/tiny.py --arch qwen3_vl --layers 4 --tie --out $DIR/tiny_pp && \
$PY tools/tiny.py --arch qwen3_5_moe --layers 4 --mtp --out $DIR/tiny_moe_pp && echo made"
  check check_pp2_qwen3_vl "${TR2[@]}" tools/check.py --hf-checkpoint "$DIR/tiny_pp" --pipeline-model-parallel-size 2
  check check_pp2_qwen3_5_moe env TRITON_F32_DEFAULT=ieee "${TR2[@]}" tools/check.py \
    --hf-checkpoint "$DIR/tiny_moe_pp" --pipeline-model-parallel-size 2  # fp32 through FLA: see check_te_qwen3_5
  check sft_pp2 "${TR2[@]}" sft.py --hf-checkpoint "$DIR/tiny_pp" --prompt-data "$DIR/data" --save "$DIR/sft_pp2" \
    --global-batch-size 8 --lr 1e-3 --pipeline-model-parallel-size 2 --bf16 --accumulate-allreduce-grads-in-fp32
  check sft_pp2_moe_3_1 "${TR2[@]}" sft.py --hf-checkpoint "$DIR/tiny_moe_pp" --prompt-data "$DIR/data" \
    --save "$DIR/sft_pp2_moe" --global-batch-size 8 --lr 1e-3 --num-epoch 1 --pipeline-model-parallel-size 2 \
    --decoder-first-pipeline-num-layers 3 --moe-token-dispatcher-type alltoall "${BF16[@]}"
  check sft_pp2_moe_3_1_metrics "$PY" -c "
import json; rows = [json.loads(x) for x in open('$DIR/sft_pp2_moe/metrics.jsonl') if '\"loss\"' in x]
assert rows and all(len(r['expert_load']) == 4 and abs(sum(r['expert_load']) - 1) < 1e-3 for r in rows), rows
print(rows[-1]['expert_load'])"
  check grpo_pp2 "${TR2[@]}" train_grpo.py "${GRPO[@]}" --hf-checkpoint "$DIR/tiny_pp" --rollout-engine local \
    --pipeline-model-parallel-size 2 --kl-loss-coef 0.01 --save "$DIR/grpo_pp2"
  check grpo_pp2_metrics metric "$DIR/grpo_pp2"
  if "$PY" -c "import sglang" 2>/dev/null; then
    # --rollout-num-gpus-per-engine 1 on 2 colocated GPUs: two servers (CUDA_VISIBLE_DEVICES 0 and 1)
    # behind SGLang's router, each taking its CUDA IPC sync from the rank on its own GPU
    check grpo_sglang_two_servers env TRITON_F32_DEFAULT=ieee "${TR2[@]}" train_grpo.py "${GRPO[@]}" "${SGL[@]}" --colocate \
      --rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.3 --save "$DIR/grpo_sglang_two"
    check grpo_sglang_two_servers_metrics metric "$DIR/grpo_sglang_two"
  fi
else
  echo "SKIP cp2, pp2: context and pipeline parallelism need 2 GPUs (this machine has $GPUS)"
fi
# ---- issue 59: lines a reading found missing (the preemption, restart and LM-head lines: issue 58's block) ----
# GSPO (one clipped ratio a sequence) and CISPO (the clipped weight without gradient, --eps-clip 1) in bf16 with the
# distributed optimizer: each step trains (grad_norm > 0) and the logprob gap stays at the one-GPU level
for est in gspo cispo; do
  clip=(); [[ $est == cispo ]] && clip=(--eps-clip 1)
  check grpo_${est}_bf16 "${TR[@]}" train_grpo.py "${GRPO[@]}" --rollout-engine local "${BF16[@]}" \
    --policy-loss $est "${clip[@]}" --save "$DIR/grpo_${est}"
  check grpo_${est}_bf16_metrics metric "$DIR/grpo_${est}"
done
# evaluation only (--num-rollout 0): greedy pass@1 and pass@4 at the rollout temperature, every response in
# eval_0000000.jsonl: four pass@4 rows a problem after one accuracy row
check eval_only_pass_at_k "${TR[@]}" train_grpo.py --hf-checkpoint "$DIR/tiny" --prompt-data "$DIR/data" \
  --eval-prompt-data "$DIR/data" --eval-samples 8 --n-samples-per-eval-prompt 4 --num-rollout 0 \
  --rollout-engine local --rollout-max-response-len 32 --save "$DIR/eval_only"
check eval_only_pass_at_k_rows "$PY" -c "
import json; m = [json.loads(x) for x in open('$DIR/eval_only/metrics.jsonl')][-1]
rows = [json.loads(x) for x in open('$DIR/eval_only/eval_0000000.jsonl')]
modes = [r['mode'] for r in rows]
assert 'eval_accuracy' in m and 'eval_pass@4' in m and modes.count('eval_pass@4') == 4 * modes.count('eval_accuracy') == 32, (m, modes)
print({k: v for k, v in m.items() if k.startswith('eval_')})"
# multi-turn GRPO on the crop task after run.sh's SFT on crop episodes (half crop the named box): the model calls
# crop, the env runs it, its observation (a new image) reaches the next turn: tool_calls_image_zoom_in_tool > 0 every step
check crop_data bash -c "$PY tools/synth.py --n 64 --n-test 8 --out $DIR/crop --kinds crop && \
$PY tools/synth.py --n 256 --n-test 8 --seed 3 --out $DIR/crop_warm --kinds crop --warm-start 0.5 --hf-checkpoint $DIR/tiny && echo made"
check sft_crop_format "${TR[@]}" sft.py --hf-checkpoint "$DIR/tiny" --prompt-data "$DIR/crop_warm" --save "$DIR/sft_crop" \
  --decoupled-lr 1e-2 --lr 3e-4 --lr-warmup-iters 10 --global-batch-size 8 --num-epoch 2 --max-tokens-per-gpu 4096
check grpo_multi_turn_crop bash -c "${TR[*]} train_grpo.py --hf-checkpoint $DIR/sft_crop/\$(cat $DIR/sft_crop/latest) \
  --prompt-data $DIR/crop --rollout-engine local --rollout-batch-size 4 --n-samples-per-prompt 4 --max-turns 3 \
  --rollout-max-response-len 192 --max-tokens-per-gpu 4096 --num-rollout 3 --lr 1e-5 --save $DIR/grpo_crop"
check grpo_multi_turn_crop_calls "$PY" -c "
import json; rows = [json.loads(x) for x in open('$DIR/grpo_crop/metrics.jsonl') if '\"reward\"' in x]
assert rows and all(r.get('tool_calls_image_zoom_in_tool', 0) > 0 and r['failed_frac'] == 0 for r in rows), rows
print([round(r['tool_calls_image_zoom_in_tool'], 2) for r in rows])"
if [ "$GPUS" -ge 2 ] && "$PY" -c "import sglang" 2>/dev/null; then
  # SGLang on a GPU of its own (--rollout-num-gpus 1 after the one training GPU): the weights go over an NCCL
  # group (/init_weights_update_group + /update_weights_from_distributed), then the fully async rollout on it
  check grpo_nccl_sync "${TR[@]}" train_grpo.py "${GRPO[@]}" "${SGL[@]}" --rollout-num-gpus 1 --weight-sync distributed \
    --save "$DIR/grpo_nccl"
  check grpo_nccl_sync_metrics metric "$DIR/grpo_nccl"
  # --fully-async: the rollout never waits; each weight update cuts what generates, which goes on with the new
  # weights (metrics staleness_max <= --max-weight-staleness, rollout_engine_idle_frac said)
  check grpo_fully_async "${TR[@]}" train_grpo.py "${GRPO[@]}" "${SGL[@]}" --rollout-num-gpus 1 --fully-async \
    --max-weight-staleness 2 --save "$DIR/grpo_fully_async"
  check grpo_fully_async_metrics "$PY" -c "
import json; rows = [json.loads(x) for x in open('$DIR/grpo_fully_async/metrics.jsonl') if '\"reward\"' in x]
assert rows and all(r['failed_frac'] == 0 and r['grad_norm'] > 0 and r['staleness_max'] <= 2 for r in rows), rows
print([(r['staleness_max'], round(r.get('rollout_engine_idle_frac', -1), 2)) for r in rows])"
else
  echo "SKIP grpo_nccl_sync, grpo_fully_async: SGLang on a GPU of its own needs sglang and 2 GPUs (this machine has $GPUS)"
fi
# ---- issue 68 ----
# the local spec's attention reaches a fused SDPA kernel (4-D calls: flash, cuDNN or efficient; 3-D ran the math one)
check local_attention_fused_sdpa "$PY" -c "
import sys; sys.path[:0] = ['bench']
import device_checks as D
r = D.sdpa_backends(); print(r); sys.exit(0 if r['passed'] else 1)"
# Gated DeltaNet in bf16 as training runs it: no TRITON_F32_DEFAULT, FLA's fp32 dots in TF32, against the bf16 bounds
check gdn_bf16_as_training bash -c "mkdir -p $DIR/gdn && env -u TRITON_F32_DEFAULT $PY bench/device_checks.py --one gdn_tf32 \
  --work $DIR/gdn && cat $DIR/gdn/gdn_tf32.json && grep -q '\"passed\": true' $DIR/gdn/gdn_tf32.json"
if "$PY" -c "import sglang" 2>/dev/null; then
  # a released colocated server answers /health from its status (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0, the
  # placement's env): five checks, as the router's every 60 s, leave it alive and serving after its resume; then the
  # same with generation on (SGLang's default), said, not judged: what the router's checks did before
  check sglang_released_health env TRITON_F32_DEFAULT=ieee "$PY" - "$DIR/tiny" "$DIR/released" <<'EOF'
import sys, time, urllib.request
sys.path.insert(0, ".")
import sglang_engine as E, train_grpo as G
args = G.parse_args(["--hf-checkpoint", sys.argv[1], "--prompt-data", "x", "--save", "x", "--rollout-engine", "sglang",
                     "--colocate", "--sglang-attention-backend", "triton", "--sglang-mm-attention-backend", "sdpa",
                     "--sglang-mem-fraction-static", "0.3"])
flags, env = E.sglang_placement(args, True, 1, 1)
seen = {}
for gen in ("0", "1"):
    eng = E.SGLangEngine(sys.argv[1], f"{sys.argv[2]}_{gen}", server_args=flags,
                         env=dict(env, SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=gen), max_restarts=0)
    try:
        eng.release()
        codes = []
        for _ in range(5):
            try:
                codes.append(urllib.request.urlopen(eng.server.url + "/health", timeout=30).status)
            except Exception as e:
                codes.append(type(e).__name__)
            time.sleep(1)
        alive = eng.server.proc.poll() is None
        ids = []
        if alive:
            eng.resume()
            ids = eng.generate([{"input_ids": [1, 2, 3]}], {"max_new_tokens": 4, "temperature": 0.0})[0]["ids"]
        seen[gen] = (codes, alive, len(ids))
    finally:
        eng.shutdown()
print("generation off / on: /health codes on released memory, alive, tokens after resume:", seen)
codes, alive, n = seen["0"]
sys.exit(0 if codes == [200] * 5 and alive and n > 0 else 1)
EOF
fi
if [ "$GPUS" -ge 2 ] && "$PY" -c "import sglang" 2>/dev/null; then
  # a colocated TP-2 server SIGKILLed in step 2's rollout, the trainer holding its optimizer states on both GPUs
  # (--no-offload-train): its restart (no barrier) meets uneven free memory; SGLang's balance check warns
  # (SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0, the placement's env) and the run ends with one restart
  TR_ONE=("${TR[@]}"); TR=("${TR2[@]}")
  check grpo_sglang_colocated_tp2_restart restart_run "$DIR/grpo_tp2_restart" "${GRPO[@]}" "${SGL[@]}" --colocate \
    --no-offload-train --weight-sync disk --sglang-mem-fraction-static 0.3
  TR=("${TR_ONE[@]}")
  check grpo_sglang_colocated_tp2_restart_log bash -c "grep -c 'memory capacity is unbalanced' \
    $DIR/grpo_tp2_restart/sglang.log; ! grep -q 'RuntimeError: The memory capacity' $DIR/grpo_tp2_restart/sglang.log"
fi
# ---- issue 75 ----
# the local spec's attention reads the packed sequences' bounds to the host once a forward, not once a layer: each
# synchronising CUDA call of one forward counted (torch.cuda.set_sync_debug_mode), by line; attention.py's must be 1
# (Megatron's unfused THD RoPE, rope_utils.py:204-215, syncs in every layer too: said)
check local_attention_one_sync_a_forward "$PY" - "$DIR/tiny" <<'EOF'
import collections, os, sys, warnings, torch
sys.path.insert(0, ".")
import model as M
m = M.load_model(sys.argv[1], M.ModelOptions(transformer_impl="local"))
seqs = [torch.arange(100, 164, device=m.par.device), torch.arange(200, 240, device=m.par.device)]
with torch.no_grad():
    m.logits(seqs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        m.logits(seqs)
    torch.cuda.set_sync_debug_mode(0)
by_line = collections.Counter(f"{w.filename}:{w.lineno}" for w in seen)
ours = sum(n for f, n in by_line.items() if f.startswith(os.path.abspath("attention.py") + ":"))
print(f"{m.hf_config.text_config.num_hidden_layers} layers; syncs of one forward by line: {dict(by_line)}; attention.py: {ours}")
sys.exit(0 if ours == 1 else 1)
EOF
if "$PY" -c "import sglang" 2>/dev/null; then
  # colocated servers capture their CUDA graphs under the memory saver (SGLANG_MEMORY_SAVER_CUDA_GRAPH=1, the
  # placement's env): releasing "cuda_graph" alone frees GPU memory, with the variable 0 nothing; both serve again
  check sglang_released_cuda_graphs env TRITON_F32_DEFAULT=ieee "$PY" bench/colocated_check.py graphs "$DIR/tiny" \
    "$DIR/graphs"
  # a hung colocated server (its scheduler SIGSTOPped) answers /health 200 from its status: the recovery a failed
  # request runs asks /health_generate (503 after SGLANG_HEALTH_CHECK_TIMEOUT, 5 s here), restarts it; it serves
  check sglang_hung_server_restarted env TRITON_F32_DEFAULT=ieee SGLANG_HEALTH_CHECK_TIMEOUT=5 "$PY" \
    bench/colocated_check.py hung "$DIR/tiny" "$DIR/hung"
fi
echo "$failed check(s) failed; logs in $DIR"
exit $((failed > 0))

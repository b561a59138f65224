#!/usr/bin/env bash
# The device check (issue 59): one command for the one-GPU machine this project is sometimes lent (Python 3.12,
# torch 2.11, transformers 5.17, no network): installs the wheels bench/device_bundle.sh carried, then runs
# bench/device_checks.py (seven checks on CUDA, each against something that is not itself, each under its own time
# limit), and ends within 8 minutes. One JSON line a check in $OUT/checks.jsonl, every check's output in
# $OUT/device_check.log ($OUT: the folder the machine hands back; elsewhere a new temporary one).
#   bash bench/device_bundle.sh              # here, first: the wheels and the real config, bench/device_wheels/
#   bash bench/device_check.sh               # there: the run tool, carry ["bench/device_wheels"] (README, GPU set-up)
#   bash bench/device_check.sh --dry-run     # tiny sizes on the CPU, the same code (tests/test_device_check.py)
#   bash bench/device_check.sh --only gdn,grpo   # a rerun of some (setup runs first)
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=()
if [[ "${1:-}" == --dry-run ]]; then DRY=(--dry-run); shift; fi
OUT=${OUT:-$(mktemp -d /tmp/device_check.XXXX)}
WORK=${DEVICE_WORK:-$(mktemp -d /tmp/device_work.XXXX)}
if [[ -z "${PY:-}" ]]; then  # the image's python3 there; the project's .venv for a dry run here
  PY=python3; [[ -n "${DRY[*]}" && -x .venv/bin/python ]] && PY=.venv/bin/python
fi
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
# fp32 Triton dots in IEEE, not TF32: FLA 0.6.0 calls tl.dot with no precision (bench/gpu_smoke.sh's note)
export TRITON_F32_DEFAULT=ieee
[[ -z "${DRY[*]}" ]] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# The carried wheels, beside the image's packages (its torch, triton, tokenizers): --target and PYTHONPATH, not a
# venv, since the image's python3 is itself a venv's (/opt/torch/.venv), whose packages a new venv would not see.
# The dry run installs them only with INSTALL=1 (they are cp312: a Python 3.12 to try them on).
if [[ -d bench/device_wheels && ( -z "${DRY[*]}" || "${INSTALL:-0}" == 1 ) ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" \
    bench/device_wheels/*.whl >>"$OUT/device_check.log" 2>&1 || { echo "wheels did not install: $OUT/device_check.log"; exit 1; }
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
elif [[ -z "${DRY[*]}" ]]; then
  echo "no bench/device_wheels: run bash bench/device_bundle.sh here first, and carry it"; exit 1
fi
# the driver's own budget (device_checks.BUDGET_S, DRY_SCALE x dry) ends it; this outer limit backs that up with
# MARGIN_S for the driver's start and its last check's end; its SIGTERM ends the check in flight with its processes
# (device_checks.stop_with_me: launch's SIGTERM, 10 s, SIGKILL), before timeout's SIGKILL 30 s later
const() { sed -n "s/^$1 = \([0-9]*\).*/\1/p" bench/device_checks.py; }
SCALE=1; [[ -n "${DRY[*]}" ]] && SCALE=$(const DRY_SCALE)
LIMIT=$(( $(const BUDGET_S) * SCALE + $(const MARGIN_S) ))
echo "device check: $($PY --version 2>&1), results $OUT/checks.jsonl, log $OUT/device_check.log, limit $LIMIT s"
timeout -k 30 $LIMIT "$PY" bench/device_checks.py --out "$OUT" --work "$WORK" "${DRY[@]}" "$@" 2>>"$OUT/device_check.log"
code=$?
[[ -z "${DEVICE_WORK:-}" ]] && rm -rf "$WORK"
exit $code

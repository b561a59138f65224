#!/usr/bin/env bash
# run.sh: the recipe. On a CPU machine it sets itself up and runs the pipeline on a tiny
# Qwen3-VL and the synthetic geometry set.
#   bash run.sh
# (The trainers land in later steps; for now this prepares data and checks the model.)
source "$(dirname "$0")/setup.sh"
export HF_HUB_OFFLINE=1
RUN=${RUN:-runs/cpu-demo}
mkdir -p "$RUN"
.venv/bin/python data.py synth --n 512 --n-test 64 --out "$RUN/data"
.venv/bin/python model.py tiny --arch qwen3_vl --out "$RUN/tiny-qwen3-vl"
.venv/bin/python data.py show "$RUN/data" --split test

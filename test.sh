#!/usr/bin/env bash
# The test command: sets up .venv on first use, then runs the CPU test suite.
#   bash test.sh                 # the suite CI runs (pytest 979 s quiet on 2 cores, 2026-12-04; bench/RESULTS.md)
#   bash test.sh -m slow         # the long learning checks
#   bash test.sh tests/test_data.py -x   # any pytest arguments
source "$(dirname "$0")/setup.sh"
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest "$@"

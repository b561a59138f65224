#!/usr/bin/env bash
# The test command: sets up .venv on first use, then runs the CPU test suite on four pytest-xdist workers, one
# torch thread each (tests/conftest.py: OMP_NUM_THREADS=1 unless set; which tests share a worker, and why four).
#   bash test.sh                 # the suite CI runs: 778 tests, 604-699 s of pytest on a 2-core machine
#                                # (2026-12-07, a clean clone, nothing beside it; bench/RESULTS.md, "Test suite")
#   bash test.sh -n 0            # the same tests one at a time (debugging; -s and --pdb imply it)
#   bash test.sh -m slow         # the long learning checks
#   bash test.sh tests/test_data.py -x   # any pytest arguments
source "$(dirname "$0")/setup.sh"
export HF_HUB_OFFLINE=1
workers=(-n 4 --dist loadgroup)
for a in "$@"; do [[ $a == -s || $a == --capture=no || $a == --pdb ]] && workers=(-n 0); done  # xdist hides both
exec .venv/bin/python -m pytest "${workers[@]}" "$@"

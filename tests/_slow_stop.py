"""A trainer whose step in flight at a SIGTERM takes SLOW_STOP_S seconds longer (tests/test_console.py: a step
longer than torchrun's shutdown timeout, without the CPU it would take):

    torchrun --nproc-per-node 2 tests/_slow_stop.py sft.py ARGS...
"""
import os
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import console  # noqa: E402

stop_reason = console.stop_reason


def slow(run):
    if run.signalled:
        time.sleep(float(os.environ["SLOW_STOP_S"]))
    return stop_reason(run)


if __name__ == "__main__":
    console.stop_reason = slow
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")

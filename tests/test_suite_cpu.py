"""bench/suite_cpu.py's measures (issue 70): a test's CPU counts the children it started, alive or ended, and each
interpreter is named by what it ran."""
import subprocess
import sys

import pytest

from bench import suite_cpu

BURN = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\nprint(flush=True)\ntime.sleep(60)"


def test_a_tests_cpu_counts_its_children_alive_and_ended():
    before = suite_cpu.cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # it has burnt 0.5 s of CPU and sleeps, not reaped
        alive = suite_cpu.cpu_seconds() - before
    finally:
        child.kill()
        child.wait()
    ended = suite_cpu.cpu_seconds() - before
    assert 0.5 <= alive <= ended, (alive, ended)


@pytest.mark.parametrize("line,what", [("python\t-m\tpytest\t-x", "-m pytest"), ("python\t-W\tignore\t-c\tx = 1", "-c"),
                                       ("/v/python\t-u\t/r/train_grpo.py\t--save\tx", "train_grpo.py"),
                                       ("python", "(no script: stdin)")])
def test_an_interpreter_is_named_by_what_it_ran(line, what):
    assert suite_cpu.kind(line) == what

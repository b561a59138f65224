"""tests/launch.py: what the tests' subprocess launches rely on (issue 45). Each case is one that
subprocess.run / Popen.communicate get wrong: a grandchild in a session of its own (as torchrun's
workers are) outlives a timed-out parent; outputs read one command after another deadlock once a
later command fills its pipe; a job whose one node failed waits for ever on the other."""
import time

import pytest

import launch

# Starts a grandchild in a session of its own that ignores SIGTERM, writes its pid to $1, then waits (sh, as the
# other commands here: launch.run's hygiene is the point, not the interpreter).
PARENT = """setsid sh -c 'trap "" TERM; echo $$ > "$1"; exec sleep 600' sh "$1" &
echo "parent up"
exec sleep 600"""


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_timeout_ends_the_grandchildren_too_and_shows_the_output(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "KILL_GRACE_S", 1.0)
    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(AssertionError, match=r"(?s)timed out after 8s.*parent up"):
        launch.run(["sh", "-c", PARENT, "sh", pidfile], timeout=8)
    pid = int(pidfile.read_text())
    assert not alive(pid), f"grandchild {pid} outlived the timed-out launch"


def test_outputs_are_read_while_the_commands_run(tmp_path):
    """The first command waits for the second, which writes 1 MB first: read in turn, the second
    would block on its full pipe and the first would wait for ever."""
    flag = tmp_path / "written"
    first = ["sh", "-c", f"until [ -e '{flag}' ]; do sleep 0.05; done"]
    second = ["sh", "-c", f"head -c {2**20} /dev/zero | tr '\\0' x; head -c {2**20} /dev/zero | tr '\\0' y >&2; : > '{flag}'"]
    a, b = launch.run_all([first, second], timeout=60)
    assert (a.returncode, b.returncode) == (0, 0) and len(b.stdout) == len(b.stderr) == 2**20


def test_once_one_command_fails_the_others_are_stopped(tmp_path, monkeypatch):
    """A node that failed leaves the other waiting in its rendezvous or collective: stop it soon,
    with what it printed."""
    monkeypatch.setattr(launch, "FAIL_GRACE_S", 1.0)
    flag = tmp_path / "up"
    node0 = ["sh", "-c", f"echo waiting; : > '{flag}'; exec sleep 600"]
    node1 = ["sh", "-c", f"until [ -e '{flag}' ]; do sleep 0.05; done; echo 'node 1 failed' >&2; exit 1"]
    t = time.monotonic()
    waiting, failed = launch.run_all([node0, node1], timeout=120)
    assert failed.returncode == 1 and "node 1 failed" in failed.stderr
    assert waiting.returncode == -15 and waiting.stdout == "waiting\n"  # SIGTERM
    assert time.monotonic() - t < 30


def test_a_sigterm_while_a_command_starts_still_ends_it(monkeypatch):
    """bench/device_checks' driver ends on SIGTERM (its handler raises SystemExit): one that lands while Popen
    waits for its child's exec (the child running, the Popen object not yet returned: seen at load 48) must not
    leave that child out of the launch's reach, holding the GPU into a rerun."""
    import os
    import signal
    import subprocess
    started, popen = [], subprocess.Popen

    def popen_then_signalled(*args, **kw):  # the signal lands in the last bytecodes of Popen
        p = popen(*args, **kw)
        started.append(p.pid)
        os.kill(os.getpid(), signal.SIGTERM)
        return p

    def stop(signum, frame):
        raise SystemExit(f"signal {signum}")
    old = signal.signal(signal.SIGTERM, stop)
    monkeypatch.setattr(launch.subprocess, "Popen", popen_then_signalled)
    try:
        with pytest.raises(SystemExit, match="signal 15"):
            launch.run(["sleep", "600"], timeout=60)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert started and not alive(started[0]), "the command started amid the SIGTERM lives on"

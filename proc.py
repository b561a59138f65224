"""Process hygiene, in one place: children that die with their parent, process groups that end.

    proc.die_with_parent(signal.SIGTERM)                        # a torchrun worker (parallel.py)
    proc.popen(cmd, log, env)                                   # any thread; runs armed(cmd): cmd under a launcher
    proc.kill_group(popen)                                      # SIGTERM, then SIGKILL, a group

The launcher is how a parent with threads starts a child that must not outlive it (docs/processes.md)."""
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from multiprocessing.pool import ThreadPool

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SPAWNERS = {}  # pid -> the pool of one daemon thread that forks this process's children (popen)
SETPRIV = shutil.which("setpriv")  # util-linux >= 2.33: --pdeathsig arms PR_SET_PDEATHSIG, then execs
PARENT_CHECK = '[ "$PPID" = "$0" ] || exit 0; exec "$@"'  # sh: run "$@" only while our parent is still $0


def die_with_parent(sig=signal.SIGKILL, parent=None):
    """Have the kernel send `sig` to this process when the thread that started it ends, even a SIGKILLed
    one (Linux PR_SET_PDEATHSIG; elsewhere a no-op). With `parent`: exit at once if our parent is no
    longer that pid (it died before the arming, so the signal will never come)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != int(parent):
        os._exit(0)


def popen(cmd, log, env=None):
    """Popen of `cmd` under the launcher (Linux), leading a session of its own, its output to `log`, forked by a thread
    that lives as long as this process, whichever thread calls: PR_SET_PDEATHSIG follows the THREAD that forked the
    child (prctl(2)); a server an episode's thread restarted died when Rollout.pause() shut the episodes' pool down."""
    if sys.platform == "linux":
        cmd = armed(cmd)
    pool = _SPAWNERS.get(os.getpid()) or _SPAWNERS.setdefault(os.getpid(), ThreadPool(1))  # a fork has no threads
    return pool.apply(subprocess.Popen, (cmd,), dict(stdout=log, stderr=subprocess.STDOUT, env=env,
                                                     stdin=subprocess.DEVNULL, start_new_session=True))


def armed(cmd, parent=None):
    """`cmd` under a launcher that arms PR_SET_PDEATHSIG (SIGKILL) and then runs it only if its parent is still
    `parent` (default: this process), which died otherwise before the arming (Linux). setpriv(1) and sh where found:
    a Python launcher costs an interpreter a child (~0.035 CPU s, ~0.09 s of wall each on a loaded machine; the
    test suite started 63); else this file: `python proc.py PARENT cmd...`."""
    parent = str(os.getpid() if parent is None else parent)
    if SETPRIV:
        return [SETPRIV, "--pdeathsig", "KILL", "/bin/sh", "-c", PARENT_CHECK, parent, *cmd]
    return [sys.executable, os.path.abspath(__file__), parent, *cmd]


def kill_group(proc, grace=15.0):
    """SIGTERM the process group that `proc` (a Popen started with start_new_session=True) leads, SIGKILL
    what is left after `grace` seconds; returns once the group is empty or 5 s after the SIGKILL."""
    pgid = proc.pid
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + wait
        while time.time() < deadline:
            proc.poll()  # reap the leader, or it lingers as a zombie member of the group
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: python proc.py PARENT_PID cmd [args...]")
    die_with_parent(signal.SIGKILL, int(sys.argv[1]))  # exits if the parent is already gone
    os.execvp(sys.argv[2], sys.argv[2:])

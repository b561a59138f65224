"""Process hygiene, in one place: children that die with their parent, process groups that end.

    proc.die_with_parent(signal.SIGTERM)                        # a torchrun worker (parallel.py)
    proc.popen([sys.executable, "proc.py", str(os.getpid()), cmd...], ...)   # from any thread: the launcher
    proc.kill_group(popen)                                      # SIGTERM, then SIGKILL, a group

The launcher (python proc.py PARENT_PID cmd args...: arm, check, exec cmd) is how a parent with threads starts a
child that must not outlive it; popen starts it from the one thread that lives as long as we do (docs/processes.md).
"""
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_SPAWNERS, _LOCK = {}, threading.Lock()  # pid -> the jobs of the thread that starts that process's children


def die_with_parent(sig=signal.SIGKILL, parent=None):
    """Have the kernel send `sig` to this process when the thread that started it ends, even a SIGKILLed
    one (Linux PR_SET_PDEATHSIG; elsewhere a no-op). With `parent`: exit at once if our parent is no
    longer that pid (it died before the arming, so the signal will never come)."""
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if parent is not None and os.getppid() != int(parent):
        os._exit(0)


def popen(cmd, **kw):
    """subprocess.Popen(cmd, **kw) run by a daemon thread that lives as long as this process: PR_SET_PDEATHSIG
    fires when the THREAD that forked the child ends (prctl(2)), so a server an episode's thread restarted
    would die when the rollout's pool shuts down. Any thread may call this."""
    with _LOCK:
        if os.getpid() not in _SPAWNERS:  # a forked process has none of its parent's threads
            _SPAWNERS[os.getpid()] = jobs = queue.SimpleQueue()
            threading.Thread(target=_spawn, args=(jobs,), daemon=True, name="proc-spawner").start()
    done = Future()
    _SPAWNERS[os.getpid()].put((done, cmd, kw))
    return done.result()


def _spawn(jobs):
    while True:
        done, cmd, kw = jobs.get()
        try:
            done.set_result(subprocess.Popen(cmd, **kw))
        except BaseException as e:  # noqa: BLE001 - raised in popen's caller
            done.set_exception(e)


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

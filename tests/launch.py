"""Start the tests' subprocesses (torchrun jobs, trainers) so that none outlives its test.

    r = launch.run(cmd, timeout=600, env=env)                    # subprocess.run's CompletedProcess
    rs = launch.run_all([cmd0, cmd1], timeout=600)               # one CompletedProcess a command
    rs = launch.torchrun_nodes(2, 1, [script, *args], timeout=600)   # `torchrun --nnodes 2` on 127.0.0.1
    r = launch.python(script, *args, nproc=2, timeout=600)      # `torchrun --standalone ...`, from a forkserver
    job = launch.start(script, *args); job.printed(); ...; job.kill(); job.wait()

python() and start() run a project script as `python script` or `torchrun --standalone --nproc_per_node N
script` would, each rank forked from multiprocessing's forkserver, which imported torch, megatron-core,
transformers and the project once for the session (PRELOAD): a fresh interpreter spends ~5 s of CPU on those
imports, ~8 s of wall time a two-rank launch on 2 cores, and the suite made ~80 launches. A rank runs the
script with runpy as __main__, in a session of its own, with torchrun's environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE) and a TCPStore this process serves on a port the kernel picks, which the
ranks join as torchrun's workers join their agent's (TORCHELASTIC_USE_AGENT_STORE); its stdout and stderr
(C++'s too) go to files. One failed rank stops the others, as torchrun does. The torchrun command itself
(its agent, rendezvous, signals) is run() and torchrun_nodes()' to test.

A test starts a fresh interpreter only where one is its point (issue 77; the rest fork from here): torchrun itself
(test_faults, test_cluster's nodes, test_console's run.sh), a terminal's run (test_console), a process under
namespaces or rlimits (test_faults' unshare and preexec runs), which modules a fresh import loads (test_imports,
test_faults' tools check), proc.py's launcher and its dying parent (test_sglang_processes), a child whose CPU is
counted (test_suite_cpu), the bench scripts as RESULTS.md runs them (test_bench), the device check's dry run
(test_device_check), the SGLang servers, fake (tests/fake_sglang.py, started by the engine as the real one is: their
image pads counted in the pytest process, tests/image_counts.py) and real (test_sglang_real*), and sglang-router.
This forkserver and multiprocessing's resource tracker are two.
A child whose point is the launch (test_launch's, run.sh's stand-in python in test_faults) is sh, not Python.

Every command runs in a session of its own and both its pipes are read while it runs (a pipe that
nobody reads fills up and stalls its writer). All share one deadline; once one has failed the others
get FAIL_GRACE_S to say why, then are stopped. However the call ends, every process the commands
started is ended by its pid: torchrun puts each worker in a session of its own, and so do the SGLang
servers, so the command's process group alone would leave them running (subprocess.run's timeout
kills only the direct child). A timeout raises AssertionError with every command's last output.
"""
import atexit
import contextlib
import datetime
import glob
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from conftest import ROOT

JOIN_S = 60  # a torchrun node that has not joined by then makes the others give up (they start seconds apart)
FAIL_GRACE_S = 30  # after one command failed: time for the others to print their side before they are stopped
KILL_GRACE_S = 10  # SIGTERM to SIGKILL: torchrun forwards SIGTERM to its workers and waits for them
TAIL = 3000  # characters of each stream in a timeout's message


def run(cmd, timeout, cwd=ROOT, env=None, preexec_fn=None):
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout) that leaves nothing behind."""
    return run_all([cmd], timeout, cwd, env, preexec_fn)[0]


def run_all(cmds, timeout, cwd=ROOT, env=None, preexec_fn=None):
    """Run `cmds` together until all have ended -> [CompletedProcess] in their order."""
    procs, streams, readers, born = [], [], [], {}
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        for cmd in cmds:
            with _signals_held():  # one raised amid Popen would leave its started child out of procs: out of reach
                p = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                                     start_new_session=True, preexec_fn=preexec_fn)
                procs.append(p)
            for pipe in (p.stdout, p.stderr):
                streams.append([])
                readers.append(threading.Thread(target=_drain, args=(pipe, streams[-1]), daemon=True))
                readers[-1].start()
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            _survey(procs, born)  # while the parents live: an orphan is out of the tree's reach
            if failed_at is None and any(p.returncode for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() > failed_at + FAIL_GRACE_S:
                break
            time.sleep(0.2)
        timed_out = any(p.poll() is None for p in procs) and failed_at is None
    finally:
        _stop(procs, born)
        for t in readers:
            t.join(timeout=10)
    outs = ["".join(s) for s in streams]
    done = [subprocess.CompletedProcess(p.args, p.returncode, outs[2 * i], outs[2 * i + 1]) for i, p in enumerate(procs)]
    if timed_out:
        raise AssertionError(f"timed out after {timeout}s:\n" + "\n".join(
            f"=== {' '.join(r.args)[:300]}\n--- exit {r.returncode}, stdout:\n{r.stdout[-TAIL:]}\n--- stderr:\n"
            f"{r.stderr[-TAIL:]}" for r in done))
    return done


def torchrun_nodes(nnodes, nproc, args, timeout, env=None, py=sys.executable):
    """`torchrun --nnodes N --nproc_per_node nproc args...` (torchrun of the Python `py`) as N launches
    on 127.0.0.1 (node ranks 0..N-1), through run_all. The port is held bound (SO_REUSEADDR, not
    listening) until the job ends: node 0's rendezvous store (libuv: SO_REUSEADDR too) still binds it,
    but no bind(0) hands it out meanwhile, the way free_port() and every server here pick theirs.
    --rdzv-conf timeout: the static rendezvous' join timeout."""
    with socket.socket() as hold:
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hold.bind(("127.0.0.1", 0))
        port = hold.getsockname()[1]
        cmds = [[py, "-m", "torch.distributed.run", "--nnodes", nnodes, "--node-rank", r,
                 "--nproc_per_node", nproc, "--master-addr", "127.0.0.1", "--master-port", port,
                 "--rdzv-conf", f"timeout={JOIN_S}", *args] for r in range(nnodes)]
        return run_all(cmds, timeout, env=env)


def _drain(pipe, chunks):
    for line in pipe:
        chunks.append(line)


def _tree(pid):
    """pid and every process under it, however deep (Linux's /proc/PID/task/TID/children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for f in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                with open(f) as fh:
                    todo += [int(c) for c in fh.read().split()]
            except OSError:  # that task just ended
                pass
    return found


def _stat(pid):
    """(state, start time) of pid from /proc/PID/stat (fields 3 and 22), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19]


@contextlib.contextmanager
def _signals_held():
    """SIGTERM and SIGINT (whose Python handlers run in the main thread) wait for the block's end, then take effect."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = []
    old = {s: signal.signal(s, lambda n, frame: held.append(n)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for n in held:
            os.kill(os.getpid(), n)


def _survey(procs, born):
    """Add to born {pid: start time} every process under the commands still running."""
    for p in procs:
        if p.poll() is None:
            for q in _tree(p.pid):
                st = _stat(q)
                if st:
                    born[q] = st[1]


def _stop(procs, born):
    """SIGTERM, then SIGKILL after KILL_GRACE_S, each command's process group and every process ever
    seen under a command (with the group it leads, if any), by pid. A pid is signalled only while it
    has the start time it had when seen, so a pid that another program has reused is left alone."""
    _survey(procs, born)

    def ours():
        live = []
        for q, t in born.items():
            st = _stat(q)
            if st and st[1] == t and st[0] != "Z":  # a zombie is done: its parent reaps it
                live.append(q)
        return live

    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        signals = [(os.killpg, p.pid) for p in procs]  # a group lives on while a member does
        signals += [(kill, q) for q in ours() for kill in (os.killpg, os.kill)]  # killpg(q): a group q started
        for kill, q in signals:
            try:
                kill(q, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end:
            for p in procs:
                p.poll()  # reap our children, else they linger as zombies in their groups
            if not ours() and not any(map(_group_alive, [p.pid for p in procs])):
                return
            time.sleep(0.05)


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# the stack, the project, and what reward.init's warm-up imports on a first parse (sympy's: ~0.3 CPU s a rank)
PRELOAD = ["torch", "torch.distributed", "megatron.core", "transformers", "model", "train_grpo", "sft", "tools.check",
           "sympy.physics.units", "sympy.combinatorics", "sympy.tensor.tensor"]
_FORKSERVER = []


def _rank(script, env, cwd, out):
    """A forked rank: a session of its own, its outputs to files, torchrun's environment, script as __main__."""
    os.setsid()
    for fd, path in ((1, f"{out}.out"), (2, f"{out}.err")):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.path[0] = str(Path(script[0]).parent)
    sys.argv = list(script)
    try:
        runpy.run_path(script[0], run_name="__main__")
    finally:  # a forked child leaves through os._exit: what atexit holds (servers to stop) runs here
        atexit._run_exitfuncs()


class Job:
    """The ranks of one launch of a script (start())."""

    def __init__(self, script, args, nproc, env, cwd):
        if not _FORKSERVER:
            _FORKSERVER.append(multiprocessing.get_context("forkserver"))
            _FORKSERVER[0].set_forkserver_preload(PRELOAD)
        env, self.store, self.dir = dict(os.environ if env is None else env), None, tempfile.mkdtemp(prefix="rank_")
        if nproc > 1:
            import torch.distributed as dist
            self.store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(minutes=10))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port), WORLD_SIZE=str(nproc),
                       LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True")
        self.args = [str(script), *map(str, args)]
        self.procs = [_FORKSERVER[0].Process(target=_rank, args=(self.args, dict(env, RANK=str(r), LOCAL_RANK=str(r))
                                                                 if nproc > 1 else env, str(cwd), f"{self.dir}/{r}"))
                      for r in range(nproc)]
        for p in self.procs:
            p.start()
        self.pid = self.procs[0].pid

    def poll(self):
        """None while every rank runs or has succeeded but one, the first failure's code, else 0."""
        failed = [p.exitcode for p in self.procs if p.exitcode not in (None, 0)]
        if failed:
            return failed[0] if failed[0] > 0 else 128 - failed[0]  # -N: killed by signal N
        return None if any(p.exitcode is None for p in self.procs) else 0

    def printed(self, rank=0):
        """What rank `rank` has written to stdout so far."""
        f = Path(f"{self.dir}/{rank}.out")
        return f.read_text(errors="replace") if f.exists() else ""

    def kill(self, sig=signal.SIGKILL):
        for p in self.procs:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout=600):
        """-> CompletedProcess(args, returncode, stdout, stderr), the ranks' outputs in rank order."""
        deadline, failed_at = time.monotonic() + timeout, None
        try:
            while any(p.is_alive() for p in self.procs) and time.monotonic() < deadline:
                if failed_at is None and self.poll():
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() > failed_at + FAIL_GRACE_S:
                    break
                time.sleep(0.05)
            timed_out = any(p.is_alive() for p in self.procs) and failed_at is None
        finally:
            _stop([], {q: _stat(q)[1] for p in self.procs for q in _tree(p.pid) if _stat(q)})
            for p in self.procs:
                p.join(5)
        out, err = ("".join(f.read_text(errors="replace") for r in range(len(self.procs))
                            for f in [Path(f"{self.dir}/{r}.{k}")] if f.exists()) for k in ("out", "err"))
        if timed_out:
            raise AssertionError(f"timed out after {timeout}s: {' '.join(self.args)[:300]}\n--- stdout:\n"
                                 f"{out[-TAIL:]}\n--- stderr:\n{err[-TAIL:]}")
        return subprocess.CompletedProcess(self.args, self.poll() or 0, out, err)


def start(script, *args, nproc=1, env=None, cwd=ROOT):
    """`python script args` (nproc 1) or `torchrun --standalone --nproc_per_node nproc script args`, started."""
    return Job(script, args, nproc, env, cwd)


def python(script, *args, nproc=1, timeout=600, env=None, cwd=ROOT):
    """start(...).wait(timeout): subprocess.run's CompletedProcess."""
    return Job(script, args, nproc, env, cwd).wait(timeout)

"""sglang_engine.py's server processes on CPU against tests/fake_sglang.py: a server killed mid-rollout restarted and
its requests retried, a restart while released, and every child dying with its parent (protocol and weight sync:
tests/test_sglang_engine.py; aborts: test_sglang_abort.py).

    .venv/bin/pytest tests/test_sglang_processes.py -q
"""
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

import launch
import rollout
from conftest import ROOT, rollout_args
from fake_sglang import fake_output, weights_digest
from test_rollout import load_model
from test_sglang_engine import FAKE, group_members, held, read_record, sglang


def test_sglang_killed_mid_rollout_restarts_and_retries(ckpt, tmp_path):
    gate = tmp_path / "gate"
    gate.touch()  # the first server holds every request in its queue until it is killed
    eng, rec = sglang(ckpt, tmp_path, "--fake-hold", "queue", "--fake-gate", str(gate), "--fake-children", "2",
                      env={"CUDA_VISIBLE_DEVICES": "1"})
    pgids = [eng.server.proc.pid]
    try:
        items = [(k, v * 1.01) for k, v in load_model(ckpt).state_dict().items()]
        eng.update_weights([items])
        digest = weights_digest(tmp_path / "weights" / "a")
        batch = [{"input_ids": [151644, 100 + i, 151645], "images": []} for i in range(8)]
        def kill():
            held(rec, 8)
            os.killpg(pgids[0], signal.SIGKILL)
            gate.unlink()
        killer = threading.Thread(target=kill)
        killer.start()
        outs = eng.generate(batch, dict(temperature=1.0, max_new_tokens=16))
        killer.join()
        assert eng.server.restarts == 1
        pgids.append(eng.server.proc.pid)
        for item, out in zip(batch, outs):  # every request answered once, in order, by the new weights
            assert out["ids"] == fake_output(item["input_ids"], 16, digest)[0] and out["finish"] == "stop"
        gens = [r for r in read_record(rec) if r["path"] == "/generate"]
        assert len({r["pid"] for r in gens}) == 2 and len(gens) == 16  # every one retried on the new server
        assert eng.server.model_path == str(tmp_path / "weights" / "a")  # restarted from the synced weights
        assert b"CUDA_VISIBLE_DEVICES=1" in Path(f"/proc/{eng.server.proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        eng.shutdown()
    assert all(group_members(g) == [] for g in pgids), [group_members(g) for g in pgids]


def test_a_server_restarted_while_released_is_released_again(ckpt, tmp_path):
    """Colocated, the server is released while the trainer trains. One that dies then comes back holding
    all its memory: the engine frees it again at once, so the resume (here the very call that found it
    dead, retried on the new server) names only regions the server freed: SGLang raises KeyError on
    another (weight_updater.py:389-390; the fake answers HTTP 500)."""
    eng, rec = sglang(ckpt, tmp_path)
    try:
        eng.release()
        first = eng.server.proc
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        eng.resume()
        assert eng.server.restarts == 1 and not eng.released
        calls = [(r["path"], r["json"]["tags"], r["pid"]) for r in read_record(rec) if "memory" in r["path"]]
        every = ["weights", "kv_cache", "cuda_graph"]
        assert [(p, sorted(t)) for p, t, _ in calls] == [("/release_memory_occupation", sorted(every))] * 2 + [
            ("/resume_memory_occupation", sorted(every))]
        assert calls[0][2] != calls[1][2] == calls[2][2]  # released again by the new server, then resumed
    finally:
        eng.shutdown()



def test_a_hung_server_is_restarted_though_its_health_answers_from_its_status(ckpt, tmp_path):
    """Colocated servers answer /health from their status (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0: no token on
    released memory), so a hung scheduler says 200 there (http_server.py:745-749). A request that found the server
    not answering asks /health_generate, one token through the scheduler (503 when hung), and restarts it; while
    released it asks /health alone. The test hangs the scheduler (--fake-hung) and calls the recovery a failed
    request calls (Server.call after a ServerDown)."""
    hung = tmp_path / "hung"
    eng, rec = sglang(ckpt, tmp_path, "--fake-hung", str(hung), env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0"})
    try:
        first = eng.server.proc.pid
        hung.touch()
        eng.release()
        eng.server._recover(eng.server.epoch, "timed out")
        assert eng.server.restarts == 0 and eng.server.proc.pid == first  # released: not probed with a token
        eng.resume()
        eng.server._recover(eng.server.epoch, "timed out")
        assert eng.server.restarts == 1 and eng.server.proc.pid != first
        probes = [(r["json"]["released"], r["pid"]) for r in read_record(rec) if r["path"] == "/health_generate"]
        assert probes == [([], first)], probes
    finally:
        eng.shutdown()

def thread_gone(tid, timeout=30):
    """Wait until thread `tid` of this process has left the kernel's task list: PR_SET_PDEATHSIG, if armed for
    it, has been sent by then."""
    deadline = time.time() + timeout
    while Path(f"/proc/self/task/{tid}").exists():
        assert time.time() < deadline, f"thread {tid} still runs"
        time.sleep(0.05)


def test_a_child_started_from_a_pool_thread_outlives_the_pool():
    """proc.popen: PR_SET_PDEATHSIG follows the THREAD that forked the child (prctl(2)), so the launcher's
    child, forked by a pool's thread, would be SIGKILLed when that pool shuts down (rc -9); popen forks
    every child from a thread that lives as long as the process."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor
    import proc
    pool = ThreadPoolExecutor(1)
    child, tid = pool.submit(lambda: (proc.popen(["sleep", "60"], subprocess.DEVNULL), threading.get_native_id())).result()
    try:
        deadline = time.time() + 20  # armed once the launcher has exec'd sleep
        while Path(f"/proc/{child.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.time() < deadline and child.poll() is None, child.returncode
            time.sleep(0.05)
        pool.shutdown(wait=True)
        thread_gone(tid)
        with pytest.raises(subprocess.TimeoutExpired):  # alive: a SIGKILL sent at the thread's exit ends it at once
            pytest.fail(f"the child ended with its pool's thread: rc {child.wait(1.0)}")
    finally:
        child.kill()
        child.wait()


def test_a_server_an_episode_restarted_outlives_the_pause(ckpt, processor, records, tmp_path):
    """The server killed mid-rollout is restarted by the episode thread whose request failed; Rollout.pause()
    shuts the episodes' pool down, and the restarted server still serves: one restart in all."""
    gate = tmp_path / "gate"  # every request held in the queue until the server is killed with one
    gate.touch()
    eng, rec = sglang(ckpt, tmp_path, "--fake-hold", "queue", "--fake-gate", str(gate))
    try:
        ro = rollout.Rollout(eng, processor, rollout_args(), target=len(records))
        killed = eng.server.proc.pid
        ro.resume(records, 0)
        held(rec)
        os.killpg(killed, signal.SIGKILL)
        gate.unlink()
        assert len(ro.take(len(records))) == 2 * len(records)
        episodes = [t for t in threading.enumerate() if t.name.startswith("episode")]
        ro.pause()
        for t in episodes:
            t.join(30)
            thread_gone(t.native_id)
        assert eng.server.proc.pid != killed and eng.server.proc.poll() is None
        out = eng.generate([{"input_ids": [151644, 100, 151645], "images": []}], dict(max_new_tokens=16))[0]
        assert out["finish"] == "stop" and eng.server.restarts == 1, (out, eng.server.log_tail())
        assert eng.server.log_path.read_text().count("starting:") == 2
    finally:
        eng.shutdown()

def test_sglang_start_failures_quote_log_and_leave_nothing(ckpt, tmp_path):
    with pytest.raises(RuntimeError, match="failing to start as asked"):
        sglang(ckpt, tmp_path / "a", "--fake-startup", "-1")
    from sglang_server import _LIVE
    before = set(_LIVE)
    # 15 s: time for the fake to start and print its children on a loaded machine (2 s was flaky)
    with pytest.raises(RuntimeError, match="not healthy after 15s") as e:
        sglang(ckpt, tmp_path / "b", "--fake-startup", "120", "--fake-children", "1", timeout=15)
    assert "fake sglang children=" in str(e.value)
    log = (tmp_path / "b" / "sglang.log").read_text()
    pid = int(log.split("pid=")[1].split()[0])
    assert group_members(pid) == [] and set(_LIVE) <= before


CHILD = """
import signal, sys, time
sys.path[:0] = [{root!r}]
# Ctrl-C as a terminal delivers it: a job started in the background (`cmd &`, CI) inherits SIGINT
# ignored, which Python and the trainer keep, and this child would sleep through the test's SIGINT
signal.signal(signal.SIGINT, signal.default_int_handler)
from sglang_engine import SGLangEngine
eng = SGLangEngine({ckpt!r}, sys.argv[2], server_args=["--fake-children", "1"],
                   launch_cmd=[sys.executable, {fake!r}], timeout=60)
print(eng.server.proc.pid, flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)
if sys.argv[1] == "error":
    raise RuntimeError("trainer crashed")
time.sleep(120)
"""


def test_sglang_server_dies_with_its_parent(ckpt, tmp_path):
    """Normal exit, an exception, Ctrl-C and SIGTERM in the trainer all end the server's group. The trainers
    are forked from the tests' forkserver (tests/launch.py): they start without importing torch again."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(Path(rollout.__file__).parent), ckpt=str(ckpt), fake=FAKE))
    modes = {"exit": None, "error": None, "sigint": signal.SIGINT, "sigterm": signal.SIGTERM,
             "sigkill": signal.SIGKILL}  # SIGKILL (OOM): no handler runs; PR_SET_PDEATHSIG does it
    jobs = {m: launch.start(script, m, tmp_path / m) for m in modes}
    try:
        for mode, job in jobs.items():
            deadline = time.time() + 60
            while not job.printed().endswith("\n"):  # the server's group, once it is up
                assert job.poll() is None and time.time() < deadline, (mode, job.wait(5).stderr[-2000:])
                time.sleep(0.1)
            pgid = int(job.printed())
            if modes[mode] is not None:
                assert group_members(pgid, wait=0)  # the server is up until we signal its parent
                os.kill(job.pid, modes[mode])
            job.wait(60)
            assert group_members(pgid) == [], (mode, group_members(pgid))
    finally:
        for job in jobs.values():
            job.kill()


@pytest.mark.parametrize("launcher", ["setpriv", "proc.py"])
def test_proc_launcher_dies_with_its_parent(tmp_path, monkeypatch, launcher):
    """proc.armed, with setpriv(1) and without (then proc.py): the launched command is SIGKILLed when its parent
    dies; a launcher whose parent is already gone (not the pid it was given) exits without running the command."""
    import subprocess
    import proc
    setpriv = proc.SETPRIV if launcher == "setpriv" else None
    assert launcher == "proc.py" or setpriv, "no setpriv(1) on this machine"
    monkeypatch.setattr(proc, "SETPRIV", setpriv)
    flag = tmp_path / "ran"
    r = subprocess.run(proc.armed(["touch", str(flag)], parent=1), timeout=30)
    assert r.returncode == 0 and not flag.exists()
    parent = subprocess.Popen([sys.executable, "-c", (
        f"import os, subprocess, sys, time\nsys.path.insert(0, {str(ROOT)!r})\n"
        f"import proc\nproc.SETPRIV = {setpriv!r}\n"
        "c = subprocess.Popen(proc.armed(['sleep', '60']))\n"
        "print(c.pid, flush=True)\ntime.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.time() + 20  # the launcher execs sleep (slow under load: it failed once at 0.5 s)
    while time.time() < deadline and Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
        time.sleep(0.1)
    assert Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] == b"sleep"
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and group_members(os.getpgid(0), wait=0).count(child):
        time.sleep(0.1)
    assert child not in group_members(os.getpgid(0), wait=0)

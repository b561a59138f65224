"""The test suite's CPU work (issue 70): the CPU seconds of every process it started, the tests with the most, and how
many Python interpreters it started (each one imports its stack again).

    .venv/bin/python bench/suite_cpu.py                              # the whole suite, as test.sh runs it
    .venv/bin/python bench/suite_cpu.py -n 0 tests/test_report.py    # any pytest arguments instead

How, and what it cannot see:
- total: this process is a child subreaper (prctl(2) PR_SET_CHILD_SUBREAPER), so a process the suite started whose
  parent died first (a server, a torchrun worker) is re-parented here, not to PID 1; once pytest has ended, every one
  is reaped as it ends (wait4: their share is said apart) and getrusage(RUSAGE_CHILDREN) holds them all. A process
  still running 60 s after pytest ended is listed (a leak) and not counted. `machine` beside it: /proc/stat's busy
  time of every CPU over the run (everything on the machine: the same on a quiet one).
- per test (tests/conftest.py, under SUITE_CPU_DIR): around each test, in its worker, getrusage of the worker and of
  the children it reaped, plus /proc/<pid>/stat's utime, stime, cutime and cstime of its live children (the forkserver
  of tests/launch.py: its ranks count once it reaped them). A test's share of a module fixture is the first test's;
  what a re-parented orphan used (e.g. a forkserver whose parent exited) is in no test's figure, only in the total.
- interpreters: a sitecustomize.py first on PYTHONPATH writes each new interpreter's command line; one started
  without PYTHONPATH (an env= built from nothing, -I, -S) is not counted. A forked child (the forkserver's ranks) is
  not a new interpreter, rightly.
"""
import ctypes
import glob
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
SITE = """import os
try:
    fd = os.open(os.path.join(os.environ["SUITE_CPU_DIR"], "interpreters"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with open("/proc/self/cmdline", "rb") as f:  # its arguments, NUL-separated -> one line, tabs between
        os.write(fd, f.read().rstrip(b"\\0").replace(b"\\n", b" ").replace(b"\\0", b"\\t") + b"\\n")  # one write: whole
    os.close(fd)
except (KeyError, OSError):
    pass
"""


def cpu_seconds():
    """CPU seconds so far of this process, the children it reaped, and its live children with what they reaped."""
    total = sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name: state, ppid, ...
        except OSError:  # it ended meanwhile: reaped (counted above) or another's
            continue
        if int(fields[1]) == os.getpid():
            total += sum(int(x) for x in fields[11:15]) / TICK  # utime, stime, cutime, cstime
    return total


def record(out, nodeid, cpu, wall):
    """A test's row, appended to its worker's file under `out`."""
    with open(Path(out) / f"tests.{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps({"test": nodeid, "cpu_s": round(cpu, 2), "wall_s": round(wall, 2)}) + "\n")


def busy():
    """Seconds every CPU of the machine spent busy so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICK


def kind(line):
    """What an interpreter ran (its arguments, tab-separated): -m its module, -c, or its script's name."""
    args = line.split("\t")
    for i in range(1, len(args)):
        if args[i] in ("-m", "-c"):
            return " ".join(args[i:i + 2]) if args[i] == "-m" else "-c"
        if not args[i].startswith("-") and args[i - 1] not in ("-W", "-X"):
            return Path(args[i]).name
    return "(no script: stdin)"


def main(argv):
    out = Path(tempfile.mkdtemp(prefix="suite_cpu."))
    (out / "site").mkdir()
    (out / "site" / "sitecustomize.py").write_text(SITE)
    env = dict(os.environ, SUITE_CPU_DIR=str(out), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(out / "site"), os.environ.get("PYTHONPATH")])))
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise SystemExit(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
    machine, t = busy(), time.monotonic()
    pytest = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                               *(argv or ["-n", "4", "--dist", "loadgroup"])], cwd=ROOT, env=env)
    orphans, rc, left = 0.0, None, []
    while rc is None:  # reap as they end: an orphan left a zombie would keep its process group alive (killpg(g, 0))
        pid, status, usage = os.wait4(-1, 0)
        if pid == pytest.pid:
            rc = pytest.returncode = os.waitstatus_to_exitcode(status)
        else:
            orphans += usage.ru_utime + usage.ru_stime
    wall, machine, deadline = time.monotonic() - t, busy() - machine, time.monotonic() + 60
    while True:  # the orphans still running: reaped within 60 s, else listed (a leak) and not counted
        try:
            pid, _, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            break
        orphans += usage.ru_utime + usage.ru_stime if pid else 0
        if pid == 0 and time.monotonic() > deadline:
            left = [Path(p).read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
                    for p in glob.glob("/proc/[0-9]*/cmdline") if _parent(p) == os.getpid()]
            break
        if pid == 0:
            time.sleep(0.1)
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    tests = [json.loads(x) for f in sorted(out.glob("tests.*.jsonl")) for x in f.read_text().splitlines()]
    interpreters = (out / "interpreters").read_text().splitlines() if (out / "interpreters").exists() else []
    summary = {"pytest_exit": rc, "wall_s": round(wall), "cpu_s": round(child.ru_utime + child.ru_stime),
               "orphans_cpu_s": round(orphans), "machine_busy_s": round(machine), "tests": len(tests),
               "tests_cpu_s": round(sum(x["cpu_s"] for x in tests)), "interpreters": len(interpreters), "left_running": left}
    print(f"\n[suite_cpu] pytest exit {rc}, {wall:.0f} s wall; CPU: {summary['cpu_s']} s in every process it started "
          f"(the machine's CPUs were busy {machine:.0f} s); {len(tests)} tests, {summary['tests_cpu_s']} s of it in them; "
          f"{orphans:.0f} s in processes whose parent ended first (in no test's figure)")
    print("[suite_cpu] the 20 tests with the most CPU (s, with what they started; wall s):")
    for x in sorted(tests, key=lambda x: -x["cpu_s"])[:20]:
        print(f"  {x['cpu_s']:8.1f} {x['wall_s']:8.1f}  {x['test']}")
    print(f"[suite_cpu] {len(interpreters)} Python interpreters started; by what they ran: "
          + ", ".join(f"{k} {n}" for k, n in Counter(map(kind, interpreters)).most_common(12)))
    for x in left:
        print(f"[suite_cpu] still running 60 s after pytest ended (not counted): {x}")
    print(json.dumps(summary))
    print(f"[suite_cpu] rows: {out}")
    return rc


def _parent(cmdline_path):
    try:
        return int(Path(cmdline_path).with_name("stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Table-driven tests of reward.py: math / geo3k rewards through reward.score, a reward that reads the row,
format_ok, strict_json, last_boxed, threads, time bounds.

    .venv/bin/pytest -q tests/test_reward.py        # 8-20 s on 2 shared cores (spawns 2 workers once)
"""
import json
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import reward
from reward import format_ok, last_boxed


@pytest.fixture(autouse=True)
def _no_wall_cap(request, monkeypatch):
    """What a reward matches must not depend on the machine's load: the 0.8 s wall-clock cap binds under heavy CPU
    contention (a right answer, 0.013 s of CPU quiet, scored 0.0 in a serial suite at load ~30). Only the tests of
    the time bound keep it."""
    if "time" not in request.node.name:
        monkeypatch.setattr(reward, "WALL_LIMIT_S", 60.0)


def math_reward(response, label):
    return reward.score("math", response, {"answer": label})


def geo3k_reward(response, label):
    return reward.score("geo3k", response, {"answer": label})

S3 = "5 \\sqrt { 3 }"                        # the real geo3k spellings of labels
F22 = "\\frac { 2 \\sqrt { 2 } } { 5 }"
PI53 = "\\frac { 5 \\pi } { 3 }"
B = "\\boxed{%s}"

# (response, label, math_reward, geo3k_reward)
CASES = [
    # the ten real geo3k answers, equivalent spellings
    (B % "80", "80", 1.0, 1.0),
    (B % "80^\\circ", "80", 1.0, 1.0),
    (B % "80^{\\circ}", "80", 1.0, 1.0),
    (B % "80°", "80", 1.0, 1.0),
    (B % "\\text{80 degrees}", "80", 1.0, 1.0),
    (B % "x = 13", "13", 1.0, 1.0),
    (B % "x=13^\\circ", "13", 1.0, 1.0),
    (B % "13.00", "13", 1.0, 1.0),
    (B % "y = 9", "9", 1.0, 1.0),
    (B % " 9 ", "9", 1.0, 1.0),
    (B % "\\text{48}", "48", 1.0, 1.0),
    (B % "48.0", "48", 1.0, 1.0),
    (B % S3, S3, 1.0, 1.0),
    (B % "5\\sqrt{3}", S3, 1.0, 1.0),
    (B % "5\\sqrt3", S3, 1.0, 1.0),
    (B % "\\sqrt{75}", S3, 1.0, 1.0),
    (B % "5 \\cdot \\sqrt{3}", S3, 1.0, 1.0),
    (B % "10 \\text{ cm}", "10", 1.0, 1.0),
    (B % "10\\,\\mathrm{cm}", "10", 1.0, 1.0),
    (B % "\\angle Q = 120^\\circ", "120", 1.0, 1.0),
    (B % "120", "120^\\circ", 1.0, 1.0),
    (B % "22", "22", 1.0, 1.0),
    (B % "22 \\text{ units}^2", "22", 1.0, 1.0),
    (B % "\\frac{2\\sqrt{2}}{5}", F22, 1.0, 1.0),
    (B % "\\dfrac{2\\sqrt{2}}{5}", F22, 1.0, 1.0),
    (B % "2\\sqrt{2}/5", F22, 1.0, 1.0),
    (B % "\\frac{\\sqrt{8}}{5}", F22, 1.0, 1.0),
    (B % "\\frac{2}{5}\\sqrt{2}", F22, 1.0, 1.0),
    (B % "16", "16", 1.0, 1.0),
    (B % "\\$16", "16", 1.0, 1.0),
    ("$\\boxed{16}$.", "16", 1.0, 1.0),
    # fractions, decimals, trailing zeros, pi
    (B % "\\frac{27}{2}", "13.5", 1.0, 1.0),
    (B % "27/2", "13.5", 1.0, 1.0),
    (B % "13.50", "13.5", 1.0, 1.0),
    (B % "13.5", "\\frac{27}{2}", 1.0, 1.0),
    (B % "\\frac{5\\pi}{3}", PI53, 1.0, 1.0),
    # non-equivalent: wrong values, wrong choices of the real problems
    (B % "60", "80", 0.0, 0.0),
    (B % "12", "13", 0.0, 0.0),
    (B % "-13", "13", 0.0, 0.0),
    (B % "13x", "13", 0.0, 0.0),
    (B % "13 \\pm 1", "13", 0.0, 0.0),
    (B % "18", "9", 0.0, 0.0),
    (B % "5\\sqrt{2}", S3, 0.0, 0.0),
    (B % "10", S3, 0.0, 0.0),
    (B % "8", "10", 0.0, 0.0),
    (B % "20", "22", 0.0, 0.0),
    (B % "\\frac{\\sqrt{2}}{5}", F22, 0.0, 0.0),
    (B % "\\frac{\\sqrt{5}}{5}", F22, 0.0, 0.0),
    (B % "300^\\circ", PI53, 0.0, 0.0),
    (B % "\\infty", "13", 0.0, 0.0),
    (B % "\\sqrt{-169}", "13", 0.0, 0.0),
    (B % "\\text{thirteen}", "13", 0.0, 0.0),
    # tolerance (geo3k only), both directions; label 0 needs exact 0
    (B % "8.66", S3, 0.0, 1.0),
    (B % "8.7", S3, 0.0, 1.0),
    (B % "8.2", S3, 0.0, 0.0),          # 5.3 % low
    (B % "0.566", F22, 0.0, 1.0),
    (B % "5.236", PI53, 0.0, 1.0),
    (B % "13", "13.5", 0.0, 1.0),       # 3.7 % low
    (B % "95.1", "100", 0.0, 1.0),
    (B % "104.9", "100", 0.0, 1.0),
    (B % "94.9", "100", 0.0, 0.0),
    (B % "105.1", "100", 0.0, 0.0),
    (B % "x = 104", "100", 0.0, 1.0),
    (B % "0", "0", 1.0, 1.0),
    (B % "0.0", "0", 1.0, 1.0),
    (B % "0.001", "0", 0.0, 0.0),
    # choice letters never match a value; a letter label is compared as text
    (B % "B", "13", 0.0, 0.0),
    (B % "D", "80", 0.0, 0.0),
    (B % "(C)", S3, 0.0, 0.0),
    (B % "E", "2.718281828", 0.0, 0.0),  # not sympy's E
    (B % "B", "B", 1.0, 1.0),
    (B % "\\text{(B)}", "B", 1.0, 1.0),
    (B % "C", "B", 0.0, 0.0),
    (B % "13", "B", 0.0, 0.0),
    # last box wins, \fbox, nesting
    ("first \\boxed{12}, no wait: \\boxed{13}", "13", 1.0, 1.0),
    ("\\boxed{13} hmm, so \\boxed{12}", "13", 0.0, 0.0),
    ("\\boxed{13} then \\boxed{13", "13", 0.0, 0.0),     # the last box is unclosed
    ("\\fbox{13}", "13", 1.0, 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("\\boxed{13}}}}", "13", 1.0, 1.0),
    # malformed
    ("", "13", 0.0, 0.0),
    ("13", "13", 0.0, 0.0),                 # no box
    (B % "", "13", 0.0, 0.0),
    (B % "  ", "13", 0.0, 0.0),
    ("\\boxed{13", "13", 0.0, 0.0),
    ("\\boxed13", "13", 0.0, 0.0),
    ("\x00\xff\ufffd\\boxed{\x00\xff}", "13", 0.0, 0.0),
    ("\x00\xff\ufffd \\boxed{13}", "13", 1.0, 1.0),
    ("a" * 100_000 + "\\boxed{13}", "13", 1.0, 1.0),
    (B % ("1" * 2000), "1" * 2000, 0.0, 0.0),  # over the box cap
    (None, "13", 0.0, 0.0),
    (b"\\boxed{13}", "13", 0.0, 0.0),
    (B % "13", "", 0.0, 0.0),
    (B % "13", None, 0.0, 0.0),
    (B % "13", 13, 1.0, 1.0),               # a numeric label is fine
    (B % "8.66", 8.660254037844386, 0.0, 1.0),
]


def _id(case):
    return repr(case[0])[:40] + "|" + repr(case[1])[:20]


@pytest.mark.parametrize("response,label,want_math,want_geo3k", CASES, ids=[_id(c) for c in CASES])
def test_rewards(response, label, want_math, want_geo3k):
    got_math, got_geo3k = math_reward(response, label), geo3k_reward(response, label)
    assert type(got_math) is float and type(got_geo3k) is float
    assert (got_math, got_geo3k) == (want_math, want_geo3k)


@pytest.mark.parametrize("response,label,tol,want", [
    (B % "8.66", S3, 0.0, 0.0),
    (B % "8.66", S3, 0.001, 1.0),
    (B % "9", "10", 0.05, 0.0),
    (B % "9", "10", 0.1, 1.0),
    (B % "0.1", "0", 1.0, 0.0),      # label 0: exact 0 whatever tol
    (B % "9", "10", float("nan"), 0.0),
])
def test_geo3k_tol(response, label, tol, want):
    assert reward.geo3k_reward(response, {"answer": label}, tol=tol) == bool(want)


def test_real_geo3k_answers(geo3k_real):
    """Each real answer matches itself and precise_value (within tol); other choices and the
    answer letter do not."""
    rows = [json.loads(line) for line in (Path(geo3k_real) / "test.jsonl").read_text().splitlines() if line]
    assert len(rows) == 10
    for row in rows:
        ans = row["answer"]
        assert math_reward(f"So \\boxed{{{ans}}}.", ans) == 1.0, ans
        assert geo3k_reward(f"\\boxed{{{row['precise_value']:.4f}}}", ans) == 1.0, ans
        assert math_reward(f"\\boxed{{{row['answer_letter']}}}", ans) == 0.0, ans
        for choice in row["choices"]:
            if choice != ans:
                assert geo3k_reward(f"\\boxed{{{choice}}}", ans) == 0.0, (choice, ans)


@pytest.mark.parametrize("text,want", [
    ("a \\boxed{1} b \\boxed{2} c", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\fbox{x}", "x"),
    ("\\boxed {3}", "3"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),   # escaped braces do not close the box
    ("\\boxed{1", None),
    # a box left open makes the answer malformed, also when a later box closes inside it: the
    # CPU demo's GRPO was rewarded for looping "\\boxed{5 \\boxed{5 ... \\boxed{5}", which greedy
    # decoding then never closed
    ("Answer: \\boxed{5 \\boxed{5 \\boxed{5}", None),
    ("\\boxed{3 and then \\boxed{5}", None),
    ("\\boxed{x = \\boxed{5}}", "5"),      # nested and closed: the innermost, last box
    ("no box", None),
    ("\\boxed{" + "1" * 2000 + "}", None),
    (None, None),
])
def test_last_boxed(text, want):
    assert last_boxed(text) == want


CALL = '<tool_call>{"name": "calc", "arguments": {"expr": "1+1"}}</tool_call>'


@pytest.mark.parametrize("response,want", [
    ("\\boxed{5}", True),
    ("the answer is 5", False),
    ("", False),
    ("\\boxed{}", False),
    ("\\boxed{5", False),
    (CALL, True),
    (CALL + " and " + CALL, True),
    ('<tool_call> {"name": "a", "arguments": {}} </tool_call> \\boxed{3}', True),
    ('<tool_call>{"name": "calc", "arguments": {expr: 1}}</tool_call>', False),
    ('<tool_call>{"name": "calc", "arguments": {"x": NaN}}</tool_call>', False),
    ('<tool_call>{"name": "calc"}</tool_call>', False),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', False),
    ('<tool_call>[1, 2]</tool_call>', False),
    ('<tool_call>{"name": "calc", "arguments": {}}', False),   # unclosed
    ("\\boxed{5} " + '<tool_call>{bad}</tool_call>', False),
    ("\\boxed{5} </tool_call>", False),
    (None, False),
])
def test_format_ok(response, want):
    assert format_ok(response) is want


def test_score_runs_the_registry_on_the_whole_row(monkeypatch):
    """A reward sees the row (its other columns too) and is made 0.0 / 1.0 and time-bounded by score();
    an unknown name is refused by name (argparse lists REWARDS as --rm-type's choices)."""
    assert list(reward.REWARDS)[:2] == ["math", "geo3k"]
    with pytest.raises(ValueError, match="unknown --rm-type 'bogus'; choose one of \\[.*'geo3k', 'math'"):
        reward.score("bogus", B % "1", {"answer": "1"})

    def choice(response, record):  # a multiple-choice row: the letter names one of its choices
        return last_boxed(response) == "ABCD"[record["choices"].index(record["answer"])]
    monkeypatch.setitem(reward.REWARDS, "choice", choice)
    row = {"answer": "13", "choices": ["12", "13", "14", "15"]}
    assert [reward.score("choice", B % x, row) for x in "BC"] == [1.0, 0.0]
    assert reward.score("choice", B % "B", {"answer": "13"}) == 0.0  # a row without choices: 0, never a crash

    def forever(response, record):
        while True:
            pass
    monkeypatch.setitem(reward.REWARDS, "forever", forever)
    faults = {}  # cut by the bound, whatever the machine's speed: it returns, its time-out kept (not a clock's reading)
    assert reward.score("forever", "", row, faults, timeout=0.05) == 0.0 and list(faults) == ["timeouts"]
    assert "forever ran past its time bound (0.05 s: --rm-timeout) on the row {'answer': '13'" in faults["timeouts"]["forever"]


@pytest.mark.parametrize("text,error", [
    ('{"a": [1, {"b": "[[[[{{{{"}]}', None),                  # brackets in strings do not count
    ("[" * 64 + "]" * 64, None),
    ("[" * 65 + "]" * 65, "nested too deeply"),
    ('{"a": "\\"' + "[" * 70 + '"}', None),                  # an escaped quote does not end the string
    ('{"x": NaN}', "NaN is not valid JSON"),
])
def test_strict_json_bounds_nesting_whatever_the_recursion_limit(text, error):
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)  # as torch inductor leaves it: the bound may not lean on it
    try:
        if error is None:
            assert reward.strict_json(text) == json.loads(text)
        else:
            with pytest.raises(ValueError, match=error):
                reward.strict_json(text)
    finally:
        sys.setrecursionlimit(old)


def test_worker_threads():
    """math-verify's signal timeouts fail off the main thread; ours must not."""
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda c: (math_reward(c[0], c[1]), geo3k_reward(c[0], c[1])), CASES))
    assert got == [(c[2], c[3]) for c in CASES]
    out = []
    t = threading.Thread(target=lambda: out.append(geo3k_reward(B % "8.66", S3)))
    t.start()
    t.join()
    assert out == [1.0]


# Kept out by cheap guards before sympy sees them: each must return well within 1 s.
GUARDED = {
    "1MB": ("x" * 1_000_000 + "\\boxed{13}", "13", 1.0),
    "tower": (B % "10^{10^{10^{10}}}", "13", 0.0),
    "nested10k": (B % ("{" * 10_000 + "13" + "}" * 10_000), "13", 0.0),
    "deep_sets": (B % ("{" * 20 + "5" + "}" * 20), "5", 0.0),
    "factorial": (B % "(10^{100000})!", "13", 0.0),
    "matrix_tower": (B % "\\begin{pmatrix}10^{10^{10}} & 2\\end{pmatrix}", "13", 0.0),
}
# Slow only inside math-verify's pure-Python LaTeX parser (seconds each without a limit): cut
# by the deadline, which counts the thread's CPU time (0.4 s), with a 0.8 s wall-clock cap.
DEADLINE = {
    "power_chain": (B % ("x^" * 400 + "2"), "13", 0.0),
    "eq_chain": (B % ("x=" * 400 + "5"), "13", 0.0),
}


def _timed_call(response, label, where):
    def timed():
        reward.init()  # math-verify's warm-up (sympy's import): ~0.4 s CPU, seconds of wall under load
        t, c = time.perf_counter(), time.thread_time()
        r = geo3k_reward(response, label)
        return r, time.perf_counter() - t, time.thread_time() - c
    if where == "main":
        return timed()
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(timed).result()


@pytest.mark.parametrize("name", list(GUARDED))
@pytest.mark.parametrize("where", ["main", "thread"])
def test_bounded_time_guarded(name, where):
    """A guard answers in well under the deadline's 0.4 s of CPU time (so it is the guard, not the deadline,
    that answers); wall time, which a loaded machine stretches, gets a hang detector's bound."""
    response, label, want = GUARDED[name]
    r, wall, cpu = _timed_call(response, label, where)
    assert r == want and cpu < 0.2 and wall < 3.0, (r, cpu, wall)


@pytest.mark.parametrize("name", list(DEADLINE))
@pytest.mark.parametrize("where", ["main", "thread"])
def test_bounded_time_deadline(name, where):
    """The 1 s holds in CPU time always, and in wall time on a machine that is not
    oversubscribed; under a load of 4 per core unwinding alone can take ~0.5 s of wall time,
    so wall time gets a hang detector's bound here."""
    response, label, want = DEADLINE[name]
    r, wall, cpu = _timed_call(response, label, where)
    assert r == want and cpu < 1.0 and wall < 3.0, (r, cpu, wall)


def test_a_collection_of_the_whole_heap_is_not_the_judges_time(monkeypatch):
    """Python's collector sweeps the process's whole heap in whichever thread allocates (a trainer's: 0.3 s of CPU at
    0.5 M objects, quiet): one that lands in a check is not the judge's time. Here 1 M objects and a 0.05 s bound: the
    judge that collects still scores; one that spins past the bound still does not (CI scored a right answer 0.0)."""
    import gc
    heap = [[i] for i in range(1_000_000)]  # containers: each one a collection visits
    monkeypatch.setattr(reward, "CPU_LIMIT_S", 0.05)
    monkeypatch.setattr(reward, "WALL_LIMIT_S", 60.0)

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        return 1.0

    def collects(response, row):  # then works 0.02 s, within the bound: the watchdog looks every 0.01 s meanwhile
        gc.collect()
        return spin(0.02)
    monkeypatch.setitem(reward.REWARDS, "collects", collects)
    monkeypatch.setitem(reward.REWARDS, "spins", lambda response, row: spin(0.2))
    t = time.thread_time()
    gc.collect()
    assert time.thread_time() - t > 0.05, "the heap is too small to outlast the bound here"
    faults = {}
    assert reward.score("collects", "", {"answer": "1"}, faults) == 1.0, faults
    assert reward.score("spins", "", {"answer": "1"}, faults) == 0.0 and list(faults) == ["timeouts"]
    del heap


def test_timeouts_never_leak(monkeypatch):
    """Threads that keep hitting the time limit get 0.0, their other calls stay right, and no
    _Timeout escapes into the caller's code afterwards."""
    monkeypatch.setattr(reward, "CPU_LIMIT_S", 0.05)
    slow, errors = DEADLINE["power_chain"][0], []

    def work(k):
        try:
            for i in range(12):
                if (i + k) % 3 == 0:
                    assert math_reward(slow, "13") == 0.0
                else:
                    assert (math_reward(B % "x = 13", "13"), math_reward(B % "12", "13")) == (1.0, 0.0)
                sum(range(20_000))  # caller's code: a late _Timeout would land here
        except BaseException as e:  # noqa: B036 (the point is to see anything that escapes)
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    time.sleep(0.05)
    assert errors == [] and reward._ARMED == {}


def test_a_timeout_that_lands_in_a_finalizer_still_scores_zero_and_is_not_reported(monkeypatch):
    """Garbage freed while a call is armed runs its __del__ in the scoring thread, so _Timeout can
    land there: CPython reports it as 'unraisable' (pytest's hook turned a second one, fired while
    it formatted the first, into a CI failure) and the judge goes on to a verdict past its budget."""
    monkeypatch.setattr(reward, "CPU_LIMIT_S", 0.05)
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", reward._drop_timeouts(seen.append))

    class SlowFinalizer:
        def __del__(self):
            end = time.thread_time() + 0.3
            while time.thread_time() < end:
                pass

    monkeypatch.setattr(reward, "_judge", lambda *a: (SlowFinalizer(), True)[1])
    assert math_reward(B % "13", "13") == 0.0  # over budget: 0.0 wherever the _Timeout landed
    sys.unraisablehook(types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("x")))
    assert [type(u.exc_value) for u in seen] == [ValueError]  # others still reach the old hook
    time.sleep(0.05)
    assert reward._ARMED == {}


def shaped(**flags):
    """The rollout's settings with the overlong flags on, L_max 20 (what the trainer builds from its flags)."""
    from conftest import rollout_args
    return rollout_args(rollout_max_response_len=20, **flags)


@pytest.mark.parametrize("length,want", [
    (0, 0.0), (15, 0.0),     # |y| <= L_max - L: none
    (16, -0.5 * 1 / 5), (18, -0.5 * 3 / 5),  # in the buffer: linear, -F (|y| - (L_max - L)) / L
    (20, -0.5),              # at L_max: -F
    (25, -0.5),              # beyond L_max: -F (Eq. 13's -1), never more
])
def test_overlong_penalty_is_dapo_eq_13_by_hand(length, want):
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13) times F, with L_max 20, L 5, F 0.5."""
    s = types.SimpleNamespace(response_ids=[0] * length)
    assert reward.overlong_penalty(s, {}, shaped(overlong_buffer_len=5, overlong_penalty_factor=0.5)) == \
        pytest.approx(want, abs=1e-12)
    assert reward.overlong_penalty(s, {}, shaped(overlong_buffer_len=5)) is None  # F 0: off
    # no buffer: only a response past L_max is punished
    assert reward.overlong_penalty(s, {}, shaped(overlong_penalty_factor=0.5)) == (-0.5 if length > 20 else 0.0)


def test_box_iou_is_the_best_crop_iou_with_the_named_box_times_its_coef():
    """--box-iou-coef C: C times the best IoU (the env's step info) of the episode's crops of image 0, 0.0 where it
    cropped none of it, None (off) at C 0; rewarded adds it to the correctness, which it leaves alone."""
    import rollout
    steps = [{"tool": "image_zoom_in_tool", "ran": True, "iou": 0.25}, {"tool": "image_zoom_in_tool", "ran": True},
             {"tool": "image_zoom_in_tool", "ran": True, "iou": 0.75}, {"tool": None, "ran": False}]
    s = rollout.Sample(prompt_ids=[], response_text=B % "12", metadata={"steps": steps})
    assert reward.box_iou(s, {}, shaped(box_iou_coef=0.5)) == pytest.approx(0.375)
    assert reward.box_iou(s, {}, shaped()) is None
    assert reward.box_iou(rollout.Sample(prompt_ids=[], metadata={"steps": steps[1:2]}), {}, shaped(box_iou_coef=0.5)) == 0.0
    assert reward.rewarded(s, {"answer": "13"}, shaped(box_iou_coef=0.5)) == pytest.approx(0.375) and s.correct is False


def test_rewarded_keeps_correctness_apart_from_the_shaped_reward(monkeypatch, capsys):
    """rewarded: sample.correct is the judge's; the reward is it plus each SHAPING term (kept in the sample's
    metadata), none where the settings turn shaping off (evaluation); a term that raises or hangs adds 0.0, one that
    raises counted (metadata["errors"]: <name>_errors), its first traceback printed once with the row."""
    import rollout
    cfg = shaped(overlong_buffer_len=5, overlong_penalty_factor=0.5)

    def sample(text, length):
        return rollout.Sample(prompt_ids=[], response_ids=[0] * length, response_text=text)
    right, wrong = sample(B % "13", 18), sample(B % "12", 20)
    assert reward.rewarded(right, {"answer": "13"}, cfg) == pytest.approx(1 - 0.3) and right.correct is True
    assert right.metadata["shaping"] == {"overlong_penalty": pytest.approx(-0.3)}
    assert reward.rewarded(wrong, {"answer": "13"}, cfg) == -0.5 and wrong.correct is False
    assert reward.rewarded(right, {"answer": "13"}, rollout.settings(cfg, evaluation=True)) == 1.0
    assert right.metadata["shaping"] == {}

    def forever(s, record, cfg):
        while True:
            pass
    monkeypatch.setitem(reward.SHAPING, "boom", reward.Shaping(lambda s, record, cfg: 1 / 0, {}))
    monkeypatch.setitem(reward.SHAPING, "forever", reward.Shaping(forever, {}))
    monkeypatch.setattr(reward, "_TOLD", {})
    s = sample(B % "13", 0)
    assert reward.rewarded(s, {"answer": "13"}, cfg) == 1.0  # cut by the bound: 0.0 (not a clock's reading)
    assert list(s.metadata["errors"]) == ["boom"] and "ZeroDivisionError" in s.metadata["errors"]["boom"]
    assert list(s.metadata["timeouts"]) == ["forever"] and "(0.4 s of CPU" in s.metadata["timeouts"]["forever"]
    monkeypatch.delitem(reward.SHAPING, "forever")
    assert reward.rewarded(sample(B % "13", 0), {"answer": "13"}, cfg) == 1.0
    err = capsys.readouterr().err
    assert err.count("Traceback") == 1 and "boom raised on the row {'answer': '13'}" in err and "ZeroDivisionError" in err
    assert err.count("[error] forever ran past its time bound") == 1 and "(counted as forever_timeouts;" in err


def test_equal_float_rewards_give_exactly_zero_advantages():
    """Shaped rewards are floats: a group whose members got the same one (0.9: every answer right, each penalised
    alike) has exactly 0 advantage under every estimator, though 0.9 - the group's mean is not 0 in floating point."""
    import torch
    import loss as L
    import rollout
    cfg = shaped(overlong_buffer_len=10, overlong_penalty_factor=0.1)
    group = [rollout.Sample(prompt_ids=[], response_ids=[0] * 20, response_text=B % "13") for _ in range(7)]
    rewards = [reward.rewarded(s, {"answer": "13"}, cfg) for s in group] + [0.9] * 6 + [0.4]
    r = torch.tensor(rewards[:7], dtype=torch.float64)
    assert rewards[:7] == [0.9] * 7 and (r - r.mean()).abs().max() > 0  # the residue an equality check must skip
    for est in L.ESTIMATORS:
        adv = L.advantages(rewards, [0] * 7 + [1] * 7, est)
        assert adv[:7] == [0.0] * 7 and adv[7] > 0 > adv[13], est

"""Rewards for geo3k GRPO: the correctness judges (--rm-type: REWARDS), the terms shaping a reward on top of
correctness (SHAPING: DAPO's overlong penalty), the one scoring call of each, the format check.

    r = reward.score("geo3k", response, {"answer": "5 \\sqrt { 3 }"})   # 1.0 or 0.0, never raises; thread-safe
    r = reward.rewarded(sample, record, cfg)  # sets sample.correct; -> correct + the SHAPING terms, a float

A judge in REWARDS is (response, record) -> bool; a term in SHAPING is (sample, record, cfg) -> float, with its flags
(docs/extending.md); each within a time bound (--rm-timeout) on any thread, 0.0 on an exception or past the bound, each
counted (<name>_errors, <name>_timeouts) and the first printed (docs/reward.md). The first score() runs init()."""
import collections
import ctypes
import functools
import gc
import itertools
import json
import logging
import math
import os
import re
import sys
import threading
import time
import traceback
from contextlib import contextmanager, suppress

import sympy
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

import flags
import task

MAX_BOX_CHARS = 1000  # a real answer is < 100 chars; longer boxes are junk and slow to parse
MAX_DEPTH = 8         # geo3k answers nest <= 3 deep; sympy's set/evalf code is exponential in depth
MAX_BITS = 20000      # biggest exact integer we let sympy build (C bigint math ignores timeouts)
CPU_LIMIT_S = 0.4     # per-call budget of the thread's own CPU time: warm real answers need < 0.25 s (most ~5 ms)
WALL_LIMIT_S = 0.8    # the 1 s spec, with room to unwind; binds only under > 2x CPU contention
MAX_JSON_DEPTH = 64   # a tool call nests 3 deep
_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TEXT_CMD = re.compile(r"\\(?:text|textrm|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_UNIT = re.compile(r"\\(?:text|textrm|mathrm|mbox)\s*\{\s*[A-Za-z][A-Za-z .]+\}(?:\s*\^\s*\{?\s*[23]\s*\}?)?")
_LETTER = re.compile(r"\(?([A-Za-z])\)?\.?")
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')  # a JSON string literal, escapes included
_PARSE_CFG = [LatexExtractionConfig(), ExprExtractionConfig()]


class _Timeout(BaseException):
    """BaseException so that math-verify's and sympy's `except Exception` cannot swallow it."""


# Time bound: a watchdog thread raises _Timeout inside an over-budget scoring thread (docs/reward.md).
_LOCK = threading.Lock()  # a plain Lock: its C-level enter/exit cannot be split by _Timeout
_ARMED = {}               # thread id -> [its CPU clock, CPU deadline, wall deadline, last fired, a collection's start]
_WATCHDOG = [False]
REFIRE_S = 0.2            # fire again this long after a _Timeout that some code swallowed
_INIT_LOCK = threading.Lock()
_FORK_HOOKED = False      # os.register_at_fork(_after_fork) done (a forked child inherits it)
_READY = False            # init() done, here or in the process this one was forked from
_TOLD = {}                # (entry name, "errors" | "timeouts") -> its first message here (_once: printed once)


def _watchdog():
    while True:
        time.sleep(0.01)
        with _LOCK:
            for tid, arm in _ARMED.items():
                clock, cpu_end, wall_end, fired, collecting = arm
                now = time.monotonic()
                if not collecting and (clock() > cpu_end or now > wall_end) and now > fired + REFIRE_S:
                    arm[3] = now
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_Timeout))


def _collecting(phase, info):
    """gc.callbacks: a collection sweeps the whole process's heap (a trainer's: 0.3 s of CPU at 0.5 M objects) in
    the thread that allocated; an armed thread's deadlines move past it: not its judge's time. No lock: the
    collector holds the GIL, and it may run where this thread holds _LOCK."""
    arm = _ARMED.get(threading.get_ident())
    if arm is None:
        return
    if phase == "start":
        arm[4] = (arm[0](), time.monotonic())
    elif arm[4]:
        arm[1] += arm[0]() - arm[4][0]
        arm[2] += time.monotonic() - arm[4][1]
        arm[4] = None


def _drop_timeouts(hook):
    """sys.unraisablehook: a _Timeout landed in a __del__ is logged in one line (the call scores 0.0); the rest pass on."""
    def drop(unraisable):
        if unraisable.exc_type is _Timeout:
            logging.getLogger(__name__).warning("a reward time limit cut short %r", unraisable.object)
        else:
            hook(unraisable)
    return drop


def _after_fork():  # the watchdog thread does not survive fork, and _LOCK or _INIT_LOCK may have been held
    global _LOCK, _ARMED, _INIT_LOCK
    _LOCK, _ARMED, _WATCHDOG[0], _INIT_LOCK = threading.Lock(), {}, False, threading.Lock()


def init():
    """What scoring needs from the process, done once, on the first scoring call: math-verify's logger
    quiet, the unraisable hook, the collector's callback, the at-fork reset, the warm-up. A thread scoring meanwhile waits."""
    global _FORK_HOOKED, _READY
    if _READY:
        return
    if not _FORK_HOOKED:  # before taking _INIT_LOCK, so a fork while it is held always resets it
        os.register_at_fork(after_in_child=_after_fork)
        _FORK_HOOKED = True
    with _INIT_LOCK:
        if _READY:
            return
        logging.getLogger("math_verify").setLevel(logging.ERROR)  # its own (signal) timeouts are off: their warning is noise
        sys.unraisablehook = _drop_timeouts(sys.unraisablehook)
        gc.callbacks.append(_collecting)
        for answer, label in WARM_UP:  # sympy imports much of itself on first use (~0.5 s): here, outside any time limit
            with suppress(Exception):  # best effort: scoring works without it
                _judge("\\boxed{%s}" % answer, label, 0.05)
        _READY = True


@contextmanager
def _deadline(cpu_s, wall_s):
    """Raise _Timeout in this thread once it has used cpu_s of CPU or wall_s of wall time, and at the end
    of a call that ran over even where the first one landed elsewhere (in a __del__)."""
    init()  # before the clock starts: the first call's warm-up is not counted against it
    tid = threading.get_ident()
    try:
        clock = functools.partial(time.clock_gettime, time.pthread_getcpuclockid(tid))
    except (AttributeError, OSError):  # no per-thread CPU clock on this OS: count wall time
        clock = time.monotonic
    with _LOCK:
        if not _WATCHDOG[0]:
            threading.Thread(target=_watchdog, name="reward-watchdog", daemon=True).start()
            _WATCHDOG[0] = True
        _ARMED[tid] = [clock, clock() + cpu_s, time.monotonic() + wall_s, -math.inf, None]
    fired = False
    try:
        yield
    finally:
        while True:  # _Timeout may land in this cleanup too; leave only once disarmed and clear
            try:
                with _LOCK:
                    arm = _ARMED.pop(tid, None)
                    fired = fired or (arm is not None and arm[3] > -math.inf)
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)  # clear one not yet raised
                break
            except _Timeout:
                pass
    if fired:
        raise _Timeout


def _box_end(text, start):
    """Index of the brace closing the box whose content begins at start; None if unclosed or too long."""
    i, depth = start, 1
    while i < len(text) and i - start <= MAX_BOX_CHARS:
        if text[i] != "\\":
            depth += (text[i] == "{") - (text[i] == "}")
            if depth == 0:
                return i
        i += 2 if text[i] == "\\" else 1  # past a backslash's char: \{ and \} do not count as grouping
    return None


def last_boxed(text):
    """Content of the last \\boxed{...} / \\fbox{...}; None if absent, too long, or if any box is
    left open (a later box closing inside an open one is malformed output, not an answer)."""
    starts = [m.end() for m in _BOX_START.finditer(text)] if isinstance(text, str) else []
    end = -1
    for start in starts:  # outermost boxes only: a closed box closes every box inside it
        if start > end:
            end = _box_end(text, start)
            if end is None:
                return None
    return text[starts[-1]:_box_end(text, starts[-1])] if starts else None


def _clean(s):
    """Light pre-clean math-verify does not do: drop word units with their power
    (`\\text{ cm}^2`), unwrap `\\text{80 degrees}`, drop $ delimiters."""
    s = _TEXT_CMD.sub(lambda m: " " + m.group(1) + " ", _UNIT.sub(" ", s).replace("\\$", " "))
    return s.replace("$", " ").replace("\\!", "").strip()


def _letter(s):
    """The choice letter if s is one (`B`, `(b)`, `\\text{B}`, `B.`), else None."""
    m = _LETTER.fullmatch(s.replace(" ", ""))
    return m.group(1).upper() if m else None


def _bits(e):
    """Upper bound on log2 of the largest exact number building/evaluating e can create."""
    if e.is_Rational:
        return max(int(e.p).bit_length(), int(e.q).bit_length())
    if e.is_Float or not e.args:
        return 64
    sizes = [_bits(a) for a in e.args]
    if e.is_Pow:
        base, exp = sizes
        if e.exp.is_Rational:  # exact power: b^p has bits(b) * |p| bits
            return base * max(1, abs(int(e.exp.p)))
        if e.exp.free_symbols:  # symbolic exponent: never evaluated to a number
            return max(sizes)
        return base * 2.0 ** exp if exp < 64 else math.inf  # 10^{10^{10}}: tower
    if isinstance(e, (sympy.factorial, sympy.factorial2, sympy.gamma, sympy.binomial, sympy.subfactorial)):
        return max(sizes) * 2.0 ** max(sizes) if max(sizes) < 32 else math.inf
    return sum(sizes) if e.is_Mul else max(sizes) + 1


def _parse(s):
    """math-verify parse of one answer string, [] when the string is unsafe to hand to sympy."""
    depth = itertools.accumulate((c in "{([") - (c in "})]") for c in s)
    if len(s) > MAX_BOX_CHARS or max(depth, default=0) > MAX_DEPTH:
        return []
    parsed = parse("$" + s + "$", _PARSE_CFG, parsing_timeout=None)
    for p in parsed:  # a matrix is not a sympy Basic: check its entries
        if any(_bits(e) > MAX_BITS for e in (p if isinstance(p, sympy.MatrixBase) else [p]) if isinstance(e, sympy.Basic)):
            return []
    return parsed


def _number(parsed):
    """The real float value of the parsed expression (`x = 13` -> 13), else None."""
    e = parsed[0].rhs if isinstance(parsed[0], sympy.Eq) else parsed[0]  # the sympy object (then its source); `x = 13`: 13
    if not isinstance(e, sympy.Expr) or e.free_symbols:
        return None
    z = complex(sympy.N(e, 20))
    return z.real if z.imag == 0 and math.isfinite(z.real) else None


def _judge(response, label, tol):
    pred, gold = _clean(last_boxed(response) or ""), _clean(str(label)) if label is not None else ""
    if not pred or not gold:
        return False
    if _letter(pred) or _letter(gold):  # a choice letter only ever matches the same letter
        return _letter(pred) == _letter(gold)
    gold_p, pred_p = _parse(gold), _parse(pred)
    if gold_p and pred_p and verify(gold_p, pred_p, timeout_seconds=None):
        return True
    a, b = (_number(pred_p), _number(gold_p)) if gold_p and pred_p and tol is not None else (None, None)
    return a is not None and b is not None and (a == 0 if b == 0 else abs(a - b) <= tol * abs(b))


def math_reward(response, record):
    """The last \\boxed{} of response equals the row's answer mathematically."""
    return _judge(response, record.get("answer"), None)


def geo3k_reward(response, record, tol=0.05):
    """math_reward, or both sides are real numbers within relative tol (answer 0: exact)."""
    return _judge(response, record.get("answer"), tol)


def _bounded(fn, *a, faults=None, name=None, timeout=None):
    """fn(*a) as a float (None stays None) within `timeout` s of CPU and wall time (None: CPU_LIMIT_S, WALL_LIMIT_S);
    0.0 past it or on an exception, kept in `faults` (a sample's metadata) ["timeouts" | "errors"][name], said once."""
    try:
        with _deadline(CPU_LIMIT_S if timeout is None else timeout, WALL_LIMIT_S if timeout is None else timeout):
            v = fn(*a)
            return None if v is None else float(v)
    except _Timeout:
        if faults is not None:
            bound = f"{CPU_LIMIT_S} s of CPU, {WALL_LIMIT_S} s of wall time" if timeout is None else f"{timeout} s"
            faults.setdefault("timeouts", {})[name] = _once(name, "timeouts", f"{name} ran past its time bound ({bound}: "
                                                            f"--rm-timeout) on the row {str(a[1])[:500]}\n")
    except Exception:
        if faults is not None:
            faults.setdefault("errors", {})[name] = raised(name, a[1])  # a[1]: the data row, of a judge as of a term
    return 0.0


def raised(name, record):
    """In an except block: entry `name`'s exception on the data row `record` as a message, printed once per entry here."""
    return _once(name, "errors", f"{name} raised on the row {str(record)[:500]}:\n{traceback.format_exc()}")


def _once(name, kind, message):
    """message, printed by the first caller of each (entry, kind) in this process (dict.setdefault is atomic)."""
    if _TOLD.setdefault((name, kind), message) is message:
        print(f"[error] {message}(counted as {name}_{kind}; later ones are not printed)", file=sys.stderr, flush=True)
    return message


def fault(metadata, name):
    """What entry `name` raised or ran past its time bound on a sample (its metadata), else None."""
    return metadata.get("errors", {}).get(name) or metadata.get("timeouts", {}).get(name)


def fault_counts(samples):
    """{<name>_errors, <name>_timeouts: the samples in which an entry raised, ran past its bound}: rollouts' and evals'."""
    out = collections.Counter()
    for s in samples:
        steps = s.metadata.get("steps", ())
        errors = {*s.metadata.get("errors", ()), *(i["tool"] for i in steps if i.get("raised"))}  # a tool's own raise
        timeouts = set(s.metadata.get("timeouts", ()))
        for i in steps:  # the oracle's judge's faults (calc_score's step info)
            errors.update(i.get("errors", ()))
            timeouts.update(i.get("timeouts", ()))
        out.update(f"{k}_errors" for k in errors)
        out.update(f"{k}_timeouts" for k in timeouts)
    return dict(out)


def score(rm_type, response, record, faults=None, timeout=None):
    """The correctness of `response` to the data row `record` under --rm-type (a REWARDS name, or --custom-rm-path's
    module.function): 1.0 or 0.0, within the time bound (`timeout`: --rm-timeout)."""
    if rm_type not in REWARDS and "." not in str(rm_type):
        raise ValueError(f"unknown --rm-type {rm_type!r}; choose one of {sorted(REWARDS)}")
    judge = REWARDS[rm_type] if rm_type in REWARDS else task.judge(rm_type)
    return 1.0 if _bounded(judge, response, record, faults=faults, name=rm_type, timeout=timeout) else 0.0


def overlong_penalty(sample, record, cfg):
    """DAPO's soft overlong punishment (arXiv 2503.14476, Eq. 13) times F = --overlong-penalty-factor (0: off), as verl's
    (workers/reward_manager/dapo.py:116-122): 0 up to L_max - L tokens (L_max --rollout-max-response-len, L
    --overlong-buffer-len), then -F (|y| - (L_max - L)) / L, -F from L_max on; |y| as the cap counts it (observations too)."""
    if not cfg.overlong_penalty_factor:
        return None
    excess = len(sample.response_ids) - (cfg.rollout_max_response_len - cfg.overlong_buffer_len)
    return -cfg.overlong_penalty_factor * min(1.0, max(0, excess) / max(1, cfg.overlong_buffer_len))


def box_iou(sample, record, cfg):
    """--box-iou-coef C (0: off) times the best IoU of the episode's crops of image 0 with the row's `box` (the env's
    step info `iou`): a grounding term for the crop task, kept apart from correctness (bench/RESULTS.md, issue 76)."""
    if not cfg.box_iou_coef:
        return None
    return cfg.box_iou_coef * max((st["iou"] for st in sample.metadata.get("steps", ()) if "iou" in st), default=0.0)


def rewarded(sample, record, cfg):
    """An ended sample of the data row `record` under the rollout's settings `cfg`: sample.correct (--rm-type's judge)
    -> its reward, correct (1.0 / 0.0) plus each SHAPING term that is on (none in evaluation), kept in its metadata."""
    sample.correct = score(cfg.rm_type, sample.response_text, record, sample.metadata, cfg.rm_timeout) > 0
    terms = {k: _bounded(t.term, sample, record, cfg, faults=sample.metadata, name=k, timeout=cfg.rm_timeout)
             for k, t in SHAPING.items()} if cfg.shaping else {}
    sample.metadata["shaping"] = {k: v for k, v in terms.items() if v is not None}
    return float(sample.correct) + sum(sample.metadata["shaping"].values())


def _reject_constant(name):  # json's parse_constant: NaN / Infinity are not JSON
    raise ValueError(f"{name} is not valid JSON")


def strict_json(text):
    """json.loads without NaN / Infinity, nested at most MAX_JSON_DEPTH deep: counted here, as json's own
    guard is the interpreter's recursion limit, which torch inductor raises (issue 49, item 10)."""
    depth = itertools.accumulate((c in "[{") - (c in "]}") for c in _JSON_STRING.sub('""', text))
    if max(depth, default=0) > MAX_JSON_DEPTH:
        raise ValueError("nested too deeply")
    return json.loads(text, parse_constant=_reject_constant)


def format_ok(response):
    """A metric: a non-empty box or a tool call, and every <tool_call> strict JSON {"name": str, "arguments": {...}}."""
    try:
        calls = [strict_json(body) for body in _TOOL_CALL.findall(response)]
        closed = response.count("<tool_call>") == len(calls) == response.count("</tool_call>")  # no stray tag
        return closed and all(isinstance(c, dict) and isinstance(c.get("name"), str) and isinstance(
            c.get("arguments"), dict) for c in calls) and (bool(calls) or bool((last_boxed(response) or "").strip()))
    except Exception:
        return False


REWARDS = {"math": math_reward, "geo3k": geo3k_reward}  # --rm-type's choices
Shaping = collections.namedtuple("Shaping", ["term", "flags"])  # (sample, record, cfg) -> float, None: off; its flags
SHAPING = {"overlong_penalty": Shaping(overlong_penalty, {  # metrics: overlong_penalty_mean, overlong_penalty_frac
    "--overlong-buffer-len": dict(type=flags.COUNT, default=0, help="DAPO's: the last L tokens of a response, penalised"),
    "--overlong-penalty-factor": dict(type=flags.at_least(0.0), default=0.0, help="DAPO's: the most penalty (0: off)")}),
    "box_iou": Shaping(box_iou, {"--box-iou-coef": dict(  # metrics: box_iou_mean, box_iou_frac
        type=flags.at_least(0.0), default=0.0, help="the crop task: this times the best IoU of a crop with the row's box (0: off)")})}
WARM_UP = [("x = 13", "13"), ("8.66", "5\\sqrt{3}"), ("(1,2]", "\\{1,2\\}"), ("x<3", "3>x"),  # init's: reach sympy's lazy parts
           ("\\sqrt{-9}", "\\frac{5\\pi}{3}")]

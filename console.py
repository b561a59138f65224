"""console.py: what both trainers show, and how their training loop ends (style practice 23): the progress
bar, one line a fact that never splices into it (say), the end-of-run summary, a stop for preemption
(--exit-signal-handler, --exit-duration-in-mins: Megatron's flags) and Ctrl-C (entry), each with the
command that resumes. Mechanism: docs/training.md, "The loop's ends"."""
import json
import os
import shlex
import signal
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm


def tensorboard(folder):
    """--use-tensorboard (slime's flag): log(metrics, step) writes a step's numbers as scalars to `folder`."""
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (requirements.txt)
    writer = SummaryWriter(str(folder))

    def log(metrics, step):
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                writer.add_scalar(key, value, step)
        writer.flush()
    return log


def steps(run, start, total):
    """The training loop's steps start .. total - 1 under a progress bar (rank 0): the caller runs each, logs it
    (run.log) and calls run.maybe_save, which checkpoints the step before a stop (stop_reason); then the loop
    ends and each rank returns to exit 0. Ends with one line: the summary, or where it stopped and how to resume."""
    if start >= total:
        return
    t, bar = time.time(), tqdm(total=total, initial=start, desc=run.kind, disable=run.rank != 0)
    if run.args.exit_signal_handler:  # for the rest of the job: the step goes on, maybe_save sees the mark
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(run, "signalled", True))
    for step in range(start, total):
        yield step
        shown = [k for k in ("reward", "loss") if k in run.last][:1]  # GRPO's, or SFT's; then the last evaluation
        bar.set_postfix({k: f"{run.last[k]:.3f}" for k in shown}, refresh=False)
        bar.update()
        if run.stopping:
            break
    bar.close()
    if run.rank == 0:  # each eval's first value (metrics.jsonl: resumed runs' earlier steps too) -> its last
        latest = run.save / (run.save / "latest").read_text().strip()
        first = {k: v for x in reversed((run.save / "metrics.jsonl").read_text().splitlines()) for k, v in json.loads(x).items()}
        shown = [f"{k} {run.last[k]:.3f}" for k in shown] + [f"{k} {first[k]:.3f} -> {v:.3f}" for k, v in run.last.items()
                                                             if k.startswith("eval_") and isinstance(v, float)]
        done = f"done: steps {start} -> {total} in {(time.time() - t) / 60:.1f} min; last {', '.join(shown)}; checkpoint"
        say(f"[run] {run.stopping}: stopped after step {step + 1} of {total}, saved {latest}; resume: "
            f"{resume_command(sys.argv, run.args)}" if run.stopping else f"[run] {done} {latest}")


def stop_reason(run):
    """Why the run stops after this step, the same on every rank (a MAX all-reduce of each rank's marks, when
    either flag is on): "SIGTERM" (--exit-signal-handler), "--exit-duration-in-mins N" (its time is up), else None."""
    a = run.args
    if not (a.exit_signal_handler or a.exit_duration_in_mins):
        return None
    late = bool(a.exit_duration_in_mins) and time.time() - run.t0 > 60 * a.exit_duration_in_mins
    marks = torch.tensor([run.signalled, late], dtype=torch.float32, device=run.par.device)
    dist.all_reduce(marks, dist.ReduceOp.MAX)
    if marks[0]:
        return "SIGTERM"
    return f"--exit-duration-in-mins {a.exit_duration_in_mins}" if marks[1] else None


STALL = 3  # GRPO steps in a row with nothing to learn before the console says why


def no_signal(m, args, step, quiet):
    """GRPO: -> how many steps in a row, this one included, had nothing to learn from (rank 0's metrics `m`:
    every advantage 0, or no gradient), given `quiet` before it; at STALL, one line says why."""
    if m.get("zero_adv_frac", 0) < 1 and m.get("grad_norm", 1) != 0:
        return 0
    if quiet + 1 == STALL:
        why = (f"in every group the rewards were equal (mean reward {m.get('reward', 0):.3f}): zero advantage"
               if m.get("zero_adv_frac") == 1 else "the gradient was zero (grad_norm 0)")
        if m.get("truncated_frac") == 1:  # why they were equal, when every response was cut short: by which cap
            cap, ctx = f"--rollout-max-response-len {args.rollout_max_response_len}", m.get("context_cap_frac", 0)
            if ctx:  # samples whose prompt + the response cap is over --max-context-len
                cap = f"--max-context-len {args.max_context_len}" + (f" ({ctx:.0%} of them; the rest at {cap})" if ctx < 1 else "")
            why = f"every response was cut at {cap}: raise it"
        say(f"[grpo] steps {step + 2 - STALL}-{step + 1} learnt nothing: {why}")
    return quiet + 1


def room(lengths, args):
    """GRPO at load: the prompts (of `lengths` tokens) --max-context-len leaves a response less room (rollout._episode)."""
    short = [n for n in lengths if args.max_context_len - args.rollout_max_response_len < n < args.max_context_len]
    if short:
        say(f"[grpo] {len(short)} of {len(lengths)} prompts (up to {max(short)} tokens) + --rollout-max-response-len "
            f"{args.rollout_max_response_len} are over --max-context-len {args.max_context_len}, which cuts them first")


def say(line):
    """A line on the console (stdout) that does not splice into a progress bar."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def resume_command(argv, args):
    """The command that resumes the run of `argv` (sys.argv; `args`, its flags): the same without --overwrite,
    with --load its --save unless it has one (torchrun's own flags: as this node had them, check them)."""
    world = os.environ.get("LOCAL_WORLD_SIZE", "1")
    launcher = [sys.executable] if world == "1" else ["torchrun", f"--nproc-per-node={world}"]
    return shlex.join([*launcher, *[a for a in argv if a != "--overwrite"], *([] if args.load else ["--load", args.save])])


def entry(main, parse_args):
    """The trainers' __main__: exit with main()'s code; a Ctrl-C ends the job with the command that resumes it,
    not a traceback (exit 130)."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0":
            args = parse_args(sys.argv[1:])
            latest = os.path.join(args.save, "latest")  # the last checkpoint, if any: the step in flight is lost
            how = f"resume from {open(latest).read().strip()}" if os.path.exists(latest) else "no checkpoint yet, start over"
            print(f"\n[run] interrupted; {how}: {resume_command(sys.argv, args)}", file=sys.stderr)
        sys.exit(130)

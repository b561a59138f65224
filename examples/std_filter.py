"""A user's own dynamic-sampling filter in a file of its own (docs/extending.md, "Your own task"): keep a group whose
rewards (shaping terms included) spread at least --min-group-std; DAPO's default reads correctness only.

    python train_grpo.py ... --dynamic-sampling-filter-path examples.std_filter.min_group_std --min-group-std 0.2
"""
import statistics


def min_group_std(samples, args):
    """(the samples of one complete group, the rollout's settings) -> keep it?"""
    return statistics.pstdev(s.reward for s in samples) >= args.min_group_std


min_group_std.flags = {"--min-group-std": dict(type=float, default=0.1, help="std of a group's rewards to keep it")}

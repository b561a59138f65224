"""A user's own judge in a file of its own (docs/extending.md, "Your own task"): the last \\boxed{} equals the row's
answer as text, spaces aside; no maths, so "0.5" is not "1/2".

    python train_grpo.py ... --custom-rm-path examples.exact_judge.exact
"""
import reward


def exact(response, record):
    """(response, record) -> bool: the REWARDS contract; record["answer"] is the row's label."""
    boxed = reward.last_boxed(response)
    return boxed is not None and boxed.replace(" ", "") == str(record["answer"]).replace(" ", "")

"""train_grpo.py: the loss plumbing by hand (loss.py's functions: test_loss.py), one update equal at TP=1/TP=2/DP=2,
and a short CPU run: metrics, train-vs-rollout logprobs, checkpoints, SIGKILL + --load."""
import json
import math
import sys
import time
from pathlib import Path

import pytest
import torch

import launch
import loss as L
import task
import train_grpo as G
import trainer as T
from fakes import FakeModel
import fakes

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def worker(ckpt, source, save, nproc=1, tp=1, ref=None, *extra):
    """-> [stats of update 0, stats of update 1] from tests/_grpo_worker.py (weights in save/final)."""
    r = launch.python(ROOT / "tests" / "_grpo_worker.py", ckpt, source, "--save", save, "--tp", tp, *extra,
                      *(["--ref", ref] if ref else []), nproc=nproc, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((Path(save) / "updates.json").read_text())


def saved(run):
    from safetensors.torch import load_file
    return load_file(Path(run) / "final" / "model.safetensors")


@pytest.mark.cores
def test_two_updates_equal_at_tp2_dp2_and_cp2(tiny_ckpt, geo3k_real, tmp_path):
    """Two updates (the second from AdamW's sharded state, decoupled lr on the split embedding and
    output layer), with the KL term's reference model: the same losses, grad norms and final weights at
    TP=1, TP=2, DP=2 and CP=2. (Each term's gradient alone, at every layout: tests/test_layouts.py.)"""
    ckpt, src = tiny_ckpt("qwen3_vl"), geo3k_real / "test.parquet"
    ref = tiny_ckpt("qwen3_vl", seed=1)  # another policy, so the KL is not 0
    one = worker(ckpt, src, tmp_path / "one", ref=ref)
    assert len(one) == 2 and one[0]["loss"] != one[1]["loss"], one
    for u in one:
        assert 0 < u["clipfrac"] < 1 and u["grad_norm"] > 0 and u["kl"] > 0, one
    w_one, w_start = saved(tmp_path / "one"), saved_start(ckpt)
    moved = max((w_one[k] - w_start[k]).abs().max().item() for k in w_one)
    assert moved > 1e-3, moved  # the updates changed the weights (lr 1e-3, embedding/head 1e-2)
    layouts = [("tp2", 2, []), ("dp2", 1, []), ("cp2", 1, ["--flags=--context-parallel-size 2"])]
    for name, tp, extra in layouts:
        got = worker(ckpt, src, tmp_path / name, 2, tp, ref, *extra)
        for u, (g, o) in enumerate(zip(got, one)):
            for k in ("loss", "grad_norm", "clipfrac", "kl"):
                assert abs(g[k] - o[k]) <= 1e-5 * max(1.0, abs(o[k])), (name, u, k, got, one)
        assert_same_weights(saved(tmp_path / name), w_one, name)


@pytest.mark.cores
def test_two_updates_equal_at_pp2(tiny_ckpt, geo3k_real, tmp_path):
    """PP2 (Qwen3-VL's tied head: the last stage's copy of the embedding; 2 + 2 layers), the KL's
    reference model a pipeline too and the old logprobs recomputed through it: the same two updates
    as one process, the saved weights gathered from both stages."""
    ckpt, src = tiny_ckpt("qwen3_vl", layers=4, tie=True), geo3k_real / "test.parquet"
    ref = tiny_ckpt("qwen3_vl", layers=4, tie=True, seed=1)
    one = worker(ckpt, src, tmp_path / "one", ref=ref)
    assert all(0 < u["clipfrac"] < 1 and u["kl"] > 0 for u in one), one
    got = worker(ckpt, src, tmp_path / "pp2", 2, 1, ref, "--flags=--pipeline-model-parallel-size 2")
    for u, (g, o) in enumerate(zip(got, one)):
        for k in ("loss", "grad_norm", "clipfrac", "kl"):
            assert abs(g[k] - o[k]) <= 1e-5 * max(1.0, abs(o[k])), ("pp2", u, k, got, one)
    assert_same_weights(saved(tmp_path / "pp2"), saved(tmp_path / "one"), "pp2")

def assert_same_weights(w, ref, name):
    """Each update moves a weight by ~lr (2e-3; 2e-2 for the embedding and head): a wrong shard or
    lr group differs in many elements by that much. Adam's first steps amplify the reduction-order
    noise of a near-zero gradient (g / (|g| + eps)), so a few single elements may differ by ~1e-5
    (11 of ~20M at TP=2, scattered over 8 tensors, after the LM head's chunk sizes changed)."""
    assert w.keys() == ref.keys()
    diffs = {k: (w[k] - ref[k]).abs() for k in w}
    worst = max(d.max().item() for d in diffs.values())
    off = sum(int((d > 1e-6).sum()) for d in diffs.values())
    where = {k: int((d > 1e-6).sum()) for k, d in diffs.items() if (d > 1e-6).any()}
    assert worst <= 1e-4 and off <= 32, (name, worst, off, where)


def saved_start(ckpt):
    from safetensors.torch import load_file
    return load_file(Path(ckpt) / "model.safetensors")


@pytest.mark.cores
def test_dp_rank_without_samples_takes_the_same_step(tiny_ckpt, geo3k_real, tmp_path):
    """One sample at DP=2: rank 1 has nothing to train on, yet joins the all-reduce with zero
    gradients (it used to call torch.cat([])) and ends with the same weights as one process."""
    ckpt, src = tiny_ckpt("qwen3_vl"), geo3k_real / "test.parquet"
    one = worker(ckpt, src, tmp_path / "one", 1, 1, None, "--items", "1")
    dp2 = worker(ckpt, src, tmp_path / "dp2", 2, 1, None, "--items", "1")
    for g, o in zip(dp2, one):
        assert abs(g["loss"] - o["loss"]) <= 1e-6 and abs(g["grad_norm"] - o["grad_norm"]) <= 1e-5 * o["grad_norm"]
    assert_same_weights(saved(tmp_path / "dp2"), saved(tmp_path / "one"), "dp2")


def grpo(*args, wait=True):
    job = launch.start(ROOT / "train_grpo.py", *args)
    if not wait:
        return job
    r = job.wait(900)
    assert r.returncode == 0, r.stderr[-3000:]


def killed_after_checkpoint(common, save, name):
    """Run train_grpo.py with `common` flags into `save` and SIGKILL it once checkpoint `name` is there."""
    proc = grpo(*common, "--save", save, wait=False)
    deadline = time.time() + 600
    while not (save / name).exists():
        assert proc.poll() is None and time.time() < deadline, proc.wait(5).stderr[-2000:]
        time.sleep(0.2)
    proc.kill()
    proc.wait()


def metrics(run):
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def test_short_run_logs_syncs_and_resumes_after_sigkill(tiny_ckpt, tmp_path):
    """Four steps, checkpoint every step, the newest two kept; a run SIGKILLed right after step
    2's checkpoint resumes with --load and logs the same steps with the same losses and grad
    norms as the uninterrupted run: none lost or repeated, weights, optimizer and RNG restored.
    (The random model's reward is 0; the entropy bonus gives every step a real gradient.)"""
    from tools import synth
    synth.write_synth(tmp_path / "d", 64, n_test=8, seed=0, kinds=("sides",))
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", tmp_path / "d", "--rollout-engine",
              "local", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len",
              "12", "--num-rollout", "4", "--lr", "1e-3", "--entropy-coef", "0.01", "--save-interval", "1",
              "--save-keep", "2", "--max-tokens-per-gpu", "512"]
    grpo(*common, "--save", tmp_path / "full", "--eval-prompt-data", tmp_path / "d", "--eval-samples", "4")
    full = metrics(tmp_path / "full")
    steps = [m for m in full if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    want = {"reward", "accuracy", "response_len", "truncated_frac", "failed_frac", "turns", "tool_calls",
            "clipfrac", "kl", "entropy", "grad_norm", "logprob_diff_mean", "logprob_diff_max", "rollout_s",
            "train_s", "sync_s", "tokens_per_s"}
    assert want <= set(steps[0]), want - set(steps[0])
    assert all(m["grad_norm"] > 0 and m["updates_skipped"] == 0 for m in steps), steps
    for m in steps:  # the trainer computes what the engine sampled with: fp32 CPU agreement
        assert m["logprob_diff_mean"] <= 1e-5 and m["logprob_diff_max"] <= 1e-4, m
    assert [m["step"] for m in full if "eval_accuracy" in m] == [0, 4]
    assert sorted(p.name for p in (tmp_path / "full").glob("iter_*")) == ["iter_0000003", "iter_0000004"]
    assert sorted(p.name for p in (tmp_path / "full" / "iter_0000004" / "train_state").iterdir()) == [
        "meta.json", "tp_00.pt"]  # the optimizer state once per TP rank
    from transformers import AutoModelForImageTextToText
    AutoModelForImageTextToText.from_pretrained(tmp_path / "full" / "iter_0000004")  # loads as it is

    # SIGKILLed after step 2's checkpoint and resumed, both with --offload-train (on CPU it parks in host memory
    # all the same: the trainer leaves before every rollout and evaluation and comes back bit for bit): the
    # same steps, bit for bit before the kill and after the resume, the same weights at the end
    crash, parked = tmp_path / "crash", ["--offload-train", "--eval-prompt-data", tmp_path / "d", "--eval-samples", "4"]
    killed_after_checkpoint([*common, *parked], crash, "iter_0000002")
    # where the kill landed: after step 2's checkpoint, before step 3 finished
    assert (crash / "latest").read_text() == "iter_0000002" and not (crash / "iter_0000003").exists()
    assert [m["step"] for m in metrics(crash) if "reward" in m] == [1, 2]
    grpo(*common, *parked, "--save", crash, "--load", crash)
    resumed = [m for m in metrics(crash) if "reward" in m]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4] and all(m["offload_host_gib"] > 0 for m in resumed)

    def same(m):  # all but the clocks
        return {k: v for k, v in m.items() if not (k.endswith("_s") or "_s_" in k or k in ("offload_host_gib",
                                                                                         "rollout_engine_idle_frac"))}
    for a, b in zip(resumed[:2], steps[:2]):
        assert same(a) == same(b), (a, b)
    for a, b in zip(resumed[2:], steps[2:]):  # steps 3 and 4 ran in the resumed process
        assert a["reward"] == b["reward"] and a["response_len"] == b["response_len"], (a, b)
        for k in ("loss", "grad_norm", "entropy", "clipfrac"):
            assert abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(b[k])), (k, {x: (a[x], b[x]) for x in a if a[x] != b[x]})
    w_crash, w_full = (saved_start(run / "iter_0000004") for run in (crash, tmp_path / "full"))
    assert w_crash.keys() == w_full.keys()
    assert all(torch.allclose(w_crash[k], w_full[k], rtol=0, atol=1e-6) for k in w_full)


def test_prompts_over_the_context_limit_never_reach_a_step(tiny_ckpt, tmp_path):
    """--max-context-len below every prompt's length: such rows are skipped and counted at load,
    naming the limit, so none becomes a sample with no response token (they used to be trained
    as "truncated" samples, and divided by zero in policy_loss before that); with none left the
    run stops before its first step. A step with no trainable sample is still skipped: see the
    HTTP 500 test."""
    from tools import synth
    synth.write_synth(tmp_path / "d", 8, n_test=2, seed=0)
    r = launch.python(ROOT / "train_grpo.py", "--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", tmp_path / "d",
                      "--save", tmp_path / "run", "--rollout-engine", "local", "--rollout-batch-size", "2",
                      "--n-samples-per-prompt", "2", "--num-rollout", "2", "--max-context-len", "20")
    assert r.returncode != 0 and "skipped 8 of 8 rows over the length limit" in r.stderr, r.stderr[-3000:]
    assert "--prompt-data" in r.stderr and "over --max-context-len 20" in r.stderr, r.stderr[-3000:]
    assert not list((tmp_path / "run").glob("iter_*")) and not (tmp_path / "run" / "metrics.jsonl").exists()


def loss_items(old, adv, rollout_old=None):
    items = []
    for i, (o, a) in enumerate(zip(old, adv)):
        it = T.Item(ids=torch.arange(len(o) + 2), mask=torch.tensor([False, False] + [True] * len(o)), adv=a,
                    rollout_logprobs=torch.tensor(o))
        if rollout_old is not None:  # o: what --recompute-logprobs computed; the engine's are rollout_old
            it.rollout_logprobs, it.recomputed_logprobs = torch.tensor(rollout_old[i]), torch.tensor(o)
        items.append(it)
    return items


@pytest.mark.parametrize("agg,tis,est,budget,want,clipfrac", [
    # sample A: old [-1.0, -0.5], new [-0.6, -0.7], adv +1; sample B: old [-2.0], new [-2.0], adv -1
    # ratios e^0.4 = 1.4918 (clipped to 1.28: A's first token), e^-0.2 = 0.8187, e^0 = 1
    ("token", 0, "ppo_clip", 1, (-1.28 - math.exp(-0.2) + 1.0) / 3, 1 / 3),     # mean over the 3 tokens
    ("sequence", 0, "ppo_clip", 1, ((-1.28 - math.exp(-0.2)) / 2 + 1.0) / 2, 0.25),  # mean per sample, then over 2
    # TIS, rollout logprobs A [-1.5, -0.5], B [-1.0]: weights exp(old - rollout) = e^0.5 -> cap 1.2, 1, e^-1
    ("token", 1.2, "ppo_clip", 1, (-1.28 * 1.2 - math.exp(-0.2) * 1.0 + 1.0 * math.exp(-1.0)) / 3, 1 / 3),
    # both samples in one micro-batch, split by lens: GSPO's ratio of A is e^((0.4 - 0.2) / 2), B's e^0
    ("token", 0, "gspo", 64, (-2 * math.exp(0.1) + 1.0) / 3, 0.0),
    # CISPO: -sg(clip(ratio)) A logp: A's tokens 1.28 * 0.6 and e^-0.2 * 0.7, B's -(1 * -1 * -2.0)
    ("sequence", 0, "cispo", 64, ((1.28 * 0.6 + math.exp(-0.2) * 0.7) / 2 - 2.0) / 2, 0.25),
])
def test_policy_loss_aggregation_tis_and_estimators_by_hand(agg, tis, est, budget, want, clipfrac):
    import types
    import parallel
    parallel.init_distributed(1)
    args = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--loss-agg", agg,
                         "--tis-cap", str(tis), "--max-tokens-per-gpu", str(budget), "--policy-loss", est])
    par = types.SimpleNamespace(dp=1, cp=1, ep=1, pp=1, dp_group=None, device=torch.device("cpu"))
    items = loss_items([[-1.0, -0.5], [-2.0]], [1.0, -1.0], [[-1.5, -0.5], [-1.0]] if tis else None)
    model = FakeModel([-0.6, -0.7, -2.0], par)
    seen = []

    def forward(seqs, loss_masks, **kw):  # micro-batches come in pack order: find each one's first sample
        k = [i for i, it in enumerate(items) if torch.equal(it.mask, loss_masks[0])][0]
        seen.append(k)
        model.offset = [0, 2][k]
        return FakeModel.forward(model, seqs, loss_masks, **kw)
    model.forward = forward
    stats = G.policy_loss(model, None, par, items, args, measure=True)
    assert sorted(seen) == ([0, 1] if budget == 1 else [0])  # one sample a micro-batch, or both in one
    assert stats["loss"] == pytest.approx(want, abs=1e-6)
    assert stats["clipfrac"] == pytest.approx(clipfrac, abs=1e-6)


def test_dynamic_sampling_tops_up_through_the_trainer(processor, records, monkeypatch):
    """A step's rollout with --dynamic-sampling: groups whose rewards are all equal are dropped and
    replaced by prompts of the over-sample that draw() adds, until --rollout-batch-size groups
    with mixed rewards are kept or --dynamic-sampling-max-prompts prompts were drawn."""
    import types
    import data
    import chat
    recs = [dict(r, problem=f"{r['problem']} ({i})", answer=str(i)) for i, r in enumerate(records * 3)]  # 12 prompts
    answer_of = {}
    for r in recs:
        answer_of[tuple(chat.encode_prompt(processor, data.prompt_messages(r), r["images"]))] = r["answer"]

    class Engine:  # right on the first sample of prompts whose answer is a multiple of 3, else wrong
        def generate(self, batch, sampling):
            outs, seen = [], set()
            for item in batch:
                key = tuple(item["input_ids"])
                answer = answer_of.get(key)
                good = answer is not None and int(answer) % 3 == 0 and key not in seen
                seen.add(key)
                ids = processor.tokenizer.encode(f"\\boxed{{{answer if good else 'no'}}}<|im_end|>",
                                                 add_special_tokens=False)
                outs.append({"ids": ids, "logprobs": [-0.5] * len(ids), "finish": "stop", "prompt_tokens": len(key)})
            return outs
    base = ["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--rollout-batch-size", "3",
            "--n-samples-per-prompt", "2", "--dynamic-sampling"]
    par = types.SimpleNamespace(rank=0, world=1, dp=1)
    for cap in (None, "4"):
        args = G.parse_args(base + (["--dynamic-sampling-max-prompts", cap] if cap else []))
        drawn = T.draw(recs, 0, args)
        assert len(drawn) == (12 if cap is None else 4) and len({r["index"] for r in drawn}) == len(drawn)
        assert drawn[:3] == T.draw(recs, 0, G.parse_args(base[:-1]))  # the batch's own prompts come first
        kept = min(3, sum(int(r["answer"]) % 3 == 0 for r in drawn))  # mixed groups there are to keep
        batch = G.Source(Engine(), processor, recs, args, 1, par).next(0)
        (items,), m = batch.items, batch.metrics
        assert len(items) == 2 * kept and m["samples"] == 2 * kept, (cap, kept, len(items))
        assert all(it.adv != 0 for it in items)  # only groups with mixed rewards
        if cap is None:  # the batch's own prompts hold fewer mixed groups: the over-sample filled it
            assert kept == 3 and sum(int(r["answer"]) % 3 == 0 for r in drawn[:3]) < 3
    assert kept < 3  # with the cap, the top-up stopped before the batch was full
    seen = {}  # an estimator's and a filter's own flags reach them through the step (Source.take, Rollout._keeps)

    def scaled(r, spy_scale):
        seen["estimator"] = spy_scale
        return spy_scale * (r - r.mean())

    def keep_every(samples, args):
        seen["filter"] = args.spy_keep
        return True
    monkeypatch.setitem(L.ESTIMATORS, "spy", L.Estimator(scaled, {"--spy-scale": dict(type=float)}))
    monkeypatch.setitem(task.FILTERS, "spy", task.Filter(keep_every, {"--spy-keep": dict(type=int)}))
    args = G.parse_args(base[:-1] + ["--advantage-estimator", "spy", "--spy-scale", "2", task.FILTER, "spy", "--spy-keep", "5"])
    mixed = [r for r in recs if int(r["answer"]) % 3 == 0]  # every group half right
    (items,) = G.Source(Engine(), processor, mixed, args, 1, par).next(0).items
    assert seen == {"estimator": 2.0, "filter": 5} and sorted(it.adv for it in items) == [-1.0] * 3 + [1.0] * 3


def test_step_where_every_sample_failed(processor, records, capsys):
    """An engine whose every answer is an error (stock SGLang's HTTP 500 on a bad request):
    every sample is failed, counted, never trained on; the step says so in one line and the
    update is skipped (Policy.train does nothing, in lockstep on every rank)."""
    import types

    class Failing:
        def generate(self, batch, sampling):
            return [{"ids": [], "logprobs": [], "finish": "abort", "error": "SGLang /generate -> HTTP 500: IndexError"}
                    for _ in batch]
    args = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--rollout-batch-size", "2",
                         "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8192"])
    par = types.SimpleNamespace(rank=0, world=1, dp=1)
    batch = G.Source(Failing(), processor, records, args, 1, par).next(0)
    assert batch.items == [None] and batch.metrics["failed_frac"] == 1.0 and batch.metrics["samples"] == 4
    assert batch.metrics["context_cap_frac"] == 1.0  # prompt + 8192 over --max-context-len 8192: console.no_signal's
    assert "step 1: no trainable sample among 4 (SGLang /generate -> HTTP 500: IndexError): update skipped" \
        in capsys.readouterr().out
    model = types.SimpleNamespace(par=par, train=lambda: None, expert_load=lambda: None)
    stats = G.Policy(model, None, None, None, args, 1).train(batch)  # no step taken
    assert stats["updates_skipped"] == 1 and "loss" not in stats and "grad_norm" not in stats


def test_each_rank_builds_todays_items_from_only_its_share(processor, records, ckpt):
    """What a DP rank receives (split_batch's share, pickled as the scatter sends it) builds exactly
    the items it trained on when rank 0 broadcast every item: ids, masks, logprobs, advantages, pixel
    values and grids, in order, for each update; it holds no other rank's sample and a group's images
    once (uint8 pixels, not the processor's float32 patches)."""
    import pickle
    import random
    import types
    from fakes import ANSWER, CROP_CALL, ScriptedEngine
    args = G.parse_args(["--hf-checkpoint", str(ckpt), "--prompt-data", "x", "--save", "x", "--max-turns", "3",
                         "--n-samples-per-prompt", "4", "--global-batch-size", "6", "--rollout-max-response-len", "400"])
    good = fakes.run_episodes(ScriptedEngine(processor, [CROP_CALL, ANSWER]), processor, records[:3], G.R.settings(args))
    assert all(len(s.images) == 2 and s.tool_calls == 1 for s in good)  # the prompt's image and a crop
    adv = [0.5 * i - 2 for i in range(len(good))]
    encoded = {}  # before: every item on rank 0, broadcast whole, then shuffled, chunked, strided
    before = [G.to_item(s, processor, a, encoded) for s, a in zip(good, adv)]
    random.Random(7).shuffle(before)
    updates, dp = 2, 2
    shares = G.split_batch(good, adv, random.Random(7), 6, updates, dp)
    whole = len(pickle.dumps(before))  # what broadcast_object_list sent every rank
    for r in range(dp):
        payload = pickle.dumps(shares[r])
        assert len(payload) < whole / dp, (len(payload), whole)
        mine, enc = pickle.loads(payload), {}
        for u in range(updates):
            got = [G.to_item(s, processor, a, enc) for s, a in mine[u]]
            want = T.dp_shard(before[u * 6:(u + 1) * 6], types.SimpleNamespace(dp_rank=r, dp=dp))
            assert len(got) == len(want) == 3
            for g, w in zip(got, want):
                assert g.adv == w.adv and g.recomputed_logprobs is w.recomputed_logprobs is None
                assert all(torch.equal(getattr(g, k), getattr(w, k))
                           for k in ("ids", "mask", "rollout_logprobs", "pixel_values", "image_grid_thw"))
        shared = {id(s.images[0]) for part in mine for s, _ in part}  # a prompt's image travels once,
        assert len(shared) <= 3 < sum(len(part) for part in mine)     # not once per sample
        print(f"rank {r}: {len(payload)} bytes; every item broadcast: {whole}")


def test_partial_rollout_resumes_with_its_buffer(tiny_ckpt, processor, records, tmp_path):
    """--partial-rollout keeps the groups a rollout stopped and the data position in the checkpoint (here a
    third group, complete: the local engine answers a round at once, and two are kept), written while the
    rollout is paused: a run resumed at step 2 trains step 3 on the samples of the uninterrupted run, none lost
    or sampled twice."""
    import types
    from fakes import ScriptedEngine
    from tools import synth
    flags = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--partial-rollout", "--over-sampling-batch-size", "3"]
    source = G.Source(ScriptedEngine(processor, ["\\boxed{4}"]), processor, records, G.parse_args(
        ["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", *flags]), 1, types.SimpleNamespace(rank=0, world=1, dp=1))
    source.next(0)
    cursor, groups = source.state()  # what step 1 starts from: the leftover of step 0, its data position
    assert cursor == 3 and len(groups) == 1
    synth.write_synth(tmp_path / "d", 32, n_test=0, seed=0, kinds=("sides",))
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", tmp_path / "d", "--rollout-engine", "local",
              "--rollout-max-response-len", "12", "--lr", "1e-3", "--entropy-coef", "0.01", "--save-interval", "2",
              "--max-tokens-per-gpu", "512", *flags]
    grpo(*common, "--save", tmp_path / "full", "--num-rollout", "3")
    grpo(*common, "--save", tmp_path / "part", "--num-rollout", "2")
    grpo(*common, "--save", tmp_path / "part", "--num-rollout", "3", "--load", tmp_path / "part")
    full, part = ([m for m in metrics(tmp_path / run) if "reward" in m] for run in ("full", "part"))
    assert [m["step"] for m in part] == [1, 2, 3] and all(m["rollout_buffer_groups"] == 1 for m in full)
    assert full[0]["offpolicy_token_frac"] == 0 and all(m["offpolicy_token_frac"] == 0.5 for m in full[1:])
    # the engine check apart from the policy's drift: the local engine's logprobs of the tokens the trained weights
    # wrote are the trainer's; those of the buffered group, one update older, are not (lr 1e-3)
    assert all(m["logprob_diff_mean_same_version"] <= 1e-5 < m["logprob_diff_mean"] for m in full[1:]), full
    assert full[0]["logprob_diff_mean_same_version"] == full[0]["logprob_diff_mean"] <= 1e-5, full[0]
    for a, b in zip(part[2:], full[2:]):
        for k in ("response_len", "offpolicy_token_frac", "oldest_token_version", "loss", "grad_norm", "entropy"):
            assert abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(b[k])), (k, {x: (a[x], b[x]) for x in a if a[x] != b[x]})


def test_fully_async_trains_every_group_once_across_a_checkpoint(processor, records):
    """--fully-async through the trainer's Source: the rollout goes on through next() (each step takes the first B
    complete groups) and settle() pauses it; what a checkpoint writes then (the data position, the groups parked)
    goes on in a fresh Source, as a resumed run's does. Whatever the timing, every group drawn is trained once,
    parked at the end or dropped as too stale: none lost, none twice."""
    import pickle
    import random
    import types
    from fakes import ScriptedEngine

    class Slow(ScriptedEngine):  # a request takes 0-40 ms: groups end out of order, some across an update
        concurrent = True

        def generate(self, batch, sampling):
            time.sleep(random.random() * 0.04)
            return super().generate(batch, sampling)
    recs = [dict(r, problem=f"{r['problem']} ({i})") for i, r in enumerate(records * 10)]  # 40 distinct prompts
    args = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--fully-async", "--rollout-batch-size",
                         "2", "--n-samples-per-prompt", "2", "--over-sampling-batch-size", "4", "--max-weight-staleness", "1"])
    par, trained, stale = types.SimpleNamespace(rank=0, world=1, dp=1), [], 0

    def steps(state, first, last):
        nonlocal stale
        source = G.Source(Slow(processor, ["\\boxed{4}"]), processor, recs, args, 1, par, state)
        take = source.rollout.take

        def logged(n):
            out = take(n)
            trained.extend(s.index for s in out[::2])  # a group's two samples
            return out
        source.rollout.take = logged
        for step in range(first, last):
            m = source.next(step).metrics
            stale += m.get("rollout_stale_dropped", 0)
            assert m["samples"] == 4 and m.get("staleness_max", 0) <= 1, (step, m)
            time.sleep(0.05)  # training: the rollout goes on
            assert source.settle()["rollout_ahead_overlap_s"] > 0
        return source.state()
    cursor, groups = steps(pickle.loads(pickle.dumps(steps(None, 0, 3))), 3, 6)
    assert len(trained) == 12 and len(set(trained)) == 12, trained  # B groups a step, each once
    left = [r["index"] for r, _, _ in groups.values()]
    assert len(trained) + len(left) + stale == cursor and not set(trained) & set(left), (trained, left, stale, cursor)


def test_async_rollout_overlaps_training_and_resumes_after_sigkill(tiny_ckpt, tmp_path, capsys):
    """--async-rollout: step k+1's rollout runs while step k trains (its samples come from the weights
    before step k's update: rollout_policy_version = step - 1), the engine gets the new weights only
    after it; a run SIGKILLed after step 2's checkpoint resumes from the batch the checkpoint kept and logs every
    step once, as the uninterrupted run. Refused with --colocate, as --fully-async is (and the two together)."""
    from tools import synth
    synth.write_synth(tmp_path / "d", 32, n_test=0, seed=0, kinds=("sides",))
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", tmp_path / "d", "--rollout-engine",
              "local", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len",
              "12", "--num-rollout", "4", "--lr", "1e-3", "--entropy-coef", "0.01", "--save-interval", "1",
              "--max-tokens-per-gpu", "512", "--async-rollout"]
    grpo(*common, "--save", tmp_path / "full")
    steps = [m for m in metrics(tmp_path / "full") if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert [m["rollout_policy_version"] for m in steps] == [0, 0, 1, 2]  # one step behind after the first
    assert all(m["rollout_ahead_overlap_s"] > 0 for m in steps[:3]) and "rollout_ahead_overlap_s" not in steps[3]
    assert all(m["grad_norm"] > 0 and m["failed_frac"] == 0 for m in steps), steps
    assert all(m["step_s"] >= m["rollout_s"] + m["train_s"] + m["sync_s"] for m in steps)  # a step's wall time
    crash = tmp_path / "crash"
    killed_after_checkpoint(common, crash, "iter_0000002")
    saved = int((crash / "latest").read_text().strip()[len("iter_"):])  # 2, or 3 if step 3 beat the kill
    grpo(*common, "--save", crash, "--load", crash)
    resumed = [m for m in metrics(crash) if "reward" in m]
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]  # none lost, none twice
    # the checkpoint held the batch made ahead: the resumed run trains what the uninterrupted one did
    assert [m["rollout_policy_version"] for m in resumed] == [0, 0, 1, 2], saved
    for bad, named in ((["--async-rollout", "--colocate"], "--async-rollout: "), (["--fully-async", "--colocate"], "--fully-async: "),
                       (["--fully-async", "--offload-train"], "--fully-async: "),
                       (["--fully-async", "--async-rollout"], "argument --async-rollout: not allowed with argument --fully-async"),
                       (["--max-weight-staleness", "2"], "need --partial-rollout or --fully-async")):
        with pytest.raises(SystemExit):
            G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", *bad])
        assert named in capsys.readouterr().err, bad


def test_fully_async_runs_the_local_engine_beside_training_and_resumes_after_sigkill(tiny_ckpt, tmp_path):
    """--fully-async with the local engine, whose episodes run on threads of their own beside training: each step
    takes the first B complete groups of three generating, the rest go on through its training, and no trained
    token is more than --max-weight-staleness 1 versions old. A run SIGKILLed after step 2's checkpoint resumes
    with what was in flight (its first step trains tokens written before the kill) and logs every step once."""
    from tools import synth
    synth.write_synth(tmp_path / "d", 32, n_test=0, seed=0, kinds=("sides",))
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", tmp_path / "d", "--rollout-engine",
              "local", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len",
              "12", "--num-rollout", "4", "--lr", "1e-3", "--entropy-coef", "0.01", "--save-interval", "1",
              "--max-tokens-per-gpu", "512", "--fully-async", "--over-sampling-batch-size", "3",
              "--max-weight-staleness", "1"]
    crash = tmp_path / "crash"
    killed_after_checkpoint(common, crash, "iter_0000002")
    saved = int((crash / "latest").read_text().strip()[len("iter_"):])  # 2, or 3 if step 3 beat the kill
    grpo(*common, "--save", crash, "--load", crash)
    steps = [m for m in metrics(crash) if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2, 3, 4] and all(m["samples"] == 8 for m in steps), steps  # each once
    assert all(m["rollout_ahead_overlap_s"] > 0 and m["staleness_max"] <= 1 for m in steps), steps
    assert any(m["offpolicy_token_frac"] > 0 for m in steps), steps  # written while an earlier step trained
    assert steps[saved]["oldest_token_version"] < saved, steps[saved]  # the parked groups, from the checkpoint

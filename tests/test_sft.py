"""sft.py end to end on CPU: it learns the ten real geo3k problems through their pixels,
TP=2 and DP=2 reproduce one process, and a SIGKILLed run resumes on the same data order."""
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import launch

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def sft(*args, nproc=1, check=True, wait=True):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    job = launch.start(ROOT / "sft.py", *args, nproc=nproc, env=env)
    if not wait:
        return job
    r = job.wait(900)
    if check and r.returncode:
        raise AssertionError(f"{' '.join(r.args)} failed:\n{r.stderr[-3000:]}")
    return r


def metrics(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def vision(ckpt):
    return {k: v for k, v in load_file(Path(ckpt) / "model.safetensors").items() if ".visual." in k}


@pytest.fixture(scope="module")
def trained(tiny_ckpt, geo3k_real, tmp_path_factory):
    """The tiny Qwen3-VL trained on the ten real problems (about four minutes on 2 cores): a fast
    embedding/output layer and a slow body, as a random model needs (README, "Known limits")."""
    out = tmp_path_factory.mktemp("sft_real")
    sft("--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", geo3k_real / "test.parquet",
        "--save", out, "--lr", "1e-4", "--decoupled-lr", "1e-2", "--global-batch-size", "10", "--num-epoch", "250",
        "--lr-warmup-iters", "5", "--lr-decay-style", "constant")
    return out


@pytest.mark.slow
def test_sft_learns_real_problems_and_generates_their_answers(trained, geo3k_real):
    import data
    from transformers import AutoModelForImageTextToText, AutoProcessor
    assert metrics(trained)[-1]["loss"] < 0.05
    ckpt = trained / (trained / "latest").read_text().strip()
    proc = AutoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    for rec in data.load_geo3k(geo3k_real / "test.parquet"):
        text = proc.apply_chat_template(data.prompt_messages(rec), add_generation_prompt=True, tokenize=False)
        enc = proc(text=[text], images=data.views(rec["images"]), return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
        reply = proc.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        assert reply == data.sft_target(rec["answer"]), (rec["problem"], reply)


@pytest.mark.slow
def test_pixels_reach_the_loss(trained, tiny_ckpt, geo3k_real, tmp_path):
    """Swapping images between problems raises the trained model's loss, most of all where two
    problems share their text ("Find x.") and only the picture tells the answers apart; the
    tower moved."""
    import data
    from transformers import AutoModelForImageTextToText, AutoProcessor
    ckpt = trained / (trained / "latest").read_text().strip()
    proc = AutoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    recs = data.load_geo3k(geo3k_real / "test.parquet")

    def losses(images):
        out = []
        for rec, imgs in zip(recs, images):
            msgs = data.prompt_messages(rec) + [{"role": "assistant", "content": data.sft_target(rec["answer"])}]
            prompt = proc.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
            full = prompt + msgs[1]["content"] + "<|im_end|>"
            enc = proc(text=[full], images=data.views(imgs), return_tensors="pt")
            n_prompt = proc(text=[prompt], images=data.views(imgs), return_tensors="pt")["input_ids"].shape[1]
            labels = enc["input_ids"].clone()
            labels[:, :n_prompt] = -100
            with torch.no_grad():
                out.append(model(**enc, labels=labels).loss.item())
        return out
    right = losses([r["images"] for r in recs])
    swapped = losses([recs[(i + 1) % len(recs)]["images"] for i in range(len(recs))])
    # problems that share their text ("Find x.", "Find y so that ..."): only the picture tells
    # their answers apart, so each given its twin's picture must lose its own answer
    texts = [r["problem"] for r in recs]
    twin = {i: [j for j, t in enumerate(texts) if t == texts[i]] for i in range(len(recs))}
    among = losses([recs[twin[i][(twin[i].index(i) + 1) % len(twin[i])]]["images"] for i in range(len(recs))])
    twins = [i for i in twin if len(twin[i]) > 1]
    print(f"loss, right images {right}\nswapped {swapped}\nswapped among twins {among}")
    assert len(twins) == 5 and max(right) < 0.05
    assert all(among[i] > 0.5 for i in twins), (right, among)
    assert sum(swapped) > 100 * sum(right), (right, swapped)
    before, after = vision(tiny_ckpt("qwen3_vl")), vision(ckpt)
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
    frozen = tmp_path / "frozen"
    sft("--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", geo3k_real / "test.parquet",
        "--save", frozen, "--lr", "3e-3", "--global-batch-size", "10", "--num-epoch", "2", "--freeze-vit")
    assert all(torch.equal(before[k], v) for k, v in vision(frozen / "iter_0000002").items())


@pytest.mark.cores
def test_tp2_and_dp2_equal_one_process(tiny_ckpt, geo3k_real, tmp_path):
    """Four steps (two epochs of 10 problems, batches of 8): every step's loss and grad norm and the
    final weights agree at TP=1, TP=2, DP=2 and CP=2, so the sharded AdamW state and the decoupled lr of
    the split embedding/output layer are checked, not only the first gradient."""
    from safetensors.torch import load_file
    from test_grpo import assert_same_weights
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", geo3k_real / "test.parquet",
              "--lr", "1e-3", "--decoupled-lr", "1e-2", "--global-batch-size", "8", "--num-epoch", "2",
              "--max-tokens-per-gpu", "600"]
    sft(*common, "--save", tmp_path / "one")
    sft(*common, "--save", tmp_path / "tp2", "--tensor-model-parallel-size", "2", nproc=2)
    sft(*common, "--save", tmp_path / "dp2", nproc=2)
    sft(*common, "--save", tmp_path / "cp2", "--context-parallel-size", "2", nproc=2)
    ref = [m for m in metrics(tmp_path / "one") if "loss" in m]
    final = load_file(tmp_path / "one" / "iter_0000004" / "model.safetensors")
    assert [m["step"] for m in ref] == [1, 2, 3, 4]
    for name in ("tp2", "dp2", "cp2"):
        got = [m for m in metrics(tmp_path / name) if "loss" in m]
        assert [m["step"] for m in got] == [1, 2, 3, 4]
        for g, r in zip(got, ref):
            assert g["tokens"] == r["tokens"]
            assert abs(g["loss"] - r["loss"]) <= 1e-5 * max(1, abs(r["loss"])), (name, g, r)
            assert abs(g["grad_norm"] - r["grad_norm"]) <= 1e-5 * max(1, r["grad_norm"]), (name, g, r)
        assert_same_weights(load_file(tmp_path / name / "iter_0000004" / "model.safetensors"), final, name)


@pytest.mark.cores
def test_pp2_equals_one_process(tiny_ckpt, geo3k_real, tmp_path):
    """PP (megatron's 1F1B over two stages of a 4-layer model with a tied head, split evenly and 3 + 1):
    every step's loss and grad norm and the final weights agree with one process, so the tied
    embedding's two copies take the same summed gradient and the stages' norms add up."""
    from safetensors.torch import load_file
    from test_grpo import assert_same_weights
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_vl", layers=4, tie=True), "--prompt-data", geo3k_real / "test.parquet",
              "--lr", "1e-3", "--decoupled-lr", "1e-2", "--global-batch-size", "8", "--max-tokens-per-gpu", "600"]
    sft(*common, "--save", tmp_path / "one")
    sft(*common, "--save", tmp_path / "pp2", "--pipeline-model-parallel-size", "2", nproc=2)
    sft(*common, "--save", tmp_path / "pp2_3_1", "--pipeline-model-parallel-size", "2",
        "--decoder-first-pipeline-num-layers", "3", nproc=2)
    ref = [m for m in metrics(tmp_path / "one") if "loss" in m]
    final = load_file(tmp_path / "one" / "iter_0000002" / "model.safetensors")
    assert [m["step"] for m in ref] == [1, 2]
    for name in ("pp2", "pp2_3_1"):
        got = [m for m in metrics(tmp_path / name) if "loss" in m]
        assert [m["step"] for m in got] == [1, 2]
        for g, r in zip(got, ref):
            assert abs(g["loss"] - r["loss"]) <= 1e-5 * max(1, abs(r["loss"])), (name, g, r)
            assert abs(g["grad_norm"] - r["grad_norm"]) <= 1e-5 * max(1, r["grad_norm"]), (name, g, r)
        assert_same_weights(load_file(tmp_path / name / "iter_0000002" / "model.safetensors"), final, name)


def test_sigkill_then_load_resumes_on_the_same_data_order(tiny_ckpt, tmp_path):
    from tools import synth
    synth.write_synth(tmp_path / "d", 48, n_test=4, seed=0)
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", tmp_path / "d", "--lr", "1e-3",
              "--global-batch-size", "8", "--num-epoch", "2", "--save-interval", "2"]
    sft(*common, "--save", tmp_path / "full")
    crash = tmp_path / "crash"
    proc = sft(*common, "--save", crash, wait=False)
    deadline = time.time() + 300
    while not (crash / "iter_0000004").exists():  # kill right after the second checkpoint lands
        assert proc.poll() is None and time.time() < deadline, proc.wait(5).stderr[-2000:]
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    assert (crash / "latest").read_text() == "iter_0000004"
    assert (crash / "iter_0000004" / "model.safetensors").exists()  # 'latest' is always complete
    sft(*common, "--save", crash, "--load", crash)
    full = {m["step"]: m["loss"] for m in metrics(tmp_path / "full") if "loss" in m}
    steps = [m["step"] for m in metrics(crash) if "loss" in m]
    assert steps == sorted(full) == list(range(1, 13))  # no step lost or repeated
    resumed = {m["step"]: m["loss"] for m in metrics(crash) if "loss" in m}
    for step in range(5, 13):
        assert abs(resumed[step] - full[step]) < 1e-6, (step, resumed[step], full[step])


def test_sft_evaluates_at_its_start_and_the_done_line_compares_start_and_end(tiny_ckpt, tmp_path):
    from tools import synth
    synth.write_synth(tmp_path / "d", 8, n_test=2, seed=0)
    r = sft("--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", tmp_path / "d", "--eval-prompt-data", tmp_path / "d",
            "--global-batch-size", "4", "--lr", "1e-3", "--save", tmp_path / "run")
    evals = [(m["step"], m["eval_loss"]) for m in metrics(tmp_path / "run") if "eval_loss" in m]
    assert [step for step, _ in evals] == [0, 2] and evals[0][1] != evals[1][1], evals
    assert f"eval_loss {evals[0][1]:.3f} -> {evals[1][1]:.3f}; checkpoint" in r.stdout, r.stdout[-1000:]


@pytest.mark.parametrize("decoupled", [None, 1e-2])
def test_optimizer_groups_decoupled_lr_and_decay(decoupled):
    """--decoupled-lr sets the token embedding and output layer apart; the schedule scales every
    group alike; norms and biases never decay."""
    import argparse
    import flags as F
    import optim
    p = argparse.ArgumentParser()
    F.add_train_args(p)
    args = p.parse_args(["--save", "x", "--hf-checkpoint", "x", "--prompt-data", "x", "--lr", "1e-4",
                         "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--weight-decay", "0.1"]
                        + (["--decoupled-lr", str(decoupled)] if decoupled else []))
    m = torch.nn.Module()
    m.embedding = torch.nn.Module()
    m.embedding.word_embeddings = torch.nn.Embedding(8, 4)
    m.output_layer = torch.nn.Linear(4, 8, bias=False)
    m.linear_fc1 = torch.nn.Linear(4, 4)
    m.final_norm = torch.nn.LayerNorm(4)
    opt, sched = optim.build_optimizer(m, args, total_steps=10)
    edge = {id(m.embedding.word_embeddings.weight), id(m.output_layer.weight)}
    seen = {}
    for g in opt.param_groups:
        for prm in g["params"]:
            seen[id(prm)] = (g["lr"], g["weight_decay"], g["initial_lr"])
    assert len(seen) == len(list(m.parameters()))
    for name, prm in m.named_parameters():
        lr, wd, base = seen[id(prm)]
        assert base == (decoupled if decoupled and id(prm) in edge else 1e-4), name
        assert lr == pytest.approx(base / 2)  # warmup step 1 of 2
        assert wd == (0.1 if prm.ndim >= 2 and "norm" not in name else 0.0), name
    for _ in range(6):
        opt.step()
        sched.step()
    lrs = {seen[id(prm)][2]: g["lr"] for g in opt.param_groups for prm in g["params"]}
    ratio = {round(lr / base, 9) for base, lr in lrs.items()}
    assert len(ratio) == 1 and 0 < ratio.pop() < 1  # one cosine factor for all groups

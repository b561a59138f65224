"""sft.py end to end on CPU: it learns the ten real geo3k problems through their pixels,
TP=2 and DP=2 reproduce one process, and a SIGKILLed run resumes on the same data order."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def sft(*args, nproc=1, check=True, wait=True):
    launcher = [PY] if nproc == 1 else [PY, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                        "--master_port", str(29500 + os.getpid() % 1000)]
    cmd = launcher + [str(ROOT / "sft.py"), *map(str, args)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if check and r.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return r


def metrics(run):
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def vision(ckpt):
    return {k: v for k, v in load_file(Path(ckpt) / "model.safetensors").items() if ".visual." in k}


@pytest.fixture(scope="module")
def trained(tiny_ckpt, geo3k_real, tmp_path_factory):
    """The tiny Qwen3-VL trained on the ten real problems (about a minute on 2 cores)."""
    out = tmp_path_factory.mktemp("sft_real")
    sft("--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", geo3k_real / "test.parquet",
        "--save", out, "--lr", "5e-3", "--global-batch-size", "10", "--num-epoch", "100",
        "--lr-warmup-iters", "5", "--lr-decay-style", "constant")
    return out


@pytest.mark.slow
def test_sft_learns_real_problems_and_generates_their_answers(trained, geo3k_real):
    import data
    from transformers import AutoModelForImageTextToText, AutoProcessor
    assert metrics(trained)[-1]["loss"] < 0.05
    ckpt = trained / "iter_0000100"
    proc = AutoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    for rec in data.load_geo3k(geo3k_real / "test.parquet"):
        text = proc.apply_chat_template(data.prompt_messages(rec), add_generation_prompt=True, tokenize=False)
        enc = proc(text=[text], images=rec["images"], return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=24, do_sample=False)
        reply = proc.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        assert reply == data.sft_target(rec["answer"]), (rec["problem"], reply)


@pytest.mark.slow
def test_pixels_reach_the_loss(trained, tiny_ckpt, geo3k_real, tmp_path):
    """Swapping images between problems raises the trained model's loss; the tower moved."""
    import data
    from transformers import AutoModelForImageTextToText, AutoProcessor
    ckpt = trained / "iter_0000100"
    proc = AutoProcessor.from_pretrained(ckpt)
    model = AutoModelForImageTextToText.from_pretrained(ckpt).eval()
    recs = data.load_geo3k(geo3k_real / "test.parquet")

    def loss(images):
        total = 0.0
        for rec, imgs in zip(recs, images):
            msgs = data.sft_messages(rec)
            prompt = proc.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=False)
            full = prompt + msgs[1]["content"] + "<|im_end|>"
            enc = proc(text=[full], images=imgs, return_tensors="pt")
            n_prompt = proc(text=[prompt], images=imgs, return_tensors="pt")["input_ids"].shape[1]
            labels = enc["input_ids"].clone()
            labels[:, :n_prompt] = -100
            with torch.no_grad():
                total += model(**enc, labels=labels).loss.item()
        return total / len(recs)
    right = loss([r["images"] for r in recs])
    swapped = loss([recs[(i + 1) % len(recs)]["images"] for i in range(len(recs))])
    assert right < 0.05 and swapped > right + 1.0, (right, swapped)
    before, after = vision(tiny_ckpt("qwen3_vl")), vision(ckpt)
    assert sum(not torch.equal(before[k], after[k]) for k in before) > len(before) // 2
    frozen = tmp_path / "frozen"
    sft("--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", geo3k_real / "test.parquet",
        "--save", frozen, "--lr", "3e-3", "--global-batch-size", "10", "--num-epoch", "2", "--freeze-vit")
    assert all(torch.equal(before[k], v) for k, v in vision(frozen / "iter_0000002").items())


def test_tp2_and_dp2_equal_one_process(tiny_ckpt, geo3k_real, tmp_path):
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", geo3k_real / "test.parquet",
              "--lr", "1e-3", "--global-batch-size", "8", "--num-epoch", "1", "--max-tokens-per-gpu", "600"]
    sft(*common, "--save", tmp_path / "one")
    sft(*common, "--save", tmp_path / "tp2", "--tensor-model-parallel-size", "2", nproc=2)
    sft(*common, "--save", tmp_path / "dp2", nproc=2)
    ref = metrics(tmp_path / "one")[0]
    for name in ("tp2", "dp2"):
        got = metrics(tmp_path / name)[0]
        assert got["tokens"] == ref["tokens"]
        assert abs(got["loss"] - ref["loss"]) <= 1e-5 * max(1, abs(ref["loss"])), (name, got, ref)
        assert abs(got["grad_norm"] - ref["grad_norm"]) <= 1e-5 * max(1, ref["grad_norm"]), (name, got, ref)


def test_sigkill_then_load_resumes_on_the_same_data_order(tiny_ckpt, tmp_path):
    import data
    data.write_synth(tmp_path / "d", 48, n_test=4, seed=0)
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", tmp_path / "d", "--lr", "1e-3",
              "--global-batch-size", "8", "--num-epoch", "2", "--save-interval", "2"]
    sft(*common, "--save", tmp_path / "full")
    crash = tmp_path / "crash"
    proc = sft(*common, "--save", crash, wait=False)
    deadline = time.time() + 300
    while not (crash / "iter_0000004").exists():  # kill right after the second checkpoint lands
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
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

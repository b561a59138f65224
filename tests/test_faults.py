"""The fault suite (issue 19): a careless user and a hostile environment. Each case asserts that
the message names the input (flag, file, row, tensor) and that nothing already written is lost.
Fast cases run in the default suite; the ones that start trainers are marked slow."""
import http.server
import io
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from PIL import Image

import console
import data
import env_geo3k
import launch
from tools import synth as synth_set
import trainer as T

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


def png(size=(32, 32)):
    buf = io.BytesIO()
    Image.new("RGB", size, "white").save(buf, format="PNG")
    return buf.getvalue()


def rows(n, **over):
    return [dict({"problem": "<image>How many sides?", "answer": "4", "images": [{"bytes": png(), "path": None}]},
                 **over) for _ in range(n)]


def parquet(path, rs):
    import pyarrow as pa
    import pyarrow.parquet as pq
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rs), path)
    return path


def run(script, *args, preexec=None, timeout=600):
    if preexec is None:
        return launch.python(ROOT / script, *args, timeout=timeout, env=ENV)
    return launch.run([PY, ROOT / script, *args], timeout, env=ENV, preexec_fn=preexec)


# ------------------------------------------------------------------ 6, 9, 11: flags at parse time
GRPO = ["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x"]


@pytest.mark.parametrize("entry,flags,named", [
    ("train_grpo", ["--rollout-batch-size", "0"], "--rollout-batch-size: 0:"),
    ("train_grpo", ["--n-samples-per-prompt", "0"], "--n-samples-per-prompt: 0:"),
    ("train_grpo", ["--n-samples-per-prompt", "1"], "--n-samples-per-prompt 1: a group of one response has "
     "zero advantage, so GRPO would learn nothing\n"),
    ("train_grpo", ["--num-rollout", "-2"], "--num-rollout: -2:"),
    ("train_grpo", ["--rollout-temperature=-1"], "--rollout-temperature: -1:"),
    ("train_grpo", ["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size: 0:"),
    ("train_grpo", ["--max-context-len", "0"], "--max-context-len: 0:"),
    ("train_grpo", ["--rollout-top-p", "1.5"], "--rollout-top-p: 1.5:"),
    ("train_grpo", ["--rm-type", "gsm8k"], "--rm-type: invalid choice: 'gsm8k' (choose from 'math', 'geo3k')"),
    ("train_grpo", ["--rollout-engine", "local", "--sglang-mem-fraction-statc", "0.5"], "--mem-fraction-statc"),
    # issue 50: what places an SGLang server, with the in-process engine: refused by name, not saved as on
    ("train_grpo", ["--rollout-engine", "local", "--colocate"], "--colocate: they place or set up an SGLang server"),
    ("train_grpo", ["--rollout-engine", "local", "--rollout-num-gpus", "2", "--weight-sync", "disk"],
     "--rollout-num-gpus --weight-sync: they place"),
    # issue 58: evaluating nothing, a media type this trainer has no model input for
    ("train_grpo", ["--num-rollout", "0"], "--num-rollout 0 only evaluates: give --eval-prompt-data"),
    ("train_grpo", ["--default-tools", "calc_score"], "--default-tools: a single-turn run (--max-turns 1) offers no tools"),
    ("sft", ["--multimodal-keys", "image_path"], "--multimodal-keys: invalid loads value: 'image_path'"),
    ("sft", ["--global-batch-size", "0"], "--global-batch-size: 0:"),
    ("sft", ["--num-epoch", "0"], "--num-epoch: 0:"),
    ("sft", ["--lr", "nan"], "--lr: nan:"),
    # issue 68: a negative number without `=` is the flag's value, refused by its bound; greedy GRPO learns nothing
    ("sft", ["--lr", "-1e-4"], "--lr: -1e-4: must be a finite number >= 0.0"),
    ("train_grpo", ["--rollout-temperature", "0"], "--rollout-temperature 0: greedy sampling gives "
     "every response of a group the same tokens, so each has zero advantage and GRPO would learn nothing\n"),
])
def test_bad_numeric_flags_fail_at_parse_time_naming_the_flag(entry, flags, named, capsys):
    mod = __import__(entry)
    with pytest.raises(SystemExit) as e:
        mod.parse_args(GRPO + flags)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_every_numeric_flag_declares_its_bound():
    """A number flag's type is its bound (flags.at_least / flags.fraction), declared with the flag;
    only the seed and --rollout-top-k (-1: off) take any integer."""
    import sft
    import train_grpo
    for mod in (train_grpo, sft):
        parser = mod.build_parser()
        plain = sorted(a.option_strings[0] for a in parser._actions if a.type in (int, float))
        assert set(plain) <= {"--rollout-top-k", "--seed"}, (mod.__name__, plain)
        groups = [g.title for g in parser._action_groups if g._group_actions]
        assert {"data and evaluation", "model and parallelism", "precision and memory", "optimizer",
                "run folder"} <= set(groups), groups


def test_every_float_flag_refuses_what_is_not_a_finite_number():
    """Issue 68: `--lr inf` trained to NaN weights. Every flag a float parses (both trainers, each registry entry's
    own) refuses inf, -inf and nan at parse time."""
    import argparse
    import sft
    import train_grpo
    floats = [a for mod in (train_grpo, sft) for a in mod.build_parser()._actions
              if getattr(a.type, "__name__", None) == "float"]  # float, flags.at_least(0.0), flags.fraction
    assert {"--lr", "--rollout-top-p", "--sapo-tau-pos", "--overlong-penalty-factor"} <= {a.option_strings[0] for a in floats}
    for a in floats:
        for text in ("inf", "-inf", "nan"):
            with pytest.raises(argparse.ArgumentTypeError, match=f"^{text}: must be"):
                a.type(text)


def test_a_checkpoint_is_periodic_by_default():
    import sft
    import train_grpo
    for args in (sft.parse_args(GRPO), train_grpo.parse_args(GRPO)):
        assert args.save_interval > 0 and args.save_keep > 0


# ------------------------------------------------------------------ 7, 8: loaders name the file
def test_loader_errors_name_the_file(tmp_path, monkeypatch):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"problem": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(data.DataError, match=r"latin1.jsonl: not UTF-8 text \(byte"):
        data.load_geo3k(tmp_path / "latin1.jsonl")
    (tmp_path / "list.jsonl").write_text('[1, 2]\n')
    with pytest.raises(data.DataError, match="row 0: line 1 is a JSON list, not an object"):
        data.load_geo3k(tmp_path / "list.jsonl")
    (tmp_path / "fake.parquet").write_text("problem,answer\n")
    with pytest.raises(data.DataError, match="fake.parquet: not a readable parquet file"):
        data.load_geo3k(tmp_path / "fake.parquet")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(data.DataError, match="^data/trian: no such file or folder"):
        data.load_geo3k("data/trian")


def test_rows_reach_no_url_and_no_file_outside_the_data_folder(tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(png())
    inside = tmp_path / "set"
    (inside / "img").mkdir(parents=True)
    (inside / "img" / "a.png").write_bytes(png())
    for value in (str(secret), "../secret.png", "img/../../secret.png"):
        with pytest.raises(ValueError, match="outside the data set's folder.*--allow-outside-paths"):
            data.decode_image(value, base_dir=inside)
        assert data.decode_image(value, base_dir=inside, allow_outside=True).size == (32, 32)
    assert data.decode_image("img/a.png", base_dir=inside).size == (32, 32)
    with pytest.raises(ValueError, match="outside"):  # a hub data set has no folder: no path at all
        data.decode_image(str(secret))

    body = {"/small.png": png(), "/big.png": png() + b"\0" * (data.URL_MAX_BYTES + 1)}
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body[self.path])

        def log_message(self, *a):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(ValueError, match="is a URL: not fetched.*--allow-image-urls"):
            data.decode_image(url + "/small.png")
        assert hits == []
        assert data.decode_image(url + "/small.png", allow_urls=True).size == (32, 32)
        with pytest.raises(ValueError, match=f"big.png: larger than {data.URL_MAX_BYTES >> 20} MB"):
            data.decode_image(url + "/big.png", allow_urls=True)
    finally:
        server.shutdown()


# ------------------------------------------------------------------ 3, 4: the processor's limits at load
def grpo_args(**kw):
    import train_grpo
    args = train_grpo.parse_args(GRPO)
    vars(args).update(kw)
    return args


def test_images_the_processor_refuses_and_over_long_rows_are_named_at_load(tmp_path, processor, capsys):
    import chat
    rs = rows(200)
    rs[3]["images"] = [{"bytes": png((4000, 8)), "path": None}]  # "absolute aspect ratio must be smaller than 200"
    rs[5]["problem"] = "<image>" + "How many sides? " * 4000
    args = grpo_args(prompt_data=str(parquet(tmp_path / "d.parquet", rs)))
    fit = dict(measure=lambda r: len(chat.prompt(processor, r, env_geo3k if args.max_turns > 1 else None)[2]),
               limit=(args.max_context_len - 1, f"--max-context-len {args.max_context_len}"))
    recs = T.load_data(args, **fit)
    assert len(recs) == 198
    err = capsys.readouterr().err
    assert "row 3: the processor refuses it (ValueError: absolute aspect ratio" in err
    assert "skipped 1 of 200 rows over the length limit" in err and "row 5: " in err
    assert "tokens, over --max-context-len 8192" in err
    # every prompt is longer: a clear error naming the flag, not a ZeroDivisionError in a step
    with pytest.raises(SystemExit, match="(?s)--prompt-data: .*no usable row of 200.*over --max-context-len 20"):
        T.load_data(args, measure=fit["measure"], limit=(19, "--max-context-len 20"))


# ------------------------------------------------------------------ 1, 2, 9: the run folder
def test_one_trainer_per_run_folder_and_a_dead_one_holds_nothing(tmp_path):
    held = T.lock_folder(tmp_path)
    with pytest.raises(SystemExit, match=f"--save {tmp_path}: in use by another trainer \\(pid {os.getpid()}"):
        T.lock_folder(tmp_path)
    held.close()
    child = subprocess.Popen([PY, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); import trainer, time; "
                              f"h = trainer.lock_folder(__import__('pathlib').Path({str(tmp_path)!r})); "
                              "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "held\n"
    with pytest.raises(SystemExit, match="in use"):
        T.lock_folder(tmp_path)
    child.send_signal(signal.SIGKILL)
    child.wait()
    T.lock_folder(tmp_path).close()  # the kernel dropped the dead process's lock


def test_a_fresh_start_never_mixes_with_an_earlier_run(tmp_path):
    (tmp_path / "iter_0000004" / "train_state").mkdir(parents=True)
    (tmp_path / "iter_0000004" / "train_state" / "meta.json").write_text('{"step": 4}')
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)))
    with pytest.raises(SystemExit, match=f"--save {tmp_path} holds checkpoints.*--load {tmp_path}.*--overwrite"):
        T.start_fresh(tmp_path, overwrite=False, load=None)
    assert (tmp_path / "iter_0000004").exists() and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4
    # --load = --save with `latest` lost: the newest complete checkpoint, not a fresh start
    assert T.find_checkpoint(str(tmp_path), tmp_path) == tmp_path / "iter_0000004"
    T.start_fresh(tmp_path, overwrite=True, load=None)
    assert not list(tmp_path.glob("iter_*")) and not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("overwrite, load", [(True, None), (False, "same")])  # --load = --save holding no checkpoint
def test_a_fresh_start_removes_every_file_of_the_earlier_run_and_says_which(tmp_path, capsys, overwrite, load):
    earlier = ["latest", "metrics.jsonl", "eval_0000000.jsonl", "eval_0000004.jsonl", "config_grpo.json",
               "config_grpo_resumed_at_0000002.json", "args.txt", "summary.md"]
    for name in earlier:
        (tmp_path / name).write_text(json.dumps({"step": 0, "eval_accuracy": 0.9}) + "\n")  # a step-0 eval of another model
    (tmp_path / "data").mkdir()  # not a run's file: stays
    if load:
        (tmp_path / "latest").unlink()
        earlier.remove("latest")
    T.start_fresh(tmp_path, overwrite=overwrite, load=load and str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    said = capsys.readouterr().out
    assert f"[run] starting fresh in {tmp_path} (removed the earlier run's {len(earlier)} file(s): " in said, said
    assert all(n in said for n in earlier)


def test_resume_drops_a_torn_metrics_line_and_says_so(tmp_path, capsys):
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:7])  # a full disk mid-line
    T.trim_metrics(tmp_path, 4)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines[:4]
    assert "metrics.jsonl: dropped unreadable line(s) [6]" in capsys.readouterr().err


def test_truncated_train_state_names_the_file(tmp_path):
    torch.save({"optimizer": {"x": torch.zeros(1000)}}, tmp_path / "tp_00.pt")
    (tmp_path / "tp_00.pt").write_bytes((tmp_path / "tp_00.pt").read_bytes()[:300])
    (tmp_path / "meta.json").write_text('{"step": 4, "t')
    for name, read in (("tp_00.pt", lambda f: torch.load(f, weights_only=False)),
                       ("meta.json", lambda f: json.loads(f.read_text()))):
        with pytest.raises(SystemExit, match=f"{tmp_path / name} is missing, truncated or corrupt"):
            T.read_state(tmp_path / name, read)


def test_corrupt_safetensors_names_the_file(tmp_path, ckpt):
    import convert
    bad = tmp_path / "model.safetensors"
    bad.write_bytes((Path(ckpt) / "model.safetensors").read_bytes()[:100_000])
    with pytest.raises(SystemExit, match=f"{bad}: not a readable safetensors file"):
        convert.weight_files(tmp_path)


def test_a_tensor_that_loads_into_no_parameter_is_named_at_load(tmp_path, ckpt):
    """Export sends only what reached a parameter (and mtp.*, passed through), and SGLang releases its
    weights without a CPU copy: a source tensor no parameter takes would be garbage on the server after
    the first release. The load stops naming it; an mtp.* tensor is no error."""
    import model as M
    import parallel
    from safetensors.torch import load_file, save_file
    shutil.copytree(ckpt, tmp_path, dirs_exist_ok=True)
    w = load_file(tmp_path / "model.safetensors")
    w["model.language_model.layers.0.mlp.gate_proj.bias"] = torch.zeros(128)
    w["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(w, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    parallel.init_distributed(1)
    with pytest.raises(SystemExit, match=r"1 tensors of the checkpoint load into no parameter of the model: "
                                         r"model\.language_model\.layers\.0\.mlp\.gate_proj\.bias$"):
        M.load_model(tmp_path)


# ------------------------------------------------------------------ 5: no port open to strangers
PORTS = """import os, subprocess, sys
sys.path.insert(0, {root!r})
import parallel
parallel.init_distributed()
out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
print([l.split()[3] for l in out.splitlines() if f"pid={{os.getpid()}}," in l])
"""


def test_collective_sockets_bind_to_loopback_whatever_the_host_name_says(tmp_path):
    """The host name resolving to an external address (as on most machines; here it is made so
    in a private UTS + mount namespace): gloo's sockets still listen on 127.0.0.1 only."""
    ip = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                        text=True).stdout.split()
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ss") or "inet" not in ip:
        pytest.skip("needs root, unshare, ss and a non-loopback IPv4 address")
    ext = ip[ip.index("inet") + 1].split("/")[0]
    (tmp_path / "hosts").write_text(Path("/etc/hosts").read_text() + f"\n{ext} faultbox\n")
    (tmp_path / "ports.py").write_text(PORTS.format(root=str(ROOT)))
    script = (f"mount --bind {tmp_path / 'hosts'} /etc/hosts && hostname faultbox && "
              f"{PY} {tmp_path / 'ports.py'}")
    env = {k: v for k, v in ENV.items() if not k.endswith("SOCKET_IFNAME")}
    r = subprocess.run(["unshare", "--uts", "--mount", "sh", "-c", script], env=env, capture_output=True,
                       text=True, timeout=300)
    if "Operation not permitted" in r.stderr:
        pytest.skip("unshare is not permitted here")
    addrs = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 - our own script's printed list
    assert addrs and all(a.startswith("127.0.0.1:") for a in addrs), addrs


# ------------------------------------------------------------------ slow: through the entry points
@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return synth_set.write_synth(tmp_path_factory.mktemp("faults") / "d", 16, n_test=2, seed=0, kinds=("sides",), size=64)


def sft_cmd(ckpt, d, save, *extra):
    return ["sft.py", "--hf-checkpoint", ckpt, "--prompt-data", d, "--save", save, "--global-batch-size", "8",
            "--save-interval", "1", "--lr", "1e-4", *extra]


@pytest.mark.slow
def test_second_trainer_on_a_held_folder_exits_and_writes_nothing(ckpt, synth, tmp_path):
    lock = T.lock_folder(tmp_path)
    r = run(*sft_cmd(ckpt, synth, tmp_path))
    assert r.returncode and f"--save {tmp_path}: in use by another trainer" in r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
    lock.close()


@pytest.mark.slow
def test_sft_resumes_over_a_torn_metrics_line_and_refuses_a_silent_fresh_start(ckpt, synth, tmp_path):
    r = run(*sft_cmd(ckpt, synth, tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    log = tmp_path / "metrics.jsonl"
    before = log.read_text()
    r = run(*sft_cmd(ckpt, synth, tmp_path))  # the same command again, no --load: refused, nothing touched
    assert r.returncode and "holds checkpoints" in r.stderr and log.read_text() == before, r.stderr[-2000:]
    (tmp_path / "latest").write_text("iter_0000001")
    log.write_text(before + '{"step": 3, "lo')
    r = run(*sft_cmd(ckpt, synth, tmp_path, "--load", tmp_path, "--num-epoch", "2"))
    assert r.returncode == 0 and "dropped unreadable line(s)" in r.stderr, r.stderr[-2000:]
    assert [json.loads(x)["step"] for x in log.read_text().splitlines() if "loss" in x] == [1, 2, 3, 4]


@pytest.mark.slow
def test_full_disk_during_a_checkpoint_is_named_and_leaves_no_temporary_folder(ckpt, synth, tmp_path):
    def small_files():  # writes past 40 MB fail with EFBIG, as a full disk fails them with ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (40 << 20, 40 << 20))
    r = run(*sft_cmd(ckpt, synth, tmp_path / "run"), preexec=small_files)
    assert r.returncode and "checkpoint" in r.stderr and "could not be written" in r.stderr, r.stderr[-2000:]
    assert "iter_0000001" in r.stderr and "Free space in --save" in r.stderr
    assert not list((tmp_path / "run").glob(".tmp_*")) and (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_full_disk_is_said_as_such(ckpt, synth, tmp_path):
    """A real full disk (a 150 MB tmpfs, mounted in a mount namespace of the trainer's own): the checkpoint's
    error says so, where torch's own says "unexpected pos" and safetensors' "os error 28" (issue 50)."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    disk = tmp_path / "disk"
    disk.mkdir()
    cmd = " ".join(shlex.quote(str(c)) for c in [PY, ROOT / "sft.py", *sft_cmd(ckpt, synth, disk / "run")[1:]])
    r = launch.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=150m tmpfs {disk} && exec {cmd}"],
                   600, env=ENV)
    if "mount" in r.stderr and "ermission denied" in r.stderr or "Operation not permitted" in r.stderr:
        pytest.skip("unshare or mount is not permitted here")
    assert r.returncode and "could not be written (no space left on the device of --save: " in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_nan_weights_are_named_at_load(ckpt, synth, tmp_path):
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "nan"
    shutil.copytree(ckpt, bad)
    w = load_file(bad / "model.safetensors")
    name = sorted(k for k in w if "layers.0.mlp.down_proj" in k)[0]
    w[name][0, 0] = float("nan")
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    r = run(*sft_cmd(bad, synth, tmp_path / "run"))
    assert r.returncode and f"tensor {name} holds NaN or inf" in r.stderr, r.stderr[-2000:]


@pytest.mark.slow
def test_grpo_survives_a_refused_image_and_names_its_row(ckpt, tmp_path):
    rs = synth_set.synth_records(100, seed=0, kinds=("sides",))  # 128 px: prompts of ~60 tokens
    rs[7]["images"] = [{"bytes": png((4000, 8)), "path": None}]
    d = parquet(tmp_path / "d" / "train.parquet", rs).parent
    r = run("train_grpo.py", "--hf-checkpoint", ckpt, "--prompt-data", d, "--save", tmp_path / "run",
            "--rollout-engine", "local", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--num-rollout", "2")
    assert r.returncode == 0 and "row 7: the processor refuses it" in r.stderr, r.stderr[-2000:]
    r = run("train_grpo.py", "--hf-checkpoint", ckpt, "--prompt-data", d, "--save", tmp_path / "short",
            "--rollout-engine", "local", "--num-rollout", "2", "--max-context-len", "50")
    assert r.returncode and "over --max-context-len 50" in r.stderr and "ZeroDivision" not in r.stderr


@pytest.mark.slow
def test_killing_torchrun_stops_its_workers(ckpt, synth, tmp_path):
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
           str(ROOT / "sft.py"), *map(str, sft_cmd(ckpt, synth, tmp_path)[1:]), "--num-epoch", "1000"]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while not (tmp_path / "metrics.jsonl").exists():
        assert launcher.poll() is None and time.time() < deadline
        time.sleep(0.5)
    kids = [int(k) for t in Path(f"/proc/{launcher.pid}/task").iterdir() for k in (t / "children").read_text().split()]
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    def running(pid):  # a dead worker may stay a zombie: its new parent need not reap it
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    deadline = time.time() + 30
    while any(map(running, kids)) and time.time() < deadline:
        time.sleep(0.2)
    alive = [k for k in kids if running(k)]
    for k in alive:
        os.kill(k, signal.SIGKILL)
    assert kids and not alive, f"workers {alive} outlived their torchrun"


# ------------------------------------------------------------------ issue 50: a user's first hour
def test_help_shows_defaults_and_each_tool_its_own(capsys):
    import sft
    import train_grpo
    from bench import blank_crop
    from tools import report
    for mod in (train_grpo, sft):
        with pytest.raises(SystemExit):
            mod.parse_args(["--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "--seed SEED the data order" in out and "(default: 1234)" in out and "(default: 0.98)" in out, out
        assert "Adam's decay of the gradient's running mean" in out and "GRPO not yet" not in out
        assert "(default: None)" not in out and "(default: False)" not in out and "(default: train)" in out
    with pytest.raises(SystemExit) as e:
        blank_crop.main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "The control of the crop task's GRPO" in out and "--rollout-batch-size" in out
    with pytest.raises(SystemExit) as e:
        report.main(["--help"])
    assert e.value.code == 0 and "the summary of a run folder" in capsys.readouterr().out


QWEN3_VL = json.dumps({"model_type": "qwen3_vl"})  # what trainer.start reads of a checkpoint before the run folder


@pytest.mark.parametrize("value,said", [
    ("{tmp}/nope", "--hf-checkpoint {tmp}/nope: no such folder"),
    ("{tmp}", "--hf-checkpoint {tmp}: no config.json in it"),
    ("nobody-here/no-such-model", "no-such-model: no such folder \\(a hub id: download it, e.g. hf download ID"),
    ("{tmp}/qwen2", "--hf-checkpoint {tmp}/qwen2: model_type 'qwen2' \\(config.json\\) is not a family this trainer "
                    "builds: qwen2_5_vl, qwen3_vl, qwen3_5, qwen3_5_moe$"),  # issue 75: a text-only Qwen2
    ("{tmp}/list", "--hf-checkpoint {tmp}/list: its config.json is not a JSON object"),
])
@pytest.mark.parametrize("entry", ["train_grpo", "sft"])
def test_a_wrong_checkpoint_is_named_before_anything_starts(value, said, entry, tmp_path, monkeypatch):
    import importlib
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a hub id is never fetched: no network wait, online or not
    for name, config in (("qwen2", {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}), ("list", [])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    value, said = value.format(tmp=tmp_path), said.format(tmp=tmp_path)
    with pytest.raises(SystemExit, match=said):
        importlib.import_module(entry).main(["--hf-checkpoint", value, "--prompt-data", "x", "--save", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()  # before the run folder


def test_a_missing_column_is_named_with_the_files_columns(tmp_path):
    path = parquet(tmp_path / "d.parquet", [dict(r, question=r.pop("problem")) for r in rows(8)])
    with pytest.raises(data.DataError, match=r"d.parquet: no column 'problem'; its columns: answer, images, "
                                             r"question\. Name yours with --input-key"):
        data.load_geo3k(path)
    assert len(data.load_geo3k(path, input_key="question")) == 8
    with pytest.raises(data.DataError, match="no column 'solution'.*--label-key"):
        data.load_geo3k(path, input_key="question", label_key="solution")
    (tmp_path / "t.jsonl").write_text('{"problem": "1 + 1?", "answer": "2", "picture": "a.png"}\n')
    with pytest.raises(data.DataError, match="no column 'images'; its columns: answer, picture, problem"):
        data.load_geo3k(tmp_path / "t.jsonl")


@pytest.mark.parametrize("evaluation", [False, True], ids=["train", "eval"])
def test_training_and_eval_data_read_the_columns_the_flags_name(evaluation, tmp_path):
    """Issue 68: eval answers were read from `answer` whatever --label-key said. Each column flag names its column
    in both data sets; the default columns sit beside them with other values, so a flag not followed shows."""
    (tmp_path / "a.png").write_bytes(png((32, 32)))
    (tmp_path / "b.png").write_bytes(png((48, 40)))
    row = {"problem": "<image>wrong", "answer": "wrong", "images": "b.png", "q": "<image>right?", "gold": "7", "pic": "a.png"}
    jsonl(tmp_path / "d.jsonl", [row])
    args = grpo_args(prompt_data=str(tmp_path / "d.jsonl"), eval_prompt_data=str(tmp_path / "d.jsonl"), input_key="q",
                     label_key="gold", multimodal_keys={"image": "pic"})
    [rec] = T.load_data(args, evaluation=evaluation)
    assert (rec["problem"], rec["answer"], rec["images"][0].size) == ("<image>right?", "7", (32, 32)), rec


def resumable(tmp_path, entry, argv, step=2, config="{}"):
    """A run folder as `entry` run with `argv` leaves it after a checkpoint at `step`: its config, its
    checkpoint's meta and config.json (what a resume reads before any model loads). -> the folder."""
    import importlib
    mod, save = importlib.import_module(entry), tmp_path / "run"
    state = save / f"iter_{step:07d}" / "train_state"
    state.mkdir(parents=True)
    (state.parent / "config.json").write_text(config)
    (state / "meta.json").write_text(json.dumps({"step": step, "tp": 1, "pp": 1}))
    (save / "latest").write_text(f"iter_{step:07d}")
    config = dict(vars(mod.parse_args(argv + ["--save", str(save)])), kind=entry.replace("train_", ""),
                  world_size=1, versions=T.versions())
    (save / f"config_{config['kind']}.json").write_text(json.dumps(config, indent=1, default=str))
    return save


def test_a_resume_refuses_what_the_checkpoint_fixes_and_keeps_the_runs_config(tmp_path):
    import sft
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(QWEN3_VL)
    argv = ["--hf-checkpoint", str(tmp_path / "ckpt"), "--prompt-data", "x"]
    save = resumable(tmp_path, "sft", argv)
    first = (save / "config_sft.json").read_text()
    with pytest.raises(SystemExit) as e:
        sft.main(argv + ["--save", str(save), "--load", str(save), "--global-batch-size", "8", "--lr", "1e-4",
                         "--eval-interval", "5"])
    said = str(e.value)
    assert "so these cannot change:\n  --global-batch-size 8 (the run: 16)\n  --lr 0.0001 (the run: 1e-05)\n" in said
    assert "eval-interval" not in said and f"--hf-checkpoint {save}/iter_N" in said, said
    assert (save / "config_sft.json").read_text() == first and [p.name for p in save.glob("config_*")] == ["config_sft.json"]


def test_a_resume_refuses_each_of_the_runs_flags_and_says_each_other_change(tmp_path, capsys):
    """Issue 68: --lr changed was refused but --prompt-data changed was only said, where README refuses a changed data
    order. docs/training.md's table: each flag of the run's (trainer.FIXED, GRPO's own) refused by name, the others
    said; the table lists each refused flag."""
    config = dict(vars(grpo_args()), kind="grpo", world_size=1, versions=T.versions())
    saved = tmp_path / "config_grpo.json"
    fixed, table = T.FIXED + ("rollout_batch_size", "partial_rollout", "fully_async"), (ROOT / "docs/training.md").read_text()
    runs = ["seed", "prompt_data", "split", "input_key", "label_key", "multimodal_keys", "max_context_len", "allow_image_urls",
            "allow_outside_paths", "lr", "min_lr", "decoupled_lr", "lr_warmup_iters", "lr_decay_style", "adam_beta1",
            "adam_beta2", "weight_decay", "rollout_batch_size", "partial_rollout", "fully_async"]
    for k in runs:
        assert f"--{k.replace('_', '-')}`" in table.split("| may change")[0] or k.startswith("adam_beta"), k
        saved.write_text(json.dumps(dict(config, **{k: "the run's"}), default=str))
        with pytest.raises(SystemExit, match=f"cannot change:\n  --{k.replace('_', '-')} .* \\(the run: the run's\\)\n"):
            T.compare(saved, config, fixed)
    for k in ("n_samples_per_prompt", "rollout_temperature", "max_bad_frac", "eval_prompt_data", "save_interval", "clip_grad"):
        saved.write_text(json.dumps(dict(config, **{k: "the run's"}), default=str))
        T.compare(saved, config, fixed)
        assert capsys.readouterr().out == f"[run] resumed with --{k.replace('_', '-')} {config[k]} (the run: the run's)\n"


def test_a_resume_says_each_changed_flag_and_that_nothing_is_left(tmp_path, capsys):
    import train_grpo
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(QWEN3_VL)
    argv = ["--hf-checkpoint", str(tmp_path / "ckpt"), "--prompt-data", "x", "--num-rollout", "4"]
    save = resumable(tmp_path, "train_grpo", argv, step=4)
    with pytest.raises(SystemExit) as e:  # before any model loads: none could, from this checkpoint folder
        train_grpo.main(argv + ["--save", str(save), "--load", str(save), "--rollout-max-response-len", "64",
                                "--n-samples-per-prompt", "8"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "[run] resumed with --rollout-max-response-len 64 (the run: 256)" in out, out
    assert "--n-samples-per-prompt 8 (the run: 4)" in out and "--global-batch-size" not in out, out  # derived
    assert f"[run] {save / 'iter_0000004'} is step 4; --num-rollout asks for 4: nothing to do (raise --num-rollout" in out
    assert sorted(p.name for p in save.glob("config_*")) == ["config_grpo.json"]


@pytest.mark.parametrize("error,full", [
    (OSError(28, "No space left on device"), True),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), True),
    (RuntimeError("PytorchStreamWriter failed writing file data/3: file write failed"), True),
    (Exception("Error while serializing: I/O error: No space left on device (os error 28)"), True),  # safetensors'
    (OSError(27, "File too large"), False),
    (PermissionError(13, "Permission denied"), False),
])
def test_a_full_disk_is_told_apart(error, full):
    assert T.disk_full(error) == full


@pytest.mark.parametrize("argv,want", [
    (["sft.py", "--lr", "1", "--save", "r"], "sft.py --lr 1 --save r --load r"),
    (["train_grpo.py", "--save=r", "--overwrite", "--rollout-batch-size", "1"],
     "train_grpo.py --save=r --rollout-batch-size 1 --load r"),
    (["sft.py", "--save", "r", "--load", "other"], "sft.py --save r --load other"),
])
def test_the_resume_command_keeps_the_flags_but_overwrite(argv, want, monkeypatch):
    import sft
    import train_grpo
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    args = (sft if argv[0] == "sft.py" else train_grpo).parse_args(argv[1:] + ["--hf-checkpoint", "x", "--prompt-data", "x"])
    assert console.resume_command(argv, args) == f"{sys.executable} {want}"


@pytest.mark.parametrize("metrics,why", [
    ({"zero_adv_frac": 0.5, "grad_norm": 0.3, "truncated_frac": 1.0}, None),  # truncated, yet something to learn
    ({"zero_adv_frac": 1.0, "grad_norm": 0.0, "truncated_frac": 1.0}, "every response was cut at --rollout-max-response-len 256"),
    ({"zero_adv_frac": 1.0, "grad_norm": 0.2, "truncated_frac": 0.5, "reward": 1.0},
     "in every group the rewards were equal (mean reward 1.000): zero advantage"),  # the entropy bonus moves it
    ({"zero_adv_frac": 0.0, "grad_norm": 0.0}, "the gradient was zero"),
    ({"zero_adv_frac": 1.0, "grad_norm": 0.0, "truncated_frac": 1.0, "context_cap_frac": 1.0},
     "every response was cut at --max-context-len 8192: raise it"),  # the cap that cut, not the other
    ({"zero_adv_frac": 1.0, "grad_norm": 0.0, "truncated_frac": 1.0, "context_cap_frac": 0.25},
     "every response was cut at --max-context-len 8192 (25% of them; the rest at --rollout-max-response-len 256)"),
])
def test_a_step_with_nothing_to_learn_is_told_why_once(metrics, why, capsys):
    quiet = 0
    for step in range(2 * console.STALL):
        quiet = console.no_signal(metrics, grpo_args(), step, quiet)
    said = capsys.readouterr().out.splitlines()
    if why is None:
        assert quiet == 0 and said == []
    else:
        assert quiet == 2 * console.STALL and len(said) == 1, said
        assert said[0].startswith(f"[grpo] steps 1-{console.STALL} learnt nothing: {why}"), said


def bash_run(*args, **env):
    """run.sh's refusals: each before it sources setup.sh or starts anything (launch.run reaps what it would)."""
    base = {k: v for k, v in os.environ.items() if k not in ("MODE", "NAME", "RUN", "NUM_GPUS")}
    return launch.run(["bash", ROOT / "run.sh", *args], timeout=60, env=dict(base, **env))


def test_run_sh_says_what_it_takes_and_keeps_a_finished_run(tmp_path):
    r = bash_run("--help")
    assert r.returncode == 0 and r.stdout.startswith("run.sh: the whole recipe") and "OVERWRITE=1" in r.stdout
    r = bash_run(MODE="single_turn")
    assert r.returncode == 2 and "MODE=single_turn is for the GPU recipe" in r.stderr, r.stderr
    r = bash_run("--lr", "1")
    assert r.returncode == 2 and "--lr 1: arguments go to train_grpo.py in the GPU recipe only" in r.stderr
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "summary.md").write_text("a finished run")
    r = bash_run(RUN=str(tmp_path / "demo"))
    assert r.returncode == 2 and "holds a run of no CPU demo" in r.stderr and "OVERWRITE=1" in r.stderr, r.stderr
    assert (tmp_path / "demo" / "summary.md").read_text() == "a finished run"


# run.sh's python in the resume test: each stage's folder and checkpoint at once; the stage FAKE_STOP (with a
# checkpoint if FAKE_CKPT) waits for a Ctrl-C and ends as the trainers do (exit 130)
FAKE_PY = """#!{exe}
import os, pathlib, sys, time
args = sys.argv[1:]
open(os.environ["FAKE_LOG"], "a").write(" ".join(args) + "\\n")
out = pathlib.Path(args[args.index("--save") + 1] if "--save" in args else args[args.index("--out") + 1]
                   if "--out" in args else args[1])
out.mkdir(parents=True, exist_ok=True)
if out.name == os.environ.get("FAKE_STOP"):
    if os.environ.get("FAKE_CKPT"):
        (out / "iter_0000002").mkdir()
        (out / "latest").write_text("iter_0000002")
    (out / "waiting").touch()
    try:
        time.sleep(60)
    except KeyboardInterrupt:
        sys.exit(130)
(out / "iter_0000009").mkdir(exist_ok=True)
(out / "latest").write_text("iter_0000009")
"""


def test_an_interrupted_demo_goes_on_where_it_stopped(tmp_path):
    """run.sh's CPU demo with a fake python: a Ctrl-C in a stage says what a rerun will do; the rerun (plain `bash
    run.sh` on the folder) says it in one line, keeps the stages done, resumes the stage in flight from its
    checkpoint (--load) or starts it again; a rerun with other seeds is refused and deletes nothing."""
    repo, demo, log = tmp_path / "repo", tmp_path / "demo", tmp_path / "calls"
    (repo / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(ROOT / "run.sh", repo)
    (repo / "setup.sh").write_text("")
    (repo / ".venv" / "bin" / "python").write_text(FAKE_PY.format(exe=PY))
    (repo / ".venv" / "bin" / "python").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("NAME", "SEED", "DATA_SEED", "NUM_GPUS", "OVERWRITE")}

    def run_sh(stop=None, **env):  # -> (exit code, stdout, stderr); stop: the stage that waits for Ctrl-C
        p = subprocess.Popen(["bash", str(repo / "run.sh")], env=dict(base, RUN=str(demo), FAKE_LOG=str(log),
                             FAKE_STOP=stop or "", **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.time() + 60
            while stop and not (demo / stop / "waiting").exists():
                assert p.poll() is None and time.time() < deadline, p.communicate()
                time.sleep(0.05)
            if stop:
                os.killpg(p.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the whole foreground group
            out, err = p.communicate(timeout=60)
        finally:
            p.kill()
        return p.returncode, out, err

    def stages():
        return [line.split("\t")[0] for line in (demo / "stages.tsv").read_text().splitlines()]

    code, _, err = run_sh("grpo", FAKE_CKPT="1")
    assert code == 130 and err.splitlines()[-1] == (f"run.sh: interrupted in stage grpo; `bash run.sh` on {demo} "
                                                    f"(same seeds) goes on: grpo resumes from {demo}/grpo/iter_0000002")
    assert stages() == ["data", "sft"]
    log.unlink()
    code, out, err = run_sh()
    assert code == 0, err
    assert out.splitlines()[0] == f"run.sh: {demo} holds this demo; done: data sft (kept); grpo resumes from {demo}/grpo/iter_0000002"
    calls = log.read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["train_grpo.py", "sft.py", "train_grpo.py", "tools/report.py"], calls
    assert f"--save {demo}/grpo --load {demo}/grpo" in calls[0] and stages()[2:] == ["grpo", "sft_crop", "grpo_mt", "report"]
    code, _, err = run_sh("sft_crop", OVERWRITE="1")  # a fresh demo, stopped before the stage's first checkpoint
    assert code == 130 and err.splitlines()[-1].endswith("goes on: sft_crop starts from its beginning"), err
    code, _, err = run_sh(SEED="7")
    assert code == 2 and f"{demo} holds a run of SEED=1234 DATA_SEED=0 (here SEED=7 DATA_SEED=0)" in err, err
    assert stages() == ["data", "sft", "grpo"]


def test_the_tools_run_sh_calls_print_no_megatron_notes():
    """tools/synth.py, tiny.py and report.py (run.sh's) never import megatron-core: without TE and Apex its import
    prints "Transformer Engine and Apex are not installed" notes (docs/model.md) that would only alarm a new user."""
    r = launch.run([PY, "-W", "always", "-c", "import sys, tools.synth, tools.tiny, tools.report; "
                    "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'optim', 'model', 'trainer'}))"],
                   timeout=120, env=ENV)
    assert r.returncode == 0 and r.stdout == "[]\n" and "not installed" not in r.stderr, (r.stdout, r.stderr[-2000:])


def test_report_reads_a_single_run_folder_and_refuses_an_empty_one(tmp_path, capsys):
    from tools import report
    for kind, key in (("grpo", "reward"), ("sft", "loss")):
        run = tmp_path / f"my_{kind}"
        run.mkdir()
        (run / f"config_{kind}.json").write_text("{}")
        lines = [{"step": 0, "eval_accuracy": 0.25}] if kind == "grpo" else []
        lines += [{"step": s, key: 0.1 * s} for s in range(1, 8)] + [{"step": 7, "eval_accuracy": 0.75}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        report.main([str(run)])
    out = capsys.readouterr().out
    assert "| my_grpo (grpo) | - | 0.300 -> 0.500 | single-turn accuracy 0.250 -> 0.750 |" in out, out  # 5 steps' means
    assert "| my_sft (sft) | - | 0.300 -> 0.500 | single-turn accuracy - -> 0.750 |" in out, out
    assert (tmp_path / "my_grpo" / "reward_curve.png").exists()
    with pytest.raises(SystemExit) as e:
        report.main([str(tmp_path)])
    assert e.value.code == 2 and f"no metrics.jsonl in {tmp_path}, nor in its stage folders" in capsys.readouterr().err


# ------------------------------------------------------------------ issue 58: a fork's data, a resume, a newcomer
def jsonl(path, rs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rs))
    return path


@pytest.mark.parametrize("second,extra,said", [
    ({"image_path": "a.png"}, [], "--prompt-data: {d}/train.jsonl: no column 'images'; its columns: answer, image_path, "
     "problem. Name yours with --multimodal-keys '{\"image\": \"COLUMN\"}' \\(docs/data.md\\)$"),
    ({"images": "bad.png"}, [], "(?s)--prompt-data: {d}/train.jsonl: 1 of 2 rows are unusable.*row 1: image 0: cannot"),
    ({"images": "gone.png"}, [], "(?s)--prompt-data: .*row 1: image 0: image file not found: {d}/gone.png"),
    ({}, ["--eval-prompt-data", "{d}/eval.jsonl"], "--eval-prompt-data: {d}/eval.jsonl: no column 'answer'"),
    ({}, ["--rollout-batch-size", "3"], "--rollout-batch-size 3: --prompt-data has 2 usable prompts"),
    ({}, ["--multimodal-keys", '{"video": "clip"}'], "--prompt-data: --multimodal-keys {\"video\": \"clip\"}: images "
     "only here"),
], ids=["image column", "corrupt image", "missing image", "eval label column", "batch above the data", "video"])
def test_every_data_check_runs_before_any_model_is_built(second, extra, said, ckpt, tmp_path, monkeypatch):
    """docs/data.md: the data is checked at load, before any model; each case one message naming it."""
    import model as M
    import train_grpo
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.png").write_bytes(png())
    (d / "bad.png").write_bytes(b"\x89PNG not an image")
    good = {"problem": "<image>How many sides?", "answer": "4", "images": "a.png"}
    if "image_path" in second:  # a fork's column name: every row has it, none has `images`
        good = {"problem": good["problem"], "answer": "4", "image_path": "a.png"}
    jsonl(d / "train.jsonl", [good, dict(good, **second)])
    jsonl(d / "eval.jsonl", [{"problem": good["problem"], "gold": "4", "images": "a.png"}])
    monkeypatch.setattr(M, "load_model", lambda *a, **k: pytest.fail("a model was built before the data was checked"))
    argv = ["--hf-checkpoint", ckpt, "--prompt-data", d / "train.jsonl", "--save", tmp_path / "run",
            "--rollout-batch-size", "1", *extra]
    with pytest.raises(SystemExit, match=said.replace("{d}", str(d))):
        train_grpo.main([str(x).replace("{d}", str(d)) for x in argv])


@pytest.mark.parametrize("entry", ["train_grpo", "sft"])
def test_eval_data_reads_its_own_columns_and_a_missing_one_names_the_eval_flag(entry, tmp_path):
    mod = __import__(entry)
    (tmp_path / "a.png").write_bytes(png())
    jsonl(tmp_path / "train.jsonl", [{"problem": "<image>How many sides?", "answer": "4", "images": "a.png"}])
    jsonl(tmp_path / "eval.jsonl", [{"question": "<image>How many corners?", "gold": "3", "images": "a.png"}])
    argv = ["--hf-checkpoint", "x", "--prompt-data", str(tmp_path / "train.jsonl"), "--save", "x",
            "--eval-prompt-data", str(tmp_path / "eval.jsonl"), "--eval-input-key", "question"]
    with pytest.raises(SystemExit) as e:
        T.load_data(mod.parse_args(argv), evaluation=True)
    assert str(e.value.code).endswith("no column 'answer'; its columns: gold, images, question. Name yours with "
                                      "--eval-label-key (docs/data.md)"), e.value.code
    (rec,) = T.load_data(mod.parse_args(argv + ["--eval-label-key", "gold"]), evaluation=True)
    assert (rec["problem"], rec["answer"]) == ("<image>How many corners?", "3")
    assert T.load_data(mod.parse_args(argv + ["--eval-label-key", "gold"]))[0]["answer"] == "4"  # training: its own


@pytest.mark.parametrize("flag,offered", [([], "calc_score, image_zoom_in_tool"), (["calc_score"], "calc_score"),
                                          (["nope"], None)])
def test_multi_turn_rows_with_no_tools_are_offered_the_default_or_flags_tools_said_once(flag, offered, ckpt, tmp_path,
                                                                                          monkeypatch, capsys):
    import model as M
    import train_grpo
    (tmp_path / "a.png").write_bytes(png())
    row = {"problem": "<image>How many sides?", "answer": "4", "images": "a.png"}
    jsonl(tmp_path / "train.jsonl", [row, dict(row, tools=["image_zoom_in_tool"])])
    loaded, load = [], T.load_data
    monkeypatch.setattr(T, "load_data", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    monkeypatch.setattr(M, "load_model", lambda *a, **k: sys.exit("loaded"))
    argv = ["--hf-checkpoint", ckpt, "--prompt-data", tmp_path / "train.jsonl", "--save", tmp_path / "run",
            "--rollout-batch-size", "1", "--max-turns", "3"] + (["--default-tools", *flag] if flag else [])
    with pytest.raises(SystemExit) as e:
        train_grpo.main([str(x) for x in argv])
    if offered is None:
        assert e.value.code == "--default-tools: tools ['nope']: a list of tool names from calc_score, image_zoom_in_tool"
        return
    said = [x for x in capsys.readouterr().out.splitlines() if "`tools`" in x]
    assert said == [f"[grpo] 1 rows have no `tools`: each is offered {offered} (--default-tools)"]
    assert [r["tools"] for r in loaded[0]] == [offered.split(", "), ["image_zoom_in_tool"]]


def test_prompts_a_response_cannot_fill_under_the_context_cap_are_said_at_load(ckpt, tmp_path, monkeypatch, capsys):
    import model as M
    import train_grpo
    (tmp_path / "a.png").write_bytes(png())
    rs = [{"problem": "<image>How many sides?" + " and" * k, "answer": "4", "images": "a.png"} for k in (0, 400)]
    jsonl(tmp_path / "train.jsonl", rs)
    monkeypatch.setattr(M, "load_model", lambda *a, **k: sys.exit("loaded"))
    argv = ["--hf-checkpoint", ckpt, "--prompt-data", tmp_path / "train.jsonl", "--save", tmp_path / "run",
            "--rollout-batch-size", "1", "--max-context-len", "600", "--rollout-max-response-len", "300"]
    with pytest.raises(SystemExit, match="loaded"):
        train_grpo.main([str(x) for x in argv])
    said = [x for x in capsys.readouterr().out.splitlines() if "--max-context-len" in x]
    assert len(said) == 1 and said[0].startswith("[grpo] 1 of 2 prompts (up to 4"), said  # the longer: 400-odd tokens
    assert said[0].endswith("+ --rollout-max-response-len 300 are over --max-context-len 600, which cuts them first"), said


def test_a_resume_refuses_a_checkpoint_of_another_architecture(tmp_path, capsys):
    """--load RUN with an --hf-checkpoint of another size: refused by name before any model loads (the run
    would train its own weights and write the other model's config.json beside them)."""
    import sft
    from tools import tiny
    (tmp_path / "big").mkdir()
    (tmp_path / "big" / "config.json").write_text(tiny.tiny_config("qwen3_vl", hidden=128).to_json_string())
    argv = ["--hf-checkpoint", str(tmp_path / "big"), "--prompt-data", "x"]
    save = resumable(tmp_path, "sft", argv, config=tiny.tiny_config("qwen3_vl", hidden=64).to_json_string())
    with pytest.raises(SystemExit) as e:
        sft.main(argv + ["--save", str(save), "--load", str(save)])
    said = str(e.value)
    assert said.startswith(f"--hf-checkpoint {tmp_path / 'big'}: not the architecture of {save / 'iter_0000002'} "
                           "(text_config.head_dim 32, the run's 16; text_config.hidden_size 128, the run's 64;"), said
    assert "[model]" not in capsys.readouterr().out and [p.name for p in save.glob("config_*")] == ["config_sft.json"]


def test_weights_that_are_not_finite_are_not_saved_and_the_step_is_named(tmp_path):
    """Issue 68: a run whose weights went NaN ended "done", rc 0, every saved tensor NaN. Now the checkpoint is
    refused naming the step and a tensor, nothing is written and the last checkpoint stays the latest."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(QWEN3_VL)
    par, run = T.start(grpo_args(hf_checkpoint=str(tmp_path / "ckpt"), save=str(tmp_path / "run")), "grpo")
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.bias[1] = float("inf")
    with pytest.raises(SystemExit, match=r"^\[run\] step 3: weights not finite \(NaN or inf: bias\); not saved, "
                                         f"earlier checkpoints kept: lower --lr and resume with --load {tmp_path}/run$"):
        run.save_checkpoint(model, None, None, 3)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock", "args.txt", "config_grpo.json"]


@pytest.mark.parametrize("entry", ["train_grpo", "sft"])
def test_a_run_writes_its_arguments_and_entry_at_args_txt_replays_them(entry, tmp_path):
    mod = __import__(entry)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(QWEN3_VL)
    (tmp_path / "more.txt").write_text("--lr\n2e-4\n--prompt-instruction\nCount the sides.\n")  # an @file of its own
    argv = ["--hf-checkpoint", str(tmp_path / "ckpt"), "--prompt-data", "x", "--save", str(tmp_path / "run"), "--seed", "7",
            f"@{tmp_path / 'more.txt'}", "--lr", "3e-4", "--freeze-vit"]
    args = mod.parse_args(argv)
    T.start(args, entry)
    replayed = mod.parse_args([f"@{tmp_path / 'run' / 'args.txt'}"])
    assert vars(replayed) == vars(args) and (args.lr, args.seed, args.freeze_vit) == (3e-4, 7, True)
    assert args.prompt_instruction == "Count the sides." and "@" not in (tmp_path / "run" / "args.txt").read_text()


def test_the_finite_check_at_save_reads_the_device_once_not_once_a_tensor(tmp_path, monkeypatch):
    """The check above, on a GPU: `not torch.isfinite(p).all()` a parameter waits for the device once a tensor
    (hundreds in a real model); one read of every verdict together, and the names only when one failed (issue 75).
    Every read of a tensor's value to the host (bool, item, tolist) counted, over models of 2 and 24 tensors."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(QWEN3_VL)
    par, run = T.start(grpo_args(hf_checkpoint=str(tmp_path / "ckpt"), save=str(tmp_path / "run")), "grpo")
    reads = []
    for name in ("__bool__", "item", "tolist"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, real=real, name=name):
            reads.append(name)
            return real(self, *a)
        monkeypatch.setattr(torch.Tensor, name, counted)
    seen = []
    for layers in (1, 12):
        model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(layers)))
        with torch.no_grad():
            model[-1].bias[1] = float("nan")
        reads.clear()
        with pytest.raises(SystemExit, match=rf"weights not finite \(NaN or inf: {layers - 1}\.bias\)"):
            run.save_checkpoint(model, None, None, 3)
        seen.append(len(reads))
    assert seen[0] == seen[1] <= 2, seen


@pytest.mark.parametrize("buckets", [1, 2], ids=["model.safetensors", "shards"])
def test_a_checkpoints_weights_have_the_mode_of_its_other_files(buckets, tmp_path):
    """Issue 68: model.safetensors was written 0600 (safetensors' temporary file), config.json 0644."""
    import convert
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    convert.write_hf([[(f"w{i}", torch.zeros(2))] for i in range(buckets)], tmp_path / "out", tmp_path / "src")
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in (tmp_path / "out").iterdir()}
    assert len(modes) == 2 + buckets - (buckets == 1) and len(set(modes.values())) == 1, modes


REAL = ROOT.parent / "shared" / "real_models"


@pytest.mark.parametrize("family", ["Qwen2.5-VL-3B-Instruct", "Qwen3-VL-2B-Instruct", "Qwen3.5-0.8B", "Qwen3.5-35B-A3B"])
def test_a_resume_refuses_another_size_in_every_part_of_the_config(family, tmp_path):
    """Issue 68: the check ignored vision_config (a ViT of another depth or patch size resumed). Each family nests
    its config its own way (Qwen2.5-VL's text fields at the top); every size of every part must be refused."""
    import convert
    if not (REAL / family / "config.json").exists():
        pytest.skip("../shared/real_models not beside the repo")
    config = json.loads((REAL / family / "config.json").read_text())
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps(config))
    parts = {"": config, **{f"{k}.": v for k, v in config.items() if isinstance(v, dict)}}
    sizes = [(p, k) for p, part in parts.items() for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "depth", "num_heads", "patch_size", "out_hidden_size") if k in part]
    assert {"vision_config.depth", "vision_config.patch_size"} <= {p + k for p, k in sizes}
    assert {"text_config.hidden_size", "hidden_size"} & {p + k for p, k in sizes}
    for p, k in sizes:
        other = json.loads(json.dumps(config))
        (other[p[:-1]] if p else other)[k] += 1
        (tmp_path / "new").mkdir(exist_ok=True)
        (tmp_path / "new" / "config.json").write_text(json.dumps(other))
        with pytest.raises(SystemExit, match=f"not the architecture .*[(; ]{p + k} "):
            convert.same_architecture(tmp_path / "new", tmp_path / "run")


def test_a_save_folder_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(QWEN3_VL)
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        T.start(grpo_args(hf_checkpoint=str(tmp_path / "ckpt"), save=str(tmp_path / "file" / "run")), "grpo")
    assert str(e.value) == f"--save {tmp_path}/file/run: cannot be made (Not a directory: {tmp_path}/file/run)"


def test_the_docs_commands_run_without_an_activated_venv():
    """A bare `python` is the system's, without torch: the README and the docs' commands name .venv's."""
    import re
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        bare = re.findall(r"^ *(?:`|\$ )?python3? [\w/]+\.py.*|`python3? [\w/]+\.py[^`]*`", doc.read_text(), re.M)
        assert not bare, (doc.name, bare)


def test_help_says_what_fully_async_does_and_what_staleness_needs(capsys):
    import train_grpo
    with pytest.raises(SystemExit):
        train_grpo.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(miles')" not in out
    assert "--fully-async generation never waits for training: a step takes the first --rollout-batch-size" in out, out
    assert ("--max-weight-staleness K with --partial-rollout or --fully-async: drop a group with a token over K "
            "weight versions old (default: none dropped)") in out, out

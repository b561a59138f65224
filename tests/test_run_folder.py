"""The fault suite's run-folder cases (issue 19, 58, 68): one trainer a folder, a fresh start never mixed with an
earlier run, a torn or corrupt checkpoint named, a resume that refuses what its checkpoint fixes, and a save that
writes no weights that are not finite."""
import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

import console
import launch
import trainer as T

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
from test_faults import grpo_args


# ------------------------------------------------------------------ 1, 2, 9: the run folder
HOLD = """import pathlib, sys, time
import trainer
h = trainer.lock_folder(pathlib.Path(sys.argv[1]))
print("held", flush=True)
time.sleep(60)
"""


def test_one_trainer_per_run_folder_and_a_dead_one_holds_nothing(tmp_path):
    held = T.lock_folder(tmp_path)
    with pytest.raises(SystemExit, match=f"--save {tmp_path}: in use by another trainer \\(pid {os.getpid()}"):
        T.lock_folder(tmp_path)
    held.close()
    (tmp_path / "hold.py").write_text(HOLD)
    child = launch.start(tmp_path / "hold.py", tmp_path)  # another process, forked warm (trainer imported)
    while child.printed() != "held\n":
        assert child.poll() is None, child.wait()
        time.sleep(0.05)
    with pytest.raises(SystemExit, match="in use"):
        T.lock_folder(tmp_path)
    child.kill()
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


QWEN3_VL = json.dumps({"model_type": "qwen3_vl"})  # what trainer.start reads of a checkpoint before the run folder


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
            "allow_outside_paths", "max_pixels", "min_pixels", "lr", "min_lr", "decoupled_lr", "lr_warmup_iters",
            "lr_decay_style", "adam_beta1", "adam_beta2", "weight_decay", "rollout_batch_size", "partial_rollout", "fully_async"]
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

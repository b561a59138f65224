"""Two checks of a colocated SGLang server on one CUDA GPU (issue 75; bench/gpu_smoke.sh runs them), the server
started with sglang_engine's own placement for --colocate (its flags and environment):

    python bench/colocated_check.py graphs TINY_CHECKPOINT RUN_DIR
    SGLANG_HEALTH_CHECK_TIMEOUT=5 python bench/colocated_check.py hung TINY_CHECKPOINT RUN_DIR

graphs: SGLang captures CUDA graphs under the memory saver only with SGLANG_MEMORY_SAVER_CUDA_GRAPH on (sglang
0.5.23 environ.py:1645, default off; model_executor/runner_backend/full_cuda_graph_backend.py:121-124, 185-195):
releasing "cuda_graph" alone must free GPU memory with the placement's 1, and frees nothing with 0; each server
generates again after its resume (the graph pool's contents come back from the host, enable_cpu_backup).
hung: a colocated server answers /health from its status (SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0,
http_server.py:745-749), 200 though its scheduler is stopped; the recovery a failed request runs (Server._recover,
what Server.call does after a ServerDown) asks /health_generate, which answers 503 once SGLANG_HEALTH_CHECK_TIMEOUT
has passed (http_server.py:218, 779-795), and restarts it; the new server generates.
Exit 0 when the check holds; its numbers printed on the last line.
"""
import os
import signal
import sys
import urllib.request
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import sglang_engine as E  # noqa: E402
import train_grpo as G  # noqa: E402


def colocated(ckpt):
    """-> (server flags, environment) of a colocated server on this one GPU (Triton attention, SDPA vision)."""
    args = G.parse_args(["--hf-checkpoint", ckpt, "--prompt-data", "x", "--save", "x", "--rollout-engine", "sglang",
                         "--colocate", "--sglang-attention-backend", "triton", "--sglang-mm-attention-backend", "sdpa",
                         "--sglang-mem-fraction-static", "0.3"])
    return E.sglang_placement(args, True, 1, 1)


def tokens(eng):
    return len(eng.generate([{"input_ids": [1, 2, 3]}], {"max_new_tokens": 4, "temperature": 0.0})[0]["ids"])


def graphs(ckpt, run_dir):
    flags, env = colocated(ckpt)
    freed = {}
    for saver in ("1", "0"):
        eng = E.SGLangEngine(ckpt, f"{run_dir}_{saver}", server_args=flags,
                             env=dict(env, SGLANG_MEMORY_SAVER_CUDA_GRAPH=saver), max_restarts=0)
        try:
            before = torch.cuda.mem_get_info()[0]
            eng.release(("cuda_graph",))
            after = torch.cuda.mem_get_info()[0]
            eng.resume()
            freed[saver] = ((after - before) / 2 ** 20, tokens(eng))
        finally:
            eng.shutdown()
    print(f"placement env {env}; MiB freed by releasing cuda_graph alone, tokens after the resume, by "
          f"SGLANG_MEMORY_SAVER_CUDA_GRAPH: {freed}")
    on, off = freed["1"], freed["0"]
    return env.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH") == "1" and on[0] > off[0] + 1 and on[1] > 0 and off[1] > 0


def schedulers(group):
    """The pids of SGLang's scheduler processes in process group `group` (their title: scheduler.py:6294)."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(p)) == group and Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"sglang::scheduler"):
                found.append(int(p))
        except OSError:  # gone meanwhile
            continue
    return found


def hung(ckpt, run_dir):
    flags, env = colocated(ckpt)
    eng = E.SGLangEngine(ckpt, run_dir, server_args=flags, env=env, max_restarts=1)
    try:
        stopped = schedulers(eng.server.proc.pid)
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        code = urllib.request.urlopen(eng.server.url + "/health", timeout=30).status
        eng.server._recover(eng.server.epoch, "a request timed out")
        n = tokens(eng)
    finally:
        eng.shutdown()
    print(f"schedulers stopped {stopped}; /health {code}; restarts {eng.server.restarts}; tokens after {n}")
    return bool(stopped) and code == 200 and eng.server.restarts == 1 and n > 0


if __name__ == "__main__":
    sys.exit(0 if {"graphs": graphs, "hung": hung}[sys.argv[1]](*sys.argv[2:4]) else 1)

"""--offload-train on one device: how much of the trainer's memory a release frees, and whether the
restore brings back every tensor bit for bit (bench/gpu_smoke.sh runs it on CUDA, where the memory is
torch.cuda.memory_allocated(); on CPU it is the bytes of the trainer's storages).

    python bench/offload_check.py CKPT [--bf16 --use-distributed-optimizer ...]
Prints `freed_frac=F exact=True|False pinned=True|False`; exits 1 unless F >= 0.9, exact and, on CUDA,
every host buffer page-locked at exactly its storage's bytes (offload.pinned), outside torch's pinned
allocator (which would round each up to a power of two: its allocated_bytes would grow by more).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model as M  # noqa: E402
import offload  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
import sft  # noqa: E402


def checksums(model, opt):
    return [float(t.detach().double().sum()) for t in [*model.parameters(), *offload.optimizer_tensors(opt)]]


def pinned_pool():
    """Bytes torch's pinned host allocator holds (0 without CUDA)."""
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) if torch.cuda.is_available() else 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = sft.parse_args(["--hf-checkpoint", argv[0], "--prompt-data", "x", "--save", "x", "--lr", "1e-3", *argv[1:]])
    par = parallel.init_distributed(1)
    model = M.load_model(args.hf_checkpoint, M.ModelOptions.from_args(args), par)
    opt, sched = optim.build_optimizer(model, args, 10)
    seq = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(0))
    (-model([seq])[0].mean()).backward()
    optim.optimizer_step(model, opt, sched, model.par, args)  # Adam's states exist from here on
    off = offload.Offload(model, opt)
    cuda = torch.cuda.is_available()

    def held():
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        return sum(s.nbytes() for v in off.storages().values() for s in v)
    want, before = checksums(model, opt), held()
    sizes = sorted(s.nbytes() for k in ("params", "optimizer") for s in off.storages()[k])
    pool = pinned_pool()
    off.release()
    after, grown = held(), pinned_pool() - pool
    bufs = list(off.host.values())
    pinned = (sorted(h.numel() for h in bufs) == sizes and grown < off.host_bytes()
              and all(h.is_pinned() or not cuda for h in bufs))
    off.restore()
    exact = checksums(model, opt) == want
    freed = 1 - after / before
    print(f"trainer {before / 2**20:.1f} MiB, after release {after / 2**20:.1f} MiB, host "
          f"{off.host_bytes() / 2**20:.1f} MiB (torch's pinned allocator: {grown / 2**20:+.1f} MiB)")
    print(f"freed_frac={freed:.3f} exact={exact} pinned={pinned}")
    return 0 if freed >= 0.9 and exact and pinned else 1


if __name__ == "__main__":
    sys.exit(main())

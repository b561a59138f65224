"""--offload-train on one device: how much of the trainer's memory a release frees, and whether the
restore brings back every tensor bit for bit (bench/gpu_smoke.sh runs it on CUDA, where the memory is
torch.cuda.memory_allocated(); on CPU it is the bytes of the trainer's storages).

    python bench/offload_check.py CKPT [--bf16 --use-distributed-optimizer ...]
Prints `freed_frac=F exact=True|False pinned=True|False returned_frac=R`; exits 1 unless F >= 0.9, exact and, on
CUDA, every host buffer page-locked at exactly its storage's bytes (offload.pinned), outside torch's pinned
allocator (which would round each up to a power of two: its allocated_bytes would grow by more), and R >= 0.9:
the CUDA cache (torch.cuda.memory_reserved) gave back 90% of the trainer's bytes, for another process to take.
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


def measure(argv):
    """One SFT step of CKPT with the trainer's flags `argv` (its Adam states exist from then on), then a release and
    a restore. -> the memory each held (MiB; reserved: torch.cuda.memory_reserved, None on CPU), freed_frac,
    returned_frac (of the trainer's bytes, what the CUDA cache gave back), exact, pinned, passed."""
    args = sft.parse_args(["--hf-checkpoint", argv[0], "--prompt-data", "x", "--save", "x", "--lr", "1e-3", *argv[1:]])
    par = parallel.init_distributed(1)
    model = M.load_model(args.hf_checkpoint, M.ModelOptions.from_args(args), par)
    opt, sched = optim.build_optimizer(model, args, 10)
    seq = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(0)).to(par.device)
    (-model([seq])[0].mean()).backward()
    optim.optimizer_step(model, opt, sched, model.par, args)  # Adam's states exist from here on
    off = offload.Offload(model, opt)
    cuda = torch.cuda.is_available()

    def held():  # (bytes the trainer holds, bytes the CUDA cache holds or None)
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        return sum(s.nbytes() for v in off.storages().values() for s in v), None
    want, (before, reserved) = checksums(model, opt), held()
    sizes = sorted(s.nbytes() for k in ("params", "optimizer") for s in off.storages()[k])
    pool = pinned_pool()
    off.release()
    (after, reserved_after), grown = held(), pinned_pool() - pool
    bufs = list(off.host.values())
    pinned = (sorted(h.numel() for h in bufs) == sizes and grown < off.host_bytes()
              and all(h.is_pinned() or not cuda for h in bufs))
    off.restore()
    exact = checksums(model, opt) == want
    freed = 1 - after / before
    returned = None if reserved is None else (reserved - reserved_after) / before
    mib = {k: None if v is None else v / 2**20 for k, v in dict(
        trainer_mib=before, after_release_mib=after, host_mib=off.host_bytes(), pinned_pool_grown_mib=grown,
        reserved_mib=reserved, reserved_after_release_mib=reserved_after).items()}
    out = dict(mib, freed_frac=freed, returned_frac=returned, exact=exact, pinned=pinned)
    return dict(out, passed=passed(out))


def passed(m):
    """A release frees >= 90% of the trainer's bytes into exactly sized pinned buffers, the restore is bit-exact,
    and on CUDA the cache gives >= 90% back."""
    return m["freed_frac"] >= 0.9 and m["exact"] and m["pinned"] and (m["returned_frac"] is None or m["returned_frac"] >= 0.9)


def main(argv=None):
    m = measure(sys.argv[1:] if argv is None else argv)
    print(f"trainer {m['trainer_mib']:.1f} MiB, after release {m['after_release_mib']:.1f} MiB, host "
          f"{m['host_mib']:.1f} MiB (torch's pinned allocator: {m['pinned_pool_grown_mib']:+.1f} MiB)")
    if m["returned_frac"] is not None:
        print(f"CUDA cache {m['reserved_mib']:.1f} MiB -> {m['reserved_after_release_mib']:.1f} MiB after release")
    print(f"freed_frac={m['freed_frac']:.3f} exact={m['exact']} pinned={m['pinned']} returned_frac={m['returned_frac']}")
    return 0 if m["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())

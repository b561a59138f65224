"""--offload-train: while SGLang generates, the trainer's GPU state waits in host memory, each storage
resized to zero bytes, so that a colocated server can take the GPU (how and why: docs/offload.md).

    off = Offload(model, opt, ref)
    off.release()                       # before the rollout: everything
    off.restore()                       # before training: everything back, bit for bit
    off.release(("optimizer", "grads")) # after training: all but the weights the sync still reads
    off.restore(("optimizer",))         # a checkpoint is due: the states it saves"""
import weakref

import torch

import optim

KINDS = ("params", "grads", "optimizer")  # a storage belongs to the first kind that names it


def optimizer_tensors(opt):
    """The tensors an optimizer owns: its parameters (fp32 masters where it keeps them) and state."""
    for o in optim.inner_optimizers(opt):
        yield from optim.params(o)
        for state in o.state.values():
            yield from (t for t in state.values() if torch.is_tensor(t))


class Offload:
    """The trainer's storages by kind (the policy's and the reference model's), moved out and back."""

    def __init__(self, model, opt, ref=None):
        self.model, self.opt, self.ref = model, opt, ref
        self.out = {}  # kind -> [(storage, host copy or None for zeros, nbytes)]
        self.host = {}  # (kind, i) -> its pinned host buffer, kept from step to step (pinning is slow)

    def storages(self):
        """{kind: [storage]}: every distinct storage on the trainer's device, each under one kind."""
        params = [p for m in (self.model, self.ref) if m is not None for p in m.parameters()]
        named = {"params": params, "optimizer": list(optimizer_tensors(self.opt)),
                 "grads": [t for p in params for t in (p.grad, getattr(p, "main_grad", None)) if t is not None]}
        device, seen, out = self.model.par.device, set(), {k: [] for k in KINDS}
        for kind in KINDS:
            for t in named[kind]:
                s = t.untyped_storage()
                if t.device == device and s.nbytes() and s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    out[kind].append(s)
        return out

    def release(self, kinds=KINDS):
        """Park `kinds` (those not parked already) in host memory and free their GPU memory."""
        cuda, found = torch.cuda.is_available(), self.storages()
        for kind in [k for k in kinds if k not in self.out]:
            self.out[kind] = []
            for i, s in enumerate(found[kind]):
                host = None
                if kind != "grads":
                    host = self.host.get((kind, i))
                    if host is None or host.numel() != s.nbytes():
                        host = self.host[kind, i] = pinned(s.nbytes())
                    host.copy_(_bytes(s), non_blocking=cuda)
                self.out[kind].append((s, host, s.nbytes()))
        if cuda:
            torch.cuda.synchronize()  # the copies are done before their sources go
        for kind in kinds:
            for s, _, _ in self.out[kind]:
                s.resize_(0)
        if cuda:
            torch.cuda.empty_cache()

    def restore(self, kinds=KINDS):
        """The parked storages of `kinds` back on the device, as they were (gradients as zeros)."""
        for kind in [k for k in kinds if k in self.out]:
            for s, host, n in self.out.pop(kind):
                s.resize_(n)
                _bytes(s).zero_() if host is None else _bytes(s).copy_(host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def host_bytes(self):
        """The host memory this holds: a buffer per parked storage but the gradients', kept between steps."""
        return sum(h.numel() for h in self.host.values())


def pinned(nbytes):
    """A host buffer of exactly nbytes, page-locked where CUDA is (pin_memory=True would round it up to a
    power of two: docs/offload.md)."""
    host = torch.empty(nbytes, dtype=torch.uint8)
    if torch.cuda.is_available():
        cudart = torch.cuda.cudart()
        if err := int(cudart.cudaHostRegister(host.data_ptr(), nbytes, 1)):  # 1: cudaHostRegisterPortable
            raise RuntimeError(f"--offload-train: cudaHostRegister of {nbytes} bytes failed (cudaError {err})")
        weakref.finalize(host, cudart.cudaHostUnregister, host.data_ptr())
    return host


def _bytes(storage):
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

"""Rollout engines: the small interface rollout.py drives, and the in-process transformers engine.

    engine = LocalEngine(hf_dir, device="cpu")       # or sglang_engine.SGLangEngine (GPU)
    outs = engine.generate([{"input_ids": ids, "images": [pil]}], dict(temperature=1.0, max_new_tokens=64))
    engine.update_weights(convert.export_hf(model))

An engine knows nothing of samples, episodes or rewards (rollout.py); how LocalEngine maps checkpoint names
and how its Sampler draws: docs/local_engine.md."""
import re

import numpy as np
import torch
from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig, StoppingCriteria
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (Concatenate, MergeModulelist, WeightConverter, WeightRenaming,
                                             rename_source_key)

import data

IMAGE_PAD = "<|image_pad|>"


class Engine:
    """generate(batch, sampling) -> [{"ids", "logprobs", "finish", "prompt_tokens"[, "error"][, "routed_experts"]}].
    batch items: {"input_ids": [int], "images": [PIL][, "max_new_tokens": int][, "routed_experts_start": int]};
    sampling: {temperature, top_p, top_k, max_new_tokens, stop_token_ids}. logprobs are
    log_softmax(logits / T) of the new ids (T = 1 for greedy; before top-p/top-k, as SGLang
    reports them). An engine made to record routes (R3) also returns "routed_experts": (n, layers, k)
    int16, the experts each MoE layer chose for the positions routed_experts_start .. prompt + new - 2
    (the last new token is never forwarded), -1 at a layer without experts. update_weights(buckets of
    (HF name, full tensor)) -> tensors loaded. Both are each engine's own."""

    concurrent = False  # generate may be called from many threads at once (else rollout batches rounds)

    def release(self, tags=None):
        """Free the engine's GPU memory for training (a server's); in process there is nothing to do."""

    def resume(self, tags=None):
        """Take back what release() freed."""

    def shutdown(self):
        """Stop the engine's server, if it has one."""

    def abort(self):
        """Cut every request in flight short (--partial-rollout): each answers "abort" with its tokens so far."""

    def sync_plan(self):
        """(trainer ranks that each serialise their own copy of a weight bucket, its dtype): one
        but for a colocated SGLang server of TP > 1 (sglang_engine.serialize_on_ranks)."""
        return 1, None


def finish_reason(ids, stops, limit, reported):
    """Why a generation of `ids` ended: its last id a stop token ("stop"), at the token limit ("length"), else
    what the engine `reported`; an aborted one may have written its turn's last token (SGLangEngine)."""
    return "stop" if ids and ids[-1] in stops else "length" if len(ids) >= limit else reported


class LocalEngine(Engine):
    """A transformers model in process (fp32): `generate` with KV cache on left-padded batches; HF computes the
    MRoPE positions."""

    def __init__(self, hf_dir, device="cpu", max_batch=16, processor=None, routed_experts=False):
        self.device, self.max_batch = torch.device(device), max_batch
        self.processor = processor or AutoProcessor.from_pretrained(hf_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).to(self.device).eval()
        tok = self.processor.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        # clean: a checkpoint's defaults (repetition_penalty, top_k=20...) would change the sampling
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id, eos_token_id=tok.eos_token_id)
        self.image_pad = tok.convert_tokens_to_ids(IMAGE_PAD)
        # checkpoint names -> the model's, as from_pretrained maps them; the names it ignores are skipped
        conv = get_model_conversion_mapping(self.model)
        self.converters = [c for c in conv if isinstance(c, WeightConverter)]
        self.renamings = [c for c in conv if isinstance(c, WeightRenaming)]
        self.ignored = "|".join(f"({p})" for p in self.model._keys_to_ignore_on_load_unexpected or ()) or None
        self.recording = None  # R3: {layer: [(B * n, k) expert ids of each forward]} during a generate
        self.route_shape, self.aborts = None, 0  # abort(): generates begun before it stop at their next token
        if routed_experts:  # forward hooks on transformers' routers: (logits, scores, indices) out
            tc = self.model.config.get_text_config()
            self.route_shape = (tc.num_hidden_layers, tc.num_experts_per_tok)
            for name, m in self.model.named_modules():
                if type(m).__name__.endswith("TopKRouter"):
                    m.register_forward_hook(self._record(int(re.search(r"layers\.(\d+)\.", name).group(1))))
            if not getattr(tc, "num_experts", None):
                raise ValueError(f"routed_experts: {hf_dir} is not a MoE model")

    def _record(self, layer):
        def hook(module, inputs, out):
            if self.recording is not None:
                self.recording.setdefault(layer, []).append(out[2].detach().cpu())
        return hook

    def generate(self, batch, sampling):  # HF's generate runs under no_grad
        return [out for i in range(0, len(batch), self.max_batch)
                for out in self._generate(batch[i:i + self.max_batch], sampling)]

    def _generate(self, batch, sp):
        lens = [len(b["input_ids"]) for b in batch]
        B, L = len(batch), max(lens)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)      # (B, L), left padded
        for i, b in enumerate(batch):
            ids[i, L - lens[i]:] = torch.tensor(b["input_ids"])
        mask = (torch.arange(L) >= L - torch.tensor(lens)[:, None]).long()
        kw = dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == self.image_pad).long() * mask)
        if images := [im for b in batch for im in b["images"]]:
            enc = self.processor.image_processor(images=data.views(images), return_tensors="pt")
            kw.update(pixel_values=enc["pixel_values"].to(self.model.dtype), image_grid_thw=enc["image_grid_thw"])
        limits = [b.get("max_new_tokens", sp["max_new_tokens"]) for b in batch]
        stop = list(sp.get("stop_token_ids") or [self.processor.tokenizer.eos_token_id])
        sampler = Sampler(float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0)), sp.get("top_k", -1) or -1)
        # HF's greedy loop, our Sampler as its last logits processor: HF's own sampling is far slower
        gc = GenerationConfig(do_sample=False, max_new_tokens=max(limits), eos_token_id=stop, pad_token_id=self.pad_id)
        self.recording = {} if self.route_shape else None
        cut = _Aborted(self, self.aborts)
        try:
            res = self.model.generate(**{k: v.to(self.device) for k, v in kw.items()}, generation_config=gc,
                                      logits_processor=[sampler], stopping_criteria=[cut])
            routes = self._routes(B)
        finally:
            self.recording = None
        new = res[:, L:].cpu()                                           # (B, N)
        sampler.settle(res[:, -1])
        lp = torch.stack(sampler.logprobs, 1).cpu()                      # (B, N)
        outs = []
        for i in range(B):
            row = new[i, :limits[i]].tolist()
            end = next((k for k, t in enumerate(row) if t in stop), None)
            n = len(row) if end is None else end + 1
            finish = finish_reason(row[:n], stop, limits[i], "abort" if cut.fired else "length")
            outs.append({"ids": row[:n], "logprobs": lp[i, :n].tolist(), "finish": finish, "prompt_tokens": lens[i]})
            if routes is not None:  # row i's positions sit at L - lens[i] .. in the left-padded batch
                first = L - lens[i] + batch[i].get("routed_experts_start", 0)
                outs[-1]["routed_experts"] = routes[i, first:L + n - 1]
        return outs

    def _routes(self, B):
        """The recorded forwards -> (B, L + steps, layers, k) int16 expert ids, -1 at a dense layer."""
        if self.recording is None:
            return None
        calls = [torch.cat([c.view(B, -1, c.shape[-1]) for c in cs], 1) for cs in self.recording.values()]
        out = np.full((B, calls[0].shape[1], *self.route_shape), -1, dtype=np.int16)
        for layer, c in zip(self.recording, calls):
            out[:, :, layer] = c.numpy()
        return out

    def abort(self):
        self.aborts += 1

    def update_weights(self, buckets):
        """Copy (HF name, full tensor) buckets into the model as from_pretrained would (a per-expert tensor into
        its slice of the fused one; names it ignores skipped). -> tensors loaded."""
        params, n = self.model.state_dict(), 0
        with torch.no_grad():
            for name, t in (item for bucket in buckets for item in bucket):
                if name not in params and self.ignored and re.search(self.ignored, name):
                    continue
                p = self._target(name, params)
                if p.shape != t.shape:
                    raise ValueError(f"update_weights: {name} is {tuple(t.shape)}, model has {tuple(p.shape)}")
                p.copy_(t.to(p.device, p.dtype))
                n += 1
        return n

    def _target(self, name, params):
        """The model tensor, or the view of one, that checkpoint tensor `name` loads into."""
        if name in params:
            return params[name]
        target, pattern = rename_source_key(name, self.renamings, self.converters, self.model.base_model_prefix, params)
        if target not in params:
            raise KeyError(f"update_weights: {name!r} is not a weight of {type(self.model).__name__}")
        if pattern is None:  # renamed only
            return params[target]
        conv = next(c for c in self.converters if pattern in c.source_patterns)
        merge, *cat = conv.operations  # per-expert -> fused: stack the experts, then join [gate, up]
        if not isinstance(merge, MergeModulelist) or len(cat) > 1 or not all(isinstance(o, Concatenate) for o in cat):
            raise KeyError(f"update_weights: {name!r} loads into {target} through {conv.operations}, which this "
                           "engine does not apply")
        x = params[target].select(merge.dim, int(re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), name)[1]))
        if cat:  # this source's part of the stacked dim, one fewer once the expert's is selected
            parts = x.chunk(len(conv.source_patterns), cat[0].dim - (cat[0].dim > merge.dim))
            x = parts[conv.source_patterns.index(pattern)]
        return x


class _Aborted(StoppingCriteria):
    """Ends a generate once its engine's abort() has been called since it began."""

    def __init__(self, engine, epoch):
        self.engine, self.epoch, self.fired = engine, epoch, False

    def __call__(self, input_ids, scores, **kwargs):
        self.fired = self.fired or self.engine.aborts != self.epoch
        return torch.full((len(input_ids),), self.fired, dtype=torch.bool, device=input_ids.device)


BLOCK = 1024  # vocabulary entries per block of the Sampler's two-level inverse-CDF draw


class Sampler:
    """A logits processor that draws each next token itself from softmax(logits / T) after top-k / top-p
    (argmax when T <= 0) by a two-level inverse CDF, and returns -inf everywhere but the drawn token (one tensor,
    rewritten at each call), so a greedy generate takes it. `logprobs[j]` (B,) = log_softmax(logits_j / T)[token j]
    of the raw logits (T = 1 when greedy; before top-k / top-p, as SGLang reports them), whichever token was taken."""

    def __init__(self, temperature, top_p=1.0, top_k=-1):
        self.T, self.top_p, self.top_k = temperature, top_p, top_k
        self.logprobs, self.prev = [], None
        self.mask, self.taken = None, None  # the (B, V) tensor returned, rewritten at each call; its 0s' columns

    def settle(self, tokens):  # (B,) the tokens taken from the previous step's logits
        if self.prev is not None:
            z, lse = self.prev
            self.logprobs.append(z.gather(1, tokens[:, None].to(z.device))[:, 0] - lse)
            self.prev = None

    def __call__(self, input_ids, scores):                               # (B, L), (B, V) fp32
        self.settle(input_ids[:, -1])
        z = scores.float() / self.T if self.T > 0 and self.T != 1 else scores.float()
        m = z.amax(-1, keepdim=True)
        e = (z - m).exp_()                                               # unnormalised softmax
        mass = block_sums(e)                                             # (B, blocks), fp64
        # log-sum-exp from fp64 sums of the blocks: ~1e-7 of fp64 where logits span tens of nats
        self.prev = (z, m[:, 0] + mass.sum(-1).log().to(z.dtype))
        if self.T <= 0:
            pick = z.argmax(-1)
        else:
            if self.top_k > 0:
                e = e.masked_fill(z < z.topk(min(self.top_k, z.shape[-1])).values[:, -1:], 0.0)
            if self.top_p < 1.0:  # keep the fewest most likely tokens whose mass reaches top_p
                sp, si = e.sort(-1, descending=True)
                e = e.scatter(1, si, sp.masked_fill(sp.cumsum(-1) - sp >= self.top_p * sp.sum(-1, keepdim=True), 0.0))
            if self.top_k > 0 or self.top_p < 1.0:
                mass = block_sums(e)
            pick = draw(e, mass)
        # one -inf tensor a generate, its 0 moved: a fresh (B, V) one a token cost more than the draw (page faults)
        if self.mask is None or self.mask.shape != scores.shape:
            self.mask = torch.full_like(scores, float("-inf"))
        else:
            self.mask.scatter_(1, self.taken[:, None], float("-inf"))
        self.taken = pick
        return self.mask.scatter_(1, pick[:, None], 0.0)


def block_sums(e):
    """(B, V) -> (B, ceil(V / BLOCK)) fp64 sums of consecutive blocks of BLOCK entries."""
    full = e.shape[1] // BLOCK * BLOCK
    sums = e[:, :full].reshape(len(e), -1, BLOCK).sum(-1)
    if full < e.shape[1]:  # the last, shorter block
        sums = torch.cat([sums, e[:, full:].sum(-1, keepdim=True)], 1)
    return sums.double()


def draw(e, mass):
    """One index a row of the nonnegative weights e (B, V), with probability e / sum(e); mass =
    block_sums(e). Sums in fp64: in fp32 a sum near 1 moves in steps of 6e-8."""
    c = mass.cumsum(-1)                                                  # (B, blocks)
    u = torch.rand(len(c), 1, dtype=c.dtype, device=c.device) * c[:, -1:]
    blk = torch.searchsorted(c, u, right=True).clamp(max=c.shape[1] - 1)  # first block whose end passes u
    u = u - (c.gather(1, blk) - mass.gather(1, blk))                     # what is left inside it
    cols = blk * BLOCK + torch.arange(BLOCK, device=e.device)            # (B, BLOCK)
    w = torch.where(cols < e.shape[1], e.gather(1, cols.clamp(max=e.shape[1] - 1)), 0.0).double().cumsum(-1)
    # rounding may leave u outside [0, the block's sum): keep it inside, on a token of mass > 0
    u = torch.minimum(u.clamp(min=0.0), torch.nextafter(w[:, -1:], torch.zeros_like(w[:, -1:])))
    return (blk * BLOCK + torch.searchsorted(w, u, right=True))[:, 0]

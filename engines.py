"""Rollout engines: the small interface rollout.py drives, and the in-process transformers engine.

    engine = LocalEngine(hf_dir, device="cpu")       # or sglang_engine.SGLangEngine (GPU)
    outs = engine.generate([{"input_ids": ids, "images": [pil]}], dict(temperature=1.0, max_new_tokens=64))
    engine.update_weights(convert.export_hf(model))

An engine takes token ids and images and returns token ids and their logprobs; it knows nothing
of samples, episodes or rewards (rollout.py), so rollout.py and the engines do not import each other.
"""
IMAGE_PAD = "<|image_pad|>"


class Engine:
    """generate(batch, sampling) -> [{"ids", "logprobs", "finish", "prompt_tokens"[, "error"]}].
    batch items: {"input_ids": [int], "images": [PIL][, "max_new_tokens": int]};
    sampling: {temperature, top_p, top_k, max_new_tokens, stop_token_ids}. logprobs are
    log_softmax(logits / T) of the new ids (T = 1 for greedy; before top-p/top-k, as SGLang
    reports them). `LocalEngine` runs transformers in process, `SGLangEngine` (sglang_engine.py)
    a stock `sglang.launch_server` subprocess on rank 0."""

    def generate(self, batch, sampling):
        raise NotImplementedError

    def update_weights(self, buckets):
        raise NotImplementedError

    # A server engine frees its GPU memory for training (release), takes it back (resume),
    # drops its caches (flush) and stops (shutdown); in process there is nothing to do.
    def release(self):
        pass

    def resume(self):
        pass

    def flush(self):
        pass

    def shutdown(self):
        pass


class LocalEngine(Engine):
    """A transformers model in process (fp32 by default): `generate` with KV cache on left-padded
    batches; HF computes the MRoPE positions."""

    def __init__(self, hf_dir, device="cpu", dtype="float32", max_batch=16, processor=None):
        import torch
        from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.device, self.max_batch = torch.device(device), max_batch
        self.processor = processor or AutoProcessor.from_pretrained(hf_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=dtype).to(self.device).eval()
        tok = self.processor.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        # A clean generation config: a checkpoint's defaults (repetition_penalty, top_k=20...)
        # would otherwise change the sampling distribution behind our back.
        self.model.generation_config = GenerationConfig(pad_token_id=self.pad_id, eos_token_id=tok.eos_token_id)
        self.image_pad = tok.convert_tokens_to_ids(IMAGE_PAD)

    def generate(self, batch, sampling):  # HF's generate runs under no_grad
        return [out for i in range(0, len(batch), self.max_batch)
                for out in self._generate(batch[i:i + self.max_batch], sampling)]

    def _generate(self, batch, sp):
        import torch
        from transformers import GenerationConfig
        lens = [len(b["input_ids"]) for b in batch]
        B, L = len(batch), max(lens)
        ids = torch.full((B, L), self.pad_id, dtype=torch.long)      # (B, L), left padded
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, b in enumerate(batch):
            ids[i, L - lens[i]:] = torch.tensor(b["input_ids"])
            mask[i, L - lens[i]:] = 1
        kw = dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == self.image_pad).long() * mask)
        images = [im for b in batch for im in b["images"]]
        if images:
            enc = self.processor.image_processor(images=images, return_tensors="pt")
            pixels, grid = enc["pixel_values"], enc["image_grid_thw"]
            kw.update(pixel_values=pixels.to(self.model.dtype), image_grid_thw=grid)
        limits = [b.get("max_new_tokens", sp["max_new_tokens"]) for b in batch]
        stop = list(sp.get("stop_token_ids") or [self.processor.tokenizer.eos_token_id])
        sampler = Sampler(float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0)), sp.get("top_k", -1) or -1)
        # HF's greedy loop with our Sampler as its last logits processor: the Sampler draws the
        # token and leaves only it finite, so argmax takes it (HF's own sampling, multinomial over
        # softmax, draws one random number per vocabulary entry: 166 ms a step at B=16, V=152k).
        gc = GenerationConfig(do_sample=False, max_new_tokens=max(limits), eos_token_id=stop, pad_token_id=self.pad_id)
        res = self.model.generate(**{k: v.to(self.device) for k, v in kw.items()}, generation_config=gc,
                                  logits_processor=[sampler])
        new = res[:, L:].cpu()                                           # (B, N)
        sampler.settle(res[:, -1])
        lp = torch.stack(sampler.logprobs, 1).cpu()                      # (B, N)
        outs = []
        for i in range(B):
            row = new[i, :limits[i]].tolist()
            cut = next((k for k, t in enumerate(row) if t in stop), None)
            n = len(row) if cut is None else cut + 1
            outs.append({"ids": row[:n], "logprobs": lp[i, :n].tolist(),
                         "finish": "length" if cut is None else "stop", "prompt_tokens": lens[i]})
        return outs

    def update_weights(self, buckets):
        """Copy (HF name, full tensor) buckets into the model; returns the number of tensors."""
        import torch
        params, n = self.model.state_dict(), 0
        with torch.no_grad():
            for name, t in (item for bucket in buckets for item in bucket):
                if name not in params:
                    raise KeyError(f"update_weights: {name!r} is not a weight of {type(self.model).__name__}")
                p = params[name]
                if p.shape != t.shape:
                    raise ValueError(f"update_weights: {name} is {tuple(t.shape)}, "
                                     f"model has {tuple(p.shape)}")
                p.copy_(t.to(p.device, p.dtype))
                n += 1
        return n


class Sampler:
    """A logits processor that draws each next token itself: an inverse-CDF draw (one uniform
    number a row, searched in the cumulative sum of softmax(logits / T) after top-k / top-p; same
    distribution as torch.multinomial), or argmax when T <= 0. It returns -inf everywhere but the
    drawn token, so a greedy generate takes it, and a processor placed after it may still force
    another. `logprobs[j]` (B,) = log_softmax(logits_j / T)[token j] from the raw logits (T = 1 when
    greedy; before top-k / top-p, as SGLang reports them), whichever token was finally taken."""

    def __init__(self, temperature, top_p=1.0, top_k=-1):
        self.T, self.top_p, self.top_k = temperature, top_p, top_k
        self.logprobs, self.prev = [], None

    def settle(self, tokens):  # (B,) the tokens taken from the previous step's logits
        if self.prev is not None:
            z, lse = self.prev
            self.logprobs.append(z.gather(1, tokens[:, None].to(z.device))[:, 0] - lse)
            self.prev = None

    def __call__(self, input_ids, scores):                               # (B, L), (B, V) fp32
        import torch
        self.settle(input_ids[:, -1])
        z = scores.float() / (self.T if self.T > 0 else 1.0)
        # fp32 logsumexp: within ~1e-6 of fp64 where logits span tens of nats (fp32 log_softmax: ~1e-5)
        self.prev = (z, torch.logsumexp(z, -1))
        if self.T <= 0:
            pick = z.argmax(-1)
        else:
            if self.top_k > 0:
                z = z.masked_fill(z < z.topk(min(self.top_k, z.shape[-1])).values[:, -1:], float("-inf"))
            p = torch.softmax(z, -1)
            if self.top_p < 1.0:  # keep the fewest most likely tokens whose mass reaches top_p
                sp, si = p.sort(-1, descending=True)
                p = p.scatter(1, si, sp.masked_fill(sp.cumsum(-1) - sp >= self.top_p, 0.0))
            # fp64 cumsum: in fp32 the sum near 1 has steps of 6e-8, 1% of a token's mass at V=152k
            c = p.double().cumsum(-1)                                    # (B, V)
            u = torch.rand(len(c), 1, dtype=c.dtype, device=c.device) * c[:, -1:]
            pick = torch.searchsorted(c, u, right=True)[:, 0].clamp(max=c.shape[-1] - 1)
        return torch.full_like(scores, float("-inf")).scatter_(1, pick[:, None], 0.0)

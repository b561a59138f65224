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
        T = float(sp.get("temperature", 1.0))
        greedy = T <= 0
        stop = list(sp.get("stop_token_ids") or [self.processor.tokenizer.eos_token_id])
        warp = {} if greedy else dict(temperature=T, top_p=float(sp.get("top_p", 1.0)),
                                      top_k=max(sp.get("top_k", -1) or 0, 0))
        gc = GenerationConfig(do_sample=not greedy, max_new_tokens=max(limits), eos_token_id=stop,
                              pad_token_id=self.pad_id, output_logits=True, return_dict_in_generate=True, **warp)
        res = self.model.generate(**{k: v.to(self.device) for k, v in kw.items()}, generation_config=gc)
        new = res.sequences[:, L:].cpu()                                 # (B, N)
        scale = 1.0 if greedy else T
        # res.logits[j]: (B, V) raw logits of step j; one step at a time, never (B, N, V) at once.
        # fp64 log-softmax: in fp32 the sum over 152k logits is off by ~1e-5, larger than the
        # train-vs-rollout agreement we check (the trainer's chunked log-softmax is within 1e-6).
        rows = torch.arange(B)
        lp = torch.stack([torch.log_softmax(step.double() / scale, -1)[rows, new[:, j].to(step.device)].float().cpu()
                          for j, step in enumerate(res.logits)], 1)      # (B, N)
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

"""The fakes the tests share (one copy each): scripted engines, a model of fixed logprobs and an env factory.

    eng = ScriptedEngine(processor, [CROP_CALL, ANSWER])       # turn k of every episode writes script[k]
    eng = ScriptedEngine(processor, lambda item: plans[...])    # each episode its own turns
    eng = ForcedFirstTurnEngine(ckpt, processor=processor)      # the local engine, its first turn forced to CROP_CALL
    model = FakeModel([-0.6, -0.7, -2.0])                      # policy_loss's plumbing without Megatron
    env = make_env(max_turns=5, rm_type="geo3k")               # env_geo3k on a row of `picture()`
"""

import numpy as np
import torch
from PIL import Image

import engines
import env_geo3k
import rollout

CROP_CALL = '<tool_call>\n{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 500, 500]}}\n</tool_call>'
ANSWER = "The crop shows the polygon. \\boxed{360}"


class ScriptedEngine(engines.Engine):
    """Answers turn k of a request (counted by the assistant headers in its ids) with script[k], the last turn
    after that; `script` is a list of turns, or a function of the request's item giving its episode's turns.
    Keeps what it was sent (seen: (ids, images)); a turn over max_new_tokens is cut there ("length")."""

    def __init__(self, processor, script, finish="stop"):
        self.tok, self.script, self.finish, self.seen = processor.tokenizer, script, finish, []
        self.im_end = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.header = self.tok.encode("<|im_start|>assistant\n")

    def turn(self, ids):
        h = self.header
        return sum(ids[i:i + len(h)] == h for i in range(len(ids))) - 1

    def generate(self, batch, sampling):
        outs = []
        for item in batch:
            self.seen.append((list(item["input_ids"]), list(item["images"])))
            turns = self.script(item) if callable(self.script) else self.script
            text = turns[min(self.turn(item["input_ids"]), len(turns) - 1)]
            ids = self.tok.encode(text, add_special_tokens=False) + [self.im_end]
            limit = item.get("max_new_tokens", sampling["max_new_tokens"])
            finish = "length" if len(ids) > limit else self.finish
            ids = ids[:limit]
            outs.append({"ids": ids, "logprobs": [-0.5] * len(ids), "finish": finish,
                         "prompt_tokens": len(item["input_ids"])})
        return outs


class ForceTokens:
    """A logits processor that makes generate emit `script` (then keeps repeating its last id):
    every other id gets -inf. The engine's logprobs come from the raw logits, so they are the
    model's own probabilities of the forced ids, computed by the engine's cached decode."""

    def __init__(self, script, prompt_len):
        self.script, self.prompt_len = script, prompt_len

    def __call__(self, input_ids, scores):                              # (B, L), (B, V)
        step = min(input_ids.shape[1] - self.prompt_len, len(self.script) - 1)
        forced = torch.full_like(scores, float("-inf"))
        forced[:, self.script[step]] = 0.0
        return forced


class ForcedFirstTurnEngine(engines.LocalEngine):
    """Turn 1 (a prompt with one image): LocalEngine's own generate and logprobs, every step forced
    to the crop call's tokens; later turns: plain LocalEngine sampling, on a prompt that now holds
    two images. The reference (teacher_logprobs: one full forward, no cache) shares no code with it."""

    def generate(self, batch, sampling):
        first = [i for i, item in enumerate(batch) if len(item["images"]) == 1]
        rest = [i for i in range(len(batch)) if i not in first]
        out = [None] * len(batch)
        if first:
            tok = self.processor.tokenizer
            script = tok.encode(CROP_CALL) + [tok.convert_tokens_to_ids("<|im_end|>")]
            prompt_len = max(len(batch[i]["input_ids"]) for i in first)   # generate left-pads to it
            plain = self.model.generate
            force = ForceTokens(script, prompt_len)  # after the engine's Sampler, so it has the last word
            self.model.generate = lambda **kw: plain(**dict(kw, logits_processor=kw["logits_processor"] + [force]))
            try:
                for i, o in zip(first, super().generate([batch[i] for i in first], sampling)):
                    assert o["ids"] == script
                    out[i] = o
            finally:
                del self.model.generate                                   # the class's method again
        for i, o in zip(rest, super().generate([batch[i] for i in rest], sampling)):
            out[i] = o
        return out


class FakeModel(torch.nn.Module):
    """Returns fixed token logprobs (a parameter, so the loss has a gradient) and zero entropy: the scored
    tokens of a micro-batch, in item order, from `offset` on."""

    def __init__(self, logp, par=None):
        super().__init__()
        self.logp, self.offset, self.par = torch.nn.Parameter(torch.tensor(logp)), 0, par

    def forward(self, seqs, loss_masks, pixel_values=None, image_grid_thw=None, temperature=1.0, with_entropy=False):
        n = [int(m.sum()) for m in loss_masks]
        starts = [sum(n[:i]) for i in range(len(n))]  # this micro-batch's tokens, in item order
        idx = torch.cat([torch.arange(s, s + k) for s, k in zip(starts, n)])
        return self.logp[self.offset + idx], torch.zeros(len(idx))


def picture(w=200, h=100):
    """Every pixel distinct, so a crop at the wrong offset cannot pass."""
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x % 256, y % 256, (x * 7 + y * 13) % 256], -1).astype(np.uint8)
    return Image.fromarray(rgb)


def make_env(max_turns=5, row=None, **opts):
    """env_geo3k's env on `row` (default: answer 80, one picture()); opts: the args it reads (oracle, rm_type...)."""
    row = {"answer": "80", "images": [picture()]} if row is None else row
    from conftest import rollout_args
    args = rollout_args(max_turns=max_turns)  # as the trainer parses them: the tools' own flags too
    vars(args).update(opts)
    return env_geo3k.build_env(row, args)


def run_episodes(engine, processor, records, args):
    """n_samples_per_prompt episodes per record (group = record position), scored."""
    return rollout.generate_group_samples(engine, processor, records, args)

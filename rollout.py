"""Rollouts: `Sample`, prompts and observations through the chat template, single/multi-turn
generation with exact token bookkeeping, group sampling and scoring.

    engine = train_grpo.make_engine(args, hf_dir, run_dir)   # engines.LocalEngine / SGLangEngine
    samples = generate_group_samples(engine, processor, records, args)

Token-in/token-out: a sample's token list is built once, here (encode_prompt, the engine's ids,
encode_observation); it is what the engine is sent each turn and what the trainer reads, and
nothing the model wrote is ever re-tokenised. Each turn checks that the engine saw exactly the
tokens sent (SGLang re-expanding image tokens shows as a prompt length mismatch), each sample that
its placeholder runs match the images' grids. A sample failing a check is `failed` with its reason
and an all-zero loss mask; neither it nor an `aborted` one is trained on.
"""
import math
import os
import sys
from dataclasses import dataclass, field

from tqdm import tqdm

import data
import env_geo3k
import model
import reward

IM_END, ENDOFTEXT = "<|im_end|>", "<|endoftext|>"
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


@dataclass
class Sample:
    """One response to one prompt: what crosses from the rollout to the trainer."""
    prompt_ids: list                 # chat-template prompt, image pads expanded
    response_ids: list = field(default_factory=list)       # model + observation tokens
    loss_mask: list = field(default_factory=list)          # 1 = the model wrote it
    rollout_logprobs: list = field(default_factory=list)   # engine logprob; 0.0 where mask 0
    images: list = field(default_factory=list)             # PIL, in order of their pads
    image_turns: list = field(default_factory=list)        # turn that brought each image
    label: str = ""
    reward: float = 0.0
    status: str = "completed"        # completed | truncated | aborted | failed
    fail_reason: str = None
    turns: int = 0
    tool_calls: int = 0
    group: int = 0                   # position of the prompt in this rollout's records
    index: int = 0                   # the prompt's index in the data
    response_text: str = ""          # the model's turns, decoded (observations excluded)
    metadata: dict = field(default_factory=dict)           # env step infos, format_ok, ...

    @property
    def tokens(self):
        return self.prompt_ids + self.response_ids


def add_rollout_args(p):
    g = p.add_argument_group("rollout")
    g.add_argument("--rollout-engine", default="auto", choices=["auto", "sglang", "local"],
                   help="auto: SGLang when importable and CUDA is present, else in-process transformers")
    g.add_argument("--rollout-batch-size", type=int, default=8, help="prompts per rollout")
    g.add_argument("--n-samples-per-prompt", type=int, default=4, help="responses per prompt (GRPO group)")
    g.add_argument("--rollout-max-response-len", type=int, default=256,
                   help="token budget of a whole response (model + observation turns)")
    g.add_argument("--rollout-temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--rollout-top-p", type=float, default=1.0, help="nucleus sampling")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--max-turns", type=int, default=1, help="1 = single-turn; >1 drives env_geo3k")
    g.add_argument("--max-context-len", type=int, default=8192, help="prompt + response token cap")
    g.add_argument("--dynamic-sampling", action="store_true",
                   help="drop groups whose rewards are all equal; top up from the extra prompts given")
    g.add_argument("--rm-type", default="math", help="reward.get_reward_fn type")
    g.add_argument("--sglang-server-timeout", type=float, default=900.0,
                   help="seconds to wait for the SGLang server's /health")
    return p


def sglang_server_args(argv):
    """Unknown trainer flags -> SGLang server flags: `--sglang-<name> [values]` -> `--<name> [values]`.
    Anything else is an error (a typo must not pass silently)."""
    out = []
    for a in argv:
        if a.startswith("--sglang-"):
            name, eq, value = a[len("--sglang-"):].partition("=")
            out.append("--" + name)
            if eq:
                out.append(value)
        elif a.startswith("--") or not out:
            raise SystemExit(f"unknown argument {a!r} (server flags are passed as --sglang-<name> <value>)")
        else:
            out.append(a)  # a flag's value; nargs='+' flags take several: --cuda-graph-bs 1 2 4
    return out


def encode_images(processor, images):
    """-> (pixel_values (sum patches, C*T*P*P), image_grid_thw (n, 3)) as the trainer feeds them."""
    if not images:
        return None, None
    out = processor.image_processor(images=list(images), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def render(processor, messages, tools=None, add_generation_prompt=False):
    """The chat template's text for `messages` (tools reach only templates that render them)."""
    return processor.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def chat_prompt(processor, record, multi_turn=False):
    """-> (messages, tools) of a record's prompt. Multi-turn: the tools go in the model's own
    trained format where its template renders a `tools=` list (Qwen3-VL, Qwen3.5, tiny.py's),
    else (Qwen2.5-VL ignores it) as env_geo3k's hand-written list in the system prompt."""
    if not multi_turn:
        return data.prompt_messages(record), None
    probe = [{"role": "user", "content": "?"}]
    if render(processor, probe, env_geo3k.TOOL_SPECS) != render(processor, probe):
        return data.prompt_messages(record, multi_turn=True), env_geo3k.TOOL_SPECS
    return data.prompt_messages(record, multi_turn=True, tool_list=env_geo3k.usage()), None


def encode_prompt(processor, messages, images, tools=None):
    text = render(processor, messages, tools, add_generation_prompt=True)
    return list(processor(text=[text], images=list(images) or None)["input_ids"][0])


def assistant_opener(processor, messages, tools=None):
    """What the generation prompt writes after `<|im_start|>assistant\\n`, which the model's text
    continues: "" for Qwen2.5-VL / Qwen3-VL, "<think>\\n\\n</think>\\n\\n" for Qwen3.5 with thinking
    off (0.8B, 2B), "<think>\\n" with it on (4B and up)."""
    head = "<|im_start|>assistant\n"
    before = render(processor, messages, tools)
    after = render(processor, messages, tools, add_generation_prompt=True)
    if not after.startswith(before + head):
        raise ValueError(f"the generation prompt {after[len(before):][:40]!r} does not open an assistant turn")
    return after[len(before) + len(head):]


def encode_observation(processor, history, message, images, tools=None):
    """Tokens appended after a model turn that ended in <|im_end|>: what the chat template adds
    to `history` (prompt, model turns as assistant messages, earlier tool messages) when the tool
    `message` and the next generation prompt follow, from the last <|im_end|> on: "\\n", the tool
    turn (a user turn with <tool_response> for Qwen3-VL / Qwen3.5, a `tool` turn for Qwen2.5-VL),
    the assistant header. The whole conversation is rendered, as real templates need (Qwen2.5-VL
    adds a default system prompt, Qwen3.5 raises without a user query), and only the added text
    tokenised; the history's rendering must be an exact prefix of the longer one, or this raises."""
    before = render(processor, history, tools)
    after = render(processor, history + [message], tools, add_generation_prompt=True)
    if not after.startswith(before):
        k = len(os.path.commonprefix([before, after]))
        raise ValueError(f"the chat template renders earlier turns differently once a tool turn follows "
                         f"(at char {k}: {before[k:k + 40]!r} vs {after[k:k + 40]!r})")
    cut = before.rfind(IM_END) + len(IM_END)
    if cut < len(IM_END) or before[cut:].strip():
        raise ValueError(f"the chat template does not end an assistant turn with {IM_END} "
                         f"(it ends {before[-40:]!r})")
    return list(processor(text=[after[cut:]], images=list(images) or None)["input_ids"][0])


def encode_target(processor, messages, text, tools=None):
    """Token ids the model should write after the prompt `messages` (and the generation prompt)
    to answer `text`, through <|im_end|>, as the template renders that answer: text + <|im_end|>
    for most templates, but "\\n</think>\\n\\n" + text + <|im_end|> for Qwen3.5 with thinking on,
    whose generation prompt leaves <think> open (SFT targets; prompt ids: encode_prompt)."""
    prompt = render(processor, messages, tools, add_generation_prompt=True)
    full = render(processor, messages + [{"role": "assistant", "content": text}], tools)
    end = full.rfind(IM_END) + len(IM_END)
    if not full.startswith(prompt) or end <= len(prompt):
        raise ValueError(f"the chat template's answer turn does not continue its generation prompt "
                         f"({full[len(prompt) - 20:len(prompt) + 20]!r})")
    return processor.tokenizer.encode(full[len(prompt):end], add_special_tokens=False)


def check_images(processor, ids, images):
    """None if every image's placeholder count is what its grid implies, else the reason."""
    start, end, pad = processor.tokenizer.convert_tokens_to_ids([VISION_START, VISION_END, IMAGE_PAD])
    runs, n = [], None  # lengths of the pad runs between <|vision_start|> and <|vision_end|>
    for t in ids:
        if t == start:
            n = 0
        elif t == pad and n is not None:
            n += 1
        elif t == end and n is not None:
            runs.append(n)
            n = None
    total = sum(t == pad for t in ids)
    _, grid = encode_images(processor, images)
    want = [] if grid is None else model.image_tokens(grid, processor.image_processor.merge_size)
    if runs != want or total != sum(want):
        return f"image placeholders {runs} (total {total}) != grids imply {want}"
    return None


def _fail(s, reason):
    s.status, s.fail_reason, s.reward = "failed", reason, 0.0
    s.loss_mask = [0] * len(s.response_ids)  # never trained on, even by a trainer that forgets


def _episode(processor, rec, args, group, multi, prompt):
    """-> (sample, env, chat): `chat` holds the conversation as messages (model turns as assistant
    messages with their text), which the chat template renders to frame each observation.
    `prompt` = (messages, tools, prompt ids), made once per record and shared by its group."""
    images = list(rec["images"])
    messages, tools, ids = prompt
    messages = list(messages)  # each episode appends its own turns
    s = Sample(prompt_ids=list(ids), images=images, image_turns=[0] * len(images), label=str(rec["answer"]),
               group=group, index=rec.get("index", group), metadata={"steps": []})
    env, chat = None, None
    if multi:
        env = env_geo3k.build_env(rec, args)
        env.reset()
        chat = {"messages": messages, "tools": tools, "opener": assistant_opener(processor, messages, tools)}
    return s, env, chat


def _finish_turn(s, env, chat, out, processor, args, stops):
    """Append one engine answer to `s`; run the env; append its observation. -> still active?"""
    ids, lps = list(out["ids"]), list(out["logprobs"])
    if out.get("error"):
        return _fail(s, out["error"])
    if out.get("prompt_tokens") not in (None, len(s.tokens)):
        return _fail(s, f"engine saw {out['prompt_tokens']} prompt tokens, was sent {len(s.tokens)} "
                        "(image tokens expanded twice?)")
    if len(lps) != len(ids) or not all(math.isfinite(x) and x <= 1e-6 for x in lps):
        return _fail(s, f"engine returned {len(ids)} ids with {len(lps)} logprobs (or non-finite ones)")
    s.response_ids += ids
    s.loss_mask += [1] * len(ids)
    s.rollout_logprobs += lps
    s.turns += 1
    text = processor.tokenizer.decode([t for t in ids if t not in stops], skip_special_tokens=False)
    s.response_text += ("\n" if s.turns > 1 else "") + text
    if out["finish"] == "abort":  # cut short by the server: incomplete, never trained on
        s.status, s.loss_mask = "aborted", [0] * len(s.response_ids)
        return False
    if out["finish"] == "length":
        s.status = "truncated"
        return False
    if env is None:  # single-turn
        return False
    obs, done, info = env.step(text)
    s.metadata["steps"].append(dict(info, observation=obs["text"]))
    s.tool_calls += int(bool(info.get("ran")))  # calls that ran, not every <tool_call> tag
    if done:
        return False
    im_end = processor.tokenizer.convert_tokens_to_ids(IM_END)
    close = [] if ids and ids[-1] == im_end else [im_end]  # stopped on another stop token
    # The model's text continues the generation prompt's opener (Qwen3.5's <think> block), so the
    # assistant message is opener + text: the template renders it as the tokens the model saw and
    # wrote (for canonically tokenised text), and a thinking template finds its </think> in it.
    chat["messages"].append({"role": "assistant", "content": chat["opener"] + text})
    message = env.format_observation(obs)
    obs_ids = close + encode_observation(processor, chat["messages"], message, obs["images"], chat["tools"])
    chat["messages"].append(message)
    if (len(s.response_ids) + len(obs_ids) >= args.rollout_max_response_len
            or len(s.tokens) + len(obs_ids) >= args.max_context_len):
        s.status = "truncated"
        return False
    s.response_ids += obs_ids
    s.loss_mask += [0] * len(obs_ids)
    s.rollout_logprobs += [0.0] * len(obs_ids)
    s.images += list(obs["images"])
    s.image_turns += [s.turns] * len(obs["images"])
    return True


def run_episodes(engine, processor, records, args, groups=None):
    """n_samples_per_prompt episodes per record, turn by turn: each round sends every active
    episode's tokens to the engine at once (SGLang keeps them all in flight)."""
    multi = args.max_turns > 1
    n = args.n_samples_per_prompt
    groups = groups if groups is not None else list(range(len(records)))
    eps = []
    for rec, g in zip(records, groups):  # the chat template and the processor once per prompt, not per sample
        messages, tools = chat_prompt(processor, rec, multi)
        prompt = (messages, tools, encode_prompt(processor, messages, list(rec["images"]), tools))
        eps += [_episode(processor, rec, args, g, multi, prompt) for _ in range(n)]
    stops = processor.tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    sampling = dict(temperature=args.rollout_temperature, stop_token_ids=stops,
                    top_p=args.rollout_top_p, top_k=args.rollout_top_k)
    budget, context = args.rollout_max_response_len, args.max_context_len
    active = list(range(len(eps)))
    bar = tqdm(total=len(eps), desc="rollout", file=sys.stderr, mininterval=1.0, leave=False)
    while active:
        reqs, live = [], []
        for i in active:
            s = eps[i][0]
            room = min(budget - len(s.response_ids), context - len(s.tokens))
            if room <= 0:
                s.status = "truncated"
                continue
            live.append(i)
            reqs.append({"input_ids": s.tokens, "images": s.images, "max_new_tokens": room})
        longest = max([r["max_new_tokens"] for r in reqs], default=0)
        outs = engine.generate(reqs, dict(sampling, max_new_tokens=longest)) if reqs else []
        active = []
        for i, out in zip(live, outs):
            s, env, chat = eps[i]
            try:
                if _finish_turn(s, env, chat, out, processor, args, stops):  # falsy once failed
                    active.append(i)
            except Exception as e:  # noqa: BLE001 - one bad episode must not end the rollout
                _fail(s, f"{type(e).__name__}: {e}")
        bar.update(len(eps) - len(active) - bar.n)
    bar.close()
    for s, env, _ in eps:
        if env is not None:
            env.close()
        reason = None if s.status == "failed" else check_images(processor, s.tokens, s.images)
        if reason:
            _fail(s, reason)
    return [s for s, _, _ in eps]


def _score(samples, args, reward_fn):
    """reward.py's RM (a process pool for big batches) or `reward_fn`; failed samples get 0."""
    live = [s for s in samples if s.status != "failed"]
    texts, labels = [s.response_text for s in live], [s.label for s in live]
    rewards = (reward.batch_rewards(texts, labels, args.rm_type)
               if reward_fn is None else [reward_fn(t, lab) for t, lab in zip(texts, labels)])
    for s, r in zip(live, rewards):
        s.reward = float(r)
    for s in samples:
        s.metadata["format_ok"] = bool(reward.format_ok(s.response_text))


def generate_group_samples(engine, processor, records, args, reward_fn=None):
    """records x n_samples_per_prompt scored samples (group = record position). With
    args.dynamic_sampling, groups whose rewards are all equal are dropped and replaced from
    the records not yet used, until rollout_batch_size groups are kept (the caller passes
    more records than that: the over-sample)."""
    if not args.dynamic_sampling:
        samples = run_episodes(engine, processor, records, args)
        _score(samples, args, reward_fn)
        return samples
    target = args.rollout_batch_size or len(records)
    kept, pos, drawn = [], 0, 0
    while len(kept) < target and pos < len(records):
        rate = len(kept) / drawn if drawn else 1.0   # observed keep rate sizes the next draw
        take = min(len(records) - pos, math.ceil((target - len(kept)) / max(rate, 0.25)))
        idx = list(range(pos, pos + take))
        pos, drawn = pos + take, drawn + take
        samples = run_episodes(engine, processor, [records[i] for i in idx], args, groups=idx)
        _score(samples, args, reward_fn)
        for g in idx:
            group = [s for s in samples if s.group == g]
            if len({s.reward for s in group}) > 1:
                kept.append(group)
    out = [s for group in kept[:target] for s in group]
    for s in out:
        s.metadata["ds_drawn_groups"], s.metadata["ds_kept_groups"] = drawn, len(kept)
    return out


def rollout_metrics(samples):
    """Means over samples; reward and accuracy over the ones not failed."""
    n = max(len(samples), 1)
    ok = [s for s in samples if s.status != "failed"] or [Sample(prompt_ids=[])]
    m = {"reward": sum(s.reward for s in ok) / len(ok),
         "accuracy": sum(s.reward > 0 for s in ok) / len(ok),
         "response_len": sum(sum(s.loss_mask) for s in ok) / len(ok),
         "truncated_frac": sum(s.status == "truncated" for s in samples) / n,
         "aborted_frac": sum(s.status == "aborted" for s in samples) / n,
         "failed_frac": sum(s.status == "failed" for s in samples) / n,
         "turns": sum(s.turns for s in samples) / n,
         "tool_calls": sum(s.tool_calls for s in samples) / n,
         "format_ok_frac": sum(bool(s.metadata.get("format_ok")) for s in samples) / n,
         "samples": len(samples)}
    if samples and "ds_drawn_groups" in samples[0].metadata:
        m["ds_keep_frac"] = samples[0].metadata["ds_kept_groups"] / max(samples[0].metadata["ds_drawn_groups"], 1)
    return m

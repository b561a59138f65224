"""How a conversation becomes tokens, through the model's own chat template: a prompt (with the tools
a row offers), each observation a tool turn appends, an SFT target, and the check that a sample's image
placeholders match its images' grids. Rollouts (rollout.py) and SFT (sft.py) both encode here, so a
trained conversation is token for token what a rollout of it would be."""
import os

import data
import model
import task

IM_END, ENDOFTEXT = "<|im_end|>", "<|endoftext|>"
VISION_START, VISION_END, IMAGE_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"


def encode_images(processor, images):
    """-> (pixel_values (sum patches, C*T*P*P), image_grid_thw (n, 3)) as the trainer feeds them."""
    if not images:
        return None, None
    out = processor.image_processor(images=data.views(images), return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def render(processor, messages, tools=None, add_generation_prompt=False):
    """The chat template's text for `messages` (tools reach only templates that render them)."""
    return processor.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)


def template_tools(processor, record, env):
    """The tools the env module offers the record (task.tools) as the template's `tools=` specs, or None where it
    renders none (or none are offered)."""
    names = task.tools(env, record)
    specs = env.specs(names) if names else None
    probe = [{"role": "user", "content": "?"}]
    return specs if specs and render(processor, probe, specs) != render(processor, probe) else None


def encode_prompt(processor, messages, images, tools=None):
    text = render(processor, messages, tools, add_generation_prompt=True)
    return list(processor(text=[text], images=data.views(images) or None)["input_ids"][0])


def prompt(processor, record, env=None, instruction=data.INSTRUCTION):
    """-> (messages, tools, token ids) of a record's prompt as a rollout encodes it (the processor checks its images);
    multi-turn (`env`: the env module), the tools it offers the row as the template's `tools=` or as usage lines in the
    system prompt (docs/rollout.md); a row offered none has no system prompt."""
    names = task.tools(env, record) if env is not None else []
    tools = template_tools(processor, record, env) if names else None
    usage = task.usage(env, names) if names and tools is None else None
    messages = data.prompt_messages(record, bool(names), usage, instruction)
    return messages, tools, encode_prompt(processor, messages, record["images"], tools)


def assistant_opener(processor, messages, tools=None):
    """What the generation prompt writes after `<|im_start|>assistant\\n`, which the model's text continues:
    "" or Qwen3.5's think block (docs/rollout.md)."""
    head = "<|im_start|>assistant\n"
    before = render(processor, messages, tools)
    after = render(processor, messages, tools, add_generation_prompt=True)
    if not after.startswith(before + head):
        raise ValueError(f"the generation prompt {after[len(before):][:40]!r} does not open an assistant turn")
    return after[len(before) + len(head):]


def encode_observation(processor, history, message, images, tools=None):
    """Tokens appended after a model turn that ended in <|im_end|>: what the chat template adds to `history`
    (prompt, model turns, earlier tool messages) when the tool `message` and the next generation prompt
    follow, from the last <|im_end|> on (docs/rollout.md). ValueError if it renders the history otherwise."""
    before = render(processor, history, tools)
    after = render(processor, history + [message], tools, add_generation_prompt=True)
    if not after.startswith(before):
        k = len(os.path.commonprefix([before, after]))
        raise ValueError(f"the chat template renders earlier turns differently once a tool turn follows "
                         f"(at char {k}: {before[k:k + 40]!r} vs {after[k:k + 40]!r})")
    cut = before.rfind(IM_END) + len(IM_END)
    if cut < len(IM_END) or before[cut:].strip():
        raise ValueError(f"the chat template does not end a turn with {IM_END} (it ends {before[-40:]!r})")
    return list(processor(text=[after[cut:]], images=data.views(images) or None)["input_ids"][0])


def encode_target(processor, messages, text, tools=None):
    """Token ids the model should write after the prompt `messages` and the generation prompt to answer `text`,
    through <|im_end|>, as the template renders that answer (SFT targets; Qwen3.5's: docs/rollout.md)."""
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
    return None if runs == want and total == sum(want) else f"image placeholders {runs} (total {total}) != grids imply {want}"

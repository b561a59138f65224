"""A user's own environment in a file of its own (docs/extending.md, "Your own task"): arithmetic word problems,
text only, with one tool, `calculate`, that evaluates + - * / and brackets of numbers (nothing else is evaluated).

    python train_grpo.py ... --max-turns 3 --rollout-interaction-env-path examples.env_calc --prompt-data calc.jsonl

Rows: {"problem": "A crate holds 37 boxes of 41 pens. How many pens?", "answer": "1517"} (no image column).
"""
import ast
import operator

import env_geo3k  # the Tool declaration (its flags and spec); nothing of the geo3k env itself
import reward     # strict_json: the project's guarded JSON reader

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.USub: operator.neg, ast.UAdd: operator.pos}


def arithmetic(node):
    """The value of a parsed expression of numbers and OPS only; ValueError for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](arithmetic(node.left), arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](arithmetic(node.operand))
    raise ValueError("only numbers, + - * / and brackets")


def calculate(env, arguments):
    expression = str(arguments["expression"])[:200]
    try:
        value = arithmetic(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        raise env_geo3k.ToolError(f"cannot evaluate {expression!r}: {e}") from None
    return f"{expression} = {value:g}", [], {}


TOOLS = {"calculate": env_geo3k.Tool(
    calculate, 'calculate {"expression": "37 * 41"}: evaluate arithmetic.', "Evaluate an arithmetic expression.",
    {"expression": {"type": "string", "description": "numbers with + - * / and brackets"}}, {"expression": "6 * 7"})}


def offered(names=None):
    if names is not None and list(names) != ["calculate"]:
        raise ValueError(f"tools {names!r}: this task has only calculate")
    return ["calculate"]


def specs(names):
    return [TOOLS[n].spec(n) for n in names]


def usage(names):
    return 'Call the tool like this:\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


def tool_metrics(steps, correct, names):
    return {"tool_calls_calculate": sum(bool(i.get("ran")) for st in steps for i in st) / max(1, len(steps))}


class CalcEnv:
    def __init__(self, record, max_turns):
        self.record, self.max_turns, self.turn = record, max_turns, 0

    def reset(self):
        self.turn = 0
        return {"text": "", "images": []}, {"turn": 0}

    def step(self, response_text):
        """Run the last <tool_call>; no call ends the episode."""
        self.turn += 1
        info = {"turn": self.turn, "tool": None, "ran": False, "error": None}
        start = response_text.rfind("<tool_call>")
        end = response_text.find("</tool_call>", start)
        if start < 0 or end < 0:
            return {"text": "", "images": []}, True, info
        try:
            call = reward.strict_json(response_text[start + len("<tool_call>"):end])
            info["tool"] = call["name"]
            if call["name"] != "calculate" or not isinstance(call.get("arguments"), dict):
                raise env_geo3k.ToolError(usage(["calculate"]))
            text, _, _ = calculate(self, call["arguments"])
            info["ran"] = True
        except (ValueError, KeyError, TypeError, env_geo3k.ToolError) as e:
            text = f"Error: {e}"
            info["error"] = text
        return {"text": text, "images": []}, self.turn >= self.max_turns, info

    def format_observation(self, observation):
        return {"role": "tool", "content": [{"type": "text", "text": observation["text"]}]}

    def close(self):
        pass


def build_env(sample=None, args=None, **_):
    return CalcEnv(dict(sample), args.max_turns)

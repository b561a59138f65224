"""How the code reads, in numbers (issue 26): lines of the core (top-level *.py) and of tools/,
the core's lines of code (no blanks, docstrings or comment-only lines), the classes over 150 lines and functions over 70, import circles among the core and tools/ (the
core must not import tools/), each trainer's flags and their argparse groups, and README's length. Run from anywhere: python bench/code_shape.py [--code DIR]"""
import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path


def lines(path):
    return sum(1 for _ in open(path))


def code_lines(path):
    """Lines of code: not blank, not a comment alone, not inside a docstring (issue 51's 4,500 budget)."""
    tree = ast.parse(path.read_text())
    doc = set()
    for n in ast.walk(tree):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i, line in enumerate(path.read_text().splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and i not in doc)


def long_defs(path, cls_max=150, fn_max=70):
    out = []
    for n in ast.walk(ast.parse(path.read_text())):
        size = getattr(n, "end_lineno", 0) - getattr(n, "lineno", 0) + 1
        if isinstance(n, ast.ClassDef) and size > cls_max or \
                isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > fn_max:
            out.append(f"{path.name}:{n.name} {size}")
    return out


def imports(f):
    """Module names file `f` imports (`from a import b`: both a and a.b, b may be a module)."""
    found = set()
    for n in ast.walk(ast.parse(f.read_text())):
        if isinstance(n, ast.Import):
            found |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom) and n.module:
            found |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
    return found


def circles(files, deps):
    """Import circles among `files` (module name: the file's stem, tools/x.py as tools.x), each once;
    deps: {file: imports(file)}."""
    names = {("tools." if f.parent.name == "tools" else "") + f.stem: f for f in files}
    edges = {name: deps[f] & set(names) for name, f in names.items()}
    out = set()

    def walk(path):
        for nxt in edges[path[-1]]:
            if nxt == path[0]:
                out.add(tuple(sorted(path)))
            elif nxt not in path and len(path) < 8:
                walk(path + [nxt])
    for name in names:
        walk([name])
    return sorted(" <-> ".join(c) for c in out)


def flags(code, script):
    """(flags, groups with at least one flag) of `script --help`, read from its build_parser() (a
    checkout older than it prints "?": RESULTS.md has 0f92aef's numbers)."""
    probe = ("import sys, json; sys.argv = ['x']; import {m} as t; p = t.build_parser()\n"
             "groups = [g for g in p._action_groups if any(a.dest != 'help' for a in g._group_actions)]\n"
             "print(json.dumps([sum(a.dest != 'help' for a in p._actions), len(groups)]))").format(m=script)
    out = subprocess.run([sys.executable, "-c", probe], cwd=code, capture_output=True, text=True)
    if out.returncode:
        return f"? ({out.stderr.strip().splitlines()[-1] if out.stderr.strip() else 'failed'})"
    n, g = json.loads(out.stdout.strip().splitlines()[-1])
    return {"flags": n, "groups": g}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--code", default=str(Path(__file__).resolve().parents[1]), help="checkout to measure")
    code = Path(p.parse_args().code)
    core = sorted(code.glob("*.py"))
    tools = sorted((code / "tools").glob("*.py")) if (code / "tools").is_dir() else []
    deps = {f: imports(f) for f in core + tools}  # each file parsed once
    report = {"core_lines": sum(map(lines, core)), "core_code_lines": sum(map(code_lines, core)),
              "tools_lines": sum(map(lines, tools)),
              "largest_files": sorted(((lines(f), f.name) for f in core), reverse=True)[:5],
              "over_size": [d for f in core for d in long_defs(f)],
              "import_circles": circles(core + tools, deps),
              "core_imports_tools": [f.name for f in core if any(m.split(".")[0] == "tools" for m in deps[f])],
              "readme_lines": lines(code / "README.md"),
              "train_grpo": flags(code, "train_grpo"), "sft": flags(code, "sft")}
    for k, v in report.items():
        print(f"{k:14s} {v}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()

"""A task's own parts, each named by one flag and found in a file of the user's own (docs/extending.md, "Your own
task"): the env module (--rollout-interaction-env-path, miles' name), a judge (--custom-rm-path, slime's) and a
dynamic-sampling filter (--dynamic-sampling-filter-path, slime's). The built-ins are entries of the same kind:
env_geo3k is the default env, FILTERS' nonzero_std the default filter, reward.REWARDS the judges.

    env = task.env(args)                      # the env module: build_env(sample, args) -> the seed's env API
    names = task.tools(env, record)           # the tools a row gets from it ([] where the module offers none)

An env module needs only `build_env`; what else it has is read where it exists: `offered(names)`, `specs(names)`,
`usage(names)` (its tools, the prompt's list), `tool_metrics(steps, correct, names)`, `TOOLS` (entries with `flags`)."""
import argparse
import collections
import importlib

ENV, JUDGE, FILTER = "--rollout-interaction-env-path", "--custom-rm-path", "--dynamic-sampling-filter-path"
Filter = collections.namedtuple("Filter", ["keep", "flags"], defaults=({},))  # keep(samples of a group, args) -> bool


def nonzero_std(samples, args):
    """DAPO's dynamic sampling: a group whose answers are all right or all wrong has no advantage to learn from."""
    return len({s.correct for s in samples}) > 1


FILTERS = {"nonzero_std": Filter(nonzero_std)}  # --dynamic-sampling-filter-path: an entry's name or module.function


def load(flag, path, attribute=True):
    """`path` ("module.function", or "module" where not `attribute`), imported once; ValueError naming flag and path."""
    module, _, name = path.rpartition(".") if attribute else (path, "", "")
    try:
        found = importlib.import_module(module) if module else None
    except ImportError as e:
        raise ValueError(f"{flag} {path}: cannot import {module!r} ({e}); give a dotted path importable from the "
                         "working folder or PYTHONPATH") from None
    if found is None or (attribute and not callable(getattr(found, name, None))):
        raise ValueError(f"{flag} {path}: want module.function, and {module or path!r} has no function {name!r}")
    if not attribute and not callable(getattr(found, "build_env", None)):
        raise ValueError(f"{flag} {path}: the module has no build_env(sample, args)")
    return getattr(found, name) if attribute else found


def env(args):
    """The env module args name (default env_geo3k)."""
    return load(ENV, getattr(args, "rollout_interaction_env_path", None) or "env_geo3k", attribute=False)


def judge(name):
    """A judge: a reward.REWARDS name's entry is the caller's to look up; anything else is --custom-rm-path's path."""
    return load(JUDGE, name)


def group_filter(args):
    """The dynamic-sampling filter as a Filter: a FILTERS entry, or a function by path (its `flags` attribute, if any)."""
    name = getattr(args, "dynamic_sampling_filter_path", None) or "nonzero_std"
    if name in FILTERS:
        return FILTERS[name]
    fn = load(FILTER, name)
    return Filter(fn, getattr(fn, "flags", {}))


def flags(module):
    """The flags an env module's tools declare (its TOOLS entries' `flags`)."""
    return {n: kw for tool in getattr(module, "TOOLS", {}).values() for n, kw in tool.flags.items()}


def chosen(argv):
    """The env module and the filter that argv names, before the parser is built (their flags join it). ValueError."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, fromfile_prefix_chars="@")
    for flag in (ENV, JUDGE, FILTER):
        pre.add_argument(flag, default=None)
    named, _ = pre.parse_known_args(argv)
    if named.custom_rm_path:
        judge(named.custom_rm_path)
    return env(named), group_filter(named)


def tools(module, record):
    """The names of the tools a row gets: the env module's `offered(row's tools)`, [] where it offers none."""
    if not hasattr(module, "offered"):
        if record.get("tools"):
            raise ValueError(f"tools {record['tools']!r}: the env {module.__name__} offers no tools")
        return []
    return module.offered(record.get("tools"))


def usage(module, names):
    """The call format and the tools' lines for a system prompt, None where the module writes none."""
    return module.usage(names) if names and hasattr(module, "usage") else None


def metrics(module, steps, correct, names):
    """The env's tool metrics over a rollout's episodes, {} where it has none (or single-turn)."""
    return module.tool_metrics(steps, correct, names) if hasattr(module, "tool_metrics") else {}

"""`--config FILE.yaml` for every entry point, and the resolved flags a training run writes to OUTPUT_DIR/config.yaml.

A config file is a flat YAML mapping of flag names (the parsed names, as `vars(args)` has them: `actor_learning_rate`,
`data_path`) to values. It is turned into command-line tokens placed before the real command line and parsed once, by
the entry point's own parser, so a value is converted and checked exactly as the flag is:

    scalar       `lr: 1e-5` -> `--lr=1e-5` (the text as written in the file: YAML's own types play no part)
    list         `data_path: [a, b]` -> `--data_path a b`; a scalar is a one-item list; `[]` is an empty one (nargs=*)
    switch       `offload: true` -> `--offload`; `false` -> nothing. A dest with two switches takes the one it names:
                 `do_sample: false` -> `--greedy`, `rollout_logprobs: false` -> `--no_rollout_logprobs`
    repeatable   `policy: [a=x, b=y]` -> `--policy=a=x --policy=b=y` (action="append")
    null         (also `~` or nothing) the flag's default

Precedence: a flag on the command line wins over every file (the file's value of that flag is dropped, whatever the
flag's kind: a list, a repeatable flag and either switch of a mutually exclusive pair are replaced, not merged); of
several `--config` files, a later file's key wins, and a `null` there puts the flag back to its default. A file cannot
turn off from the command line a switch it turns on (the switches have no negative form): edit the file, or layer one
that says `false`. Refused, each in one line naming the file and the key: a missing or unreadable file, bad YAML, a
document that is not a mapping, an unknown key (with the closest flag), a nested value, a list for a one-value flag,
a switch that is not true/false, a value its flag's type or choices refuse, a list item that argparse would read as
a flag (`-x`; negative numbers are fine). The file is read with yaml.safe_load's rules (nothing in it runs code).

`ConfigFileParser` is the entry points' parser class: it has the `--config` flag and expands it in
`parse_known_args`, so every way to a parse (parse_args, tests, the generated reference) sees the same flags.
`config` itself is not kept in the parsed namespace: the run's flags are the same whether they came from a file
or the command line (a resume compares them, utils.train.checkpoint.changed_flags). The namespace keeps the
flags as parsed, before an entry point's checks fill or change any (`as_parsed`): `write_run_config` writes
those, so that `--config OUTPUT_DIR/config.yaml` parses to the same namespace and the same checks run on it.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import os
import re
import sys
import tempfile

from utils.cli import FlagParser
from utils.errors import UsageError

CONFIG_FILE = "config.yaml"
# set per process by the launcher, not a setting of the run: never written to config.yaml
PER_PROCESS_FLAGS = ("local_rank",)
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # what argparse reads as a value, not a flag
_YAML_TRUE = ("yes", "true", "on")


def _fail(message: str):
    raise UsageError(message) from None


class Flags(argparse.Namespace):
    """The parsed flags; `as_parsed` (outside vars(), so comparisons and the saved flags ignore it) holds them as
    the parser produced them, before any check changed one, and `defaults` the parser's defaults (a flag set to
    something else was asked for: utils.train.flags.was_set)."""

    __slots__ = ("as_parsed", "defaults")


class ConfigFileParser(FlagParser):
    """argparse.ArgumentParser with `--config FILE` (repeatable): the files' flags first, the command line's win."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._config_action = self.add_argument(
            "--config",
            action="append",
            metavar="FILE",
            help="YAML file of flag values, keys the flag names without -- (actor_learning_rate: 1e-5); flags on "
            "the command line win; repeatable, a later file wins (see docs/guides/configuration.md)",
        )

    def parse_known_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        paths, given = self._command_line(argv)
        values: dict[str, list[str]] = {}
        for path in paths:
            values.update(read_config(path, self))
        tokens = [token for dest, dest_tokens in values.items() if dest not in given for token in dest_tokens]
        namespace, extras = super().parse_known_args(tokens + argv, Flags() if namespace is None else namespace)
        if getattr(namespace, "config", None) not in (None, paths):  # an abbreviation the scan did not see
            _fail(f"--config: write the flag in full (--config FILE), got {namespace.config}")
        if hasattr(namespace, "config"):
            delattr(namespace, "config")
        if isinstance(namespace, Flags):
            namespace.as_parsed = copy.deepcopy(vars(namespace))
            namespace.defaults = {a.dest: a.default for a in self._actions if a.dest in namespace.as_parsed}
        return namespace, extras

    def _action_of(self, token: str) -> tuple[argparse.Action | None, str | None]:
        """The action an option token names (argparse's own resolution: exact, `--name=value`, or a unique
        prefix), and its `=value`; (None, None) for a value."""
        if not token.startswith("-") or token == "-" or _NEGATIVE_NUMBER.match(token):
            return None, None
        if token in self._option_string_actions:
            return self._option_string_actions[token], None
        name, sep, value = token.partition("=") if token.startswith("--") else (token, "", "")
        explicit = value if sep else None
        if name in self._option_string_actions:
            return self._option_string_actions[name], explicit
        if self.allow_abbrev and name.startswith("--"):
            matches = {id(a): a for option, a in self._option_string_actions.items() if option.startswith(name)}
            if len(matches) == 1:
                return next(iter(matches.values())), explicit
        return None, None

    def _command_line(self, argv: list[str]) -> tuple[list[str], set[str]]:
        """(the --config paths, the dests the command line sets, with the partners of a mutually exclusive one)."""
        paths, given = [], set()
        i = 0
        while i < len(argv) and argv[i] != "--":
            action, explicit = self._action_of(argv[i])
            if action is self._config_action:
                if explicit is not None:
                    paths.append(explicit)
                elif i + 1 < len(argv) and not (argv[i + 1].startswith("-") and argv[i + 1] != "-"):
                    paths.append(argv[i + 1])  # else argparse says --config expects an argument
                    i += 1
            elif action is not None:
                given.add(action.dest)
            i += 1
        for group in self._mutually_exclusive_groups:
            dests = {a.dest for a in group._group_actions}
            if dests & given:
                given |= dests
        return paths, given


# --------------------------------------------------------------------------- #
# Reading a file
# --------------------------------------------------------------------------- #
def _compose(path: str):
    """The file's root YAML node (None when empty), after yaml.safe_load accepted it."""
    import yaml  # lazy: only a --config reads YAML (chat.py's --help imports no more than it needs)

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        _fail(f"{path}: no such file (--config)")
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"{path}: cannot read it: {e}")
    try:
        yaml.safe_load(text)  # refuses what a safe loader refuses (a tag that would build an object)
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        _fail(f"{path}: not valid YAML: {' '.join(str(problem).split())}{where}")


class _Boolean(str):
    """A YAML boolean (true, no, on, ...): its text, for a flag that takes a string; `truth`, for a switch."""

    @property
    def truth(self) -> bool:
        return self.lower() in _YAML_TRUE


def _scalar(node) -> str | None:
    """A scalar node as the file wrote it: None (null), a _Boolean, or its text."""
    tag = node.tag.rsplit(":", 1)[-1]
    if tag == "null":
        return None
    if tag == "bool":
        return _Boolean(node.value)
    if tag == "float" and node.value.lower().lstrip("+-") in (".inf", ".nan"):  # YAML's spelling, Python's text
        return str(float(node.value.lower().replace(".", "")))
    return node.value


def _kind(node) -> str:
    return {"MappingNode": "a mapping", "SequenceNode": "a list"}.get(type(node).__name__, "a value")


def read_config(path: str, parser: ConfigFileParser) -> dict[str, list[str]]:
    """{dest: its command-line tokens} of a config file, each value checked as its flag checks it."""
    import yaml  # lazy: only a --config reads YAML (chat.py's --help imports no more than it needs)

    root = _compose(path)
    if root is None:
        return {}
    if not isinstance(root, yaml.MappingNode):
        _fail(f"{path}: expected flag: value lines (a mapping), got {_kind(root)}")
    actions: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if action.dest not in (argparse.SUPPRESS, "help", "config"):
            actions.setdefault(action.dest, []).append(action)
    tokens: dict[str, list[str]] = {}
    for key_node, value_node in root.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
        if key in tokens:
            _fail(f"{path}: key {key!r} appears twice")
        if key not in actions:
            _fail(f"{path}: {_unknown(key, actions, parser)}")
        where = f"{path}: key {key!r}"
        if isinstance(value_node, yaml.MappingNode):
            _fail(f"{where}: a nested mapping; the keys are flat flag names ({key}: value)")
        if isinstance(value_node, yaml.SequenceNode):
            if any(not isinstance(item, yaml.ScalarNode) for item in value_node.value):
                _fail(f"{where}: a nested value in the list; give a list of plain values")
            value = [_scalar(item) for item in value_node.value]
        else:
            value = _scalar(value_node)
        tokens[key] = _tokens(actions[key], value, where)
    return tokens


def _unknown(key: str, actions: dict, parser: ConfigFileParser) -> str:
    for action in parser._actions:  # a flag's option name whose dest differs: --greedy is do_sample: false
        if f"--{key}" in action.option_strings and action.dest != key:
            spelled = f"{action.dest}: {str(action.const).lower()}" if action.nargs == 0 else f"{action.dest}: ..."
            return f"unknown key {key!r} (--{key} is written {spelled})"
    if key == "config":
        return "key 'config': a file cannot load another (give several --config; a later file wins)"
    if f"--{key}" in parser.RENAMED:
        return f"key {key!r}: --{key} was renamed: use {parser.RENAMED[f'--{key}']}"
    close = difflib.get_close_matches(key, sorted(actions), n=1)
    return f"unknown key {key!r}" + (f" (did you mean --{close[0]}?)" if close else "")


def _tokens(actions: list[argparse.Action], value, where: str) -> list[str]:
    """The command-line tokens that give the dest of `actions` this file `value`."""
    if value is None:
        return []
    switches = [a for a in actions if a.nargs == 0]
    if switches:
        if not isinstance(value, _Boolean):
            names = " / ".join(_long_option(a) for a in switches)
            _fail(f"{where}: {names} is a switch: true or false, got {_shown(value)}")
        for action in switches:
            if action.const is value.truth:
                return [_long_option(action)]
        if value.truth is actions[0].default:
            return []
        _fail(f"{where}: no flag sets it to {value}")
    (action,) = actions
    option = _long_option(action)
    if isinstance(action, argparse._AppendAction) and action.nargs in (None, "?"):  # repeatable: once per item
        return [f"{option}={_checked(action, item, where)}" for item in (value if isinstance(value, list) else [value])]
    if action.nargs in (None, "?"):
        if isinstance(value, list):
            _fail(f"{where}: one value expected, got {_shown(value)}")
        return [f"{option}={_checked(action, value, where)}"]  # `=`: a value may start with '-'
    if isinstance(action, argparse._AppendAction):
        _fail(f"{where}: a repeatable flag of several values each cannot be set from a file")
    items = [_checked(action, item, where) for item in (value if isinstance(value, list) else [value])]
    if action.nargs == "+" and not items:
        _fail(f"{where}: expected at least one value, got []")
    if isinstance(action.nargs, int) and len(items) != action.nargs:
        _fail(f"{where}: expected {action.nargs} values, got {len(items)}")
    for text in items:
        if text.startswith("-") and not _NEGATIVE_NUMBER.match(text):
            _fail(f"{where}: the list item {text!r} would be read as a flag")
    return [option, *items]


def _long_option(action: argparse.Action) -> str:
    return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])


def _shown(value) -> str:
    return f"a list {[str(v) for v in value]!r}" if isinstance(value, list) else repr(str(value))


def _checked(action: argparse.Action, value, where: str) -> str:
    """`value` as a command-line token, after the flag's type and choices accepted it (as argparse will)."""
    if value is None:
        _fail(f"{where}: a null list item")
    text = str(value)  # a YAML boolean (`yes`) for a flag of another kind: its text, as on the command line
    converted = text
    if callable(action.type):
        try:
            converted = action.type(text)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            kind = getattr(action.type, "__name__", "")
            detail = str(e) if isinstance(e, argparse.ArgumentTypeError) else f"invalid {kind} value {text!r}"
            _fail(f"{where}: {detail}")
    if action.choices is not None and converted not in action.choices:
        _fail(f"{where}: invalid choice {text!r} (choose from {', '.join(map(str, action.choices))})")
    return text


# --------------------------------------------------------------------------- #
# Writing the resolved flags
# --------------------------------------------------------------------------- #
def _dump(flags: dict) -> str:
    """YAML of `flags`, one `flag: value` line (or list) each, in the parser's order (every float flag is finite:
    utils.cli.Number)."""
    import yaml  # lazy: only a run that writes its config.yaml needs it (chat.py's --help stays without it)

    return yaml.dump(flags, Dumper=yaml.SafeDumper, sort_keys=False, default_flow_style=False, width=10**6)


def resolved_flags(args) -> dict:
    """The flags to write: as parsed (before the checks changed any), without the per-process ones."""
    flags = getattr(args, "as_parsed", None)
    if flags is None:
        flags = dict(vars(args))
    return {name: value for name, value in flags.items() if name not in PER_PROCESS_FLAGS}


def config_text(args, command: str) -> str:
    """config.yaml's text: a header saying how to rerun it, then one `flag: value` line (or list) per flag."""
    header = (
        f"# The flags of a run of `python -m {command}`, resolved (command line over --config files over defaults),\n"
        f"# written at its start. Rerun it: python -m {command} --config THIS_FILE (flags given after it win).\n"
    )
    return header + _dump(resolved_flags(args))


def write_config(path: str, args, command: str) -> str:
    """Write `config_text` to `path` atomically (a reader never sees half a file); returns `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".config.", suffix=".yaml", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(config_text(args, command))
        os.chmod(tmp, 0o644)  # as a plain file (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


# id(args) -> the command of a --resume run whose config.yaml waits for the resume's checks (write_deferred_run_config)
_deferred: dict[int, str] = {}


def write_run_config(args, command: str) -> str | None:
    """Rank 0 writes the run's resolved flags to OUTPUT_DIR/config.yaml (its path; None on other ranks, or when
    deferred). With --resume it waits until the checkpoint's checks passed (Run.restore calls
    write_deferred_run_config): a resume refused for a changed flag leaves the earlier run's config.yaml as it was."""
    if os.environ.get("RANK", "0") != "0":
        return None
    if getattr(args, "resume", False):
        _deferred[id(args)] = command
        return None
    return write_config(os.path.join(args.output_dir, CONFIG_FILE), args, command)


def write_deferred_run_config(args) -> str | None:
    """The config.yaml `write_run_config` deferred for this --resume run, now that its checks passed."""
    command = _deferred.pop(id(args), None)
    if command is None:
        return None
    return write_config(os.path.join(args.output_dir, CONFIG_FILE), args, command)

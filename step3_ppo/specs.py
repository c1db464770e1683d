"""Loading a user's Python object by its spec: `path/to/file.py:name` or `package.module:name`.

Why one loader: reward functions, environments and tools are all named on the command line the same
way, and a spec that does not load must say why in one line (no such file, a syntax error at line N,
no such module, no such name, not a function) before any model is loaded. Each caller raises its own
ProjectError subclass, so its messages name its flag's kind of thing (`error(spec, problem)`).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import itertools
import os
import re
import sys
from typing import Callable

from utils.errors import one_line

_MESSAGE_LIMIT = 200
_module_counter = itertools.count()

# what `kind` a spec must name: how to check it
KINDS: dict[str, Callable[[object], bool]] = {"function": callable, "class": inspect.isclass}

Error = Callable[[str, str], Exception]  # error(spec, problem) -> the caller's exception


def load_object(spec: str, error: Error, *, what: str, kind: str = "function", forms: str | None = None):
    """The object `spec` names, `path/to/file.py:attr` or `package.module:attr` (`attr` may be dotted),
    checked to be a `kind` (a KINDS key). Any problem raises `error(spec, problem)`, `problem` one line;
    `what` ("reward function") and `forms` (the accepted forms, built-ins first) word a spec with no ':'."""
    forms = forms or f"path/to/file.py:{kind} or package.module:{kind}"
    if ":" not in spec:
        if spec.endswith(".py"):
            raise error(spec, f"missing the ':{kind}' part (expected path/to/file.py:{kind})")
        raise error(spec, f"unknown {what}; expected {forms}")
    where, _, attr = spec.rpartition(":")
    if not attr or not where:
        raise error(spec, f"missing the {kind if not attr else 'file or module'} name around ':' (expected {forms})")
    module = _load_file(spec, where, error) if _is_path(where) else _load_module(spec, where, error)
    return _attribute(spec, module, attr, kind, error)


def _is_path(where: str) -> bool:
    return where.endswith(".py") or "/" in where or os.sep in where or os.path.exists(where)


def _import_problem(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"syntax error at line {exc.lineno}: {one_line(exc.msg, _MESSAGE_LIMIT)}"
    return f"importing it raised {type(exc).__name__}: {one_line(exc, _MESSAGE_LIMIT)}"


def _load_file(spec: str, path: str, error: Error):
    if not os.path.exists(path):
        raise error(spec, f"no such file: {path}")
    if not os.path.isfile(path):
        raise error(spec, f"{path} is not a file")
    stem = re.sub(r"[^A-Za-z0-9_]", "_", os.path.splitext(os.path.basename(path))[0])
    name = f"_spec_{next(_module_counter)}_{stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(spec, f"{path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses, pickling and typing look the module up by name
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)  # while it runs: the file may import a helper next to it
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise error(spec, _import_problem(exc)) from exc
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def _load_module(spec: str, name: str, error: Error):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
            raise error(spec, f"no module named '{exc.name}' (on sys.path)") from exc
        raise error(spec, _import_problem(exc)) from exc
    except Exception as exc:
        raise error(spec, _import_problem(exc)) from exc


def _attribute(spec: str, module, attr: str, kind: str, error: Error):
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(spec, f"has no {kind} '{attr}'")
        obj = getattr(obj, part)
    if not KINDS[kind](obj):
        raise error(spec, f"'{attr}' is a {type(obj).__name__}, not a {kind}")
    return obj

"""Imports sit at the top of each module, so its dependencies read at a glance; an import inside a function
says why on its line (`# lazy: +0.8 s on every --help`), and every module imports alone in a fresh process
(no import cycle hidden by the order a program happens to import them in)."""

import ast
import io
import os
import subprocess
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("utils", "step1_sft", "step2_reward", "step2_dpo", "step3_ppo", "data")


def project_files() -> list[str]:
    """Paths (relative to the root, '/'-separated) of every .py file of the project's packages."""
    paths = []
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            paths += [
                os.path.relpath(os.path.join(folder, n), ROOT).replace(os.sep, "/") for n in names if n.endswith(".py")
            ]
    return sorted(paths)


def module_name(path: str) -> str:
    name = path[: -len(".py")].replace("/", ".")
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def function_imports(source: str) -> list[ast.stmt]:
    """The import statements inside any function (nested ones included)."""
    functions = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return sorted(
        {id(n): n for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}.values(),
        key=lambda n: n.lineno,
    )


def lazy_comment_lines(source: str) -> set[int]:
    """Lines that carry a `# lazy: ...` comment."""
    return {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and tok.string.startswith("# lazy:")
    }


def test_imports_inside_functions_say_why():
    unexplained = []
    for path in project_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            source = f.read()
        commented = lazy_comment_lines(source)
        unexplained += [
            f"{path}:{n.lineno}: {ast.unparse(n)}"
            for n in function_imports(source)
            if not commented & set(range(n.lineno, n.end_lineno + 1))
        ]
    assert not unexplained, (
        "imports inside functions without a `# lazy: <measured cost or cycle>` comment "
        "(move them to the top of the module):\n" + "\n".join(unexplained)
    )


# One interpreter preloads the heavy libraries, then forks a child per module: each child starts with no project
# module imported, as a fresh process would, without paying torch's import 90 times (about 10 s in all).
_IMPORT_EACH_ALONE = """
import importlib, os, sys, traceback
import numpy, torch
failed = []
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        failed.append(name)
print("FAILED:", " ".join(failed))
sys.exit(1 if failed else 0)
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_every_module_imports_alone():
    proc = _run(_IMPORT_EACH_ALONE, *[module_name(p) for p in project_files()])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]


def test_light_modules_import_without_torch():
    """The worker processes (reward functions, tools) and the light tools start without torch or transformers:
    the reasons their lazy imports give."""
    light = [
        "step3_ppo.function_worker",
        "step3_ppo.rewards.functions",
        "step3_ppo.agents.tools",
        "step3_ppo.agents.flags",
        "utils.runtime.ports",
        "utils.models.tiny",
        "utils.models.default",
    ]
    code = (
        "import importlib, sys\n"
        f"for name in {light!r}: importlib.import_module(name)\n"
        "heavy = sorted({'torch', 'transformers', 'deepspeed'} & set(sys.modules))\n"
        "assert not heavy, heavy\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]

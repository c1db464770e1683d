"""The layering the code promises: steps -> utils, never back; no step imports another; bench/ (the
benchmarks) sits on top: it may import the steps and utils (and itself), and nothing in utils/ or a step
imports bench; the pure math modules import no DeepSpeed, no models and no orchestration. Read from the
source (ast), so a lazy import inside a function counts too."""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("step1_sft", "step2_reward", "step2_dpo", "step3_ppo")
BENCH = "bench"
# of the repository's own top-level packages and modules, what bench/ may import: the steps, utils and bench
BENCH_MAY_IMPORT = {*STEPS, "utils", BENCH}
PURE = {"utils/math/ops.py": set(), "utils/math/losses.py": {"utils.math.ops"}, "step3_ppo/algo/advantages.py": {"utils.math.ops"},
        "step3_ppo/algo/shaping.py": {"utils.math.ops"}}
PURE_ALLOWED_THIRD_PARTY = {"torch", "math", "typing", "dataclasses", "__future__"}


def imports(path: str) -> set[str]:
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def python_files(folder: str) -> list[str]:
    """The project's .py files under `folder`, not those of a virtual environment kept there (bench's TRL venvs)."""
    out = []
    for base, dirs, files in os.walk(os.path.join(ROOT, folder)):
        dirs[:] = [d for d in dirs if not os.path.exists(os.path.join(base, d, "pyvenv.cfg"))]
        out += [os.path.relpath(os.path.join(base, f), ROOT) for f in files if f.endswith(".py")]
    return sorted(out)


def project_top_levels() -> set[str]:
    """The repository's own importable top-level names: its folders holding Python files and its .py modules."""
    names = set()
    for entry in os.listdir(ROOT):
        path = os.path.join(ROOT, entry)
        if entry.startswith((".", "_")):
            continue
        if entry.endswith(".py"):
            names.add(entry[:-3])
        elif os.path.isdir(path) and any(f.endswith(".py") for f in os.listdir(path)):
            names.add(entry)
    return names


def test_every_step_is_listed():
    """A new step folder (stepN_*) is covered by these checks only once it is in STEPS."""
    folders = {entry for entry in project_top_levels() if entry.startswith("step")}
    assert folders == set(STEPS), f"step folders {sorted(folders)} vs STEPS {sorted(STEPS)}"


@pytest.mark.parametrize("path", python_files("utils"))
def test_utils_import_no_step(path):
    bad = [name for name in imports(path) if name.split(".")[0] in STEPS]
    assert not bad, f"{path} imports {bad}: shared code must not know a step"


@pytest.mark.parametrize("step", STEPS)
def test_no_step_imports_another(step):
    for path in python_files(step):
        bad = [name for name in imports(path) if name.split(".")[0] in STEPS and name.split(".")[0] != step]
        assert not bad, f"{path} imports {bad}: steps meet only through utils and saved directories"


@pytest.mark.parametrize("path", python_files("utils") + [p for step in STEPS for p in python_files(step)])
def test_utils_and_steps_import_no_bench(path):
    bad = [name for name in imports(path) if name.split(".")[0] == BENCH]
    assert not bad, f"{path} imports {bad}: the benchmarks sit on top, nothing below may depend on them"


@pytest.mark.parametrize("path", python_files(BENCH))
def test_bench_imports_only_steps_and_utils(path):
    own = project_top_levels()
    bad = [name for name in imports(path) if name.split(".")[0] in own - BENCH_MAY_IMPORT]
    assert not bad, f"{path} imports {bad}: of the project, bench/ may import only {sorted(BENCH_MAY_IMPORT)}"


@pytest.mark.parametrize("path", sorted(PURE))
def test_pure_math_imports_only_torch_and_ops(path):
    for name in imports(path):
        top = name.split(".")[0]
        assert top in PURE_ALLOWED_THIRD_PARTY or name in PURE[path], \
            f"{path} (pure math) imports {name}: no DeepSpeed, no models, no orchestration"

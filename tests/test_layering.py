"""The layering the code promises, as rules on packages: steps -> utils, never back; no step imports another;
bench/ (the benchmarks) sits on top; inside utils/ and step3_ppo/ each folder may import only the folders below
it (ALLOWED); the pure math (utils/math, step3_ppo/algo) imports torch and nothing of ours above it. Read from
the source (ast), so a lazy import inside a function counts too."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("step1_sft", "step2_reward", "step2_dpo", "step3_ppo")
BENCH = "bench"
# of the repository's own top-level packages and modules, what bench/ may import: the steps, utils and bench
BENCH_MAY_IMPORT = {*STEPS, "utils", BENCH}
# Inside utils/ and step3_ppo/: what each package (a folder, or a module at the top) may import of the project
# besides itself. The arrows form layers: a new arrow up (utils.runtime importing utils.models, say) is a design
# change to make here, on purpose. utils/errors.py sits below everything.
ALLOWED = {
    "utils.errors": set(),
    "utils.cli": {"utils.errors"},  # the entry points' parser and numeric flag type
    "utils.math": set(),
    "utils.runtime": {"utils.errors"},
    "utils.data": {"utils.errors", "utils.runtime"},
    "utils.models": {"utils.errors", "utils.cli", "utils.runtime", "utils.data", "utils.math"},
    "utils.evaluation": {"utils.errors", "utils.runtime", "utils.data", "utils.math", "utils.models"},
    "utils.train": {"utils.errors", "utils.cli", "utils.runtime", "utils.data", "utils.math", "utils.models"},
    "utils.tiny_model": {"utils.models"},  # entry shims of `python -m utils.tiny_model` / `utils.default_model`
    "utils.default_model": {"utils.models"},
    "step3_ppo.algo": {"utils.math"},
    "step3_ppo.specs": {"utils.errors"},
    "step3_ppo.function_worker": {"utils.errors", "utils.runtime"},
    "step3_ppo.rollout": {"utils"},
    "step3_ppo.rewards": {"utils", "step3_ppo.specs", "step3_ppo.function_worker", "step3_ppo.algo"},  # algo: combine
    "step3_ppo.agents": {
        "utils",
        "step3_ppo.specs",
        "step3_ppo.function_worker",
        "step3_ppo.rewards",
        "step3_ppo.plot",
    },
    "step3_ppo.deepspeed_models": {"utils", "step3_ppo.algo", "step3_ppo.rollout"},  # rollout: a served teacher
    "step3_ppo.teachers": {"utils", "step3_ppo.algo", "step3_ppo.rollout"},  # rollout: engines that serve one
    "step3_ppo.trainer": {
        "utils",
        "step3_ppo.algo",
        "step3_ppo.teachers",
        "step3_ppo.rollout",
        "step3_ppo.rewards",
        "step3_ppo.agents",
        "step3_ppo.metrics",
    },
    "step3_ppo.metrics": {"utils", "step3_ppo.algo", "step3_ppo.agents"},
}
# the pure math: of third-party code only torch (and the standard library's typing helpers)
PURE = ("utils.math", "step3_ppo.algo")
PURE_ALLOWED_THIRD_PARTY = {"torch", "math", "typing", "dataclasses", "__future__"}


def imports(path: str) -> set[str]:
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from utils import errors` imports utils.errors: each name is kept under its module
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
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


def package_of(path: str) -> str:
    """utils/models/forward.py -> utils.models; utils/errors.py -> utils.errors; step3_ppo/main.py -> step3_ppo.main."""
    parts = path[:-3].split(os.sep)
    return ".".join(parts[:2])


def own_package(name: str) -> str:
    """The package (as in ALLOWED) an imported dotted name belongs to: utils.models.forward -> utils.models."""
    return ".".join(name.split(".")[:2])


def allows(allowed: set[str], target: str) -> bool:
    return any(target == a or target.startswith(a + ".") for a in allowed)


def layered_files() -> list[str]:
    return [p for p in python_files("utils") + python_files("step3_ppo") if package_of(p) in ALLOWED]


def test_every_package_has_a_rule():
    """A new folder (or top-level module) in utils/ or step3_ppo/ gets its line in ALLOWED, or it is unchecked."""
    entry_points = {
        "step3_ppo.main",
        "step3_ppo.eval",
        "step3_ppo.plot",
        "step3_ppo.generation_check",
        "step3_ppo.__init__",
        "utils.__init__",
    }  # on top: they may import the packages below them
    missing = {package_of(p) for p in python_files("utils") + python_files("step3_ppo")} - set(ALLOWED) - entry_points
    assert not missing, f"packages without a layering rule in ALLOWED: {sorted(missing)}"


@pytest.mark.parametrize("path", layered_files())
def test_packages_import_only_the_layers_below(path):
    me = package_of(path)
    bad = sorted(
        name
        for name in imports(path)
        if name.split(".")[0] in ("utils", "step3_ppo") and own_package(name) != me and not allows(ALLOWED[me], name)
    )
    assert not bad, f"{path} ({me}) imports {bad}; {me} may import only {sorted(ALLOWED[me])} (tests/test_layering.py)"


@pytest.mark.parametrize("path", [p for p in layered_files() if package_of(p) in PURE])
def test_pure_math_imports_only_torch(path):
    for name in imports(path):
        top = name.split(".")[0]
        assert top in PURE_ALLOWED_THIRD_PARTY or allows(ALLOWED[package_of(path)] | {package_of(path)}, name), (
            f"{path} (pure math) imports {name}: no DeepSpeed, no models, no orchestration"
        )

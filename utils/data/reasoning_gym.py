"""Prompt rows generated offline by reasoning-gym's procedural tasks: ``--data_path reasoning_gym:...``.

Syntax: ``reasoning_gym:TASK[,TASK...][:KEY=VALUE[,KEY=VALUE...]]``, e.g.
``reasoning_gym:leg_counting:size=500,max_animals=2`` or ``reasoning_gym:basic_arithmetic,chain_sum:seed=3``.

* ``size`` (default 1000): training rows per task; ``eval_size`` (default 200): held-out rows per task;
  ``seed`` (default 1): the tasks' generator seed; ``system`` (default ``default``): the system turn, one of
  reasoning-gym's ``SYSTEM_PROMPTS`` (``default`` asks for the answer in ``<answer>`` tags, as its scorers
  expect; ``direct``, ``simple``, ... likewise) or ``none`` (the question alone).
* Any other ``KEY`` is a field of the tasks' config (their difficulty: ``max_digits=1``), given to every task
  whose config has it; ``TASK.KEY=VALUE`` to one task only. Values are read as JSON where they parse
  (``3``, ``true``, ``0.5``), else kept as text; a field whose default is a tuple or list takes items
  separated by ``|`` (``operators=+|-``).

Train and held-out rows never share a question: training is entries 0..size-1 of the task's dataset at
``seed``; the held-out rows are the next entries whose question is neither a training question nor an
earlier held-out one (a task with few distinct problems may run out: a DataError says so).

Each row: ``prompt`` (a system turn, unless ``system=none``, and the question as the user turn), ``question``,
``answer``, ``metadata`` (the entry's, JSON-safe), ``task`` and ``task_config`` (what the scorer rebuilds the
task from); origin ``reasoning_gym:TASK#INDEX``, the entry's index in its dataset. The ``reasoning_gym``
reward function (step3_ppo/rewards/reasoning_gym.py) scores completions with the task's own ``score_answer``.
reasoning-gym is imported only when such a source is read (~1 s).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from importlib.metadata import PackageNotFoundError, version

from utils.data.sources import DataError

PREFIX = "reasoning_gym:"
DEFAULTS = {"size": 1000, "eval_size": 200, "seed": 1, "system": "default"}
# held-out entries examined per wanted held-out row before giving up (tasks with few distinct problems)
SCAN_FACTOR = 20


def is_reasoning_gym(source: str) -> bool:
    return isinstance(source, str) and source.startswith(PREFIX)


def _library():
    try:
        import reasoning_gym  # lazy: ~1 s (100+ task modules), only for reasoning_gym: sources
        import reasoning_gym.factory  # lazy: as reasoning_gym
        import reasoning_gym.utils  # lazy: as reasoning_gym
    except ImportError as e:
        raise DataError(
            f"reasoning_gym sources need the reasoning-gym package (pip install reasoning-gym): {e}"
        ) from None
    return reasoning_gym


def _value(text: str, default):
    """A config value from its text: JSON where it parses, else the text; sequences split at '|'."""
    if isinstance(default, (tuple, list)):
        return type(default)(text.split("|"))
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _fields(config_cls) -> dict:
    return {f.name: f for f in dataclasses.fields(config_cls)}


def _default(field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def parse(source: str) -> tuple[list[str], dict, dict]:
    """(tasks, options, {task: config kwargs}) of a ``reasoning_gym:`` source; DataError on a bad one."""
    rg = _library()
    datasets = rg.factory.DATASETS
    body = source[len(PREFIX) :]
    task_part, _, option_part = body.partition(":")
    tasks = [t.strip() for t in task_part.split(",") if t.strip()]
    if not tasks:
        raise DataError(f"{source}: no task named (reasoning_gym:TASK[,TASK...][:KEY=VALUE,...])")
    for task in tasks:
        if task not in datasets:
            close = difflib.get_close_matches(task, list(datasets), n=5, cutoff=0.5)
            hint = f"close: {', '.join(close)}" if close else f"{len(datasets)} tasks in reasoning_gym.factory.DATASETS"
            raise DataError(f"{source}: unknown reasoning-gym task {task!r} ({hint})")
    options, configs = dict(DEFAULTS), {t: {} for t in tasks}
    for item in filter(None, (s.strip() for s in option_part.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise DataError(f"{source}: option {item!r} is not KEY=VALUE")
        owner, dot, name = key.rpartition(".")
        if not dot and key in DEFAULTS:
            options[key] = text.strip() if key == "system" else _value(text.strip(), None)
            continue
        targets = [owner] if dot else tasks
        if dot and owner not in tasks:
            raise DataError(f"{source}: option {key!r} names task {owner!r}, which is not one of {', '.join(tasks)}")
        matched = False
        for task in targets:
            fields = _fields(datasets[task][1])
            if name in fields and name not in ("size", "seed"):
                configs[task][name] = _value(text.strip(), _default(fields[name]))
                matched = True
            elif dot:
                known = ", ".join(n for n in fields if n not in ("size", "seed"))
                raise DataError(f"{source}: {task} has no config field {name!r} (its fields: {known})")
        if not matched:
            known = "; ".join(
                f"{t}: {', '.join(n for n in _fields(datasets[t][1]) if n not in ('size', 'seed'))}" for t in tasks
            )
            raise DataError(
                f"{source}: {key!r} is neither an option ({', '.join(DEFAULTS)}) nor a config field of the "
                f"task(s) ({known})"
            )
    for key in ("size", "eval_size", "seed"):
        value, low = options[key], 0 if key == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise DataError(f"{source}: {key} must be an integer >= {low}, got {value!r}")
    if options["system"] != "none" and options["system"] not in rg.utils.SYSTEM_PROMPTS:
        raise DataError(
            f"{source}: system must be none or one of reasoning-gym's prompts "
            f"({', '.join(rg.utils.SYSTEM_PROMPTS)}), got {options['system']!r}"
        )
    return tasks, options, configs


def json_safe(value):
    """``value`` as JSON would give it back (tuples become lists, sets sorted lists, other objects text)."""

    def default(obj):
        if isinstance(obj, (set, frozenset)):
            return sorted(obj, key=str)
        return str(obj)

    return json.loads(json.dumps(value, default=default))


def create(task: str, config: dict, seed: int, size: int):
    """The task's reasoning-gym dataset (``size`` is only its nominal length: entries are made by index)."""
    rg = _library()
    if task in rg.factory.DATASETS:  # a config read back from JSON: its tuple fields were made lists
        fields = _fields(rg.factory.DATASETS[task][1])
        config = {
            k: tuple(v) if k in fields and isinstance(_default(fields[k]), tuple) and isinstance(v, list) else v
            for k, v in config.items()
        }
    try:
        return rg.create_dataset(task, seed=seed, size=size, **config)
    except Exception as e:  # config classes raise AssertionError/ValueError/TypeError on bad fields
        raise DataError(
            f"reasoning_gym:{task}: cannot create the task with {config} ({type(e).__name__}: {e})"
        ) from None


def _row(entry: dict, task: str, config: dict, system: str | None, prompt_key: str) -> dict:
    turns = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": entry["question"]}
    ]
    return {
        prompt_key: turns,
        "question": entry["question"],
        "answer": json_safe(entry["answer"]),
        "metadata": json_safe(entry.get("metadata", {})),
        "task": task,
        "task_config": json_safe(config),
    }


def generate(source: str, prompt_key: str = "prompt") -> tuple[list, list]:
    """(train, held-out) records ``(row, origin)`` of a ``reasoning_gym:`` source, deterministic for its seed."""
    rg = _library()
    tasks, options, configs = parse(source)
    size, eval_size, seed = options["size"], options["eval_size"], options["seed"]
    system = None if options["system"] == "none" else rg.utils.SYSTEM_PROMPTS[options["system"]]
    scan = size + SCAN_FACTOR * eval_size + 1000
    train, held_out = [], []
    for task in tasks:
        dataset = create(task, configs[task], seed, scan)
        entries, i = [], 0
        try:
            for i in range(size):
                entries.append(dataset[i])
            seen = {e["question"] for e in entries}
            train += [
                (_row(e, task, configs[task], system, prompt_key), f"{PREFIX}{task}#{j}") for j, e in enumerate(entries)
            ]
            found, i = 0, size
            while found < eval_size and i < scan:
                entry = dataset[i]
                if entry["question"] not in seen:
                    seen.add(entry["question"])
                    held_out.append((_row(entry, task, configs[task], system, prompt_key), f"{PREFIX}{task}#{i}"))
                    found += 1
                i += 1
        except Exception as e:  # a generator that needs data or network, or fails on this config
            raise DataError(f"{PREFIX}{task}: generating entry {i} failed ({type(e).__name__}: {e})") from None
        if found < eval_size:
            raise DataError(
                f"{source}: {task} gave only {found} held-out questions not among its {size} training ones in "
                f"{scan - size} tries; lower size or eval_size, or make the task harder (more distinct problems)"
            )
    return train, held_out


def fingerprint(source: str) -> list:
    """What identifies the rows for the tokenised-data cache: the source and the library's version."""
    try:
        return [source, version("reasoning-gym")]
    except PackageNotFoundError:
        return [source]

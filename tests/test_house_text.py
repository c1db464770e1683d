"""Every file speaks to a user or a contributor: no tracked text file names this project's tracker (an issue by
its number, or "the issue" as a case) or how and where the project was developed (the work session, the stop,
the development machine). Such text says nothing to a reader of the checkout; say what the thing is, or what a test
guards, instead. Peer projects' issues stay fine (TRL #6439, OpenRLHF issue 1249): a hit right after a peer
project's name is not one of ours. The changelog (docs/changelog.md) and the archived benchmark outputs
(bench/results/) are records and keep their wording."""

import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTENSIONS = (".py", ".md", ".sh", ".txt", ".yaml", ".yml", ".toml", ".jinja")
EXCLUDED = ("docs/changelog.md",)
EXCLUDED_FOLDERS = ("bench/results/",)
# (pattern, why it is refused); case-insensitive
RULES = [
    (r"\bissues?(?:'s)? #?\d+", "names an issue of this project's tracker: say what the thing is or what it guards"),
    (r"\bissue's\b", "refers to a tracker issue: describe the case itself"),
    (
        r"\bthis (?:stop|session)\b(?![ _-]?(?:token|sequence|string|word|id|criteri|condition))",
        "tells when the project was developed: say what the thing is for",
    ),
    (r"\bthe dev VM\b", "names the machine the project was developed on: say what the host is (CPU, cores)"),
]
PATTERN = re.compile("|".join(f"({p})" for p, _ in RULES), re.IGNORECASE)
# a hit right after one of these names is a peer project's issue, not ours
PEER_BEFORE = re.compile(
    r"(?:TRL|OpenRLHF|veRL|DeepSpeed(?:-Chat)?|vLLM|transformers|PyTorch|torch|open-instruct|peft|accelerate|"
    r"datasets|GitHub|upstream)(?:'s)? $",
    re.IGNORECASE,
)


def tracked_text_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    paths = [p for p in out.decode().split("\0") if p.endswith(EXTENSIONS)]
    return [p for p in paths if p not in EXCLUDED and not p.startswith(EXCLUDED_FOLDERS)]


def hits(path: str, text: str) -> list[str]:
    found = []
    for match in PATTERN.finditer(text):
        if PEER_BEFORE.search(text[max(0, match.start() - 40) : match.start()]):
            continue
        line = text.count("\n", 0, match.start()) + 1
        why = RULES[match.lastindex - 1][1]
        found.append(f"{path}:{line}: {match.group(0)!r} {why}")
    return found


def sample(text: str) -> str:
    """The rules' examples carry a `|` that breaks each match, so this file does not match its own rules."""
    return text.replace("|", "")


def test_the_rules_catch_tracker_and_development_text_and_spare_peer_issues():
    number, reference = sample("issue| 32"), sample("Issue|'s")
    assert hits("x.py", f"# until {number}\n\nthe {reference} case") == [
        f"x.py:1: {number!r} {RULES[0][1]}",
        f"x.py:3: {reference!r} {RULES[1][1]}",
    ]
    assert len(hits("x.md", sample("as before this| stop\nin this| session, on the dev| VM"))) == 3
    assert hits("x.md", sample("OpenRLHF issue| 1249, TRL #6439, this| stop token, these issues are fine")) == []


def test_no_tracked_text_file_names_the_tracker_or_the_development():
    found = []
    for path in tracked_text_files():
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):  # deleted in the work tree, not yet committed
            continue
        with open(full, encoding="utf-8", errors="replace") as f:
            found += hits(path, f.read())
    if found:
        pytest.fail("text a reader of the checkout cannot use:\n" + "\n".join(found), pytrace=False)

"""The library's code describes itself: no history in ``moelora_lib/``.

Docstrings, comments and messages state behaviour, contracts, shapes and the reasons for a design. How the
code got there (optimization rounds, dates, commit hashes, this project's issue numbers, what an earlier
version measured) belongs in ``docs/perf_notes.md`` and the git log. Citations of upstream work (a vLLM PR
``#27445``, an arXiv id, an upstream file path) are not history and pass. Code cites only files a clone has.
"""

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "moelora_lib"

MARKERS = {
    "an optimization round": re.compile(
        r"\b(first|second|third|fourth|fifth|sixth|seventh|next|previous|earlier|last) rounds?\b"
        r"|\bround (one|two|three|four|five|\d)\b",
        re.IGNORECASE,
    ),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    # 7-40 hex digits holding both a letter and a digit, as git prints commit ids
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"),
    "this project's issue number": re.compile(r"\b(issue|task) #?\d{1,3}\b", re.IGNORECASE),
    "a path outside the repository": re.compile(r"\.\./shared\b"),
    "a past measurement": re.compile(
        r"\b(was|were) measured (at|in|on|by|\d|[\d.]+x|slower|faster)"
        r"|\bno longer\b|\bpreviously\b|\bsuite run\b"
        r"|\b(this|earlier|previous|later|next) session\b",
        re.IGNORECASE,
    ),
}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_scan_sees_the_package():
    names = {p.name for p in _sources()}
    assert {"__init__.py", "layer.py", "moe_lora.py"} <= names


@pytest.mark.parametrize(
    "text, kind",
    [
        ("Second round: the B tiles", "an optimization round"),
        ("measured on 2026-12-03", "a date"),
        ("the suite run at 8402a0c", "a commit hash"),
        ("added for issue 13", "this project's issue number"),
        ("see ../shared/notes/x.md", "a path outside the repository"),
        ("it was measured 1.2x slower", "a past measurement"),
        ("the stacked form was measured at 8 points", "a past measurement"),
    ],
)
def test_markers_catch_history(text, kind):
    assert MARKERS[kind].search(text)


@pytest.mark.parametrize(
    "text",
    [
        "vLLM PR #27445: one binary per config",
        "arXiv 2603.11873",
        "BLOCK_SIZE_K = 64 keeps EVEN_K for every preset",
        "mask = 0xffffffff",
        "scaling = alpha / r is folded into B",
        "one launch issues 1 + 6 kernels",
        "where a number was measured: gpu, torch",
    ],
)
def test_citations_and_code_pass(text):
    assert not any(p.search(text) for p in MARKERS.values()), text


def test_no_history_in_the_library():
    found = []
    for path in _sources():
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for kind, pattern in MARKERS.items():
                m = pattern.search(line)
                if m:
                    rel = path.relative_to(PACKAGE.parent)
                    found.append(f"{rel}:{lineno}: {kind} ({m.group(0)!r}): {line.strip()[:100]}")
    assert not found, "history in moelora_lib/ (move it to docs/perf_notes.md):\n" + "\n".join(found)

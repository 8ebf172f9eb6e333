"""docs/results.md and the README's results block are what scripts/make_results.py writes from data/.

The committed files must match the generator (``--check``); the check must fail when a measurement
changes; every table must name its source with a commit, a GPU and a date; the headline ratio must be
vLLM's best whole layer (faster LoRA path + base + its alignment) ÷ our module's time, recomputed here
from the two CSVs.
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pandas")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "make_results.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_committed_results_match_the_generator():
    r = _run("--check")
    assert r.returncode == 0, r.stdout + r.stderr + "\nrun: python scripts/make_results.py"


def test_check_fails_when_a_measurement_changes(tmp_path):
    for name in ("README.md", "docs/results.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(
        ROOT / "data", tmp_path / "data", ignore=shutil.ignore_patterns("executed", "figures", "dev", "cpu")
    )
    assert _run("--check", "--root", str(tmp_path)).returncode == 0
    p = tmp_path / "data" / "09_graph.csv"
    rows = list(csv.DictReader(p.open()))
    i = next(i for i, r in enumerate(rows) if r["what"] == "module_logits")  # in both files
    rows[i]["us_p50"] = str(float(rows[i]["us_p50"]) * 2)
    with p.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    r = _run("--check", "--root", str(tmp_path))
    assert r.returncode == 1 and "README.md" in r.stdout and "docs/results.md" in r.stdout, r.stdout
    assert _run("--root", str(tmp_path)).returncode == 0  # writing, then the check passes again
    assert _run("--check", "--root", str(tmp_path)).returncode == 0


def test_every_table_names_its_source():
    text = (ROOT / "docs" / "results.md").read_text()
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    assert len(sections) >= 8
    for s in sections:
        sources = re.findall(r"^Source: (.*)$", s, re.M)
        assert sources, f"section without a source: {s.splitlines()[0]}"
        for src in sources:
            assert re.search(r"`data/[^`]+`", src), src
            anchor = "anchors/" in src
            assert anchor or re.search(r"commit [0-9a-f]{7,40}", src), src
            assert re.search(r"\d{4}-\d{2}-\d{2}|not stated", src), src


def test_headline_ratio_recomputed():
    anchor = list(csv.DictReader((ROOT / "data" / "anchors" / "vllm033_vs_moelora_moe_h200.csv").open()))
    graph = list(csv.DictReader((ROOT / "data" / "09_graph.csv").open()))

    def us(impl, part, T, model="gpt-oss-20b"):
        return [
            float(r["median_us"])
            for r in anchor
            if (r["shape"], r["impl"], r["part"], int(r["T"])) == (model, impl, part, T)
        ]

    T = 1600
    vllm = (
        min(us("vllm033", "total", T) + us("vllm033_2k", "total", T))
        + us("vllm033_cudaops", "align_cuda", T)[0]
    )
    ours = next(
        float(r["us_p50"])
        for r in graph
        if (r["model"], int(r["T"]), r["what"]) == ("gpt-oss-20b", T, "module_logits")
    )
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| GPT-OSS-20B: vLLM ÷ ours"))
    cell = row.split("|")[6]  # T = 1, 8, 64, 256, 1600
    assert f"**{vllm / ours:.2f}×** ({vllm:.0f} / {ours:.0f})" in cell, (cell, vllm, ours)

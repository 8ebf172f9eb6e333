"""Papermill smoke test: notebooks 01, 12, 13, 14 and 15 execute end to end on the cpu profile (Triton
interpreter); notebook 00 runs in tests/test_explorer.py.

Each notebook's asserts (reference checks, naive kernel vs the fp32 reference) run inside it, so a
pass here means the notebooks' own checks passed. Executed copies go to a temp folder; the CSVs go to
data/cpu/ (git-ignored), never over the GPU evidence in data/. The executed copies must read as the
committed ones will: text progress bars (no widget outputs) and no machine paths.
"""

import json
from pathlib import Path

import pytest

from moelora_lib.studies.runner import run_notebooks

ROOT = Path(__file__).resolve().parents[1]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@pytest.mark.parametrize("stage", ["01", "12", "13", "14", "15"])
def test_notebook_runs_on_cpu_profile(stage, tmp_path):
    results = run_notebooks(ROOT / "notebooks", tmp_path, "cpu", only=[stage], progress_bar=False)
    assert [r.status for r in results] == ["ok"]
    executed = list(tmp_path.glob(f"{stage}_*.ipynb"))
    assert len(executed) == 1 and executed[0].stat().st_size > 0
    nb = json.loads(executed[0].read_text())
    outputs = [o for c in nb["cells"] if c["cell_type"] == "code" for o in c.get("outputs", [])]
    widgets = [o for o in outputs if WIDGET_MIME in o.get("data", {})]
    assert not widgets, (
        f"{len(widgets)} widget outputs (tqdm.auto/notebook bars); progress must print as text"
    )
    text = json.dumps(outputs)
    assert str(ROOT) not in text, f"the executed {executed[0].name} shows the machine path {ROOT}"

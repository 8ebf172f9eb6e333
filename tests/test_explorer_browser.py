"""notebooks/00_explorer.ipynb in a real browser: JupyterLab on 127.0.0.1, headless Chromium via Playwright.

The test starts JupyterLab (loopback, a free port, a random token, every Jupyter/IPython/matplotlib folder and
HOME in a temp dir) with the project's kernel (the runner's kernelspec for this interpreter), opens a copy of
the explorer, runs all cells, changes the "tokens T" control as a user would and checks that the plot and
the table changed; it saves a screenshot of the explorer after the change (to the test's temp folder).

Browser: Debian's Chromium (``apt-get install chromium``; .ci/run installs it), driven through Playwright's
``executable_path`` — Playwright's own browser download is not used (``playwright install`` needs a CDN this
kind of machine cannot reach). The test is skipped, saying why, only where no Chromium binary or no
Playwright is installed. Waits: the status bar's "| Idle" before Run All (the toolbar's indicator reports
idle before any kernel exists), the conclusion's heading for "the notebook ran to its end", and the
explorer's status line, which it sets after the plot and the tables, for "redrawn".
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed in this interpreter (pip install -e .[dev])"
)
pytest.importorskip("jupyterlab", reason="jupyterlab is not installed (pip install -e .[notebooks])")
nbformat = pytest.importorskip("nbformat")

from moelora_lib.studies.runner import write_kernelspec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEADING = "### What the committed evidence says"  # the conclusion cell's first line
NOTEBOOK = ROOT / "notebooks" / "00_explorer.ipynb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium on this machine: install Debian's package (apt-get install chromium; .ci/run does); "
    "Playwright's own browser download is not used",
)

RUN_ALL_TIMEOUT_MS = 240_000  # the notebook takes ~15 s on a 2-core CPU machine; generous for a busy one


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


class Lab:
    """A JupyterLab server in a temp dir: url, token, root (the served folder), env, kernel."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.root = tmp / "nbroot"
        self.root.mkdir()
        d = {
            "HOME": tmp / "home",
            "JUPYTER_CONFIG_DIR": tmp / "jupyter" / "config",
            "JUPYTER_DATA_DIR": tmp / "jupyter" / "data",
            "JUPYTER_RUNTIME_DIR": tmp / "jupyter" / "runtime",
            "IPYTHONDIR": tmp / "ipython",
            "MPLCONFIGDIR": tmp / "matplotlib",
            "XDG_CACHE_HOME": tmp / "xdg" / "cache",
            "XDG_CONFIG_HOME": tmp / "xdg" / "config",
        }
        for p in d.values():
            p.mkdir(parents=True, exist_ok=True)
        # The project's kernel: the runner's kernelspec for this interpreter, first on JUPYTER_PATH.
        self.kernel = write_kernelspec(d["JUPYTER_DATA_DIR"])
        self.env = {
            **os.environ,
            **{k: str(v) for k, v in d.items()},
            "JUPYTER_PATH": os.pathsep.join(
                [str(d["JUPYTER_DATA_DIR"]), *filter(None, [os.environ.get("JUPYTER_PATH")])]
            ),
            "JUPYTER_PLATFORM_DIRS": "1",
        }
        settings = d["JUPYTER_CONFIG_DIR"] / "lab" / "user-settings" / "@jupyterlab"
        # No "get notified about Jupyter news?" toast (the setting decides, not news_url).
        _write_json(
            settings / "apputils-extension" / "notification.jupyterlab-settings",
            {"fetchNews": "false", "checkForUpdates": False},
        )
        # Every cell in the DOM (no virtualized notebook), so locators find outputs out of view.
        _write_json(
            settings / "notebook-extension" / "tracker.jupyterlab-settings", {"windowingMode": "none"}
        )
        self.port = _free_port()
        self.token = os.urandom(16).hex()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (tmp / "lab.log").open("w")
        cmd = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            "--ServerApp.password=",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--expose-app-in-browser",  # window.jupyterapp, for the run-all command
        ]
        self.proc = subprocess.Popen(
            cmd, env=self.env, stdout=self.log, stderr=subprocess.STDOUT, cwd=self.root
        )

    def log_tail(self, n: int = 4000) -> str:
        self.log.flush()
        return (self.tmp / "lab.log").read_text()[-n:]

    def wait_ready(self, timeout_s: float = 60) -> float:
        t0 = time.perf_counter()
        req = urllib.request.Request(
            f"{self.url}/api/status", headers={"Authorization": f"token {self.token}"}
        )
        while time.perf_counter() - t0 < timeout_s:
            if self.proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except OSError:
                time.sleep(0.25)
        pytest.fail(f"JupyterLab did not answer /api/status within {timeout_s} s:\n{self.log_tail()}")

    def stop(self) -> None:
        self.proc.terminate()  # the server shuts its kernels down itself
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def lab(tmp_path):
    server = Lab(tmp_path)
    try:
        server.ready_s = server.wait_ready()
        yield server
    finally:
        server.stop()


def test_explorer_in_jupyterlab(lab, tmp_path):
    screenshot = tmp_path / "00_explorer.png"  # never over the committed data/figures/00_explorer.png
    from playwright.sync_api import expect, sync_playwright

    # A copy per test (JupyterLab marks it dirty and may autosave it), opened with the project's kernel.
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    nb.metadata["kernelspec"] = {"name": lab.kernel, "display_name": "moelora", "language": "python"}
    name = f"explorer_{os.getpid()}.ipynb"
    nbformat.write(nb, str(lab.root / name))

    times = {"server up": lab.ready_s}
    errors: list[str] = []
    with sync_playwright() as p:
        t0 = time.perf_counter()
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], env=lab.env)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1500})
            page.set_default_timeout(60_000)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{lab.url}/lab/tree/{name}?reset&token={lab.token}")
            # A connected, idle kernel (not the toolbar's indicator: it says idle before a kernel exists).
            expect(page.locator("#jp-main-statusbar")).to_contain_text("| Idle", timeout=90_000)
            times["page + kernel idle"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            # Fire and forget: evaluate() has no timeout; the waits below have.
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            done = page.locator(".jp-OutputArea .jp-RenderedMarkdown", has_text=HEADING.lstrip("# "))
            failed = page.locator(
                ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']", has_text="Traceback"
            )
            expect(done.or_(failed).first).to_be_attached(timeout=RUN_ALL_TIMEOUT_MS)
            if failed.count():
                pytest.fail(
                    f"a cell of the explorer failed in JupyterLab:\n{failed.first.inner_text()[-3000:]}"
                )
            times["run all"] = time.perf_counter() - t0

            status = page.locator(".moelora-status")
            img = page.locator(".moelora-plot img")
            table = page.locator(".moelora-table")
            expect(status).to_contain_text("T = 64")
            expect(img).to_have_count(1)
            expect(page.locator(".moelora-source")).to_contain_text("EVEN_K")
            src_before, table_before = img.get_attribute("src"), table.inner_html()
            assert src_before and src_before.startswith("data:image/png"), src_before

            # Change a control as a user would: the "tokens T" dropdown, 64 -> 1600.
            t0 = time.perf_counter()
            page.locator(".widget-dropdown", has_text="tokens T").locator("select").select_option(
                label="1600"
            )
            expect(status).to_contain_text("T = 1600", timeout=30_000)  # set after the plot and the tables
            expect(img).not_to_have_attribute("src", src_before)
            times["control change -> redrawn"] = time.perf_counter() - t0
            table_after = table.inner_html()
            assert table_after != table_before, "the layer table did not change with T"
            c = pd.read_csv(ROOT / "data" / "07_cumulative.csv").set_index(["model", "T", "part"])
            want = f"{c.at[('gpt-oss-20b', 1600, 'total'), 'tuned']:,.1f}"
            assert want in table_after, f"the table does not show tuned's whole layer at T = 1600 ({want})"
            assert page.locator(".moelora-plot img").get_attribute("src") != src_before

            main = page.locator(".moelora-main")
            # the explorer in the middle of the notebook panel, clear of its toolbar and the status bar
            page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
            main.evaluate("el => el.scrollIntoView({block: 'center'})")
            main.screenshot(path=str(screenshot))
        finally:
            browser.close()
    print("browser test timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    assert not errors, f"errors in the page: {errors}"
    assert screenshot.stat().st_size > 10_000

"""The one set-up call of the stage notebooks, and the small display helpers they share.

Every notebook starts (after its ``parameters`` cell) with::

    from moelora_lib.studies.notebook import setup
    nb = setup("02", PROFILE, seed=SEED)

:func:`setup` resolves ``PROFILE`` ("auto": "gpu" where CUDA is present, else "cpu"), switches the Triton
interpreter on for the CPU profile *before* any kernel module is imported (``@triton.jit`` reads
``TRITON_INTERPRET`` when it decorates), seeds torch, sets pandas display options, picks the device, the
dtype (bf16 on the GPU; fp32 on the CPU, where the interpreter's bf16 dot is wrong) and the data folder
(``data/`` on the GPU, ``data/cpu/`` on the CPU so a CPU run never overwrites GPU evidence), and records
the environment to ``data/env/<NN>_<profile>.json``.

Helpers: :func:`progress` (text progress bars that read well in executed copies), :func:`save_figure`
(save under the figures folder and show inline), :func:`conclude` (render a Markdown conclusion),
:func:`rel` (a path relative to the repository, so outputs carry no machine paths).
"""

from __future__ import annotations

import numbers
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .runner import REPO_ROOT, resolve_profile

__all__ = ["NotebookSession", "setup", "progress", "save_figure", "conclude", "rel"]


@dataclass(frozen=True)
class NotebookSession:
    """What :func:`setup` resolved for one notebook run.

    Attributes:
        notebook: the notebook's number ("02").
        profile: "gpu" or "cpu".
        device: "cuda" or "cpu".
        dtype: torch.bfloat16 (gpu) or torch.float32 (cpu).
        data: folder for CSV/JSON results (``data/`` or ``data/cpu/``).
        figures: folder for PNG figures (``<data>/figures``), created.
        env: the environment record (gpu, torch, triton, helion, git commit, ...).
    """

    notebook: str
    profile: str
    device: str
    dtype: Any
    data: Path
    figures: Path
    env: dict = field(repr=False)

    @property
    def gpu(self) -> bool:
        """True on the GPU profile."""
        return self.profile == "gpu"

    def csv(self, name: str) -> Path:
        """``<data>/<name>``."""
        return self.data / name


def _kernels_imported() -> bool:
    return "moelora_lib.kernels.triton_kernels" in sys.modules


def setup(notebook: str, profile: str = "auto", seed: int = 0, *, save_env: bool = True) -> NotebookSession:
    """Prepare a notebook run; see the module docstring.

    Args:
        notebook: the notebook's two-digit number, e.g. "02" (names the env record).
        profile: "auto", "gpu" or "cpu".
        seed: passed to ``torch.manual_seed``.
        save_env: write ``data/env/<notebook>_<profile>.json``.

    Raises:
        ValueError: unknown profile, a notebook id that is not two digits, a seed that is not an int
            (bools rejected), or a save_env that is not a bool.
        RuntimeError: the gpu profile without CUDA, or the kernel modules were already imported in the
            other interpreter mode (restart the kernel and run the notebook from the top).
    """
    if not (isinstance(notebook, str) and len(notebook) == 2 and notebook.isdigit()):
        raise ValueError(f"notebook: expected a two-digit id like '02', got {notebook!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(
            f"seed: expected an int (passed to torch.manual_seed), got {seed!r} ({type(seed).__name__})"
        )
    if not isinstance(save_env, bool):
        raise ValueError(f"save_env: expected a bool, got {save_env!r} ({type(save_env).__name__})")
    profile = resolve_profile(profile)
    interpret_wanted = profile == "cpu"
    interpret_now = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if interpret_wanted != interpret_now:
        if _kernels_imported():
            raise RuntimeError(
                f"profile {profile!r} needs TRITON_INTERPRET={'1' if interpret_wanted else 'unset'}, but the "
                "kernel modules were already imported in the other mode: restart the kernel and run from "
                "the top"
            )
        if interpret_wanted:
            os.environ["TRITON_INTERPRET"] = "1"
        else:
            os.environ.pop("TRITON_INTERPRET", None)

    import pandas as pd
    import torch

    from . import bench

    if profile == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("profile 'gpu' needs a CUDA GPU; use PROFILE = 'auto' or 'cpu' on this machine")
    torch.manual_seed(seed)
    pd.set_option("display.width", 200)
    pd.set_option("display.max_columns", 40)
    pd.set_option("display.max_rows", 200)
    data = bench.data_path() if profile == "gpu" else bench.data_path("cpu")
    figures = data / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    if save_env:
        env = bench.save_env(bench.data_path("env", f"{notebook}_{profile}.json"))
    else:
        env = bench.env_record()
    session = NotebookSession(
        notebook=notebook,
        profile=profile,
        device="cuda" if profile == "gpu" else "cpu",
        dtype=torch.bfloat16 if profile == "gpu" else torch.float32,
        data=data,
        figures=figures,
        env=env,
    )
    shown = {k: env.get(k) for k in ("gpu", "torch", "triton", "helion", "git_commit")}
    print(
        f"profile={profile} device={session.device} dtype={str(session.dtype).removeprefix('torch.')} "
        f"data={rel(data)} {shown}"
    )
    return session


def progress(iterable: Iterable, desc: str | None = None, total: int | None = None, **kw):
    """A text progress bar (tqdm's plain text bar on stdout, ASCII): readable in JupyterLab and in the
    executed copies, where widget bars stay frozen at 0 %."""
    from tqdm.std import tqdm

    kw.setdefault("mininterval", 2.0)
    return tqdm(
        iterable, desc=desc, total=total, file=sys.stdout, ascii=True, dynamic_ncols=False, ncols=90, **kw
    )


def save_figure(fig, session: NotebookSession, name: str, *, dpi: int = 120) -> Path:
    """Save ``fig`` as ``<figures>/<name>`` (PNG) and leave it to show inline; returns the path.

    ``name`` is a bare file name ending in ``.png``; raises ValueError otherwise.
    """
    if not (isinstance(name, str) and name.endswith(".png") and "/" not in name):
        raise ValueError(f"name: expected a bare file name ending in '.png', got {name!r}")
    path = session.figures / name
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    print(f"saved {rel(path)}")
    return path


def conclude(markdown: str) -> None:
    """Display ``markdown`` as a rendered Markdown output (the notebook's written conclusion).

    Returns None, so that a cell ending in ``conclude(...)`` shows the rendered text once.
    Raises TypeError for anything but a non-empty str.
    """
    from IPython.display import Markdown, display

    if not (isinstance(markdown, str) and markdown.strip()):
        raise TypeError(f"markdown: expected a non-empty str, got {type(markdown).__name__}")
    display(Markdown(markdown))


def rel(path: str | os.PathLike) -> str:
    """``path`` relative to the repository root when inside it (no machine paths in outputs)."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO_ROOT))
    except ValueError:
        return p.name

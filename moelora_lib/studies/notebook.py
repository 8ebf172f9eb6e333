"""The one set-up call of the notebooks, and the small display helpers they share.

Every notebook starts (after its ``parameters`` cell) with::

    from moelora_lib.studies.notebook import setup
    nb = setup("02", PROFILE, seed=SEED)
"""

from __future__ import annotations

import ast
import difflib
import inspect
import numbers
import os
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .runner import REPO_ROOT, _set_env, resolve_profile


@dataclass(frozen=True)
class NotebookSession:
    """What :func:`setup` resolved: notebook ("02"), profile ("gpu"/"cpu"), device ("cuda"/"cpu"), dtype
    (bf16 on the GPU, fp32 on the CPU), data (CSV folder), figures (``<data>/figures``) and env (the
    environment record)."""

    notebook: str
    profile: str
    device: str
    dtype: Any
    data: Path
    figures: Path
    env: dict = field(repr=False)

    @property
    def gpu(self) -> bool:
        return self.profile == "gpu"

    def csv(self, name: str) -> Path:
        """``<data>/<name>``."""
        return self.data / name


def setup(notebook: str, profile: str = "auto", seed: int = 0, *, save_env: bool = True) -> NotebookSession:
    """Prepare a notebook run (module docstring). ValueError: unknown profile, a notebook id not two
    digits, a non-int seed, a non-bool save_env. RuntimeError: gpu without CUDA, or the kernel modules
    already imported in the other interpreter mode."""
    if not (isinstance(notebook, str) and len(notebook) == 2 and notebook.isdigit()):
        raise ValueError(f"notebook: expected a two-digit id like '02', got {notebook!r}")
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool):
        raise ValueError(f"seed: expected an int (passed to torch.manual_seed), got {seed!r}")
    if not isinstance(save_env, bool):
        raise ValueError(f"save_env: expected a bool, got {save_env!r}")
    profile = resolve_profile(profile)
    interpret_wanted = profile == "cpu"
    if interpret_wanted != (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")):
        if "moelora_lib.kernels.triton_kernels" in sys.modules:
            want = "1" if interpret_wanted else "unset"
            msg = f"profile {profile!r} needs TRITON_INTERPRET={want}, but the kernel modules were imported"
            raise RuntimeError(msg + " in the other mode: restart the kernel and run from the top")
        _set_env("TRITON_INTERPRET", "1" if interpret_wanted else None)

    import pandas as pd
    import torch

    from . import bench

    if profile == "gpu" and not torch.cuda.is_available():
        raise RuntimeError("profile 'gpu' needs a CUDA GPU; use PROFILE = 'auto' or 'cpu' on this machine")
    torch.manual_seed(seed)
    for key, value in (("width", 200), ("max_columns", 40), ("max_rows", 200)):
        pd.set_option(f"display.{key}", value)
    data = bench.data_path() if profile == "gpu" else bench.data_path("cpu")
    figures = data / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    env_path = bench.data_path("env", f"{notebook}_{profile}.json")
    env = bench.save_env(env_path) if save_env else bench.env_record()
    gpu = profile == "gpu"
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    session = NotebookSession(notebook, profile, device, dtype, data, figures, env)
    shown = {k: env.get(k) for k in ("gpu", "torch", "triton", "helion", "git_commit")}
    print(f"profile={profile} device={device} dtype={str(dtype)[6:]} data={rel(data)} {shown}")
    return session


def progress(iterable: Iterable, desc: str | None = None, total: int | None = None, **kw):
    """A text progress bar (tqdm's plain text bar on stdout, ASCII): readable in JupyterLab and in the
    executed copies, where widget bars stay frozen at 0 %."""
    from tqdm.std import tqdm

    kw.setdefault("mininterval", 2.0)
    kw |= dict(file=sys.stdout, ascii=True, dynamic_ncols=False, ncols=90)
    return tqdm(iterable, desc=desc, total=total, **kw)


def save_figure(fig, session: NotebookSession, name: str, *, dpi: int = 120) -> Path:
    """Save ``fig`` as ``<figures>/<name>`` (PNG) and return the path; ``name`` is a bare file name ending
    in ``.png`` (ValueError otherwise)."""
    if not (isinstance(name, str) and name.endswith(".png") and "/" not in name):
        raise ValueError(f"name: expected a bare file name ending in '.png', got {name!r}")
    path = session.figures / name
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    print(f"saved {rel(path)}")
    return path


def conclude(markdown: str) -> None:
    """Display ``markdown`` rendered (a notebook's conclusion); returns None. TypeError unless a non-empty
    str."""
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


# --- The kernel lines a stage changes -----------------------------------------------------------------------

#: The LoRA kernels, whose constexprs follow the stage's switches (the base GEMM follows its own config).
_LORA_KERNELS = ("lora_shrink", "lora_expand")


def _fixed_constexprs(stage) -> dict[str, Any]:
    """The constexprs a stage fixes in the LoRA kernels (what its :meth:`Stage.adapt` and launches force)."""
    off = {"SPLIT_K": (stage.split_k, 1), "GROUP_SIZE_M": (stage.swizzle, 1), "EVEN_K": (stage.even_k, False)}
    return {**{k: v for k, (on, v) in off.items() if not on}, "ADD_INPUTS": bool(stage.fused_add)}


def _resolve_branches(src: str, fixed: dict[str, Any]) -> str:
    """``src`` with every ``if`` whose test is decided by ``fixed`` replaced by the branch taken."""
    lines = src.splitlines()
    drop: set[int] = set()
    shift: dict[int, int] = {}
    elif_to_if: set[int] = set()

    def test_value(node: ast.If):
        try:
            code = compile(ast.Expression(node.test), "<test>", "eval")
            return bool(eval(code, {"__builtins__": {}}, dict(fixed)))  # noqa: S307 - names and literals
        except Exception:  # noqa: BLE001 - a test that names anything not fixed stays as written
            return None

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and (taken := test_value(node)) is not None:
                drop.update(range(node.lineno, node.end_lineno + 1))
                keep = node.body if taken else node.orelse
                if keep:
                    a, b = keep[0].lineno, keep[-1].end_lineno
                    drop.difference_update(range(a, b + 1))
                    first = keep[0]
                    if len(keep) == 1 and isinstance(first, ast.If) and first.col_offset == node.col_offset:
                        elif_to_if.add(a)  # an elif taken on its own becomes an if
                    else:
                        for i in range(a, b + 1):
                            shift[i] = shift.get(i, 0) + keep[0].col_offset - node.col_offset
                    visit(keep)
            else:
                for name in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, name, []) or [])

    visit(ast.parse(src).body)
    out = []
    for i, line in enumerate(lines, 1):
        if i in drop:
            continue
        line = line[shift.get(i, 0) :] if line[: shift.get(i, 0)].strip() == "" else line
        if i in elif_to_if:
            line = line.replace("elif ", "if ", 1)
        out.append(line)
    return "\n".join(out)


def _stage_kernels(stage) -> list[str]:
    """The kernel names (``triton_kernels.KERNELS`` keys) one layer of ``stage`` launches, in call order."""
    from moelora_lib.kernels import stages as st

    table = st.FUSED_LAUNCH_KERNELS if stage.fused_gemm else st.LAUNCH_KERNELS
    return list(dict.fromkeys(table[op] for op in stage.launch_ops if op in table))


def stage_kernel_source(stage_name: str) -> str:
    """The source of every kernel ``stage_name`` launches, as that stage compiles it: the ``@triton.jit``
    line with its ``do_not_specialize`` arguments, the constexprs the stage fixes, and the body with the
    branches those constexprs decide resolved. Raises ValueError for an unknown stage."""
    from moelora_lib.kernels import STAGES
    from moelora_lib.kernels.triton_kernels import KERNELS

    if stage_name not in STAGES:
        raise ValueError(f"stage: unknown stage {stage_name!r}; known: {list(STAGES)}")
    stage = STAGES[stage_name]
    parts = []
    for name in _stage_kernels(stage):
        jit = KERNELS[name][bool(stage.specialize_lengths)]
        dns = getattr(jit, "do_not_specialize", None) or getattr(jit, "kwargs", {}).get("do_not_specialize")
        src = textwrap.dedent(inspect.getsource(jit.fn))
        params = set(inspect.signature(jit.fn).parameters)
        fixed = {k: v for k, v in _fixed_constexprs(stage).items() if k in params and name in _LORA_KERNELS}
        parts.append(f"# kernel {name}")
        parts.append(f"@triton.jit(do_not_specialize={list(dns)})" if dns else "@triton.jit")
        if fixed:
            parts.append("# fixed by the stage: " + ", ".join(f"{k} = {v}" for k, v in fixed.items()))
        parts.append(_resolve_branches(src, fixed))
    return "\n".join(parts) + "\n"


def show_kernel_change(prev_stage: str, stage: str, *, show: bool = True) -> str:
    """The kernel lines ``stage`` changes against ``prev_stage``: a unified diff of the two stages'
    :func:`stage_kernel_source` (jitted source as each compiles it), shown as a Markdown ``diff`` block in
    IPython when ``show``; returns the text ("" when the kernel source is the same, e.g. ``tuned``).
    ValueError naming the argument for an unknown stage."""
    from moelora_lib.kernels import STAGES

    for arg, value in (("prev_stage", prev_stage), ("stage", stage)):
        if value not in STAGES:
            raise ValueError(f"{arg}: unknown stage {value!r}; known: {list(STAGES)}")
    a = stage_kernel_source(prev_stage).splitlines(keepends=True)
    b = stage_kernel_source(stage).splitlines(keepends=True)
    diff = "".join(difflib.unified_diff(a, b, fromfile=prev_stage, tofile=stage, n=3))
    if show and "IPython" in sys.modules and sys.modules["IPython"].get_ipython() is not None:
        from IPython.display import Markdown, display

        same = f"(no kernel line differs: `{stage}` launches the kernels of `{prev_stage}` unchanged)"
        display(Markdown(f"```diff\n{diff}```" if diff else same))
    return diff

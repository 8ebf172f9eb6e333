"""Test set-up: the Triton interpreter on machines without a GPU.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a kernel, so it is set here, before any
moelora_lib kernel module is imported (environment.md §2). Tests marked ``gpu`` are skipped
without CUDA; on a GPU host the interpreter is not used.
"""

import os
import re
import sys
from pathlib import Path

# Before numpy loads OpenBLAS: its non-FMA kernels give each row of a product independently of the other rows,
# as the GPU's MMA does (scripts/_common.sh says why; the interpreter's tl.dot is numpy's matmul).
os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
#: tests/interpreter_site: interpreter_speedups.py and the sitecustomize.py that applies it in child processes
INTERPRETER_SITE = Path(__file__).resolve().parent / "interpreter_site"


if os.environ.get("TRITON_INTERPRET") == "1":
    # the same replacements in this process and in the Python processes the tests start
    sys.path.insert(0, str(INTERPRETER_SITE))
    _paths = [str(INTERPRETER_SITE), os.environ.get("PYTHONPATH")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in _paths if p)
    import interpreter_speedups  # noqa: E402

    interpreter_speedups.apply()

#: Test files with a module-scoped fixture (a built model, a written checkpoint): pytest-xdist runs each on
#: one worker, which builds the fixture once (else each worker builds it for its share of the tests).
SHARED_FIXTURE_FILES = frozenset(
    p.name
    for p in Path(__file__).parent.glob("test_*.py")
    if re.search(r"@pytest\.fixture\(scope=\"module\"", p.read_text())
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` with the default ``--dist load``: each file of :data:`SHARED_FIXTURE_FILES` is one work unit
    (given out first, the larger ones first), every other test its own; a worker gets the next unit when it
    is nearly idle."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if Path(path).name in SHARED_FIXTURE_FILES else nodeid

    return SharedFixtureScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernels run: cuda if present, else cpu through the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"

"""Test set-up: the Triton interpreter on machines without a GPU.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a kernel, so it is set here, before any
moelora_lib kernel module is imported (environment.md §2). Tests marked ``gpu`` are skipped
without CUDA; on a GPU host the interpreter is not used.
"""

import os

# Before numpy loads OpenBLAS: its non-FMA kernels give each row of a product independently of the other rows,
# as the GPU's MMA does (scripts/_common.sh says why; the interpreter's tl.dot is numpy's matmul).
os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


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

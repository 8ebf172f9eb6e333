"""Test set-up: the Triton interpreter on machines without a GPU.

TRITON_INTERPRET is read when ``@triton.jit`` decorates a kernel, so it is set here, before any
moelora_lib kernel module is imported (environment.md §2). Tests marked ``gpu`` are skipped
without CUDA; on a GPU host the interpreter is not used.
"""

import os
import re
from pathlib import Path

# Before numpy loads OpenBLAS: its non-FMA kernels give each row of a product independently of the other rows,
# as the GPU's MMA does (scripts/_common.sh says why; the interpreter's tl.dot is numpy's matmul).
os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")

import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_lang_once_per_launch() -> None:
    """Triton's interpreter swaps triton.language's builtins for interpreted ones (``_patch_lang``: an
    ``inspect.getmembers`` walk of tl, tl.tensor, tl.math, ...) at each launch and again at every call of a
    ``@triton.jit`` device function from inside it, where the builtins are already swapped and the walk
    changes nothing: about a fifth of the interpreted test time. Here a device call skips the walk when the
    launch has already swapped the modules its function sees; the kernels run the same interpreted code.
    Left as it is if this Triton has other internals."""
    import triton.language as tl
    from triton.runtime import interpreter as ti

    real_patch, executor = getattr(ti, "_patch_lang", None), getattr(ti, "GridExecutor", None)
    if real_patch is None or executor is None or not hasattr(ti, "_LangPatchScope"):
        return
    real_call, swapped = executor.__call__, []  # swapped: the lang modules the running launch swapped

    seen_langs: dict = {}  # (id, size) of a module's globals -> its lang modules: one walk per module

    def langs_of(fn):
        g = fn.__globals__
        key = (id(g), len(g))
        if key not in seen_langs:
            seen_langs[key] = {id(v) for v in g.values() if isinstance(v, type(tl)) and v in (tl, tl.core)}
        return seen_langs[key]

    def patch_lang(fn):
        langs = langs_of(fn)
        if swapped and langs <= swapped[0]:
            return ti._LangPatchScope()  # nothing to restore
        scope = real_patch(fn)
        if swapped:
            swapped[0] |= langs
        else:
            swapped.append(set(langs))  # a copy: the cached set stays as it is
        return scope

    def call(self, *args, **kwargs):
        outer = not swapped
        try:
            return real_call(self, *args, **kwargs)
        finally:
            if outer:
                swapped.clear()

    ti._patch_lang = patch_lang
    executor.__call__ = call


def _skip_dead_interpreter_work() -> None:
    """Two costs of Triton's interpreter that compute nothing a kernel sees:

    * the integer-overflow sanitizer: every int add/sub/mul recomputed in int64 and compared with the
      type's range, for a ``device_assert`` that is a no-op unless ``debug`` is on (the interpreter's
      builder never turns it on): about a third of the interpreted test time. It is switched off only
      while ``debug`` is off, where the check it builds is dropped anyway;
    * ``_get_np_dtype`` rebuilding its dtype table (hashing every tl dtype) at each call: built once here,
      the same table and lookups.

    Left as they are if this Triton has other internals."""
    import inspect
    from dataclasses import replace

    import numpy as np
    import triton.language as tl
    from triton.language import semantic
    from triton.runtime import interpreter as ti

    builder = getattr(ti, "InterpreterBuilder", None)
    device_assert = getattr(getattr(semantic, "TritonSemantic", None), "device_assert", None)
    assert_src = inspect.getsource(device_assert) if device_assert is not None else ""
    if builder is not None and "if not self.builder.options.debug:" in assert_src:
        real_init = builder.__init__

        def init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            if not self.options.debug:
                self.options = replace(self.options, sanitize_overflow=False)

        builder.__init__ = init
        shared = getattr(ti, "interpreter_builder", None)
        if shared is not None and not shared.options.debug:
            shared.options = replace(shared.options, sanitize_overflow=False)

    real_np_dtype = getattr(ti, "_get_np_dtype", None)
    if real_np_dtype is None:
        return
    names = "int1 float16 float32 float64 int8 uint8 int16 uint16 int32 uint32 int64 uint64 bfloat16".split()
    names += "float8e5 float8e5b16 float8e4nv float8e4b8 float8e4b15".split()
    table = {getattr(tl, n): real_np_dtype(getattr(tl, n)) for n in names}
    ptr = np.dtype(np.uint64)

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.pointer_type):
            return ptr
        if isinstance(tt_dtype, tl.block_type):
            return ptr if isinstance(tt_dtype.element_ty, tl.pointer_type) else table[tt_dtype.element_ty]
        return table[tt_dtype]

    ti._get_np_dtype = np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_lang_once_per_launch()
    _skip_dead_interpreter_work()


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

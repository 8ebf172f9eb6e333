"""Applies interpreter_speedups.py (this folder) in a Python process the tests start, once its
``import triton`` has finished (triton.language complete), with ``TRITON_INTERPRET=1``; tests/conftest.py puts
this folder on PYTHONPATH. Any other process, or a failure to apply, leaves Triton as it ships."""

import os
import sys

_MODULE = "triton"


class _AfterInterpreterImport:
    """A meta-path finder that only wraps the loader of :data:`_MODULE`, to run the replacements after it."""

    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        real_exec = spec.loader.exec_module

        def exec_module(module):
            real_exec(module)
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
            try:
                import interpreter_speedups

                interpreter_speedups.apply()
            except Exception:  # noqa: BLE001 - a speed-up only: Triton as shipped still works
                pass

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("MOELORA_PLAIN_INTERPRETER") != "1":
    sys.meta_path.insert(0, _AfterInterpreterImport())

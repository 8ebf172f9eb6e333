"""Small facts and helpers that several product modules share: one place for each.

- :data:`DTYPES` / :func:`parse_dtype` / :func:`dtype_name`: the one map between dtype names and torch dtypes.
- :func:`gpu_name`: the GPU name used in config file and folder names (``NVIDIA_H200``).
- :func:`write_json_atomic`: the one atomic JSON writer (temporary file in the same folder, fsync,
  ``os.replace``).
- :func:`is_int`: an int that is not a bool (JSON ``true`` must not pass as 1).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["DTYPES", "parse_dtype", "dtype_name", "gpu_name", "write_json_atomic", "is_int"]

#: Canonical dtype names (as in CSV rows and config files) -> torch dtypes.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` -> ``torch.bfloat16``.

    Raises:
        ValueError: naming the argument and the accepted names, for anything else.
    """
    if isinstance(dtype, torch.dtype):
        if dtype in DTYPES.values():
            return dtype
    elif isinstance(dtype, str):
        name = _ALIASES.get(dtype, dtype).removeprefix("torch.")
        if name in DTYPES:
            return DTYPES[name]
    raise ValueError(f"dtype: expected one of {sorted(DTYPES) + sorted(_ALIASES)}, got {dtype!r}")


def dtype_name(dtype: str | torch.dtype) -> str:
    """``torch.bfloat16`` (or ``"bf16"``) -> ``"bfloat16"``; raises ValueError like :func:`parse_dtype`."""
    return str(parse_dtype(dtype)).removeprefix("torch.")


def is_int(v: Any) -> bool:
    """True for a Python or numpy integer that is not a bool."""
    import numbers

    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def gpu_name(device: int | None = None, *, required: bool = False) -> str:
    """``torch.cuda.get_device_name(device)`` with spaces and '-' as '_' (``NVIDIA_H200``).

    Without CUDA: ``"cpu"``, or RuntimeError when ``required``.
    """
    if not torch.cuda.is_available():
        if required:
            raise RuntimeError("no CUDA device: there is no GPU name to pick a config file by")
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_").replace("-", "_")


def write_json_atomic(
    path: str | os.PathLike, data: Any, *, indent: int = 1, sort_keys: bool = False
) -> Path:
    """Write ``data`` as JSON to ``path`` atomically; returns the path.

    A temporary file in the same folder is written, fsynced and renamed over ``path`` (``os.replace``),
    so an interrupted write leaves the old file (or none), never half a JSON. Parent folders are made.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=indent, sort_keys=sort_keys)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path

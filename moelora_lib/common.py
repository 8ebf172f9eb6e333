"""Small facts and helpers that several product modules share: one place for each.

- :data:`DTYPES` / :func:`parse_dtype` / :func:`dtype_name`: the one map between dtype names and torch dtypes.
- :func:`gpu_name`: the GPU name used in config file and folder names (``NVIDIA_H200``).
- :func:`write_json_atomic`: the one atomic JSON writer (temporary file in the same folder, fsync,
  ``os.replace``).
- :func:`is_int`: an int that is not a bool (JSON ``true`` must not pass as 1).
- :func:`check_real_scalar`: one finite real number of any of Python's, numpy's or torch's scalar kinds
  (an adapter's ``scaling``).
- :func:`check_no_grad`: the inference-only check of inputs that require grad (host-side).
- :func:`aligned16`: a tensor whose data pointer is 16-byte aligned (Triton's pointer specialization).
- :func:`describe` / :func:`check_tensor`: the one shape / dtype / device check of an input tensor, with
  a message naming the argument.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DTYPES",
    "parse_dtype",
    "dtype_name",
    "gpu_name",
    "write_json_atomic",
    "is_int",
    "check_real_scalar",
    "check_bool",
    "check_no_grad",
    "aligned16",
    "MisalignedCopyWarning",
    "MISALIGNED_COPY_WARN_BYTES",
    "describe",
    "check_tensor",
]

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
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


#: What :func:`check_real_scalar` accepts, for its message.
_REAL_SCALAR_KINDS = (
    "a Python int or float, a numpy real scalar, a numbers.Real (e.g. Fraction) or a 0-d real tensor"
)


def check_real_scalar(name: str, v: Any) -> float:
    """``float(v)`` when ``v`` is one finite real number; ValueError naming ``name`` otherwise.

    Accepted: a Python int or float, a numpy real scalar (``np.float32``, ``np.int64``, ...), any other
    :class:`numbers.Real` (e.g. ``fractions.Fraction``), and a 0-d tensor of a float or int dtype (its
    ``.item()``: one host read, for a CUDA tensor a sync; meant for values given at load time, not per
    call). Refused: bools (``True`` is a flag, not 1.0), complex
    numbers, tensors with a dim or without data (meta), NaN, infinities and values beyond float64's range.
    """
    value = None
    if isinstance(v, torch.Tensor):
        if v.dim() == 0 and v.dtype != torch.bool and not v.is_complex() and v.device.type != "meta":
            value = v.item()
    elif isinstance(v, numbers.Real) and not isinstance(v, bool):
        value = v
    if value is not None:
        try:
            value = float(value)
        except OverflowError:  # an int or Fraction beyond float64
            value = None
    if value is None or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite real number ({_REAL_SCALAR_KINDS}), got {v!r}")
    return value


def check_bool(name: str, v: Any) -> bool:
    """Return ``v`` when it is a bool; ValueError naming ``name`` otherwise (no truthiness of 0/1, None
    or strings: a flag given as ``"false"`` must not mean True)."""
    if not isinstance(v, bool):
        t = type(v)
        kind = t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
        raise ValueError(f"{name} must be a Python bool (True or False), got {kind}: {v!r}")
    return v


def check_slices(slices, n_total: int | None = None, total: str = "N_total") -> tuple[int, ...]:
    """``slices`` (a projection's output widths N_s) as a tuple of ints.

    Raises:
        ValueError naming ``slices`` unless it is a non-empty tuple/list of ints >= 1 that sums to
        ``n_total`` when given (``total`` names where that width comes from, e.g. ``weight.shape[0]``).
    """
    if not isinstance(slices, (tuple, list)) or not slices or not all(is_int(n) and n >= 1 for n in slices):
        raise ValueError(f"slices must be a non-empty tuple of output widths (ints >= 1), got {slices!r}")
    slices = tuple(int(n) for n in slices)
    if n_total is not None and sum(slices) != n_total:
        raise ValueError(f"slices {slices} must sum to {total} = {n_total}, got {sum(slices)}")
    return slices


def check_no_grad(*named: tuple[str, Any]) -> None:
    """ValueError naming the first tensor of the (name, value) pairs ``named`` that requires grad while
    grad mode is on (non-tensors and None are skipped).

    Why: the kernels are Triton launches with no autograd formula, so such a call would return a
    result that silently carries no gradient (or, through a custom op, fails only in backward).
    Cost: ``torch.is_grad_enabled()`` and one ``requires_grad`` attribute read per tensor on the host;
    no device work, no sync, nothing a CUDA graph or torch.compile sees.
    """
    if not torch.is_grad_enabled():
        return
    for name, t in named:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(
                f"{name} requires grad: moelora_lib is inference only; call under torch.no_grad() / "
                "torch.inference_mode() or pass a detached tensor"
            )


def is_finite(t: torch.Tensor) -> bool:
    """Whether the float tensor ``t`` holds no NaN and no infinity: one min/max reduction (NaN propagates
    into both) without a temporary the size of ``t``, one host sync. For weights and adapters when they are
    loaded, never per call."""
    if not t.numel():
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def check_finite(name: str, t: torch.Tensor) -> None:
    """ValueError naming ``name`` when the float tensor ``t`` holds a NaN or an infinity (:func:`is_finite`;
    for weights at construction)."""
    if t.is_floating_point() and t.device.type in ("cpu", "cuda") and not is_finite(t):
        raise ValueError(f"{name} holds non-finite values (NaN or inf): every output row would be NaN")


def describe(x) -> str:
    """What ``x`` is, for an error message: a tensor's shape, dtype and device, else its type."""
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}"
    return f"{type(x).__name__}"


#: The dtypes the kernels run (activations, weights, adapters).
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_kernel_dtype(dtype: torch.dtype, device: torch.device, name: str, cpu_backend_check) -> None:
    """ValueError naming ``name`` unless the kernels can run ``dtype`` on ``device``: one of
    :data:`KERNEL_DTYPES`, and on the CPU what ``cpu_backend_check(dtype, name)`` accepts (the Triton
    interpreter is on; no bfloat16 there)."""
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"{name} must be float16, bfloat16 or float32, got {dtype}")
    if device.type == "cpu":
        cpu_backend_check(dtype, name)


def check_cpu_backend(kernel, dtype: torch.dtype | None, name: str) -> None:
    """ValueError naming ``name`` (an argument on the CPU) unless ``kernel`` can run it: CPU tensors run only
    through the Triton interpreter, so ``kernel`` (a jitted function of the module the call launches) must
    have been built with ``TRITON_INTERPRET=1``; and the interpreter multiplies raw bf16 bit patterns
    (triton-lang/triton#11584), so ``dtype`` must not be bfloat16 (None: not checked, for kernels that only
    convert)."""
    if type(kernel).__name__ != "InterpretedFunction":
        raise ValueError(
            f"{name} is on the CPU but the kernels were not built for the Triton interpreter: use CUDA "
            "tensors, or set TRITON_INTERPRET=1 before the first kernel module is imported (before the first "
            "call into moelora_lib; restart the process if a kernel was already built)"
        )
    if dtype == torch.bfloat16:
        raise ValueError(
            f"{name}: bfloat16 is not supported on the CPU (the Triton interpreter multiplies raw bf16 bit "
            "patterns, triton-lang/triton#11584); use float16 or float32 on the CPU, bfloat16 on a GPU"
        )


def check_kernel_device(name: str, device: torch.device) -> None:
    """ValueError naming ``name`` (the argument on ``device``) unless ``device`` is a CUDA device or the
    CPU: the kernels hold no other backend, and meta tensors no data."""
    if device.type not in ("cuda", "cpu"):
        what = "meta tensors hold no data and are not supported" if device.type == "meta" else "not supported"
        raise ValueError(
            f"{name} is on {device}: {what}; the kernels run on CUDA (or on the CPU through the Triton "
            "interpreter)"
        )


def check_activations(name: str, x, kernel) -> tuple[torch.dtype, torch.device]:
    """The (dtype, device) of ``x``, the [T, H] activations of a kernel call; ValueError naming ``name``
    unless x is a 2-D tensor of one of :data:`KERNEL_DTYPES` on a CUDA device, or on the CPU where
    :func:`check_cpu_backend` accepts it for ``kernel``."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [T, H], got {describe(x)}")
    dt, dev = x.dtype, x.device
    if dt not in KERNEL_DTYPES:
        raise ValueError(f"{name} dtype must be float16, bfloat16 or float32, got {dt}")
    check_kernel_device(name, dev)
    if dev.type == "cpu":
        check_cpu_backend(kernel, dt, name)
    return dt, dev


def check_tensor(name: str, t, shape: tuple, dtypes, device, dtype_note: str = "", *, like: str) -> None:
    """Raise ValueError naming ``name`` unless t is a tensor of ``shape``, dtype and device.

    ``shape`` holds (letter, size) pairs, e.g. (("E", 4), ("2I", 64), ("H", 64)); the sizes are the
    ones most arguments agree on, so the message names the tensor that disagrees. ``dtypes``: the
    accepted dtypes (``dtype_note`` follows the wanted dtype in the message, e.g. " (like x)").
    ``like``: the argument whose device the others must share (named in the message).
    """
    want = "[" + ", ".join(f"{k}={v}" for k, v in shape) + "]"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {want}, got {describe(t)}")
    if t.dim() != len(shape) or any(v != d for (_, v), d in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        want_dt = str(dtypes[0]) if len(dtypes) == 1 else f"in {[str(d) for d in dtypes]}"
        raise ValueError(f"{name} must have dtype {want_dt}{dtype_note}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (like {like}), got {t.device}")


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
    so an interrupted write leaves the old file (or none), never half a JSON. Parent folders are made. The
    file keeps an existing file's permission bits, else gets those of a plain new file (0o666 less the
    umask: the temporary file's 0o600 would hide a shared config folder's files from other users).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o7777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, mode)
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


class MisalignedCopyWarning(UserWarning):
    """:func:`aligned16` copied a large tensor (a weight, most likely) because its data pointer was
    not 16-byte aligned; the copy then happens on every call that passes that view."""


#: :func:`aligned16` warns when the tensor it has to copy is larger than this (16 MiB).
MISALIGNED_COPY_WARN_BYTES = 16 * 2**20


def aligned16(t: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """``t`` itself when its data pointer is 16-byte aligned (or it is empty), else a contiguous copy.

    Why: Triton specializes every pointer argument on ``data_ptr() % 16 == 0`` (the ``'D'`` in its
    cache key). A view that starts at an odd element offset (``buf[1:17]`` of a [17, 6] float32
    buffer, ``x[:, 3:]``...) therefore gets a second compiled binary of every kernel it reaches
    (1–1.4 s per kernel on an H200), and that binary also loses the vectorized loads the alignment
    hint allows. A copy made by the caching allocator is aligned (CUDA: 512 bytes; CPU: 64), so the
    launch reuses the binary of aligned inputs.

    Cost: nothing in the common case (the same object is returned); one copy of ``t`` only for a
    misaligned view. Meta tensors (``data_ptr() == 0``; compile-only checks) are returned as they
    are; a meta *view* reports its byte offset as data pointer and gets a new meta tensor (no data),
    like the aligned copy a device tensor would get.

    Args:
        t: any tensor.
        name: what to call it in the warning.
    Returns:
        ``t``, or a contiguous copy of it (same values, dtype, device) whose data pointer is aligned.
    Warns:
        MisalignedCopyWarning: the copy is larger than :data:`MISALIGNED_COPY_WARN_BYTES` (a weight:
            it would be copied on every call; pass an aligned tensor instead). Python's warning filter
            shows it once per message.
    """
    if t.numel() == 0 or t.data_ptr() % 16 == 0:
        return t
    nbytes = t.numel() * t.element_size()
    if nbytes > MISALIGNED_COPY_WARN_BYTES:
        warnings.warn(
            f"{name} ({tuple(t.shape)}, {t.dtype}, {nbytes / 2**20:.0f} MiB) is a view whose data pointer "
            "is not 16-byte aligned; it is copied on every call so the kernels keep one compiled binary. "
            "Pass an aligned tensor (e.g. .clone() it once) to avoid the copy.",
            MisalignedCopyWarning,
            stacklevel=3,
        )
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)

"""Linear methods: an engine-style API (shaped like vLLM's ``LinearMethodBase``, no vLLM dependency)
with a cuBLAS implementation and the Helion one.

A layer is any ``nn.Module``; the method puts ``weight`` [N, K] on it (``create_weights``), the model
loader fills it, ``process_weights_after_loading`` prepares it, and ``apply(layer, x, bias)`` computes
the output. :class:`Linear` is a minimal module wired that way.

Dispatch of :class:`HelionLinearMethod` (see :meth:`HelionLinearMethod.path_for`): M is rounded up to
its bucket (configs.BUCKETS); the Helion runner for (epilogue, dtype, K, N, bucket) is used when a
tuned config exists and the device can run it; otherwise ``F.linear`` (cuBLAS) with the same epilogue
in PyTorch, with one ``HelionFallbackWarning`` per distinct reason — also when a tuned config passes
the table's checks but Helion or Triton cannot build/compile it (remembered per bucket, not
retried). ``warmup`` compiles every bucket once (no autotuning ever happens at serving time:
configs come from the JSON table only).

The design follows vLLM's Helion linear backend (pre-tuned JSON configs per GPU, shape-bucketed
runners, a native fallback; docs/helion.md §8-§9) and Helion's "bind + compile_config"
deployment recipe.
"""

from __future__ import annotations

import abc
import copy
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import configs as C

__all__ = [
    "HelionFallbackWarning",
    "HelionLinearMethod",
    "Linear",
    "LinearMethodBase",
    "TorchLinearMethod",
    "build_runner",
    "helion_available",
]


#: Weight/activation dtypes a Linear may hold (Helion runs bf16/fp16, fp32 under the CPU interpreter;
#: fp64 only through TorchLinearMethod, e.g. as a reference).
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _check_max_m(max_m: Any, *, allow_none: bool = False) -> None:
    if allow_none and max_m is None:
        return
    if not (C.is_int(max_m) and max_m >= 1):
        expected = "None or an int >= 1" if allow_none else "an int >= 1"
        raise ValueError(f"max_m: expected {expected}, got {max_m!r}")


class HelionFallbackWarning(UserWarning):
    """A shape, dtype or device runs through ``F.linear`` instead of Helion (issued once per reason),
    including a tuned config that Helion or Triton cannot build (e.g. ``loop_orders`` of the wrong
    length: it passes the table's checks but raises ``helion.exc.InvalidConfig`` at compile time)."""


class _FailedRunner:
    """Stands in the runner cache for a config that failed to build or to compile on first call."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


def _short_error(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    if len(msg) > 300:
        msg = msg[:297] + "..."
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def _compile_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "this config cannot be compiled" when a runner is first called (Triton
    compiles then): Helion's errors and Triton's (CompilationError, OutOfResources, PTXASError, and
    InterpreterError under the CPU interpreter)."""
    errs: list[type[BaseException]] = []
    try:
        import helion.exc

        errs.append(helion.exc.Base)
    except Exception:  # pragma: no cover - helion missing: no runner is ever built
        pass
    try:
        from triton.errors import TritonError

        errs.append(TritonError)
    except Exception:  # pragma: no cover - older triton
        pass
    return tuple(errs)


_HELION_IMPORT_ERROR: str | None = None


def helion_available() -> tuple[bool, str]:
    """(True, "") when helion and the kernels module import, else (False, reason)."""
    global _HELION_IMPORT_ERROR
    try:
        from . import kernels  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        _HELION_IMPORT_ERROR = f"{type(e).__name__}: {e}"
        return False, _HELION_IMPORT_ERROR
    return True, ""


def _silu(v: torch.Tensor) -> torch.Tensor:
    return v * torch.sigmoid(v)


def torch_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, epilogue: str):
    """The PyTorch computation of every epilogue (what TorchLinearMethod runs; fp32/fp64 inputs give a
    reference). swiglu: ``silu(x·W[:I]ᵀ) * (x·W[I:]ᵀ)`` -> [M, I]."""
    y = F.linear(x, weight, bias)
    if epilogue in ("none", "bias"):
        return y
    if epilogue == "silu":
        return F.silu(y)
    if epilogue == "swiglu":
        gate, up = y.chunk(2, dim=-1)
        return F.silu(gate) * up
    raise ValueError(f"epilogue must be one of {C.EPILOGUES}, got {epilogue!r}")


def _check_epilogue(epilogue: str) -> str:
    if epilogue not in C.EPILOGUES:
        raise ValueError(f"epilogue must be one of {C.EPILOGUES}, got {epilogue!r}")
    return epilogue


class LinearMethodBase(abc.ABC):
    """Mirror of vLLM's ``LinearMethodBase``: weights are created on a layer, post-processed after
    loading, and ``apply`` computes the layer.

    epilogue: "none" (y = x·Wᵀ), "bias" (+ b), "silu" (silu(x·Wᵀ)) or "swiglu" (W = [gate | up]
    merged [2I, K], output silu(gate)·up [M, I]).
    """

    epilogue: str = "none"

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ) -> None:
        """Register ``layer.weight``: an uninitialized ``nn.Parameter`` [output_size, input_size] of
        ``dtype`` (requires_grad False), and ``layer.input_size`` / ``layer.output_size``.

        For epilogue "swiglu", output_size is 2I (gate rows [0, I), up rows [I, 2I)) and must be even.
        Raises ValueError for non-positive sizes or an odd swiglu output_size.
        """
        if input_size < 1 or output_size < 1:
            raise ValueError(f"input_size and output_size must be >= 1, got {input_size}, {output_size}")
        if self.epilogue == "swiglu" and output_size % 2:
            raise ValueError(f"swiglu: output_size must be 2I (even), got {output_size}")
        w = torch.empty(output_size, input_size, dtype=dtype, device=device)
        layer.register_parameter("weight", nn.Parameter(w, requires_grad=False))
        layer.input_size = input_size
        layer.output_size = output_size

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after the weights are loaded. Base: make ``weight`` contiguous."""
        if not layer.weight.is_contiguous():
            layer.weight.data = layer.weight.data.contiguous()

    @abc.abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y for x [M, K]: [M, N] (swiglu: [M, N/2]) in x.dtype."""

    # -- shared input checks ------------------------------------------------------------------
    def _resolve_bias(self, layer: nn.Module, bias: torch.Tensor | None) -> torch.Tensor | None:
        if self.epilogue == "bias":
            if bias is None:
                bias = getattr(layer, "bias", None)
            if bias is None:
                raise ValueError("bias: epilogue 'bias' needs a bias [N] (argument or layer.bias), got None")
            return bias
        if bias is not None:
            raise ValueError(f"bias: epilogue {self.epilogue!r} takes no bias; use epilogue='bias'")
        return None

    def check_input(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Raise ValueError naming the argument when x or bias does not fit ``layer.weight`` [N, K]."""
        w = layer.weight
        n, k = w.shape
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"x: expected a torch.Tensor [M, {k}], got {type(x).__name__}")
        if x.dim() != 2:
            raise ValueError(f"x: expected a 2-D tensor [M, {k}], got shape {tuple(x.shape)}")
        if x.shape[1] != k:
            raise ValueError(f"x: expected shape [M, {k}] (K of weight [{n}, {k}]), got {tuple(x.shape)}")
        if x.shape[0] < 1:
            raise ValueError(f"x: expected M >= 1 rows, got shape {tuple(x.shape)}")
        if x.dtype != w.dtype:
            raise ValueError(f"x: expected dtype {w.dtype} (the weight's), got {x.dtype}")
        if x.device != w.device:
            raise ValueError(f"x: expected device {w.device} (the weight's), got {x.device}")
        if bias is not None:
            if bias.shape != (n,):
                raise ValueError(f"bias: expected shape [{n}], got {tuple(bias.shape)}")
            if bias.dtype != w.dtype:
                raise ValueError(f"bias: expected dtype {w.dtype}, got {bias.dtype}")
            if bias.device != w.device:
                raise ValueError(f"bias: expected device {w.device}, got {bias.device}")


class TorchLinearMethod(LinearMethodBase):
    """``F.linear`` (cuBLAS on the GPU) plus the epilogue in PyTorch: the baseline and the fallback.

    swiglu runs one merged GEMM [M, 2I] then ``F.silu(gate) * up`` (what vLLM's unquantized path does).
    """

    def __init__(self, epilogue: str = "none"):
        self.epilogue = _check_epilogue(epilogue)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        bias = self._resolve_bias(layer, bias)
        self.check_input(layer, x, bias)
        return torch_reference(x, layer.weight, bias, self.epilogue)


def kernel_args(epilogue: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """The positional arguments of the Helion kernel for ``epilogue``."""
    if epilogue in ("none", "silu"):
        return (x, weight)
    if epilogue == "bias":
        return (x, weight, bias)
    if epilogue == "swiglu":
        i = weight.shape[0] // 2
        return (x, weight[:i], weight[i:])
    raise ValueError(f"epilogue must be one of {C.EPILOGUES}, got {epilogue!r}")


def build_runner(epilogue: str, cfg: dict, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """Compile the Helion kernel for ``epilogue`` and ``cfg`` (a config dict, configs.py) for weights
    shaped like ``weight`` [N, K]; returns the runner ``f(*kernel_args(epilogue, x, weight, bias))``.

    The kernel is bound with an example x [2, K] (M is dynamic; the runner serves every M ≥ 1) and
    compiled with ``bound.compile_config(helion.Config(**cfg))`` — code generation only; Triton
    compiles on the first call. Raises ConfigFileError for a bad cfg, and whatever Helion raises for a
    config it cannot compile.
    """
    import helion

    from . import kernels

    C.validate_config_entry(cfg, path=[epilogue])
    split = "split_k" in cfg
    kern = kernels.KERNELS.get((epilogue, split))
    if kern is None:
        raise C.ConfigFileError(f"no split-K kernel for epilogue {epilogue!r}")
    k = weight.shape[1]
    x_example = torch.empty(2, k, dtype=weight.dtype, device=weight.device)
    bound = kern.bind(kernel_args(epilogue, x_example, weight, bias))
    return bound.compile_config(helion.Config(**cfg))


def warm_m_values(bucket: int) -> list[int]:
    """The M values that trigger every Triton variant a bucket can meet: Triton specializes an int
    argument on ``== 1`` and ``% 16 == 0``. Bucket 1 -> [1]; 2, 4, 8 -> [b]; ≥ 16 -> [b, b - 1]."""
    return [bucket] if bucket < 16 else [bucket, bucket - 1]


class HelionLinearMethod(LinearMethodBase):
    """Helion GEMMs with pre-tuned per-bucket configs and an ``F.linear`` fallback.

    Args:
        configs: a config table (dict, configs.py format), a path to a JSON file, or None for the
            shipped file of the current GPU (``moelora_lib/configs/helion/<GPU_NAME>.json``, read at the
            first warm-up/apply; a missing file means "fall back to torch", with one warning).
            An explicit path is read here; errors raise ConfigFileError / FileNotFoundError.
        epilogue: "none" | "bias" | "silu" | "swiglu" (see LinearMethodBase).
        max_m: M above this goes to F.linear (vLLM uses Helion only for M ≤ 32); None = no limit.
        allow_interpreter: allow CPU tensors, run through the Triton interpreter; requires
            ``TRITON_INTERPRET=1`` in the environment *before* the first compile (tests and the cpu
            profile). Without it CPU tensors fall back to F.linear.

    Runners are cached on the method, keyed by (epilogue, dtype, K, N, device, config); layers of the
    same shape share them. A config that passes the table's checks but cannot be built (Helion raises
    at ``compile_config``, e.g. ``InvalidConfig`` for three ``loop_orders`` entries of the 2-D tile
    loop) or compiled (Helion/Triton errors at the runner's first call) is remembered as failed: that
    (dtype, K, N, bucket) goes to ``F.linear`` from then on, with one ``HelionFallbackWarning`` naming
    the shape, bucket and error, and is never retried (``path_for`` reports it).
    """

    def __init__(
        self,
        configs: dict | str | os.PathLike | None = None,
        epilogue: str = "none",
        *,
        max_m: int | None = None,
        allow_interpreter: bool = False,
    ):
        self.epilogue = _check_epilogue(epilogue)
        _check_max_m(max_m, allow_none=True)
        if configs is not None and not isinstance(configs, (dict, str, os.PathLike)):
            raise TypeError(
                f"configs: expected a config table (dict), a path (str / os.PathLike) or None, "
                f"got {type(configs).__name__}"
            )
        self.max_m = max_m
        self.allow_interpreter = allow_interpreter
        self._table: dict | None = None
        self._table_error: str | None = None
        self.config_source = "<dict>"
        if isinstance(configs, dict):
            self._table = C.validate_table(configs)
        elif configs is not None:
            self._table = C.load_configs(configs)
            self.config_source = str(Path(configs))
        self._runners: dict[tuple, Any] = {}
        #: runner keys built but not yet run once (Triton compiles on the first call)
        self._unproven: set[tuple] = set()
        #: (dtype, K, N, device, bucket) -> "torch: ..." reason, for configs that failed to build/compile
        self._failed: dict[tuple, str] = {}
        self._warned: set[str] = set()
        #: seconds spent compiling, per bucket, by the last warmup() call
        self.last_warmup: dict[int, dict[str, Any]] = {}

    # -- configuration --------------------------------------------------------------------------
    def table(self) -> dict:
        """The config table (loading the shipped file for the current GPU on first use)."""
        if self._table is None and self._table_error is None:
            try:
                path = C.shipped_config_path()
                self._table = C.load_configs(path)
                self.config_source = str(path)
            except (FileNotFoundError, RuntimeError) as e:
                self._table_error = str(e)
        return self._table if self._table is not None else {}

    def config_for(self, layer: nn.Module, m: int) -> dict | None:
        """The config dict for this layer's (dtype, K, N) and the bucket of ``m``, or None."""
        n, k = layer.weight.shape
        return C.lookup(self.table(), self.epilogue, C.dtype_name(layer.weight.dtype), k, n, C.bucket_for(m))

    def path_for(self, layer: nn.Module, m: int) -> str:
        """Which path an input of ``m`` rows takes: ``"helion:<bucket>"`` or ``"torch: <reason>"``."""
        return self._route(layer, m)[0]

    def _route(self, layer: nn.Module, m: int) -> tuple[str, dict | None]:
        ok, why = helion_available()
        if not ok:
            return f"torch: helion unavailable ({why})", None
        w = layer.weight
        dev = w.device
        if dev.type != "cuda":
            if not self.allow_interpreter:
                return f"torch: device {dev} (Helion needs CUDA, or allow_interpreter=True)", None
            if os.environ.get("TRITON_INTERPRET") != "1":
                return f"torch: device {dev} needs TRITON_INTERPRET=1 for the interpreter", None
            if w.dtype == torch.bfloat16:  # the interpreter multiplies raw bf16 bits (triton#11584)
                return "torch: bfloat16 is wrong under the Triton interpreter", None
        if self.max_m is not None and m > self.max_m:
            return f"torch: M={m} above max_m={self.max_m}", None
        table = self.table()
        if self._table_error is not None and not table:
            return f"torch: no config file ({self._table_error})", None
        n, k = w.shape
        dt = C.dtype_name(w.dtype)
        by_bucket = table.get(self.epilogue, {}).get(dt, {}).get(C.shape_key(k, n))
        if by_bucket is None:
            return (
                f"torch: no tuned config for epilogue={self.epilogue} dtype={dt} K={k} N={n} "
                f"in {self.config_source}",
                None,
            )
        b = C.bucket_for(m)
        # The table's own entry, read only (no copy on this per-call path): _runner copies it before
        # handing it to Helion, warmup before exposing it.
        cfg = by_bucket.get(str(b))
        if cfg is None:
            return f"torch: bucket {b} not tuned for epilogue={self.epilogue} dtype={dt} K={k} N={n}", None
        if self._failed:
            failed = self._failed.get((dt, k, n, str(dev), b))
            if failed is not None:
                return failed, None
        return f"helion:{b}", cfg

    def _mark_failed(self, layer: nn.Module, m: int, error: str) -> str:
        """Remember that the config of ``layer``'s shape and the bucket of ``m`` cannot run; returns
        the fallback path ("torch: ...")."""
        w = layer.weight
        n, k = w.shape
        dt = C.dtype_name(w.dtype)
        b = C.bucket_for(m)
        path = (
            f"torch: the tuned config for epilogue={self.epilogue} dtype={dt} K={k} N={n} bucket {b} "
            f"(in {self.config_source}) cannot run ({error})"
        )
        self._failed[(dt, k, n, str(w.device), b)] = path
        return path

    # -- runners ----------------------------------------------------------------------------------
    def _runner_key(self, layer: nn.Module, cfg: dict) -> tuple:
        w = layer.weight
        n, k = w.shape
        return (self.epilogue, w.dtype, k, n, str(w.device), repr(sorted(cfg.items())))

    def _runner(self, layer: nn.Module, cfg: dict, bias: torch.Tensor | None, key: tuple | None = None):
        """The cached runner for ``cfg`` (built on first use), or a ``_FailedRunner`` when Helion
        cannot build it (the failure is cached too: never retried)."""
        if key is None:
            key = self._runner_key(layer, cfg)
        runner = self._runners.get(key)
        if runner is None:
            try:
                runner = build_runner(self.epilogue, copy.deepcopy(cfg), layer.weight, bias)
                self._unproven.add(key)
            except Exception as e:  # code generation only: any failure means this config cannot run
                runner = _FailedRunner(_short_error(e))
            self._runners[key] = runner
        return runner

    def _first_call(self, key: tuple, runner, args: tuple):
        """Run a runner for the first time (Triton compiles now); a compile error caches a
        ``_FailedRunner`` under ``key`` and returns it instead of a result."""
        try:
            out = runner(*args)
        except _compile_errors() as e:
            failed = _FailedRunner(_short_error(e))
            self._runners[key] = failed
            self._unproven.discard(key)
            return failed
        self._unproven.discard(key)
        return out

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Make ``weight`` contiguous; for swiglu keep the gate/up row views (no copy) on the layer."""
        super().process_weights_after_loading(layer)
        if self.epilogue == "swiglu":
            i = layer.weight.shape[0] // 2
            layer.w_gate = layer.weight[:i]
            layer.w_up = layer.weight[i:]

    def _kernel_args(self, layer, x, bias):
        gate = getattr(layer, "w_gate", None)
        if self.epilogue == "swiglu" and gate is not None and gate.data_ptr() == layer.weight.data_ptr():
            return (x, gate, layer.w_up)
        return kernel_args(self.epilogue, x, layer.weight, bias)

    def warmup(self, layer: nn.Module, max_m: int, *, strict: bool = True) -> dict[int, str]:
        """Compile (and run once, on zeros) every bucket up to ``bucket_for(max_m)`` that has a config,
        triggering each Triton variant (:func:`warm_m_values`), so that serving never compiles.

        Returns ``{bucket: path}``; compile seconds per bucket are kept in ``self.last_warmup``.
        A config that cannot be built or compiled is remembered as failed (``apply`` then uses
        ``F.linear`` for that bucket, as for an untuned one) and, with ``strict=True`` (the default: a
        shipped config must compile), raises RuntimeError naming the shape, bucket and error; with
        ``strict=False`` it warns once (``HelionFallbackWarning``) and its path is "torch: ...".
        ``max_m`` that is not an int >= 1 raises ValueError.
        """
        _check_max_m(max_m)
        w = layer.weight
        bias = getattr(layer, "bias", None) if self.epilogue == "bias" else None
        if self.epilogue == "bias" and bias is None:
            bias = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
        out: dict[int, str] = {}
        self.last_warmup = {}
        top = C.bucket_for(max_m)
        for b in C.BUCKETS:
            if b > top:
                break
            path, cfg = self._route(layer, b)
            out[b] = path
            if cfg is None:
                continue
            t0 = time.perf_counter()
            key = self._runner_key(layer, cfg)
            runner = self._runner(layer, cfg, bias, key)
            for m in warm_m_values(b):
                if isinstance(runner, _FailedRunner):
                    break
                x = torch.zeros(m, w.shape[1], dtype=w.dtype, device=w.device)
                args = self._kernel_args(layer, x, bias)
                if key in self._unproven:  # first call compiles; a failure replaces the runner
                    res = self._first_call(key, runner, args)
                    if isinstance(res, _FailedRunner):
                        runner = res
                else:
                    runner(*args)
            if isinstance(runner, _FailedRunner):
                out[b] = self._mark_failed(layer, b, runner.reason)
                if strict:
                    raise RuntimeError(
                        f"HelionLinearMethod.warmup: {out[b].removeprefix('torch: ')} "
                        "(warmup(..., strict=False) falls back to F.linear instead)"
                    )
                self._warn_once(out[b].removeprefix("torch: "))
                continue
            if w.device.type == "cuda":
                torch.cuda.synchronize(w.device)
            self.last_warmup[b] = {"seconds": time.perf_counter() - t0, "config": copy.deepcopy(cfg)}
        return out

    # -- forward ------------------------------------------------------------------------------------
    def _warn_once(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(
                f"HelionLinearMethod: {reason}; using F.linear", HelionFallbackWarning, stacklevel=3
            )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y for x [M, K] (dtype and device of ``layer.weight`` [N, K]): [M, N], swiglu [M, N/2].

        Raises ValueError (naming ``x`` or ``bias``) for a non-2-D x, a K mismatch, a dtype or
        device different from the weight's, or a bias that does not fit the epilogue. A tuned config
        that Helion/Triton cannot build or compile does not raise: that bucket falls back to
        ``F.linear`` with one ``HelionFallbackWarning`` (naming shape, bucket and error), for good.
        """
        bias = self._resolve_bias(layer, bias)
        self.check_input(layer, x, bias)
        m = x.shape[0]
        path, cfg = self._route(layer, m)
        if cfg is None:
            self._warn_once(path.removeprefix("torch: "))
            return torch_reference(x, layer.weight, bias, self.epilogue)
        key = self._runner_key(layer, cfg)
        runner = self._runner(layer, cfg, bias, key)
        if key in self._unproven:  # first call of a new runner: Triton compiles now
            y = self._first_call(key, runner, self._kernel_args(layer, x, bias))
            if not isinstance(y, _FailedRunner):
                return y
            runner = y
        if isinstance(runner, _FailedRunner):
            self._warn_once(self._mark_failed(layer, m, runner.reason).removeprefix("torch: "))
            return torch_reference(x, layer.weight, bias, self.epilogue)
        return runner(*self._kernel_args(layer, x, bias))


class Linear(nn.Module):
    """A linear layer driven by a linear method (the vLLM ``LinearBase`` protocol in miniature).

    weight [output_size, input_size]; optional bias [output_size] (used by epilogue "bias").
    ``forward(x [M, input_size]) -> method.apply(self, x, self.bias if epilogue == 'bias')``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        method: LinearMethodBase,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        bias: bool = False,
    ):
        super().__init__()
        if not isinstance(method, LinearMethodBase):
            raise TypeError(f"method: expected a LinearMethodBase, got {type(method).__name__}")
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype: expected one of {SUPPORTED_DTYPES}, got {dtype}")
        if bias and method.epilogue != "bias":
            raise ValueError(
                f"bias: epilogue {method.epilogue!r} does not add a bias (it would be ignored); "
                "use a method with epilogue='bias'"
            )
        self.method = method
        method.create_weights(self, input_size, output_size, dtype, device)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(output_size, dtype=dtype, device=device), requires_grad=False
            )
        else:
            self.bias = None

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, method: LinearMethodBase, bias: torch.Tensor | None = None
    ) -> Linear:
        """A layer holding ``weight`` [N, K] (and ``bias`` [N]) with ``process_weights_after_loading``
        already applied. Raises ValueError for a weight that is not a 2-D tensor or a bias that is not
        [N] (and, via ``__init__``, for an unsupported dtype or a bias with an epilogue other than
        "bias")."""
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"weight: expected a 2-D tensor [N, K], got {shape}")
        n, k = weight.shape
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)):
            shape = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"bias: expected a tensor of shape [{n}] (N of weight [{n}, {k}]), got {shape}")
        layer = cls(k, n, method, dtype=weight.dtype, device=weight.device, bias=bias is not None)
        with torch.no_grad():
            layer.weight.copy_(weight)
            if bias is not None:
                layer.bias.copy_(bias)
        method.process_weights_after_loading(layer)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.method.epilogue == "bias" else None
        return self.method.apply(self, x, bias)

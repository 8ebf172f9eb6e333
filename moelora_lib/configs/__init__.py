"""Tuned kernel configs: the JSON file format, the loader, and atomic writes.

Files (one JSON per (GPU name, op), in one folder; GPU name = ``torch.cuda.get_device_name()`` with
spaces and ``-`` replaced by ``_``, e.g. ``NVIDIA_H200``; ``cpu`` without CUDA):

* ``{gpu}_FUSED_MOE_LORA_W13_SHRINK.json``, ``{gpu}_FUSED_MOE_LORA_W13_EXPAND.json``,
  ``{gpu}_FUSED_MOE_LORA_W2_SHRINK.json``, ``{gpu}_FUSED_MOE_LORA_W2_EXPAND.json`` — the four LoRA ops
  (gate_up_shrink, gate_up_expand, down_shrink, down_expand), vLLM's names and nesting::

      config_data[max_loras][num_slices][m][k][n][i] = leaf

  with every key a decimal string and, following vLLM's *runtime* convention for these four ops
  (docs/upstream-vllm-moe-lora.md §7: only the dense ``shrink`` op swaps them):

  ======== ===================================================================================
  key      value
  ======== ===================================================================================
  max_loras L, adapter slots
  num_slices S for the W13 ops (2 = gate and up slices, 1 = fused gate_up), 1 for the W2 ops
  m         T, the number of tokens of the call (not T·K)
  k         R, the max LoRA rank
  n         H, the hidden size
  i         vLLM's ``moe_intermediate_size``: ``lora_b13.shape[-2]`` = 2I/S for the W13 ops,
            ``lora_a2.shape[-1]`` = I for the W2 ops
  ======== ===================================================================================

* ``{gpu}_FUSED_MOE_BASE.json`` — the two base grouped GEMMs (no vLLM equivalent in this form)::

      config_data[E][N][K][m] = {"base_gate_up": leaf, "base_down": leaf}   (or one leaf for both)

  with (N, K) = (2I, H), the shape of the w13 GEMM, and m = T. A single flat leaf is applied to both
  GEMMs, as vLLM's base fused-MoE configs are.

A leaf is ``{"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "NUM_WARPS",
"NUM_STAGES", "SPLIT_K"}`` (any subset; missing keys take :class:`~moelora_lib.kernels.OpConfig`'s
defaults; lower-case names accepted; vLLM's ``USE_TMA`` and ``NUM_CTAS`` are accepted and ignored).
Any other key raises.

Lookup: at every level the exact key, else the nearest by ``|int(key) - value|`` (ties: the smaller
key), except ``num_slices``, which must match exactly (no entry = the file has nothing for this
workload: fall back). Nearest entries are looked up independently in the four LoRA files, so mixing
workloads can give different BLOCK_SIZE_M to the four ops: that raises (the four ops share one
alignment).

Precedence of :func:`load_layer_config`: the explicit ``folder`` argument, else the folder named by
``MOELORA_TUNED_CONFIG_FOLDER`` (read at call time), else the files shipped in this package under
``moelora_lib/configs/<gpu>/``, else :func:`~moelora_lib.kernels.default_config`. The LoRA group (four
files) and the base group (one file) are resolved separately: a missing file, folder or workload entry
gives the defaults of that group with one ``warnings.warn`` per (folder, op). The returned
``LayerConfig.source`` says where the config came from (``folder:/p``, ``env:/p``, ``shipped:NVIDIA_H200``
or ``default``, with ``; lora=default`` / ``; base=default`` when one group fell back).

Errors (ValueError naming the file and the key path): malformed JSON, a non-object level, a
non-integer key, an unknown leaf key, a non-power-of-two block, BLOCK_SIZE_M differing between the
four LoRA ops or between the two base GEMMs.

Files are parsed once per (path, mtime, size) (``functools.lru_cache``) and written atomically by
:func:`save_config_file` (temporary file in the same folder + ``os.replace``).
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path
from typing import Any

from ..common import gpu_name, write_json_atomic
from ..kernels.config import BASE_OPS, LORA_OPS, LayerConfig, OpConfig
from ..shapes import Dims

__all__ = [
    "ENV_VAR",
    "LORA_FILE_OPS",
    "BASE_FILE_OP",
    "SHIPPED_DIR",
    "gpu_name",
    "shipped_folder",
    "config_file_name",
    "lora_keys",
    "base_keys",
    "load_layer_config",
    "load_config_file",
    "lookup",
    "save_config_file",
    "set_entry",
    "clear_cache",
]

ENV_VAR = "MOELORA_TUNED_CONFIG_FOLDER"
#: op of :class:`~moelora_lib.kernels.LayerConfig` -> op part of the file name (vLLM's names)
LORA_FILE_OPS = {
    "gate_up_shrink": "FUSED_MOE_LORA_W13_SHRINK",
    "gate_up_expand": "FUSED_MOE_LORA_W13_EXPAND",
    "down_shrink": "FUSED_MOE_LORA_W2_SHRINK",
    "down_expand": "FUSED_MOE_LORA_W2_EXPAND",
}
BASE_FILE_OP = "FUSED_MOE_BASE"
SHIPPED_DIR = Path(__file__).resolve().parent
LORA_DEPTH = 6  # max_loras, num_slices, m, k, n, i
BASE_DEPTH = 4  # E, N, K, m
_IGNORED_KEYS = {"USE_TMA", "NUM_CTAS"}  # vLLM leaf keys with no meaning here
_WARNED: set[tuple[str, str]] = set()


# gpu_name (re-exported from moelora_lib.common): ``NVIDIA_H200``, ``cpu`` without CUDA. The alias keeps
# it reachable inside load_layer_config, whose ``gpu_name`` argument shadows it.
_current_gpu_name = gpu_name


def shipped_folder(gpu: str | None = None) -> Path:
    """``moelora_lib/configs/<gpu>/``, where the package's tuned configs for that GPU live."""
    return SHIPPED_DIR / (gpu or gpu_name())


def config_file_name(gpu: str, op: str) -> str:
    """File name of ``op`` (a LoRA op of :data:`LORA_FILE_OPS`, or "base") for ``gpu``."""
    part = BASE_FILE_OP if op in ("base",) + BASE_OPS else LORA_FILE_OPS[op]
    return f"{gpu}_{part}.json"


def lora_keys(op: str, dims: Dims | int, *legacy: int) -> tuple[int, ...]:
    """(max_loras, num_slices, m, k, n, i) of one LoRA op (see the module docstring).

    ``dims``: a :class:`~moelora_lib.shapes.Dims`, or the ints ``T, H, I, R, L, S`` (old form).
    """
    if isinstance(dims, Dims):
        if legacy:
            raise TypeError("lora_keys: pass a Dims or the ints T, H, I, R, L, S, not both")
        T, H, I, R, L, S = dims.T, dims.H, dims.I, dims.rank, dims.adapters, dims.slices
    else:
        T, (H, I, R, L, S) = dims, legacy
    if op.startswith("gate_up"):
        return (L, S, T, R, H, 2 * I // S)
    return (L, 1, T, R, H, I)


def base_keys(dims: Dims | int, *legacy: int) -> tuple[int, ...]:
    """(E, N, K, m) of the base file: N = 2I, K = H (the w13 GEMM), m = T.

    ``dims``: a :class:`~moelora_lib.shapes.Dims`, or the ints ``T, H, I, E`` (old form).
    """
    if isinstance(dims, Dims):
        if legacy:
            raise TypeError("base_keys: pass a Dims or the ints T, H, I, E, not both")
        T, H, I, E = dims.T, dims.H, dims.I, dims.E
    else:
        T, (H, I, E) = dims, legacy
    return (E, 2 * I, H, T)


def _keypath(keys) -> str:
    return "".join(f"[{json.dumps(str(k))}]" for k in keys)


def _parse_leaf(leaf: Any, where: str) -> OpConfig:
    if not isinstance(leaf, dict):
        raise ValueError(f"{where}: a config leaf must be a JSON object, got {type(leaf).__name__}")
    d = {k: v for k, v in leaf.items() if k.upper() not in _IGNORED_KEYS}
    for k, v in d.items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{where}: key {k!r} must be an integer, got {v!r}")
    try:
        return OpConfig.from_dict(d, where=where)
    except TypeError as e:  # pragma: no cover - from_dict raises ValueError for bad keys
        raise ValueError(f"{where}: {e}") from None
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith(where) else f"{where}: {msg}") from None


def _walk(node: Any, depth: int, path: str, keys: tuple, out: dict, leaf_kind: str) -> None:
    """Check the nesting and parse every leaf into ``out[keys] = OpConfig | {op: OpConfig}``."""
    if depth == 0:
        where = f"{path} at {_keypath(keys)}"
        if leaf_kind == "base" and isinstance(node, dict) and set(node) & set(BASE_OPS):
            unknown = set(node) - set(BASE_OPS)
            if unknown:
                raise ValueError(
                    f"{where}: unknown key {sorted(unknown)[0]!r}; expected {list(BASE_OPS)} "
                    "or the keys of one config"
                )
            cfgs = {op: _parse_leaf(node[op], f"{path} at {_keypath(keys + (op,))}") for op in node}
            if len(cfgs) == 1:  # one given: the other takes the same config
                only = next(iter(cfgs.values()))
                cfgs = {op: only for op in BASE_OPS}
            bms = {op: c.BLOCK_SIZE_M for op, c in cfgs.items()}
            if len(set(bms.values())) != 1:
                raise ValueError(f"{where}: base_gate_up and base_down must share BLOCK_SIZE_M, got {bms}")
            for op, c in cfgs.items():
                if c.SPLIT_K != 1:
                    raise ValueError(
                        f"{path} at {_keypath(keys + (op, 'SPLIT_K'))}: must be 1 for the base GEMMs"
                    )
            out[keys] = cfgs
        else:
            c = _parse_leaf(node, where)
            if leaf_kind == "base":
                if c.SPLIT_K != 1:
                    raise ValueError(f"{where}['SPLIT_K']: must be 1 for the base GEMMs")
                out[keys] = {op: c for op in BASE_OPS}
            else:
                if leaf_kind == "expand" and c.SPLIT_K != 1:
                    raise ValueError(f"{where}['SPLIT_K']: must be 1 for an expand op")
                out[keys] = c
        return
    if not isinstance(node, dict) or not node:
        raise ValueError(
            f"{path} at {_keypath(keys)}: expected a non-empty JSON object keyed by "
            f"integers, got {type(node).__name__}"
        )
    for k, v in node.items():
        try:
            int(k)
        except ValueError:
            raise ValueError(f"{path} at {_keypath(keys + (k,))}: key {k!r} is not an integer") from None
        _walk(v, depth - 1, path, keys + (k,), out, leaf_kind)


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, mtime_ns: int, size: int, depth: int, leaf_kind: str):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    parsed: dict = {}
    _walk(data, depth, path, (), parsed, leaf_kind)
    return data, parsed


def _kind(op: str) -> str:
    return "base" if op == "base" else ("expand" if op.endswith("expand") else "shrink")


def load_config_file(path: str | os.PathLike, op: str) -> dict:
    """Parse and validate one config file of ``op`` (a LoRA op or "base"); returns the raw nested dict.

    Cached by (path, mtime, size). Raises ValueError naming the file and key path (see the module
    docstring); FileNotFoundError when it does not exist.
    """
    p = Path(path)
    st = p.stat()
    depth = BASE_DEPTH if op == "base" else LORA_DEPTH
    return _load_cached(str(p), st.st_mtime_ns, st.st_size, depth, _kind(op))[0]


def clear_cache() -> None:
    """Forget parsed files and which fallbacks were already warned about."""
    _load_cached.cache_clear()
    _WARNED.clear()


def _pick(node: dict, value: int, exact: bool):
    k = str(int(value))
    if k in node:
        return k
    if exact:
        return None
    return min(node, key=lambda key: (abs(int(key) - value), int(key)))


def lookup(
    data: dict, keys: tuple[int, ...], exact_levels: tuple[int, ...] = ()
) -> tuple[tuple[str, ...], Any] | None:
    """Walk ``data`` by ``keys``: exact key, else nearest by |int(key) - value| (levels in
    ``exact_levels`` must match exactly). Returns (the keys taken, the leaf) or None."""
    node, taken = data, []
    for level, v in enumerate(keys):
        k = _pick(node, v, level in exact_levels)
        if k is None:
            return None
        taken.append(k)
        node = node[k]
    return tuple(taken), node


def _warn_once(folder: str, op: str, why: str) -> None:
    if (folder, op) in _WARNED:
        return
    _WARNED.add((folder, op))
    warnings.warn(f"moelora_lib tuned configs: {why}; using the default {op} config", stacklevel=4)


def _lora_group(folder: Path, gpu: str, dims: Dims) -> dict[str, OpConfig] | None:
    found: dict[str, OpConfig] = {}
    where: dict[str, str] = {}
    for op in LORA_OPS:
        path = folder / config_file_name(gpu, op)
        if not path.is_file():
            _warn_once(str(folder), op, f"no file {path}")
            return None
        st = path.stat()
        data, parsed = _load_cached(str(path), st.st_mtime_ns, st.st_size, LORA_DEPTH, _kind(op))
        keys = lora_keys(op, dims)
        hit = lookup(data, keys, exact_levels=(1,))
        if hit is None:
            _warn_once(str(folder), op, f"{path} has no entry for num_slices={keys[1]}")
            return None
        taken, _ = hit
        found[op] = parsed[taken]
        where[op] = f"{path} at {_keypath(taken)}"
    bms = {op: c.BLOCK_SIZE_M for op, c in found.items()}
    if len(set(bms.values())) != 1:
        detail = "; ".join(f"{where[op]}: BLOCK_SIZE_M={bm}" for op, bm in bms.items())
        raise ValueError(
            "the four LoRA ops must share BLOCK_SIZE_M (one alignment serves all four): " + detail
        )
    return found


def _base_group(folder: Path, gpu: str, dims: Dims) -> dict[str, OpConfig] | None:
    path = folder / config_file_name(gpu, "base")
    if not path.is_file():
        _warn_once(str(folder), "base", f"no file {path}")
        return None
    st = path.stat()
    data, parsed = _load_cached(str(path), st.st_mtime_ns, st.st_size, BASE_DEPTH, "base")
    taken, _ = lookup(data, base_keys(dims))
    return parsed[taken]


def load_layer_config(
    dims: Dims | int,
    *legacy: int,
    folder: str | os.PathLike | None = None,
    gpu_name: str | None = None,
) -> LayerConfig:
    """The :class:`~moelora_lib.kernels.LayerConfig` for one layer call, from tuned files if any.

    Args:
        dims: a :class:`~moelora_lib.shapes.Dims` (``Dims.of("qwen3-30b-a3b", T, rank=32, adapters=8)``);
            the old positional form ``load_layer_config(T, H, I, E, K, R, L, S=2, ...)`` (R before L)
            is still accepted.
        folder: a config folder (highest precedence); else ``$MOELORA_TUNED_CONFIG_FOLDER``; else the
            shipped ``moelora_lib/configs/<gpu>/``; else the defaults.
        gpu_name: the GPU part of the file names (default :func:`gpu_name`).
    Returns: a LayerConfig whose ``source`` records where each group came from.
    Raises: ValueError for a malformed or invalid file (naming the file and key path), or when the
        folder named by ``folder`` or by ``$MOELORA_TUNED_CONFIG_FOLDER`` is not a directory (a typo
        there would otherwise silently drop every tuned config). A missing file inside an existing
        folder falls back to the defaults with one warning.
    """
    from ..kernels.stages import as_dims, default_config

    dims = as_dims(dims, *legacy)
    gpu = gpu_name or _current_gpu_name()
    if folder is not None:
        where, label = Path(folder), f"folder:{folder}"
    elif os.environ.get(ENV_VAR):
        where, label = Path(os.environ[ENV_VAR]), f"env:{os.environ[ENV_VAR]}"
    elif shipped_folder(gpu).is_dir():
        where, label = shipped_folder(gpu), f"shipped:{gpu}"
    else:
        return default_config(dims)
    if not where.is_dir():
        origin = "folder argument" if folder is not None else f"${ENV_VAR}"
        raise ValueError(f"{origin}: config folder {str(where)!r} is not a directory")
    dflt = default_config(dims)
    lora = _lora_group(where, gpu, dims)
    base = _base_group(where, gpu, dims)
    if lora is None and base is None:
        return dflt  # source "default"
    source = label + ("; lora=default" if lora is None else "") + ("; base=default" if base is None else "")
    changes: dict[str, Any] = {"source": source}
    changes.update(lora or {})
    changes.update(base or {})
    return dflt.replace(**changes)


def set_entry(data: dict, keys: tuple[int, ...], leaf: Any) -> dict:
    """``data[str(k0)][str(k1)]...[str(kn)] = leaf``, creating levels; returns ``data``."""
    node = data
    for k in keys[:-1]:
        node = node.setdefault(str(k), {})
    node[str(keys[-1])] = leaf
    return data


def _sorted(node: Any) -> Any:
    if isinstance(node, dict) and node and all(_isint(k) for k in node):
        return {k: _sorted(node[k]) for k in sorted(node, key=int)}
    return node


def _isint(k: str) -> bool:
    try:
        int(k)
        return True
    except ValueError:
        return False


def save_config_file(path: str | os.PathLike, data: dict) -> Path:
    """Write ``data`` as JSON atomically (:func:`moelora_lib.common.write_json_atomic`: a temporary
    file in the same folder, fsync, ``os.replace``), integer-keyed levels sorted numerically.

    An interrupted write leaves the old file (or none), never half a JSON. Returns the path.
    """
    return write_json_atomic(path, _sorted(data), indent=1)

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
gives the defaults of that group with one :class:`TunedConfigWarning` per (folder, op). The returned
``LayerConfig.source`` says where the config came from (``folder:/p``, ``env:/p``, ``shipped:NVIDIA_H200``
or ``default``, with ``; lora=default`` / ``; base=default`` when one group fell back, and
`` (mapped from <gpu>)`` when :func:`map_gpu_name` chose the GPU name).

Other GPU names: the GPU name must match a folder (shipped) or the file names (explicit / env folder)
exactly; "NVIDIA H200 NVL" or "NVIDIA H20-3e" are *not* treated as "NVIDIA H200" (different chips,
different best configs). When no tuned file exists for the GPU at all, the loader returns the defaults
and issues one :class:`TunedConfigWarning` per (GPU, folder set) naming the GPU and every folder it
looked at (the ``folder`` argument, ``$MOELORA_TUNED_CONFIG_FOLDER``, the shipped folder) and how to
map it. Mapping is explicit, in code: ``map_gpu_name("NVIDIA H200 NVL", "NVIDIA_H200")`` (process-wide:
stage ``tuned`` and every loader call without ``gpu_name``), or ``gpu_name="NVIDIA_H200"`` on one
:func:`load_layer_config` / ``STAGES["tuned"].config_for`` call. There is deliberately no environment
variable for it (an environment variable may only point at a folder). Without CUDA the name is ``cpu``,
for which nothing is shipped; that case stays silent unless a folder was given.

Errors (ValueError naming the file and the key path): malformed JSON, a non-object level, a
non-integer key, an unknown leaf key, a non-power-of-two block, BLOCK_SIZE_M differing between the
four LoRA ops or between the two base GEMMs.

Files are parsed once per (path, mtime, size) (``functools.lru_cache``) and written atomically by
:func:`save_config_file` (temporary file in the same folder + ``os.replace``).

Dense multi-LoRA (:mod:`moelora_lib.lora_linear`, stage ``tuned``; :func:`load_dense_config`): vLLM's
dense LoRA files, in the same folders, ``{gpu}_SHRINK.json`` and ``{gpu}_EXPAND_TRUE.json``
(``_FALSE``: an expand without the fused add; the tuner writes ``_TRUE``, stage ``tuned``'s)::

    config_data[max_loras][num_slices][m][k][n] = leaf

with max_loras = L, num_slices = S = len(slices) (exact), m = T, and vLLM's runtime convention: shrink
k = H, n = R; expand k = R, n = the widest slice. A leaf uses vLLM's keys (``block_m``, ``block_n``,
``block_k``, ``split_k`` (shrink only), ``group_size_m``, ``num_warps``, ``num_stages``; ``num_ctas``,
``max_nreg``, ``use_tma`` ignored) or OpConfig's names. Lookup as above (exact, else nearest, ties to
the smaller key); the shrink and the expand share one alignment, so the expand entry is the nearest
one whose BLOCK_SIZE_M equals the shrink's (none: ValueError naming both files). Same precedence,
GPU mapping and memo as :func:`load_layer_config`; warnings: no tuned file for the GPU at all, one
per (GPU, folder set) (apart from the MoE warning: another op, another tuner); a shipped folder
with MoE files and no dense files: silent (nothing is shipped for the dense op yet); an explicit or
environment folder without dense files for the GPU: one per folder; a missing file or num_slices
entry: one per (folder, op). Written by :mod:`moelora_lib.studies.dense_tuning`; differences from
vLLM: ``moelora_lib/configs/README.md``.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..common import gpu_name, write_json_atomic
from ..kernels.config import BASE_OPS, LORA_OPS, LayerConfig, OpConfig
from ..shapes import Dims

__all__ = [
    "ENV_VAR",
    "TunedConfigWarning",
    "map_gpu_name",
    "gpu_name_map",
    "shipped_gpus",
    "LORA_FILE_OPS",
    "BASE_FILE_OP",
    "FUSED_FILE_OP",
    "FUSED_FILE_KEYS",
    "SHIPPED_DIR",
    "gpu_name",
    "shipped_folder",
    "config_file_name",
    "lora_keys",
    "base_keys",
    "load_layer_config",
    "load_fused_config",
    "load_config_file",
    "lookup",
    "save_config_file",
    "set_entry",
    "clear_cache",
    "DENSE_FILE_OPS",
    "dense_config_file_name",
    "dense_keys",
    "dense_leaf",
    "load_dense_config",
    "tuned_dense_block_sizes_m",
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
#: stage ``fused``'s two GEMMs (base GEMM + LoRA expand [+ activation]): same nesting as the base file
FUSED_FILE_OP = "FUSED_MOE_LORA_FUSED"
#: leaf keys of the fused file -> the LayerConfig field that configures that launch
FUSED_FILE_KEYS = {"fused_gate_up": "base_gate_up", "fused_down": "base_down"}
#: The keys a fused leaf may hold: the two GEMMs and, optionally, ``lora_stack`` (true/false: the LoRA
#: epilogue's form measured for that entry, :class:`~moelora_lib.kernels.LayerConfig`'s ``lora_stack``).
FUSED_LEAF_KEYS = frozenset(FUSED_FILE_KEYS) | {"lora_stack"}
SHIPPED_DIR = Path(__file__).resolve().parent
LORA_DEPTH = 6  # max_loras, num_slices, m, k, n, i
BASE_DEPTH = 4  # E, N, K, m
_IGNORED_KEYS = {"USE_TMA", "NUM_CTAS"}  # vLLM leaf keys with no meaning here
#: dense multi-LoRA op (``load_config_file`` name) -> op part of the file name (vLLM's dense LoRA
#: names; the expand's file also carries add_inputs: ``EXPAND_TRUE`` / ``EXPAND_FALSE``)
DENSE_FILE_OPS = {"dense_shrink": "SHRINK", "dense_expand": "EXPAND"}
DENSE_DEPTH = 5  # max_loras, num_slices, m, k, n
#: vLLM's dense leaf keys -> OpConfig fields
_DENSE_KEYS = {
    "block_m": "BLOCK_SIZE_M",
    "block_n": "BLOCK_SIZE_N",
    "block_k": "BLOCK_SIZE_K",
    "group_size_m": "GROUP_SIZE_M",
    "split_k": "SPLIT_K",
    "num_warps": "NUM_WARPS",
    "num_stages": "NUM_STAGES",
}
_DENSE_IGNORED = {"num_ctas", "max_nreg", "use_tma"}  # vLLM dense leaf keys with no meaning here
_WARNED: set[tuple] = set()
#: explicit GPU name -> config GPU name mappings (:func:`map_gpu_name`); never filled implicitly
_GPU_MAP: dict[str, str] = {}


class TunedConfigWarning(UserWarning):
    """Stage ``tuned`` / :func:`load_layer_config` fell back to the default configs (no tuned file or
    entry for this GPU or workload). Issued once per (GPU, folder set) or per (folder, op)."""


# gpu_name (re-exported from moelora_lib.common): ``NVIDIA_H200``, ``cpu`` without CUDA. The alias keeps
# it reachable inside load_layer_config, whose ``gpu_name`` argument shadows it.
_current_gpu_name = gpu_name


def shipped_folder(gpu: str | None = None) -> Path:
    """``moelora_lib/configs/<gpu>/``, where the package's tuned configs for that GPU live."""
    return SHIPPED_DIR / (gpu or gpu_name())


def _norm_gpu(name: str) -> str:
    return name.replace(" ", "_").replace("-", "_")


def shipped_gpus() -> list[str]:
    """GPU names with tuned configs shipped in this package (folders ``moelora_lib/configs/<gpu>/``
    holding ``<gpu>_FUSED_MOE_*.json`` files or dense LoRA files ``<gpu>_SHRINK.json`` /
    ``<gpu>_EXPAND_{TRUE,FALSE}.json``), sorted."""
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(
        d.name
        for d in SHIPPED_DIR.iterdir()
        if d.is_dir() and (any(d.glob(f"{d.name}_FUSED_MOE_*.json")) or _has_dense_file(d, d.name))
    )


def map_gpu_name(gpu: str, use: str | None) -> None:
    """Use the tuned configs of GPU name ``use`` (a shipped folder, e.g. ``"NVIDIA_H200"``) when
    running on ``gpu`` (e.g. ``"NVIDIA H200 NVL"``, as ``torch.cuda.get_device_name()`` spells it or
    with ``_``). Process-wide: applies to stage ``tuned`` and to every :func:`load_layer_config` call
    without ``gpu_name``. ``use=None`` removes the mapping.

    Nothing is mapped implicitly: a similar chip is a different chip, and only the user can decide
    that its configs are good enough. Raises ValueError when ``use`` has no shipped folder (see
    :func:`shipped_gpus`) or a name is empty or contains a path separator.
    """
    for arg, v in (("gpu", gpu), ("use", use)):
        if v is None and arg == "use":
            continue
        if not isinstance(v, str) or not v.strip() or any(c in v for c in "/\\") or v in (".", ".."):
            raise ValueError(f"map_gpu_name: {arg} must be a GPU name (no path separators), got {v!r}")
    key = _norm_gpu(gpu)
    if use is None:
        _GPU_MAP.pop(key, None)
        return
    target = _norm_gpu(use)
    if target not in shipped_gpus():
        raise ValueError(
            f"map_gpu_name: no shipped tuned configs for {use!r} (shipped: {shipped_gpus()}); to use "
            f"files of your own, pass folder= (or ${ENV_VAR}) and gpu_name= to load_layer_config"
        )
    _GPU_MAP[key] = target
    _WARNED.clear()


def gpu_name_map() -> dict[str, str]:
    """A copy of the mappings set with :func:`map_gpu_name` (running GPU name -> config GPU name)."""
    return dict(_GPU_MAP)


def config_file_name(gpu: str, op: str) -> str:
    """File name of ``op`` (a LoRA op of :data:`LORA_FILE_OPS`, "base", or "fused": stage ``fused``'s
    two GEMMs) for ``gpu``."""
    if op == "fused":
        return f"{gpu}_{FUSED_FILE_OP}.json"
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
        if leaf_kind == "fused":
            if not isinstance(node, dict) or not set(FUSED_FILE_KEYS) <= set(node) <= FUSED_LEAF_KEYS:
                got = sorted(node) if isinstance(node, dict) else type(node).__name__
                raise ValueError(
                    f"{where}: a fused leaf must have exactly the keys {list(FUSED_FILE_KEYS)} "
                    f"(and optionally 'lora_stack'), got {got}"
                )
            ops = [op for op in node if op in FUSED_FILE_KEYS]
            for op in ops:
                if isinstance(node[op], dict) and "lora_stack" in node[op]:
                    raise ValueError(
                        f"{path} at {_keypath(keys + (op, 'lora_stack'))}: 'lora_stack' belongs to the "
                        f"entry, beside {list(FUSED_FILE_KEYS)}, not inside one GEMM's config"
                    )
            cfgs: dict[str, Any] = {
                FUSED_FILE_KEYS[op]: _parse_leaf(node[op], f"{path} at {_keypath(keys + (op,))}")
                for op in ops
            }
            bms = {op: cfgs[FUSED_FILE_KEYS[op]].BLOCK_SIZE_M for op in ops}
            if len(set(bms.values())) != 1:
                raise ValueError(f"{where}: fused_gate_up and fused_down must share BLOCK_SIZE_M, got {bms}")
            for op in ops:
                if cfgs[FUSED_FILE_KEYS[op]].SPLIT_K != 1 and op != "fused_down":  # fp32 y: down GEMM only
                    raise ValueError(
                        f"{path} at {_keypath(keys + (op, 'SPLIT_K'))}: must be 1 for the fused gate_up GEMM "
                        "(its activation needs all of K; only fused_down may split K)"
                    )
            if "lora_stack" in node:
                if not isinstance(node["lora_stack"], bool):
                    raise ValueError(
                        f"{path} at {_keypath(keys + ('lora_stack',))}: must be true or false, "
                        f"got {node['lora_stack']!r}"
                    )
                cfgs["lora_stack"] = node["lora_stack"]
            out[keys] = cfgs
        elif leaf_kind == "base" and isinstance(node, dict) and set(node) & set(BASE_OPS):
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
        elif leaf_kind in DENSE_FILE_OPS:
            c = _parse_dense_leaf(node, where)
            if leaf_kind == "dense_expand" and c.SPLIT_K != 1:
                raise ValueError(f"{where}['split_k']: must be 1 for the dense expand op")
            out[keys] = c
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
    if op in DENSE_FILE_OPS or op == "fused":
        return op
    return "base" if op == "base" else ("expand" if op.endswith("expand") else "shrink")


def _depth(op: str) -> int:
    if op in ("base", "fused"):
        return BASE_DEPTH
    return DENSE_DEPTH if op in DENSE_FILE_OPS else LORA_DEPTH


def load_config_file(path: str | os.PathLike, op: str) -> dict:
    """Parse and validate one config file of ``op`` (a LoRA op of the MoE layer, "base", or a dense
    op "dense_shrink" / "dense_expand"); returns the raw nested dict.

    Cached by (path, mtime, size). Raises ValueError naming the file and key path (see the module
    docstring); FileNotFoundError when it does not exist.
    """
    if op not in (*LORA_OPS, "base", "fused", *DENSE_FILE_OPS):
        raise ValueError(f"op must be one of {[*LORA_OPS, 'base', 'fused', *DENSE_FILE_OPS]}, got {op!r}")
    p = Path(path)
    st = p.stat()
    return _load_cached(str(p), st.st_mtime_ns, st.st_size, _depth(op), _kind(op))[0]


def clear_cache() -> None:
    """Forget parsed files, resolved configs and which fallbacks were already warned about."""
    _load_cached.cache_clear()
    _RESOLVED.clear()
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


def _warn_once(folder: str, op: str, why: str, then: str | None = None) -> None:
    if (folder, op) in _WARNED:
        return
    _WARNED.add((folder, op))
    then = then or f"using the default {op} config"
    warnings.warn(f"moelora_lib tuned configs: {why}; {then}", TunedConfigWarning, stacklevel=4)


def _gpus_in(folder: Path) -> list[str]:
    """GPU names that have a base or LoRA config file in ``folder``."""
    parts = (BASE_FILE_OP, *LORA_FILE_OPS.values())
    names = set()
    for p in folder.glob("*_FUSED_MOE_*.json"):
        for part in parts:
            if p.name.endswith(f"_{part}.json"):
                names.add(p.name[: -len(f"_{part}.json")])
    return sorted(names)


def _has_any_file(folder: Path, gpu: str) -> bool:
    return any((folder / config_file_name(gpu, op)).is_file() for op in (*LORA_OPS, "base", "fused"))


class _NoConfigs(NamedTuple):
    """What a "no tuned configs for this GPU" warning says (:func:`_no_configs`)."""

    name: str  # the GPU, and the running GPU's name when mapped
    searched: str  # the folders looked at, in precedence order
    others: list[str]  # GPUs the chosen folder has files for
    shipped: list[str]  # GPUs with a shipped folder
    example: str  # one of them (for the map_gpu_name advice)
    asked: str  # the name map_gpu_name would map: the running GPU's


def _no_configs(
    kind: str, gpu: str, mapped_from: str | None, folder, env: str | None, chosen, gpus_in
) -> _NoConfigs | None:
    """The facts of a "no tuned configs for ``gpu``" warning, or None when the warning of this
    ``kind`` was already given for this GPU and folder set (one warning per (kind, GPU, folder set)).
    ``gpus_in(chosen)``: the GPUs the chosen folder has files for."""
    shipped = shipped_folder(gpu)
    key = (kind, gpu, mapped_from, None if folder is None else str(folder), env, str(shipped))
    if key in _WARNED:
        return None
    _WARNED.add(key)
    searched = [f"folder argument {str(folder)!r}" if folder is not None else "folder argument: none"]
    if env:
        searched.append(f"${ENV_VAR}={env!r}" + ("" if folder is None else " (not read: folder given)"))
    else:
        searched.append(f"${ENV_VAR}: unset")
    if folder is None and not env:
        searched.append(f"shipped folder {str(shipped)!r} (does not exist)")
    else:
        searched.append(f"shipped folder {str(shipped)!r} (not read: a folder was given)")
    shipped_names = shipped_gpus()
    return _NoConfigs(
        name=f"{gpu!r}" + (f" (mapped from {mapped_from!r})" if mapped_from else ""),
        searched="; ".join(searched),
        others=gpus_in(chosen) if chosen is not None else [],
        shipped=shipped_names,
        example=shipped_names[0] if shipped_names else "<a shipped GPU>",
        asked=gpu if mapped_from is None else mapped_from,
    )


def _warn_no_configs(gpu: str, mapped_from: str | None, folder, env: str | None, chosen: Path | None) -> None:
    """One TunedConfigWarning per (GPU, folder set): no tuned file at all for ``gpu``."""
    w = _no_configs("gpu", gpu, mapped_from, folder, env, chosen, _gpus_in)
    if w is None:
        return
    have = f"; that folder has files for {w.others}" if w.others else ""
    warnings.warn(
        f"moelora_lib tuned configs: no tuned configs for GPU {w.name}; searched: {w.searched}"
        f"{have}; shipped configs exist for {w.shipped}. Stage 'tuned' uses the default configs. "
        "To use another GPU's configs explicitly (only if you accept they may not be the best here): "
        f"moelora_lib.configs.map_gpu_name({w.asked!r}, {w.example!r}), "
        f"or load_layer_config(..., gpu_name={w.example!r}) / STAGES['tuned'].config_for(..., "
        "gpu_name=...); or tune this GPU (python -m moelora_lib.studies.tuning) and point "
        f"folder= / ${ENV_VAR} at the result",
        TunedConfigWarning,
        stacklevel=3,
    )


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


def _base_group(
    folder: Path, gpu: str, dims: Dims, op: str = "base", then: str | None = None
) -> dict[str, OpConfig] | None:
    """The entry for ``dims`` of a file keyed like the base file (``op`` "base", or "fused": stage
    ``fused``'s GEMMs), None with one warning (``then``: what happens instead) when it is missing."""
    path = folder / config_file_name(gpu, op)
    if not path.is_file():
        _warn_once(str(folder), op, f"no file {path}", then)
        return None
    st = path.stat()
    data, parsed = _load_cached(str(path), st.st_mtime_ns, st.st_size, BASE_DEPTH, op)
    taken, _ = lookup(data, base_keys(dims))
    return parsed[taken]


def load_fused_config(
    dims: Dims | int,
    *legacy: int,
    folder: str | os.PathLike | None = None,
    gpu_name: str | None = None,
) -> LayerConfig:
    """The :class:`~moelora_lib.kernels.LayerConfig` of stage ``fused`` for one layer call.

    Same arguments, precedence and errors as :func:`load_layer_config`, whose result it starts from
    (the two shrinks: stage ``tuned``'s LoRA files). The two GEMMs (the ``base_gate_up`` and
    ``base_down`` fields, see :data:`~moelora_lib.kernels.stages.FUSED_CONFIG_FIELD`) come from
    ``{gpu}_FUSED_MOE_LORA_FUSED.json`` (nesting of the base file, ``config_data[E][N][K][m]``, leaf
    ``{"fused_gate_up": {...}, "fused_down": {...}}`` and optionally ``"lora_stack": true|false``, the
    LoRA epilogue's form, :class:`~moelora_lib.kernels.LayerConfig`'s ``lora_stack``; written by
    :mod:`moelora_lib.studies.fused_tuning`); without that file (one :class:`TunedConfigWarning`) they
    are derived from the tuned base GEMMs (:func:`~moelora_lib.kernels.fused.fused_gemm_configs`).
    With no tuned file at all (e.g. the CPU): :func:`~moelora_lib.kernels.fused.fused_default_config`.
    ``source`` ends in ``; fused=file``, ``; fused=derived`` or is ``default:fused``.
    """
    from ..kernels.fused import fused_default_config, fused_gemm_configs
    from ..kernels.stages import as_dims

    if gpu_name is not None and not isinstance(gpu_name, str):
        raise ValueError(f"gpu_name must be a str (e.g. 'NVIDIA_H200') or None, got {gpu_name!r}")
    dims = as_dims(dims, *legacy)
    key = _memo_key(("fused", dims), folder, gpu_name)
    cfg = _RESOLVED.get(key)
    if cfg is not None:
        return cfg
    tuned = load_layer_config(dims, folder=folder, gpu_name=gpu_name)
    src = _config_source(folder, gpu_name)
    if src.where is None:
        return _memo_put(key, fused_default_config(dims))
    fused = _base_group(
        src.where, src.gpu, dims, "fused", "stage fused derives its GEMM configs from the tuned base ones"
    )
    if fused is not None:  # the fused file is used even when the LoRA/base groups fell back to defaults
        label = tuned.source if tuned.source != "default" else src.label + "; lora=default; base=default"
        cfg = tuned.replace(**fused, source=label + "; fused=file")
    elif tuned.source == "default":
        cfg = fused_default_config(dims)
    else:
        cfg = fused_gemm_configs(tuned).replace(source=tuned.source + "; fused=derived")
    return _memo_put(key, cfg)


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
        gpu_name: the GPU part of the file names and the shipped folder's name (default: the
            mapping set by :func:`map_gpu_name` for the current GPU, else :func:`gpu_name`). Passing
            ``"NVIDIA_H200"`` on another GPU uses the H200's configs there, explicitly.
    Returns: a LayerConfig whose ``source`` records where each group came from.
    Raises: ValueError for a malformed or invalid file (naming the file and key path), or when the
        folder named by ``folder`` or by ``$MOELORA_TUNED_CONFIG_FOLDER`` is not a directory (a typo
        there would otherwise silently drop every tuned config). A missing file inside an existing
        folder falls back to the defaults with one :class:`TunedConfigWarning`; no tuned file at all
        for the GPU (e.g. an unknown GPU, nothing shipped for it) gives the defaults with one
        :class:`TunedConfigWarning` per (GPU, folder set) naming the GPU and the folders searched.
    """
    from ..kernels.stages import as_dims

    dims = as_dims(dims, *legacy)
    key = _memo_key((dims,), folder, gpu_name)
    cfg = _RESOLVED.get(key)
    return cfg if cfg is not None else _memo_put(key, _resolve_layer_config(dims, folder, gpu_name))


#: The resolved configs of load_layer_config and load_dense_config by :func:`_memo_key`; cleared by
#: clear_cache() and save_config_file().
_RESOLVED: dict = {}


def _memo_key(key: tuple, folder, gpu_name: str | None) -> tuple:
    """``key`` + (folder, gpu_name, environment variable, device, GPU mapping): a config is resolved
    once per such key. The lookup stats files and walks the JSON (~20 µs on a 2-core CPU, ~160 µs on
    the H200's host, notebook 09), which an eager layer call cannot afford."""
    dev = torch.cuda.current_device() if torch.cuda.is_available() else -1
    key += (None if folder is None else str(folder), gpu_name, os.environ.get(ENV_VAR), dev)
    return key + (tuple(sorted(_GPU_MAP.items())),)


def _memo_put(key: tuple, cfg):
    """Remember ``cfg`` under ``key`` (:func:`_memo_key`) and return it."""
    if len(_RESOLVED) >= 65536:  # bounded: a server sees at most max_tokens distinct T per shape
        _RESOLVED.clear()
    _RESOLVED[key] = cfg
    return cfg


def _config_gpu(gpu_name: str | None) -> tuple[str, str | None]:
    """(config GPU name, the running GPU's name when mapped by map_gpu_name else None)."""
    if gpu_name:
        return gpu_name, None
    gpu = _current_gpu_name()
    if gpu in _GPU_MAP:
        return _GPU_MAP[gpu], gpu
    return gpu, None


def _config_folder(folder, gpu: str) -> tuple[Path | None, str, str | None]:
    """(folder to read, its label, $MOELORA_TUNED_CONFIG_FOLDER) by the precedence folder > env >
    shipped; folder None when nothing is shipped for ``gpu``. Raises ValueError when ``folder`` or the
    environment variable names something that is not a directory."""
    env = os.environ.get(ENV_VAR) or None
    if folder is not None:
        where, label = Path(folder), f"folder:{folder}"
    elif env:
        where, label = Path(env), f"env:{env}"
    elif shipped_folder(gpu).is_dir():
        return shipped_folder(gpu), f"shipped:{gpu}", env
    else:
        return None, "default", env
    if not where.is_dir():
        origin = "folder argument" if folder is not None else f"${ENV_VAR}"
        raise ValueError(f"{origin}: config folder {str(where)!r} is not a directory")
    return where, label, env


class _Source(NamedTuple):
    """Where a config lookup reads (:func:`_config_source`)."""

    gpu: str
    mapped_from: str | None
    where: Path | None  # None: nothing to read, use the defaults
    label: str  # the config's ``source``: folder:/p, env:/p, shipped:GPU, with " (mapped from ...)"
    env: str | None


def _config_source(folder, gpu_name: str | None) -> _Source:
    """The GPU (:func:`_config_gpu`) and folder (:func:`_config_folder`) of one lookup."""
    gpu, mapped_from = _config_gpu(gpu_name)
    where, label, env = _config_folder(folder, gpu)
    if mapped_from is not None:
        label += f" (mapped from {mapped_from})"
    return _Source(gpu, mapped_from, where, label, env)


def _resolve_layer_config(dims: Dims, folder, gpu_name: str | None) -> LayerConfig:
    from ..kernels.stages import default_config

    gpu, mapped_from, where, label, env = _config_source(folder, gpu_name)
    if where is None:
        if gpu != "cpu":  # no GPU: nothing is ever shipped for the interpreter, stay quiet
            _warn_no_configs(gpu, mapped_from, None, None, None)
        return default_config(dims)
    if (folder is not None or env) and not _has_any_file(where, gpu):  # (a shipped folder has files)
        _warn_no_configs(gpu, mapped_from, folder, env, where)
        return default_config(dims)
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
    _RESOLVED.clear()  # a resolved config may come from the file being replaced
    return write_json_atomic(path, _sorted(data), indent=1)


# --------------------------------------------------------------------------------------------------
# Dense multi-LoRA (moelora_lib.lora_linear): vLLM's dense shrink / expand config files
# --------------------------------------------------------------------------------------------------
def dense_config_file_name(gpu: str, op: str, add_inputs: bool = True) -> str:
    """``{gpu}_SHRINK.json`` for "dense_shrink" (or "shrink"), ``{gpu}_EXPAND_TRUE.json`` /
    ``{gpu}_EXPAND_FALSE.json`` for "dense_expand" (or "expand") with / without ``add_inputs`` (the
    fused add into the base output, the stages with ``fused_add``): vLLM's dense LoRA file names."""
    op = op if op.startswith("dense_") else f"dense_{op}"
    if op == "dense_shrink":
        return f"{gpu}_SHRINK.json"
    if op == "dense_expand":
        return f"{gpu}_EXPAND_{str(bool(add_inputs)).upper()}.json"
    raise ValueError(f"op must be 'dense_shrink' or 'dense_expand', got {op!r}")


def dense_keys(op: str, T: int, *, hidden: int, slices, rank: int, adapters: int) -> tuple[int, ...]:
    """(max_loras, num_slices, m, k, n) of a dense op, vLLM's runtime convention
    (``get_lora_op_configs``): shrink k = hidden (H), n = rank (R); expand k = R, n = the widest
    slice (vLLM's ``max_n``). max_loras = L, num_slices = len(slices), m = T."""
    op = op if op.startswith("dense_") else f"dense_{op}"
    S = len(slices)
    if op == "dense_shrink":
        return (adapters, S, T, hidden, rank)
    if op == "dense_expand":
        return (adapters, S, T, rank, max(int(n) for n in slices))
    raise ValueError(f"op must be 'dense_shrink' or 'dense_expand', got {op!r}")


def dense_leaf(cfg: OpConfig, op: str) -> dict:
    """The file leaf of ``cfg`` in vLLM's key names (``block_m``, ``block_n``, ``block_k``,
    ``group_size_m``, ``num_warps``, ``num_stages``, and ``split_k`` for the shrink only)."""
    op = op if op.startswith("dense_") else f"dense_{op}"
    d = {k: getattr(cfg, f) for k, f in _DENSE_KEYS.items()}
    if op == "dense_expand":
        if cfg.SPLIT_K != 1:
            raise ValueError(f"dense_leaf: the expand's SPLIT_K must be 1, got {cfg.SPLIT_K}")
        del d["split_k"]
    return d


def _parse_dense_leaf(leaf: Any, where: str) -> OpConfig:
    """A dense leaf: vLLM's keys (``block_m`` ...; ``num_ctas`` / ``max_nreg`` / ``use_tma`` ignored)
    or OpConfig's names (any case); missing keys take OpConfig's defaults."""
    if not isinstance(leaf, dict):
        raise ValueError(f"{where}: a config leaf must be a JSON object, got {type(leaf).__name__}")
    fields = set(_DENSE_KEYS.values())
    norm: dict[str, int] = {}
    for k, v in leaf.items():
        if k.lower() in _DENSE_IGNORED:
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise ValueError(f"{where}: key {k!r} must be an integer or null, got {v!r}")
            continue
        f = _DENSE_KEYS.get(k.lower()) or (k.upper() if k.upper() in fields else None)
        if f is None:
            raise ValueError(
                f"{where}: unknown key {k!r}; expected a subset of {sorted(_DENSE_KEYS)} (vLLM's names) "
                f"or of {sorted(fields)}"
            )
        if f in norm:
            raise ValueError(f"{where}: key {k!r} given twice (as {f} under another name)")
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{where}: key {k!r} must be an integer, got {v!r}")
        norm[f] = v
    try:
        return OpConfig(**norm)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _has_dense_file(folder: Path, gpu: str) -> bool:
    return any(
        (folder / n).is_file()
        for n in (
            dense_config_file_name(gpu, "shrink"),
            dense_config_file_name(gpu, "expand", True),
            dense_config_file_name(gpu, "expand", False),
        )
    )


def _dense_gpus_in(folder: Path) -> list[str]:
    """GPU names that have a dense config file in ``folder``."""
    names = set()
    for suffix in ("_SHRINK.json", "_EXPAND_TRUE.json", "_EXPAND_FALSE.json"):
        for p in folder.glob(f"*{suffix}"):
            if "_FUSED_MOE_" not in p.name:  # the MoE LoRA files end in _SHRINK/_EXPAND too
                names.add(p.name[: -len(suffix)])
    return sorted(names)


def _warn_no_dense_configs(gpu: str, mapped_from: str | None, folder, env: str | None, chosen) -> None:
    """One TunedConfigWarning per (GPU, folder set) for the dense op: no tuned file at all for ``gpu``
    (kept apart from the MoE layer's warning: another op, another tuner)."""
    w = _no_configs("dense-gpu", gpu, mapped_from, folder, env, chosen, _dense_gpus_in)
    if w is None:
        return
    have = f"; that folder has dense files for {w.others}" if w.others else ""
    warnings.warn(
        f"moelora_lib tuned configs: no tuned dense LoRA configs ({dense_config_file_name(gpu, 'shrink')}, "
        f"{dense_config_file_name(gpu, 'expand')}) for GPU {w.name}; searched: {w.searched}{have}. "
        "Stage 'tuned' of lora_linear / LoRALinear uses default_dense_config. To use another GPU's "
        "configs explicitly: moelora_lib.configs.map_gpu_name("
        f"{w.asked!r}, {w.example!r}) or load_dense_config(..., "
        f"gpu_name={w.example!r}); or tune this GPU (python -m moelora_lib.studies.dense_tuning) and point "
        f"folder= / ${ENV_VAR} at the result",
        TunedConfigWarning,
        stacklevel=4,
    )


def _check_dense_args(T, hidden, slices, rank, adapters, t_name: str = "T") -> tuple:
    """(T, hidden, slices as a tuple of ints, rank, adapters), or ValueError naming the argument."""
    from ..common import is_int
    from ..shapes import check_int

    out = [check_int(t_name, T, 1), check_int("hidden", hidden, 1)]
    if not isinstance(slices, (tuple, list)) or not slices or not all(is_int(n) and n >= 1 for n in slices):
        raise ValueError(f"slices must be a non-empty tuple of output widths (ints >= 1), got {slices!r}")
    return (
        *out,
        tuple(int(n) for n in slices),
        check_int("rank", rank, 1),
        check_int("adapters", adapters, 1),
    )


def _dense_file(folder: Path, gpu: str, op: str, add_inputs: bool):
    """(path, raw data, parsed leaves) of one dense file, or None when it does not exist."""
    path = folder / dense_config_file_name(gpu, op, add_inputs)
    if not path.is_file():
        return None
    st = path.stat()
    data, parsed = _load_cached(str(path), st.st_mtime_ns, st.st_size, DENSE_DEPTH, op)
    return path, data, parsed


def _nearest_leaf(
    parsed: dict, keys: tuple[int, ...], exact_levels=(), accept=None
) -> tuple[str, ...] | None:
    """The key path of the leaf that :func:`lookup` takes (exact key, else the nearest by
    ``|int(key) - value|``, ties: the smaller key; levels in ``exact_levels`` exact only), among the
    leaves of ``parsed`` (key path -> OpConfig) for which ``accept(key path, leaf)`` holds (None =
    all)."""
    cands = [k for k, c in parsed.items() if accept is None or accept(k, c)]
    for level, v in enumerate(keys):
        opts = {k[level] for k in cands}
        if not opts:
            return None
        if str(int(v)) in opts:
            pick = str(int(v))
        elif level in exact_levels:
            return None
        else:
            pick = min(opts, key=lambda key: (abs(int(key) - v), int(key)))
        cands = [k for k in cands if k[level] == pick]
    return cands[0] if cands else None


def load_dense_config(
    T: int,
    hidden: int,
    slices,
    rank: int,
    adapters: int,
    *,
    folder: str | os.PathLike | None = None,
    gpu_name: str | None = None,
    add_inputs: bool = True,
):
    """The :class:`~moelora_lib.kernels.dense_lora.DenseLoRAConfig` of one dense multi-LoRA call
    (:func:`moelora_lib.lora_linear.lora_linear`, stage ``tuned``), from tuned files if any.

    Args:
        T: tokens of the call. hidden: H. slices: the output widths (N_s). rank: R. adapters: L.
        folder: a config folder (highest precedence); else ``$MOELORA_TUNED_CONFIG_FOLDER``; else the
            shipped ``moelora_lib/configs/<gpu>/``; else
            :func:`~moelora_lib.kernels.dense_lora.default_dense_config`.
        gpu_name: the GPU part of the file names (default: the :func:`map_gpu_name` mapping of the
            current GPU, else :func:`gpu_name`), as for :func:`load_layer_config`.
        add_inputs: which expand file: ``EXPAND_TRUE`` (the expand adds into the base output — the
            stages with fused add, ``tuned`` among them) or ``EXPAND_FALSE``.
    Lookup: the shrink entry at (max_loras, num_slices, m, k, n) = (L, S, T, H, R), the expand entry
    at (L, S, T, R, max(slices)), every level exact else nearest, num_slices exact; the expand entry
    is the nearest one whose BLOCK_SIZE_M equals the shrink's (they share one alignment).
    Returns: a DenseLoRAConfig whose ``source`` says where it came from (``folder:/p``, ``env:/p``,
        ``shipped:NVIDIA_H200``, `` (mapped from ...)``, or ``default``).
    Raises: ValueError naming the argument for bad sizes; for a malformed file (naming the file and
        key path); when the folder named by ``folder`` / the environment variable is not a directory;
        when the expand file has no entry with the shrink's BLOCK_SIZE_M for (L, S) (naming both).
    Fallbacks (the defaults): nothing shipped for the GPU — one :class:`TunedConfigWarning` per (GPU,
    folder set), none for ``cpu``; a shipped folder without dense files (MoE files only) — silent; an
    explicit or environment folder without dense files for the GPU — one warning per folder; one of
    the two files missing, or no entry for num_slices — one warning per (folder, op).
    Resolved once per (arguments, environment variable, device, GPU mapping), like
    :func:`load_layer_config`; :func:`clear_cache` / :func:`save_config_file` forget it.
    """
    T, hidden, slices, rank, adapters = _check_dense_args(T, hidden, slices, rank, adapters)
    key = _memo_key(("dense", T, hidden, slices, rank, adapters, bool(add_inputs)), folder, gpu_name)
    cfg = _RESOLVED.get(key)
    if cfg is None:
        cfg = _resolve_dense_config(T, hidden, slices, rank, adapters, folder, gpu_name, bool(add_inputs))
        cfg = _memo_put(key, cfg)
    return cfg


def _resolve_dense_config(T, hidden, slices, rank, adapters, folder, gpu_name, add_inputs):
    from ..kernels.dense_lora import DenseLoRAConfig, default_dense_config

    dflt = default_dense_config(T, hidden=hidden, slices=slices, rank=rank, adapters=adapters)
    gpu, mapped_from, where, label, env = _config_source(folder, gpu_name)
    if where is None:
        if gpu != "cpu":  # no GPU: nothing is ever shipped for the interpreter, stay quiet
            _warn_no_dense_configs(gpu, mapped_from, None, None, None)
        return dflt
    shipped = folder is None and not env
    if not _has_dense_file(where, gpu):
        if shipped:
            return dflt  # the shipped folder has MoE configs only: no dense configs shipped yet, quietly
        if _has_any_file(where, gpu):  # MoE configs of this GPU only: say once that dense ones lack
            _warn_once(
                str(where),
                "dense",
                f"{where} has no dense LoRA config files ({dense_config_file_name(gpu, 'shrink')}, "
                f"{dense_config_file_name(gpu, 'expand', add_inputs)}) for {gpu}",
            )
        else:
            _warn_no_dense_configs(gpu, mapped_from, folder, env, where)
        return dflt
    files = {}
    for op in DENSE_FILE_OPS:
        got = _dense_file(where, gpu, op, add_inputs)
        if got is None:
            path = where / dense_config_file_name(gpu, op, add_inputs)
            _warn_once(str(where), op, f"no file {path}")
            return dflt
        files[op] = got
    keys = {op: dense_keys(op, T, hidden=hidden, slices=slices, rank=rank, adapters=adapters) for op in files}
    spath, _, sparsed = files["dense_shrink"]
    staken = _nearest_leaf(sparsed, keys["dense_shrink"], exact_levels=(1,))
    if staken is None:
        _warn_once(str(where), "dense_shrink", f"{spath} has no entry for num_slices={len(slices)}")
        return dflt
    shrink = sparsed[staken]
    epath, _, eparsed = files["dense_expand"]
    bm = shrink.BLOCK_SIZE_M
    S = str(len(slices))
    etaken = _nearest_leaf(
        eparsed, keys["dense_expand"], (1,), accept=lambda k, c: k[1] == S and c.BLOCK_SIZE_M == bm
    )
    if etaken is None:
        if _nearest_leaf(eparsed, keys["dense_expand"], exact_levels=(1,)) is None:
            _warn_once(str(where), "dense_expand", f"{epath} has no entry for num_slices={len(slices)}")
            return dflt
        raise ValueError(
            f"the dense shrink and expand share one alignment, so their BLOCK_SIZE_M must be equal: "
            f"{spath} at {_keypath(staken)}: BLOCK_SIZE_M={bm}, and {epath} has no entry with "
            f"BLOCK_SIZE_M={bm} for max_loras near {adapters}, num_slices={len(slices)}"
        )
    return DenseLoRAConfig(shrink, eparsed[etaken], source=label)


def tuned_dense_block_sizes_m(
    max_tokens: int,
    *,
    hidden: int,
    slices,
    rank: int,
    adapters: int,
    folder: str | os.PathLike | None = None,
    gpu_name: str | None = None,
    add_inputs: bool = True,
) -> tuple[int, ...]:
    """Every BLOCK_SIZE_M :func:`load_dense_config` gives for 1 ≤ T ≤ max_tokens (ascending), so a
    module can allocate its alignment workspaces up front: the configs at T = 1, T = max_tokens and at
    every tuned ``m`` in between (the nearest-key lookup only changes entry there), plus the
    defaults' block sizes (:func:`~moelora_lib.kernels.dense_lora.dense_block_sizes_m`) when a lookup
    falls back to them."""
    from ..kernels.dense_lora import dense_block_sizes_m

    max_tokens, hidden, slices, rank, adapters = _check_dense_args(
        max_tokens, hidden, slices, rank, adapters, "max_tokens"
    )
    Ts = {1, max_tokens}
    gpu, _ = _config_gpu(gpu_name)
    where, _, _ = _config_folder(folder, gpu)
    got = _dense_file(where, gpu, "dense_shrink", add_inputs) if where is not None else None
    if got is not None:
        _, data, _ = got
        hit = _pick(data, adapters, False)
        node = data[hit].get(str(len(slices)), {})
        Ts |= {int(m) for m in node if 1 <= int(m) <= max_tokens}
    kw = dict(folder=folder, gpu_name=gpu_name, add_inputs=add_inputs)
    cfgs = [load_dense_config(T, hidden, slices, rank, adapters, **kw) for T in sorted(Ts)]
    bms = {c.block_size_m for c in cfgs}
    if any(c.source == "default" for c in cfgs):
        bms |= set(dense_block_sizes_m(max_tokens, adapters))
    return tuple(sorted(bms))

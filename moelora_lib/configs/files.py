"""The tuned-config file format: file names, lookup keys, parsing and validation, lookup, atomic writes.

Files (one JSON per (GPU name, op), in one folder; GPU name = ``torch.cuda.get_device_name()`` with
spaces and ``-`` replaced by ``_``, e.g. ``NVIDIA_H200``; ``cpu`` without CUDA):

* ``{gpu}_FUSED_MOE_LORA_W13_SHRINK.json``, ``{gpu}_FUSED_MOE_LORA_W13_EXPAND.json``,
  ``{gpu}_FUSED_MOE_LORA_W2_SHRINK.json``, ``{gpu}_FUSED_MOE_LORA_W2_EXPAND.json`` — the four LoRA ops
  (gate_up_shrink, gate_up_expand, down_shrink, down_expand), vLLM's names and nesting::

      config_data[max_loras][num_slices][m][k][n][i] = leaf

  with every key a decimal string and, following vLLM's *runtime* convention for these four ops
  (docs/upstream-vllm-moe-lora.md §7: only the dense ``shrink`` op swaps them):

  ========= ==================================================================================
  key       value
  ========= ==================================================================================
  max_loras L, adapter slots
  num_slices S for the W13 ops (2 = gate and up slices, 1 = fused gate_up), 1 for the W2 ops
  m         T, the number of tokens of the call (not T·K)
  k         R, the max LoRA rank
  n         H, the hidden size
  i         vLLM's ``moe_intermediate_size``: ``lora_b13.shape[-2]`` = 2I/S for the W13 ops,
            ``lora_a2.shape[-1]`` = I for the W2 ops
  ========= ==================================================================================

* ``{gpu}_FUSED_MOE_BASE.json`` — the two base grouped GEMMs (no vLLM equivalent in this form)::

      config_data[E][N][K][m] = {"base_gate_up": leaf, "base_down": leaf}   (or one leaf for both)

  with (N, K) = (2I, H), the shape of the w13 GEMM, and m = T. A single flat leaf is applied to both
  GEMMs, as vLLM's base fused-MoE configs are.

* ``{gpu}_FUSED_MOE_BASE_<FORMAT>.json`` and ``{gpu}_FUSED_MOE_LORA_FUSED_<FORMAT>.json`` (FORMAT: MXFP4,
  FP8, FP8_W8A8, :data:`~moelora_lib.shapes.CONFIG_WEIGHT_FORMATS`) — the same two files tuned on packed
  expert weights (:attr:`~moelora_lib.shapes.Dims.weight_format`); a lookup of such dims reads them where
  they exist and the dense files otherwise.

* ``{gpu}_FUSED_MOE_LORA_FUSED.json`` — stage ``fused``'s two GEMMs (base GEMM + LoRA expand
  [+ activation]): the base file's nesting, leaf ``{"fused_gate_up": leaf, "fused_down": leaf}``,
  optionally with ``"stage": "fused"`` or ``"tuned"`` (the stage :class:`~moelora_lib.layer.MoELoRALayer`'s
  ``stage="auto"`` runs at that m, :func:`~moelora_lib.configs.loader.load_stage_choice`; absent:
  ``tuned``; any other value raises).

* ``{gpu}_SHRINK.json`` and ``{gpu}_EXPAND_TRUE.json`` (``_FALSE``: an expand without the fused add) —
  vLLM's dense LoRA files (:mod:`moelora_lib.lora_linear`)::

      config_data[max_loras][num_slices][m][k][n] = leaf

  with max_loras = L, num_slices = S = len(slices), m = T, and vLLM's runtime convention: shrink
  k = H, n = R; expand k = R, n = the widest slice. A dense leaf uses vLLM's keys (``block_m``,
  ``block_n``, ``block_k``, ``split_k`` (shrink only), ``group_size_m``, ``num_warps``,
  ``num_stages``; ``num_ctas``, ``max_nreg``, ``use_tma`` ignored) or OpConfig's names.

A MoE leaf is ``{"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "NUM_WARPS",
"NUM_STAGES", "SPLIT_K"}`` (any subset; missing keys take :class:`~moelora_lib.configs.schema.OpConfig`'s
defaults; lower-case names accepted; vLLM's ``USE_TMA`` and ``NUM_CTAS`` are accepted and ignored).
Any other key raises.

Lookup (:func:`lookup`): at every level the exact key, else the nearest by ``|int(key) - value|``
(ties: the smaller key); levels named exact (``num_slices``) must match.

Errors (ValueError naming the file and the key path): malformed JSON, a non-object level, a
non-integer key, an unknown leaf key, a non-power-of-two block, BLOCK_SIZE_M differing between the
two base GEMMs or the two fused GEMMs, SPLIT_K ≠ 1 where the kernel cannot split K.

Files are parsed once per (path, mtime, size) (``functools.lru_cache``) and written atomically by
:func:`save_config_file` (temporary file in the same folder + ``os.replace``). Differences from vLLM:
``moelora_lib/configs/README.md``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from ..common import write_json_atomic
from ..shapes import CONFIG_WEIGHT_FORMATS, Dims, check_dims
from .schema import BASE_OPS, LORA_OPS, OpConfig

__all__ = [
    "LORA_FILE_OPS",
    "BASE_FILE_OP",
    "FUSED_FILE_OP",
    "FUSED_FILE_KEYS",
    "STAGE_KEY",
    "STAGE_CHOICES",
    "GEMV_KEY",
    "GEMV_LEAF_KEYS",
    "DENSE_FILE_OPS",
    "gpu_file_part",
    "config_file_name",
    "lora_keys",
    "base_keys",
    "load_config_file",
    "lookup",
    "set_entry",
    "save_config_file",
    "dense_config_file_name",
    "dense_keys",
    "dense_leaf",
]

#: op of :class:`~moelora_lib.configs.schema.LayerConfig` -> op part of the file name (vLLM's names)
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

#: optional key of a fused leaf: the stage that ``stage="auto"`` runs at that leaf's (dims, m) bucket
#: (:func:`~moelora_lib.configs.loader.load_stage_choice`; absent: ``tuned``), one of
#: :data:`STAGE_CHOICES`; the parsed leaf carries it under this key
STAGE_KEY = "stage"
STAGE_CHOICES = ("tuned", "fused", "gemv")
#: optional key of a fused leaf: stage ``gemv``'s launches at that bucket, ``{"gate_up": {...}, "down":
#: {...}, "shrink": {...}}`` (BLOCK_SIZE_N, BLOCK_SIZE_K, SPLIT_K, NUM_WARPS of the two GEMVs; the shrink's
#: BLOCK_SIZE_K, SPLIT_K, NUM_WARPS serve both shrinks); the parsed leaf carries it under this key as
#: ``{"base_gate_up": OpConfig, "base_down": OpConfig, "shrink": OpConfig}``
GEMV_KEY = "gemv"
GEMV_LEAF_KEYS = {"gate_up": "base_gate_up", "down": "base_down", "shrink": "shrink"}
_FUSED_LEAF_KEYS = {*FUSED_FILE_KEYS, STAGE_KEY, GEMV_KEY}

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

#: The configs :mod:`moelora_lib.configs.loader` resolved, by its memo key; cleared by its clear_cache()
#: and by save_config_file() (the file being replaced may have given them).
_RESOLVED: dict = {}


def gpu_file_part(gpu: str, arg: str = "gpu") -> str:
    """The GPU part of a config file name and of a shipped folder's name: ``gpu`` with spaces and '-' as
    '_', so ``"NVIDIA H200"`` (as ``torch.cuda.get_device_name()`` spells it) and ``"NVIDIA_H200"`` both
    give ``NVIDIA_H200``, the name the loaders look for (:func:`moelora_lib.common.gpu_name`). ValueError
    naming ``arg`` unless ``gpu`` is a non-empty str without path separators."""
    if not isinstance(gpu, str) or not gpu.strip() or any(c in gpu for c in "/\\") or gpu in (".", ".."):
        raise ValueError(f"{arg} must be a GPU name such as 'NVIDIA_H200' (no path separators), got {gpu!r}")
    return gpu.replace(" ", "_").replace("-", "_")


def config_file_name(gpu: str, op: str, weight_format: str = "dense") -> str:
    """File name of ``op`` (a LoRA op of :data:`LORA_FILE_OPS`, "base", or "fused": stage ``fused``'s
    two GEMMs) for ``gpu`` (either spelling: :func:`gpu_file_part`); ``weight_format``
    (:data:`~moelora_lib.shapes.CONFIG_WEIGHT_FORMATS`) other than "dense" names the base or fused file
    of that form, ``_<FORMAT>`` before ``.json`` (``NVIDIA_H200_FUSED_MOE_BASE_MXFP4.json``); the LoRA
    ops' files have no form (they run on the activations' dtype whatever the experts' form). ValueError
    for an unknown op or form, or a ``gpu`` that is not a GPU name."""
    gpu = gpu_file_part(gpu)
    if weight_format not in CONFIG_WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {CONFIG_WEIGHT_FORMATS}, got {weight_format!r}")
    if op == "fused":
        part = FUSED_FILE_OP
    elif op in ("base",) + BASE_OPS or op in LORA_FILE_OPS:
        part = BASE_FILE_OP if op in ("base",) + BASE_OPS else LORA_FILE_OPS[op]
    else:
        raise ValueError(f"op must be 'base', 'fused', a base or a LoRA op {list(LORA_FILE_OPS)}, got {op!r}")
    if weight_format != "dense" and part in (BASE_FILE_OP, FUSED_FILE_OP):
        part += "_" + weight_format.upper()
    return f"{gpu}_{part}.json"


def lora_keys(op: str, dims: Dims) -> tuple[int, ...]:
    """(max_loras, num_slices, m, k, n, i) of one LoRA op for a call of ``dims`` (a
    :class:`~moelora_lib.shapes.Dims`; TypeError otherwise), see the module docstring."""
    d = check_dims("lora_keys: dims", dims)
    if op.startswith("gate_up"):
        return (d.adapters, d.slices, d.T, d.rank, d.H, 2 * d.I // d.slices)
    return (d.adapters, 1, d.T, d.rank, d.H, d.I)


def base_keys(dims: Dims) -> tuple[int, ...]:
    """(E, N, K, m) of the base and fused files for a call of ``dims`` (a
    :class:`~moelora_lib.shapes.Dims`; TypeError otherwise): N = 2I, K = H (the w13 GEMM), m = T."""
    d = check_dims("base_keys: dims", dims)
    return (d.E, 2 * d.I, d.H, d.T)


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
            if not isinstance(node, dict) or not set(FUSED_FILE_KEYS) <= set(node) <= _FUSED_LEAF_KEYS:
                got = sorted(node) if isinstance(node, dict) else type(node).__name__
                raise ValueError(
                    f"{where}: a fused leaf must have exactly the keys {list(FUSED_FILE_KEYS)} "
                    f"(and optionally {STAGE_KEY!r}), got {got}"
                )
            cfgs: dict = {
                FUSED_FILE_KEYS[op]: _parse_leaf(node[op], f"{path} at {_keypath(keys + (op,))}")
                for op in FUSED_FILE_KEYS
            }
            if STAGE_KEY in node:
                v = node[STAGE_KEY]
                if not isinstance(v, str) or v not in STAGE_CHOICES:
                    raise ValueError(
                        f"{path} at {_keypath(keys + (STAGE_KEY,))}: {STAGE_KEY!r} must be one of "
                        f"{list(STAGE_CHOICES)}, got {v!r}"
                    )
                cfgs[STAGE_KEY] = v
            if GEMV_KEY in node:
                g = node[GEMV_KEY]
                if not isinstance(g, dict) or set(g) != set(GEMV_LEAF_KEYS):
                    got = sorted(g) if isinstance(g, dict) else type(g).__name__
                    raise ValueError(
                        f"{path} at {_keypath(keys + (GEMV_KEY,))}: must have exactly the keys "
                        f"{list(GEMV_LEAF_KEYS)}, got {got}"
                    )
                cfgs[GEMV_KEY] = {
                    GEMV_LEAF_KEYS[k]: _parse_leaf(g[k], f"{path} at {_keypath(keys + (GEMV_KEY, k))}")
                    for k in GEMV_LEAF_KEYS
                }
            if cfgs.get(STAGE_KEY) == "gemv" and GEMV_KEY not in cfgs:
                raise ValueError(
                    f"{path} at {_keypath(keys + (STAGE_KEY,))}: stage 'gemv' needs the leaf's {GEMV_KEY!r} "
                    "configs"
                )
            bms = {op: cfgs[FUSED_FILE_KEYS[op]].BLOCK_SIZE_M for op in FUSED_FILE_KEYS}
            if len(set(bms.values())) != 1:
                raise ValueError(f"{where}: fused_gate_up and fused_down must share BLOCK_SIZE_M, got {bms}")
            if cfgs["base_gate_up"].SPLIT_K != 1:  # its activation needs all of K; fp32 y: down only
                raise ValueError(
                    f"{path} at {_keypath(keys + ('fused_gate_up', 'SPLIT_K'))}: must be 1 for the fused "
                    "gate_up GEMM (its activation needs all of K; only fused_down may split K)"
                )
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
            raise ValueError(
                f"{path} at {_keypath(keys + (k,))}: key {k!r} is not an integer ({depth} more level(s) of "
                f"integer keys expected above the leaf: the file nests {len(keys) + depth} levels)"
            ) from None
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
# Dense multi-LoRA (moelora_lib.linear): vLLM's dense shrink / expand config files
# --------------------------------------------------------------------------------------------------
def dense_config_file_name(gpu: str, op: str, add_inputs: bool = True) -> str:
    """``{gpu}_SHRINK.json`` for "dense_shrink" (or "shrink"), ``{gpu}_EXPAND_TRUE.json`` /
    ``{gpu}_EXPAND_FALSE.json`` for "dense_expand" (or "expand") with / without ``add_inputs`` (the
    fused add into the base output, the stages with ``fused_add``): vLLM's dense LoRA file names.
    ``gpu`` in either spelling (:func:`gpu_file_part`). ValueError for another op or a bad ``gpu``."""
    gpu = gpu_file_part(gpu)
    if not isinstance(op, str):
        raise ValueError(f"op must be 'dense_shrink' or 'dense_expand', got {op!r}")
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

"""M buckets and the tuned-config JSON of the Helion linear backend.

File: ``moelora_lib/configs/helion/<GPU_NAME>.json``, GPU_NAME = ``torch.cuda.get_device_name()`` with
spaces and '-' replaced by '_' (``NVIDIA_H200``). Structure::

    {
      "_meta": {...},                                  # optional, free-form (tuner: seconds, versions)
      "<epilogue>": {                                  # "none" | "bias" | "silu" | "swiglu"
        "<dtype>": {                                   # "bfloat16" | "float16" | "float32"
          "<K>,<N>": {                                 # weight shape [N, K]; SwiGLU: N = 2I (merged)
            "<bucket>": {<helion.Config fields>}       # bucket in 1 2 4 8 16 32 ... 1024 2048
          }
        }
      }
    }

A config is the keyword arguments of ``helion.Config`` (``block_sizes`` [BM, BN, BK], powers of two
≥ 16, is required; ``num_warps`` (1–32, power of two), ``num_stages``, ``indexing`` (pointer /
block_ptr / tensor_descriptor), ``pid_type``, ``l2_groupings``, ... optional; Helion fills the rest
from its defaults) plus, optionally, ``split_k`` (a power of two ≤ 64): a config with
``split_k`` runs the split-K kernel (epilogues "none" and "bias" only).

Keys are canonical: ``"<K>,<N>"`` without spaces, buckets without leading zeros (anything else
would never match a lookup, so it is rejected). Buckets: an M is served by the smallest bucket ≥ M;
every M > 1024 goes to the "≥2048" bucket, written ``"2048"``. Errors in a file raise
:class:`ConfigFileError` (a ValueError) naming the file and the key path. Writes are atomic
(temporary file in the same folder + ``os.replace``).
"""

from __future__ import annotations

import copy
import json
import operator
import os
import re
from pathlib import Path
from typing import Any

from ..common import DTYPES as _DTYPE_MAP
from ..common import gpu_name, is_int, write_json_atomic

#: M buckets; the last one means "≥ 2048" and serves every M > 1024.
BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
EPILOGUES: tuple[str, ...] = ("none", "bias", "silu", "swiglu")
#: dtype names a table may hold: the names of :data:`moelora_lib.common.DTYPES`.
DTYPES: tuple[str, ...] = tuple(_DTYPE_MAP)
#: Epilogues that have a split-K kernel.
SPLIT_K_EPILOGUES: tuple[str, ...] = ("none", "bias")
MAX_SPLIT_K = 64
#: Values helion 1.4.0 accepts for these config fields.
INDEXING_VALUES: tuple[str, ...] = ("pointer", "block_ptr", "tensor_descriptor")
PID_TYPES: tuple[str, ...] = ("flat", "xyz", "persistent_blocked", "persistent_interleaved")
NUM_WARPS_VALUES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
_SHAPE_KEY = re.compile(r"[1-9][0-9]*,[1-9][0-9]*")
_BUCKET_KEY = re.compile(r"[1-9][0-9]*")

#: Where the shipped per-GPU files live.
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "helion"

#: helion.Config keyword names in helion 1.4.0 (used when helion cannot be imported; otherwise the
#: live signature of ``helion.Config.__init__`` is used).
_CONFIG_FIELDS_140 = frozenset(
    """block_sizes num_threads loop_orders flatten_loops l2_groupings reduction_loops range_unroll_factors
    range_warp_specializes range_num_stages range_multi_buffers range_flattens static_ranges
    pallas_load_buffer_count load_eviction_policies load_cache_modifiers store_cache_modifiers num_warps
    num_stages pid_type num_sm_multiplier maxnreg indexing atomic_indexing advanced_controls_file
    epilogue_subtile xcd_remap""".split()
)


class ConfigFileError(ValueError):
    """A malformed Helion linear config file or table; the message names the file and the key."""


def bucket_for(m: int) -> int:
    """The M bucket serving ``m`` rows: the smallest bucket ≥ m, or 2048 for every m > 1024.

    m: a Python or numpy integer (anything with ``__index__``, bools excluded).
    Raises ValueError for m < 1 or a non-integer m.
    """
    if isinstance(m, bool):
        raise ValueError(f"m must be an int >= 1, got {m!r}")
    try:
        m = operator.index(m)
    except TypeError:
        raise ValueError(f"m must be an int >= 1, got {m!r}") from None
    if m < 1:
        raise ValueError(f"m must be an int >= 1, got {m!r}")
    for b in BUCKETS:
        if m <= b:
            return b
    return BUCKETS[-1]


def gpu_config_name(device: Any = None) -> str:
    """:func:`moelora_lib.common.gpu_name` with ``required=True`` (``NVIDIA_H200``).

    Raises RuntimeError when CUDA is not available.
    """
    return gpu_name(device, required=True)


def shipped_config_path(gpu_name: str | None = None) -> Path:
    """Path of the shipped file for ``gpu_name`` (default: the current GPU); it may not exist."""
    return CONFIG_DIR / f"{gpu_name or gpu_config_name()}.json"


def config_fields() -> frozenset[str]:
    """The keys a config entry may have: helion.Config's keyword names plus ``split_k``."""
    try:
        import inspect

        import helion

        params = inspect.signature(helion.Config.__init__).parameters
        names = {p.name for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    except Exception:  # helion missing or changed: the 1.4.0 list
        names = set(_CONFIG_FIELDS_140)
    return frozenset(names | {"split_k"})


def shape_key(k: int, n: int) -> str:
    """``"<K>,<N>"`` for a weight of shape [N, K]."""
    return f"{int(k)},{int(n)}"


def _fail(source: str, path: list[str], msg: str) -> ConfigFileError:
    where = "/".join(path) if path else "<top level>"
    return ConfigFileError(f"{source}: key {where!r}: {msg}")


def validate_config_entry(cfg: Any, *, source: str = "<table>", path: list[str] | None = None) -> dict:
    """Check one config dict (see the module docstring); returns it. Raises ConfigFileError."""
    path = path or []
    if not isinstance(cfg, dict):
        raise _fail(source, path, f"a config must be a JSON object, got {type(cfg).__name__}")
    unknown = sorted(set(cfg) - config_fields())
    if unknown:
        raise _fail(source, path, f"unknown helion.Config field(s) {unknown}")
    bs = cfg.get("block_sizes")
    if bs is None:
        raise _fail(source, path, "missing 'block_sizes' (expected [BM, BN, BK])")
    if not (isinstance(bs, list) and len(bs) == 3 and all(_pow2(v) and v >= 16 for v in bs)):
        raise _fail(
            source,
            path,
            f"'block_sizes' must be 3 powers of two >= 16 [BM, BN, BK] (tl.dot tiles), got {bs!r}",
        )
    if "split_k" in cfg:
        s = cfg["split_k"]
        if not (_pow2(s) and s <= MAX_SPLIT_K):
            raise _fail(source, path, f"'split_k' must be a power of two in [1, {MAX_SPLIT_K}], got {s!r}")
        if len(path) >= 1 and path[0] not in SPLIT_K_EPILOGUES:
            raise _fail(source, path, f"'split_k' is only supported for epilogues {SPLIT_K_EPILOGUES}")
    if "num_warps" in cfg and not (is_int(cfg["num_warps"]) and cfg["num_warps"] in NUM_WARPS_VALUES):
        raise _fail(source, path, f"'num_warps' must be one of {NUM_WARPS_VALUES}, got {cfg['num_warps']!r}")
    if "num_stages" in cfg and not (is_int(cfg["num_stages"]) and cfg["num_stages"] >= 1):
        raise _fail(source, path, f"'num_stages' must be a positive int, got {cfg['num_stages']!r}")
    if "indexing" in cfg:
        idx = cfg["indexing"]
        vals = idx if isinstance(idx, list) else [idx]
        if not vals or not all(isinstance(v, str) and v in INDEXING_VALUES for v in vals):
            raise _fail(source, path, f"'indexing' must be one of {INDEXING_VALUES} (or a list), got {idx!r}")
    if "pid_type" in cfg and cfg["pid_type"] not in PID_TYPES:
        raise _fail(source, path, f"'pid_type' must be one of {PID_TYPES}, got {cfg['pid_type']!r}")
    if "l2_groupings" in cfg:
        g = cfg["l2_groupings"]
        if not (isinstance(g, list) and len(g) == 1 and is_int(g[0]) and g[0] >= 1):
            raise _fail(source, path, f"'l2_groupings' must be [G] with a positive int G, got {g!r}")
    return cfg


def _pow2(v: Any) -> bool:
    return is_int(v) and v >= 1 and v & (v - 1) == 0


def validate_table(table: Any, *, source: str = "<table>") -> dict:
    """Check a whole table (nested dict, module docstring); returns it. Raises ConfigFileError."""
    if not isinstance(table, dict):
        raise _fail(source, [], f"the file must hold a JSON object, got {type(table).__name__}")
    for epi, by_dtype in table.items():
        if epi == "_meta":
            continue
        if epi not in EPILOGUES:
            raise _fail(source, [epi], f"unknown epilogue (expected one of {EPILOGUES} or '_meta')")
        if not isinstance(by_dtype, dict):
            raise _fail(source, [epi], "expected an object keyed by dtype")
        for dt, by_shape in by_dtype.items():
            if dt not in DTYPES:
                raise _fail(source, [epi, dt], f"unknown dtype (expected one of {DTYPES})")
            if not isinstance(by_shape, dict):
                raise _fail(source, [epi, dt], "expected an object keyed by '<K>,<N>'")
            for sk, by_bucket in by_shape.items():
                if not (isinstance(sk, str) and _SHAPE_KEY.fullmatch(sk) and sk.isascii()):
                    raise _fail(
                        source,
                        [epi, dt, sk],
                        "shape key must be '<K>,<N>': two positive ASCII ints, no spaces",
                    )
                parts = sk.split(",")
                if epi == "swiglu" and int(parts[1]) % 2:
                    raise _fail(source, [epi, dt, sk], "swiglu N (= 2I rows of w_gate_up) must be even")
                if not isinstance(by_bucket, dict):
                    raise _fail(source, [epi, dt, sk], "expected an object keyed by M bucket")
                for b, cfg in by_bucket.items():
                    if not (
                        isinstance(b, str) and b.isascii() and _BUCKET_KEY.fullmatch(b) and int(b) in BUCKETS
                    ):
                        raise _fail(source, [epi, dt, sk, b], f"bucket must be one of {list(BUCKETS)}")
                    validate_config_entry(cfg, source=source, path=[epi, dt, sk, b])
    return table


def load_configs(path: str | os.PathLike | None = None) -> dict:
    """Read and validate a config file: ``path`` if given, else the shipped file for the current GPU.

    Raises FileNotFoundError (naming the file) when it does not exist, RuntimeError without a GPU
    and without ``path``, and ConfigFileError for bad JSON or a malformed table.
    """
    p = Path(path) if path is not None else shipped_config_path()
    if not p.is_file():
        raise FileNotFoundError(f"Helion linear config file not found: {p}")
    try:
        table = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"{p}: not UTF-8 text: {e}") from e
    except json.JSONDecodeError as e:
        raise ConfigFileError(f"{p}: invalid JSON: {e}") from e
    return validate_table(table, source=str(p))


def save_configs(table: dict, path: str | os.PathLike) -> Path:
    """Validate ``table`` and write it to ``path`` atomically
    (:func:`moelora_lib.common.write_json_atomic`)."""
    p = Path(path)
    validate_table(table, source=str(p))
    return write_json_atomic(p, table, indent=1, sort_keys=True)


def lookup(table: dict, epilogue: str, dtype: str, k: int, n: int, bucket: int) -> dict | None:
    """The config dict for (epilogue, dtype, K, N, bucket), or None when the table has none."""
    entry = table.get(epilogue, {}).get(dtype, {}).get(shape_key(k, n), {}).get(str(bucket))
    return copy.deepcopy(entry) if entry is not None else None


def set_entry(table: dict, epilogue: str, dtype: str, k: int, n: int, bucket: int, cfg: dict) -> dict:
    """Insert ``cfg`` (validated) into ``table`` in place; returns the table."""
    validate_config_entry(cfg, path=[epilogue, dtype, shape_key(k, n), str(bucket)])
    table.setdefault(epilogue, {}).setdefault(dtype, {}).setdefault(shape_key(k, n), {})[str(bucket)] = (
        copy.deepcopy(cfg)
    )
    return table


def dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, for any dtype (a float64 weight gets ``"float64"``, which no
    table holds, so it takes the fallback; :func:`moelora_lib.common.dtype_name` would raise)."""
    return str(dtype).removeprefix("torch.")

"""Which config a call gets: tuned files by precedence, GPU name mapping, fallbacks, warnings.

Precedence of :func:`load_layer_config`: the explicit ``folder`` argument, else the folder named by
``MOELORA_TUNED_CONFIG_FOLDER`` (read at call time), else the files shipped in this package under
``moelora_lib/configs/<gpu>/``, else :func:`~moelora_lib.configs.defaults.default_config`. The LoRA
group (four files) and the base group (one file) are resolved separately: a missing file, folder or
workload entry gives the defaults of that group with one :class:`TunedConfigWarning` per (folder, op).
Nearest entries are looked up independently in the four LoRA files, so mixing workloads can give
different BLOCK_SIZE_M to the four ops: that raises (the four ops share one alignment). The returned
``LayerConfig.source`` says where the config came from (``folder:/p``, ``env:/p``,
``shipped:NVIDIA_H200`` or ``default``, with ``; lora=default`` / ``; base=default`` when one group
fell back, ``; base=file(<form>)`` when packed experts took their form's own file, and
`` (mapped from <gpu>)`` when :func:`map_gpu_name` chose the GPU name).

Packed experts (:attr:`~moelora_lib.shapes.Dims.weight_format` other than "dense") read the base and
fused entries of their form's files (``<gpu>_FUSED_MOE_BASE_<FORM>.json``, ...) where those hold the
layer's exact GEMM shape (N, K; E and T take the nearest key, so an expert-parallel shard of E/world
experts finds its model's entry), the dense files otherwise; the LoRA files serve every form.

Other GPU names: the GPU name must match a folder (shipped) or the file names (explicit / env folder)
exactly; "NVIDIA H200 NVL" or "NVIDIA H20-3e" are *not* treated as "NVIDIA H200" (different chips,
different best configs). When no tuned file exists for the GPU at all, the loader returns the defaults
and issues one :class:`TunedConfigWarning` per (GPU, folder set) naming the GPU and every folder it
looked at and how to map it. Mapping is explicit, in code: ``map_gpu_name("NVIDIA H200 NVL",
"NVIDIA_H200")`` (process-wide: stage ``tuned`` and every loader call without ``gpu_name``), or
``gpu_name="NVIDIA_H200"`` on one call. There is deliberately no environment variable for it (an
environment variable may only point at a folder). Without CUDA the name is ``cpu``, for which nothing
is shipped; that case stays silent unless a folder was given.

:func:`load_fused_config` (stage ``fused``), :func:`load_stage_choice` (stage ``auto``'s stage per
call) and :func:`load_dense_config` (dense multi-LoRA, stage
``tuned``) follow the same precedence, GPU mapping and memo. A config is resolved once per
(arguments, environment variable, device, GPU mapping); :func:`clear_cache` and
:func:`~moelora_lib.configs.files.save_config_file` forget what was resolved.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..common import gpu_name
from ..shapes import CONFIG_WEIGHT_FORMATS, Dims, check_dims
from .defaults import (
    default_config,
    default_dense_config,
    dense_block_sizes_m,
    fused_default_config,
    fused_gemm_configs,
    gemv_default_config,
)
from .files import (
    _RESOLVED,
    BASE_DEPTH,
    BASE_FILE_OP,
    DENSE_FILE_OPS,
    GEMV_KEY,
    LORA_DEPTH,
    LORA_FILE_OPS,
    STAGE_KEY,
    _dense_file,
    _keypath,
    _kind,
    _load_cached,
    _nearest_leaf,
    _pick,
    base_keys,
    config_file_name,
    dense_config_file_name,
    dense_keys,
    gpu_file_part,
    lookup,
    lora_keys,
)
from .schema import GEMV_MAX_PAIRS, LORA_OPS, DenseLoRAConfig, LayerConfig, OpConfig

__all__ = [
    "ENV_VAR",
    "SHIPPED_DIR",
    "TunedConfigWarning",
    "map_gpu_name",
    "gpu_name_map",
    "shipped_gpus",
    "shipped_folder",
    "gpu_name",
    "load_layer_config",
    "load_fused_config",
    "load_stage_choice",
    "load_gemv_config",
    "load_dense_config",
    "tuned_dense_block_sizes_m",
    "clear_cache",
]

ENV_VAR = "MOELORA_TUNED_CONFIG_FOLDER"

SHIPPED_DIR = Path(__file__).resolve().parent

#: the fallbacks already warned about: (folder, op) and (kind, GPU, folder set) keys
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
    key = gpu_file_part(gpu)
    if use is None:
        _GPU_MAP.pop(key, None)
        return
    target = gpu_file_part(use)
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


def clear_cache() -> None:
    """Forget parsed files, resolved configs and which fallbacks were already warned about."""
    _load_cached.cache_clear()
    _RESOLVED.clear()
    _WARNED.clear()


def _warn_once(folder: str, op: str, why: str, then: str | None = None) -> None:
    if (folder, op) in _WARNED:
        return
    _WARNED.add((folder, op))
    then = then or f"using the default {op} config"
    warnings.warn(f"moelora_lib tuned configs: {why}; {then}", TunedConfigWarning, stacklevel=4)


def _gpus_in(folder: Path) -> list[str]:
    """GPU names that have a base or LoRA config file in ``folder``."""
    forms = [f"{BASE_FILE_OP}_{f.upper()}" for f in CONFIG_WEIGHT_FORMATS if f != "dense"]
    parts = (BASE_FILE_OP, *forms, *LORA_FILE_OPS.values())
    names = set()
    for p in folder.glob("*_FUSED_MOE_*.json"):
        for part in parts:
            if p.name.endswith(f"_{part}.json"):
                names.add(p.name[: -len(f"_{part}.json")])
    return sorted(names)


def _has_any_file(folder: Path, gpu: str) -> bool:
    """Whether ``folder`` has a MoE config file of ``gpu``: a LoRA op's, a base or fused one (any form)."""
    ops = [(op, "dense") for op in LORA_OPS] + [
        (op, f) for op in ("base", "fused") for f in CONFIG_WEIGHT_FORMATS
    ]
    return any((folder / config_file_name(gpu, op, f)).is_file() for op, f in ops)


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


#: what a missing LoRA file or entry means: the four LoRA ops share BLOCK_SIZE_M, so all four fall back
_LORA_DEFAULTS = "using the default configs of all four LoRA ops (they share one BLOCK_SIZE_M)"


def _lora_group(folder: Path, gpu: str, dims: Dims) -> dict[str, OpConfig] | None:
    found: dict[str, OpConfig] = {}
    where: dict[str, str] = {}
    for op in LORA_OPS:
        path = folder / config_file_name(gpu, op)
        if not path.is_file():
            _warn_once(str(folder), op, f"no file {path}", _LORA_DEFAULTS)
            return None
        st = path.stat()
        data, parsed = _load_cached(str(path), st.st_mtime_ns, st.st_size, LORA_DEPTH, _kind(op))
        keys = lora_keys(op, dims)
        hit = lookup(data, keys, exact_levels=(1,))
        if hit is None:
            _warn_once(str(folder), op, f"{path} has no entry for num_slices={keys[1]}", _LORA_DEFAULTS)
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


def _form_entry(folder: Path, gpu: str, dims: Dims, op: str) -> dict | None:
    """The parsed entry for ``dims`` in the ``op`` file ("base" or "fused") of the packed form
    ``dims.weight_format``, or None: a dense form, no such file, or no entry for exactly this layer's
    GEMM shape (N, K) in it (a form tuned for one model never configures another). Among the E keys
    holding that (N, K) the nearest is taken (an expert-parallel shard holds E/world experts), then the
    nearest T bucket."""
    if dims.weight_format == "dense":
        return None
    path = folder / config_file_name(gpu, op, dims.weight_format)
    if not path.is_file():
        return None
    st = path.stat()
    data, parsed = _load_cached(str(path), st.st_mtime_ns, st.st_size, BASE_DEPTH, op)
    E, N, K, T = base_keys(dims)
    es = {e: v for e, v in data.items() if str(N) in v and str(K) in v[str(N)]}
    hit = lookup(es, (E, N, K, T), exact_levels=(1, 2)) if es else None
    return None if hit is None else parsed[hit[0]]


def _form_label(folder: Path, gpu: str, dims: Dims, op: str) -> str:
    """``"(<weight_format>)"`` when a lookup of ``dims`` takes the packed form's own ``op`` entry, else ""."""
    return "" if _form_entry(folder, gpu, dims, op) is None else f"({dims.weight_format})"


def _base_group(
    folder: Path, gpu: str, dims: Dims, op: str = "base", then: str | None = None, *, warn: bool = True
) -> dict[str, OpConfig] | None:
    """The entry for ``dims`` of a file keyed like the base file (``op`` "base", or "fused": stage
    ``fused``'s GEMMs): the packed form's own entry (:func:`_form_entry`), else the dense file's; None when
    that file is missing: with one warning (``then``: what happens instead), or silently with
    ``warn=False``."""
    own = _form_entry(folder, gpu, dims, op)
    if own is not None:
        return own
    path = folder / config_file_name(gpu, op)
    if not path.is_file():
        if warn:
            _warn_once(str(folder), op, f"no file {path}", then)
        return None
    st = path.stat()
    data, parsed = _load_cached(str(path), st.st_mtime_ns, st.st_size, BASE_DEPTH, op)
    taken, _ = lookup(data, base_keys(dims))
    return parsed[taken]


def load_fused_config(
    dims: Dims,
    *,
    folder: str | os.PathLike | None = None,
    gpu_name: str | None = None,
) -> LayerConfig:
    """The :class:`~moelora_lib.configs.schema.LayerConfig` of stage ``fused`` for one layer call.

    Same arguments, precedence and errors as :func:`load_layer_config`, whose result it starts from
    (the two shrinks: stage ``tuned``'s LoRA files). The two GEMMs (the ``base_gate_up`` and
    ``base_down`` fields) come from ``{gpu}_FUSED_MOE_LORA_FUSED.json`` (nesting of the base file,
    ``config_data[E][N][K][m]``, leaf ``{"fused_gate_up": {...}, "fused_down": {...}}``; written by
    :mod:`moelora_lib.studies.fused_tuning`); without that file (one :class:`TunedConfigWarning`) they
    are derived from the tuned base GEMMs (:func:`~moelora_lib.configs.defaults.fused_gemm_configs`).
    With no tuned file at all (e.g. the CPU): :func:`~moelora_lib.configs.defaults.fused_default_config`.
    ``source`` ends in ``; fused=file`` (``; fused=file(<form>)`` from a packed form's own file: module
    docstring), ``; fused=derived`` or is ``default:fused``.
    """
    dims = check_dims("load_fused_config: dims", dims)
    _check_source_args(folder, gpu_name)
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
        fused = {k: v for k, v in fused.items() if k not in (STAGE_KEY, GEMV_KEY)}  # not fields
        label = tuned.source if tuned.source != "default" else src.label + "; lora=default; base=default"
        cfg = tuned.replace(
            **fused, source=label + "; fused=file" + _form_label(src.where, src.gpu, dims, "fused")
        )
    elif tuned.source == "default":
        cfg = fused_default_config(dims)
    else:
        cfg = fused_gemm_configs(tuned).replace(source=tuned.source + "; fused=derived")
    return _memo_put(key, cfg)


def _fused_leaf(src, dims: Dims) -> dict | None:
    """The parsed fused-file leaf for ``dims`` from the config source ``src``, or None (silently)
    without a folder or a fused file there."""
    return None if src.where is None else _base_group(src.where, src.gpu, dims, "fused", warn=False)


def load_gemv_config(
    dims: Dims,
    *,
    folder: str | os.PathLike | None = None,
    gpu_name: str | None = None,
) -> LayerConfig:
    """The :class:`~moelora_lib.configs.schema.LayerConfig` of stage ``gemv`` for one layer call.

    Its ``base_gate_up`` / ``base_down`` fields configure the two GEMVs (BLOCK_SIZE_N, BLOCK_SIZE_K,
    SPLIT_K, NUM_WARPS) and ``gate_up_shrink`` / ``down_shrink`` the two shrinks (BLOCK_SIZE_K, SPLIT_K,
    NUM_WARPS); the expand fields are unused. From the ``"gemv"`` key of the fused file's leaf for
    ``dims`` (:data:`~moelora_lib.configs.files.GEMV_KEY`; the same folder precedence, GPU mapping and
    nearest-key lookup as :func:`load_fused_config`), else
    :func:`~moelora_lib.configs.defaults.gemv_default_config`. ``source`` ends in ``; gemv=file``
    (``; gemv=file(<form>)`` from a packed form's own fused file) or is ``default:gemv``. Same errors as
    :func:`load_layer_config`.
    """
    dims = check_dims("load_gemv_config: dims", dims)
    _check_source_args(folder, gpu_name)
    key = _memo_key(("gemv", dims), folder, gpu_name)
    cfg = _RESOLVED.get(key)
    if cfg is not None:
        return cfg
    cfg = gemv_default_config(dims)
    src = _config_source(folder, gpu_name)
    leaf = _fused_leaf(src, dims)
    g = None if leaf is None else leaf.get(GEMV_KEY)
    if g is not None:  # BLOCK_SIZE_M is unused by stage gemv: the defaults' shared ones are kept
        bm = cfg.base_gate_up.BLOCK_SIZE_M
        lm = cfg.gate_up_shrink.BLOCK_SIZE_M
        cfg = cfg.replace(
            base_gate_up=replace(g["base_gate_up"], BLOCK_SIZE_M=bm),
            base_down=replace(g["base_down"], BLOCK_SIZE_M=bm),
            gate_up_shrink=replace(g["shrink"], BLOCK_SIZE_M=lm),
            down_shrink=replace(g["shrink"], BLOCK_SIZE_M=lm),
            source=src.label + "; gemv=file" + _form_label(src.where, src.gpu, dims, "fused"),
        )
    return _memo_put(key, cfg)


def load_stage_choice(
    dims: Dims,
    *,
    folder: str | os.PathLike | None = None,
    gpu_name: str | None = None,
) -> str:
    """The stage (``"tuned"``, ``"fused"`` or ``"gemv"``) that ``stage="auto"`` runs for a layer call of
    ``dims``.

    The choice is the ``"stage"`` key of the ``{gpu}_FUSED_MOE_LORA_FUSED.json`` leaf that
    :func:`load_fused_config` takes for ``dims`` (the same folder precedence, GPU mapping and
    nearest-key lookup over ``config_data[E][N][K][m]``, so the T buckets are those of the fused
    configs); the shipped H200 choices are the faster stage per measured (model, T) of notebook 12
    (:func:`moelora_lib.studies.fused_tuning.stage_choices_from_csv`). ``"tuned"`` where there is no
    choice, always: no fused file (or no tuned folder at all: the CPU without a folder, a GPU with no
    shipped files and none given), or a leaf without the key. Silent (the fused and tuned loaders
    warn about missing files themselves).
    A pure function of (dims, files, environment variable, GPU mapping), resolved once per such key
    like the other loaders, so a layer can pick per T on the host without reading device data.

    Raises: as :func:`load_layer_config` for bad arguments or folders; ValueError naming the file and
    key path for a malformed fused file, a ``"stage"`` value other than ``"tuned"`` / ``"fused"``
    among them.
    """
    dims = check_dims("load_stage_choice: dims", dims)
    _check_source_args(folder, gpu_name)
    key = _memo_key(("stage", dims), folder, gpu_name)
    got = _RESOLVED.get(key)
    if got is not None:
        return got
    leaf = _fused_leaf(_config_source(folder, gpu_name), dims)
    choice = "tuned" if leaf is None else leaf.get(STAGE_KEY, "tuned")
    if choice == "gemv" and dims.T * dims.top_k > GEMV_MAX_PAIRS:  # a bucket key nearest to a large T
        choice = "tuned"
    return _memo_put(key, choice)


def load_layer_config(
    dims: Dims,
    *,
    folder: str | os.PathLike | None = None,
    gpu_name: str | None = None,
) -> LayerConfig:
    """The :class:`~moelora_lib.configs.schema.LayerConfig` for one layer call, from tuned files if any.

    Args:
        dims: a :class:`~moelora_lib.shapes.Dims` (``Dims.of("qwen3-30b-a3b", T, rank=32, adapters=8)``).
        folder: a config folder (highest precedence); else ``$MOELORA_TUNED_CONFIG_FOLDER``; else the
            shipped ``moelora_lib/configs/<gpu>/``; else the defaults.
        gpu_name: the GPU part of the file names and the shipped folder's name, spaces and '-' read
            as '_' (:func:`~moelora_lib.configs.files.gpu_file_part`; default: the mapping set by
            :func:`map_gpu_name` for the current GPU, else :func:`gpu_name`). Passing ``"NVIDIA_H200"``
            (or ``"NVIDIA H200"``) on another GPU uses the H200's configs there, explicitly.
    Returns: a LayerConfig whose ``source`` records where each group came from.
    Raises: TypeError when ``dims`` is not a Dims. ValueError naming the argument when ``folder`` is
        not a str / os.PathLike / None or ``gpu_name`` not a str / None (or holding a path
        separator); for a malformed or invalid
        file (naming the file and key path), or when the folder named by ``folder`` or by
        ``$MOELORA_TUNED_CONFIG_FOLDER`` is not a directory (a typo there would otherwise silently drop
        every tuned config). A missing file inside an existing folder falls back to the defaults with
        one :class:`TunedConfigWarning`; no tuned file at all for the GPU (e.g. an unknown GPU, nothing
        shipped for it) gives the defaults with one :class:`TunedConfigWarning` per (GPU, folder set)
        naming the GPU and the folders searched.
    """
    dims = check_dims("load_layer_config: dims", dims)
    _check_source_args(folder, gpu_name)
    key = _memo_key((dims,), folder, gpu_name)
    cfg = _RESOLVED.get(key)
    return cfg if cfg is not None else _memo_put(key, _resolve_layer_config(dims, folder, gpu_name))


def _check_source_args(folder, gpu_name) -> None:
    """ValueError naming the argument unless ``folder`` is a str, os.PathLike or None and ``gpu_name`` a
    str or None (the loaders' common arguments)."""
    if folder is not None and not isinstance(folder, (str, os.PathLike)):
        raise ValueError(
            f"folder must be a str, os.PathLike or None, got {type(folder).__name__}: {folder!r}"
        )
    if gpu_name is not None and not isinstance(gpu_name, str):
        raise ValueError(
            "gpu_name must be a str (e.g. 'NVIDIA_H200') or None, "
            f"got {type(gpu_name).__name__}: {gpu_name!r}"
        )
    if gpu_name:
        gpu_file_part(gpu_name, "gpu_name")


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
        return gpu_file_part(gpu_name), None
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
    form = _form_label(where, gpu, dims, "base") if base is not None else ""
    source += f"; base=file{form}" if form else ""
    changes: dict[str, Any] = {"source": source}
    changes.update(lora or {})
    changes.update(base or {})
    return dflt.replace(**changes)


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
    from ..common import check_slices
    from ..shapes import check_int

    out = [check_int(t_name, T, 1), check_int("hidden", hidden, 1)]
    return (
        *out,
        check_slices(slices),
        check_int("rank", rank, 1),
        check_int("adapters", adapters, 1),
    )


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
    """The :class:`~moelora_lib.configs.schema.DenseLoRAConfig` of one dense multi-LoRA call
    (:func:`moelora_lib.linear.lora_linear`, stage ``tuned``), from tuned files if any.

    Args:
        T: tokens of the call. hidden: H. slices: the output widths (N_s). rank: R. adapters: L.
        folder: a config folder (highest precedence); else ``$MOELORA_TUNED_CONFIG_FOLDER``; else the
            shipped ``moelora_lib/configs/<gpu>/``; else
            :func:`~moelora_lib.configs.defaults.default_dense_config`.
        gpu_name: the GPU part of the file names (default: the :func:`map_gpu_name` mapping of the
            current GPU, else :func:`gpu_name`), as for :func:`load_layer_config`.
        add_inputs: which expand file: ``EXPAND_TRUE`` (the expand adds into the base output — the
            stages with fused add, ``tuned`` among them) or ``EXPAND_FALSE``.
    Lookup: the shrink entry at (max_loras, num_slices, m, k, n) = (L, S, T, H, R), the expand entry
    at (L, S, T, R, max(slices)), every level exact else nearest, num_slices exact; the expand entry
    is the nearest one whose BLOCK_SIZE_M equals the shrink's (they share one alignment).
    Returns: a DenseLoRAConfig whose ``source`` says where it came from (``folder:/p``, ``env:/p``,
        ``shipped:NVIDIA_H200``, `` (mapped from ...)``, or ``default``).
    Raises: ValueError naming the argument for bad sizes; ValueError naming ``folder`` or ``gpu_name``
        for one of the wrong type (as :func:`load_layer_config`); ValueError for a malformed file
        (naming the file and key path); when the folder named by ``folder`` / the environment variable
        is not a directory; when the expand file has no entry with the shrink's BLOCK_SIZE_M for (L, S)
        (naming both).
    Fallbacks (the defaults): nothing shipped for the GPU — one :class:`TunedConfigWarning` per (GPU,
    folder set), none for ``cpu``; a shipped folder without dense files (MoE files only) — silent; an
    explicit or environment folder without dense files for the GPU — one warning per folder; one of
    the two files missing, or no entry for num_slices — one warning per (folder, op).
    Resolved once per (arguments, environment variable, device, GPU mapping), like
    :func:`load_layer_config`; :func:`clear_cache` / :func:`save_config_file` forget it.
    """
    T, hidden, slices, rank, adapters = _check_dense_args(T, hidden, slices, rank, adapters)
    _check_source_args(folder, gpu_name)
    key = _memo_key(("dense", T, hidden, slices, rank, adapters, bool(add_inputs)), folder, gpu_name)
    cfg = _RESOLVED.get(key)
    if cfg is None:
        cfg = _resolve_dense_config(T, hidden, slices, rank, adapters, folder, gpu_name, bool(add_inputs))
        cfg = _memo_put(key, cfg)
    return cfg


def _resolve_dense_config(T, hidden, slices, rank, adapters, folder, gpu_name, add_inputs):
    dflt = default_dense_config(T, hidden=hidden, slices=slices, rank=rank, adapters=adapters)
    gpu, mapped_from, where, label, env = _config_source(folder, gpu_name)
    if where is None:
        if gpu != "cpu":  # no GPU: nothing is ever shipped for the interpreter, stay quiet
            _warn_no_dense_configs(gpu, mapped_from, None, None, None)
        return dflt
    shipped = folder is None and not env
    if not _has_dense_file(where, gpu):
        if shipped:
            return dflt  # the shipped folder has MoE configs only: a package state, not a user error
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
    defaults' block sizes (:func:`~moelora_lib.configs.defaults.dense_block_sizes_m`) when a lookup
    falls back to them."""
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

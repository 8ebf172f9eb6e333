"""PTX / SASS text helpers of the compile-only tests (pure functions over the text of
:func:`moelora_lib.studies.compile_check.ptx` / ``sass``)."""

from __future__ import annotations

import re

_LABEL = re.compile(r"^\s*(\$L__\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+)\s*;")


def k_loop_bodies(ptx_text: str) -> list[str]:
    """The bodies of the PTX loops (a label to the last ``bra`` back to it), outermost first. With
    ``num_stages=1`` (no pipelined prologue) every load of the K loop sits in its body."""
    lines = ptx_text.splitlines()
    where = {}
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            where[m.group(1)] = i
    spans = {}
    for j, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and m.group(1) in where and where[m.group(1)] < j:
            spans[m.group(1)] = (where[m.group(1)], j)
    return ["\n".join(lines[a : b + 1]) for a, b in sorted(spans.values())]


_PRED_LD = re.compile(r"^\s*@!?%p\w*\s+ld\.global\b", re.M)
_CP_ASYNC_ZFILL = re.compile(r"\bcp\.async\.\w+(?:\.\w+)*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*[^,;]+,\s*%r\w*\s*;")
_PRED_CP_ASYNC = re.compile(r"^\s*@!?%p\w*\s+cp\.async\b", re.M)
_LD_GLOBAL = re.compile(r"^\s*(?:@!?%p\w*\s+)?ld\.global\b", re.M)


def tensor_core_ops(ptx_text: str) -> dict:
    """Counts of ``mma.sync`` and ``wgmma.mma_async`` instructions in PTX."""
    mma = len(re.findall(r"(?<![\w.])mma\.sync\.aligned\.\S+", ptx_text))
    return {"mma_sync": mma, "wgmma": len(re.findall(r"\bwgmma\.mma_async\.\S+", ptx_text))}


def masked_global_loads(ptx_text: str) -> dict:
    """Global loads of PTX by kind: ``predicated`` (``@%p ld.global``), ``zero_fill`` (``cp.async`` with a
    src-size operand), ``predicated_cp_async`` (``@%p cp.async``), ``all_ld_global``."""
    pats = dict(predicated=_PRED_LD, zero_fill=_CP_ASYNC_ZFILL, predicated_cp_async=_PRED_CP_ASYNC)
    return {k: len(p.findall(ptx_text)) for k, p in (pats | dict(all_ld_global=_LD_GLOBAL)).items()}


_GLOBAL_OP = re.compile(r"^\s*(?:@!?%p\w*\s+)?(st|ld)\.global((?:\.\w+)*)\s", re.M)
_CP_ASYNC_SIZE = re.compile(
    r"\bcp\.async\.\w+\.shared\.global\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(0x[0-9a-f]+|\d+)"
)


def global_vector_ops(ptx_text: str) -> dict:
    """Counts of global memory instructions in PTX by width: ``st_v4``/``st_v2``/``st_scalar``,
    ``ld_v4``/``ld_v2``/``ld_scalar`` and ``cp_async_<bytes>``."""
    out = {f"{op}_{w}": 0 for op in ("st", "ld") for w in ("v4", "v2", "scalar")}
    for op, mods in _GLOBAL_OP.findall(ptx_text):
        out[f"{op}_{'v4' if '.v4' in mods else 'v2' if '.v2' in mods else 'scalar'}"] += 1
    for size in _CP_ASYNC_SIZE.findall(ptx_text):
        out[f"cp_async_{int(size, 0)}"] = out.get(f"cp_async_{int(size, 0)}", 0) + 1
    return out


_RED_PTX = re.compile(r"(?<![\w.])red\.global\S*add|atom\.global\S*relaxed\S*add|atom\.global\S*add")


def has_atomic_add(ptx_text: str | None = None, sass_text: str | None = None) -> dict:
    """Global atomic adds: PTX ``red.global...add`` / ``atom.global...add`` (with ``relaxed``) and SASS
    ``REDG...ADD`` / ``ATOMG...ADD`` lines (counts)."""
    out = {}
    if ptx_text is not None:
        hits = _RED_PTX.findall(ptx_text)
        out["ptx_atomic_add"] = len(hits)
        out["ptx_relaxed"] = sum("relaxed" in h for h in hits)
    if sass_text is not None:
        out["sass_red"] = len(re.findall(r"(?<![\w.])REDG?\.\S*ADD", sass_text))
        out["sass_atom"] = len(re.findall(r"(?<![\w.])ATOMG?\.\S*ADD", sass_text))
    return out

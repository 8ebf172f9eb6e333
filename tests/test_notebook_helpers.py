"""moelora_lib.studies.notebook.show_kernel_change on the real stages (CPU, no kernel launched)."""

from __future__ import annotations

import pytest

from moelora_lib.kernels import STAGES
from moelora_lib.kernels.triton_kernels import LENGTH_ARGS
from moelora_lib.studies.notebook import show_kernel_change, stage_kernel_source


def _changed(diff: str, sign: str) -> list[str]:
    return [ln[1:] for ln in diff.splitlines() if ln.startswith(sign) and not ln.startswith(sign * 3)]


def test_no_recompile_adds_do_not_specialize_and_nothing_else():
    diff = show_kernel_change("naive", "no_recompile")
    assert diff.startswith("--- naive\n+++ no_recompile\n")
    removed, added = _changed(diff, "-"), _changed(diff, "+")
    assert removed == ["@triton.jit"] * 4
    assert sorted(added) == sorted(
        f"@triton.jit(do_not_specialize={LENGTH_ARGS[k]})"
        for k in ("fused_moe", "lora_shrink", "lora_expand", "gated_act")
    )


def test_split_k_shows_the_atomic_add_branch():
    added = _changed(show_kernel_change("no_recompile", "split_k"), "+")
    assert "    if SPLIT_K == 1:" in added
    assert any("tl.atomic_add(" in ln and 'sem="relaxed"' in ln for ln in added)
    assert not any("EVEN_K" in ln and "if" in ln for ln in added)


def test_even_k_fused_add_shows_the_unmasked_loop_and_the_add():
    diff = show_kernel_change("swizzle", "even_k_fused_add")
    added, removed = _changed(diff, "+"), _changed(diff, "-")
    assert "    if EVEN_K:" in added and "xa = tl.load(x_ptrs)" in [a.strip() for a in added]
    assert "# fixed by the stage: EVEN_K = False, ADD_INPUTS = False" in removed
    assert "# fixed by the stage: ADD_INPUTS = True" in added


def test_tuned_changes_no_kernel_line():
    assert show_kernel_change("even_k_fused_add", "tuned") == ""


def test_stage_source_resolves_the_fixed_branches():
    naive = stage_kernel_source("naive")
    assert "if EVEN_K" not in naive.split("# kernel lora_shrink")[1].split("# kernel gated_act")[0]
    assert "if EVEN_K:" in naive.split("# kernel lora_shrink")[0]  # the base GEMM follows its own config
    fused = stage_kernel_source("fused")
    assert [ln for ln in fused.splitlines() if ln.startswith("# kernel ")] == [
        "# kernel lora_shrink_rows",
        "# kernel fused_moe_lora_act",
        "# kernel fused_moe_lora",
    ]
    assert STAGES["fused"].fused_gemm


@pytest.mark.parametrize("args, bad", [(("nope", "tuned"), "prev_stage"), (("naive", "nope"), "stage")])
def test_unknown_stage_names_the_argument(args, bad):
    with pytest.raises(ValueError, match=rf"^{bad}: unknown stage 'nope'"):
        show_kernel_change(*args)

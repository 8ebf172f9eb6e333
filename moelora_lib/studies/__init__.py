"""The experiment floor of moelora_lib: what the notebooks use to measure, tune and inspect the product.

Nothing in the product (``moelora_lib`` outside this package) imports from here. Modules: :mod:`.bench`
(the timing harness), :mod:`.moe_bench`, :mod:`.dense_bench`, :mod:`.fused_bench`, :mod:`.serving`,
:mod:`.e2e`, :mod:`.helion_study`, :mod:`.fp8_study` (per-notebook measurements), :mod:`.tuner` (the tuning
engine) with :mod:`.tuning`, :mod:`.dense_tuning`, :mod:`.fused_tuning`, :mod:`.helion_tune` (tuners),
:mod:`.compile_check` (compile-only sm_90 inspection), :mod:`.explorer` (notebook 00), :mod:`.runner`
(executes the notebooks) and :mod:`.notebook` (the notebooks' set-up and display helpers).
"""

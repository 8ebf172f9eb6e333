"""The experiment floor of moelora_lib: what the notebooks use to measure, tune and inspect the product.

Nothing in the product (``moelora_lib`` outside this package) imports from here.

- :mod:`.bench`          the one timing harness (CUDA events via do_bench, L2 flush, CUDA graphs), floors,
                         result rows and environment records
- :mod:`.moe_bench`      MoE-LoRA measurements: op costs, layer/op timing, checks, recompile counts, ncu
- :mod:`.tuner`          the tuning engine that the MoE, dense and fused tuners configure
- :mod:`.tuning`         the tuner of the four LoRA ops and the base GEMMs
                         (``python -m moelora_lib.studies.tuning``)
- :mod:`.dense_tuning`   the dense LoRA tuner (``python -m moelora_lib.studies.dense_tuning``)
- :mod:`.fused_tuning`   stage ``fused``'s tuner (``python -m moelora_lib.studies.fused_tuning``)
- :mod:`.dense_bench`    notebook 10's dense multi-LoRA measurements
- :mod:`.serving`        notebook 09's serving-layer measurements
- :mod:`.fused_bench`    notebook 12's measurements of stage ``fused``
- :mod:`.e2e`            notebook 11's end-to-end generation measurements (TTFT, output tokens/s, breakdown)
- :mod:`.compile_check`  compile-only sm_90 inspection: variant counts, PTX/SASS, registers
- :mod:`.helion_tune`    the Helion linear backend's tuner
- :mod:`.helion_study`   notebook 08's sweep, ceilings, L2 probe and bounds
- :mod:`.explorer`       notebook 00's interactive view of the committed evidence
- :mod:`.runner`         executes the notebooks with papermill (``python -m moelora_lib.studies.runner``)
- :mod:`.notebook`       the one set-up call of the notebooks, their display helpers and
                         :func:`~.notebook.show_kernel_change`
"""

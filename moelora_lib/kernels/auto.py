"""Stage ``auto``: per call, stage ``tuned``, ``fused`` or ``gemv``, as the config files choose for its T.

Not a set of kernel switches of its own and not in :data:`~moelora_lib.kernels.STAGES` (so the studies
that sweep every stage skip it): :meth:`AutoStage.pick` returns the concrete stage a call of ``dims``
runs — the ``"stage"`` key of the fused config file's leaf for (E, 2I, H, T)
(:func:`moelora_lib.configs.load_stage_choice`: same folder precedence, GPU mapping and nearest-key T
buckets as the fused configs; ``tuned`` where the file records no choice, or where there is no file).
The shipped H200 choices are the faster stage per measured (model, T) of notebook 12
(``data/12_fused.csv``, :func:`moelora_lib.studies.fused_tuning.stage_choices_from_csv`).

The stage the MoE path runs by default. The choice is a pure function of the call's dims and the
files: :class:`~moelora_lib.layer.MoELoRALayer` (``stage="auto"``) resolves it on the host once per T,
with no device data read, so a CUDA graph captured at one T stays valid;
:func:`moelora_lib.fused_moe_lora` (``stage="auto"``) resolves it per call. Both candidate stages add
the LoRA expand into the output (``fused_add``), so the layer's scratch buffers serve either.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..shapes import Dims
from .config import LayerConfig
from .stages import Stage

__all__ = ["STAGE", "AutoStage"]


@dataclass(frozen=True)
class AutoStage(Stage):
    """Stage ``auto``: picks stage ``tuned``, ``fused`` or ``gemv`` per call (:meth:`pick`); it launches
    nothing
    itself, so :meth:`adapt` raises (adapt with the picked stage)."""

    def pick(self, dims: Dims, folder=None, gpu_name: str | None = None) -> Stage:
        """The stage a call of ``dims`` runs: ``STAGES[load_stage_choice(dims, ...)]``. ``folder`` /
        ``gpu_name``: as in :meth:`TunedStage.config_for <moelora_lib.kernels.tuned.TunedStage.config_for>`.
        """
        from ..configs import load_stage_choice  # lazy: loaded on the first config lookup
        from . import fused, gemv, tuned

        choice = load_stage_choice(dims, folder=folder, gpu_name=gpu_name)
        return {"fused": fused.STAGE, "gemv": gemv.STAGE}.get(choice, tuned.STAGE)

    def config_for(self, dims: Dims, folder=None, gpu_name: str | None = None) -> LayerConfig:
        """The picked stage's config for ``dims`` (before that stage's ``adapt``)."""
        st = self.pick(dims, folder, gpu_name)
        return st.config_for(dims, folder=folder, gpu_name=gpu_name)

    def adapt(self, cfg: LayerConfig) -> LayerConfig:
        raise TypeError("stage 'auto' launches nothing itself: adapt with the stage pick(dims) returns")


STAGE = AutoStage(
    name="auto",
    title="tuned, fused or gemv per T, as the config files choose",
    specialize_lengths=False,
    split_k=True,
    swizzle=True,
    even_k=True,
    fused_add=True,
)

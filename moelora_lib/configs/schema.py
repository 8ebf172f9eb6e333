"""The config types: one frozen dataclass per kernel launch, one per MoE layer, one per dense projection.

Key names follow Triton's and vLLM's config JSONs (BLOCK_SIZE_M/N/K, GROUP_SIZE_M, SPLIT_K, NUM_WARPS,
NUM_STAGES), so configs carry between the two projects. Pure Python (no torch, no Triton): the file
loaders (:mod:`moelora_lib.configs.files`, :mod:`moelora_lib.configs.loader`), the built-in defaults
(:mod:`moelora_lib.configs.defaults`) and the kernels all build on these types.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ..common import is_int

__all__ = ["OpConfig", "LayerConfig", "DenseLoRAConfig", "LORA_OPS", "BASE_OPS", "next_pow2"]

LORA_OPS = ("gate_up_shrink", "gate_up_expand", "down_shrink", "down_expand")
BASE_OPS = ("base_gate_up", "base_down")


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ n (1 for n ≤ 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


#: Most (token, k) pairs a stage ``gemv`` call takes (:mod:`moelora_lib.kernels.gemv`): beyond this the
#: expert weights are read by many pairs and the tensor-core stages win.
GEMV_MAX_PAIRS = 256


def _is_pow2(v: int) -> bool:
    return is_int(v) and v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class OpConfig:
    """Launch parameters of one kernel.

    Attributes:
        BLOCK_SIZE_M/N/K: tile sizes, powers of two ≥ 16 (tl.dot's minimum).
        GROUP_SIZE_M: grouped program order (1 = row-major), ≥ 1.
        SPLIT_K: programs sharing one output tile along K, power of two ≥ 1 (the shrinks; and stage
            ``fused``'s down GEMM, ``base_down``, at decode; 1 everywhere else).
        NUM_WARPS: warps per program, power of two.
        NUM_STAGES: software-pipelining depth, ≥ 1.
    Every field is an int (numpy integers are taken as Python ints; a bool is refused).
    Raises:
        ValueError: any field not an int or out of range, naming the field.
    """

    BLOCK_SIZE_M: int = 16
    BLOCK_SIZE_N: int = 64
    BLOCK_SIZE_K: int = 64
    GROUP_SIZE_M: int = 1
    SPLIT_K: int = 1
    NUM_WARPS: int = 4
    NUM_STAGES: int = 2

    def __post_init__(self) -> None:
        for f in fields(self):  # numpy ints (a config read from a DataFrame) become Python ints
            v = getattr(self, f.name)
            if is_int(v) and type(v) is not int:
                object.__setattr__(self, f.name, int(v))
        for name in ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K"):
            v = getattr(self, name)
            if not _is_pow2(v) or v < 16:
                raise ValueError(f"{name} must be a power of two >= 16, got {v!r}")
        for name in ("SPLIT_K", "NUM_WARPS"):
            if not _is_pow2(getattr(self, name)):
                raise ValueError(f"{name} must be a power of two >= 1, got {getattr(self, name)!r}")
        if not is_int(self.GROUP_SIZE_M) or self.GROUP_SIZE_M < 1:
            raise ValueError(f"GROUP_SIZE_M must be an int >= 1, got {self.GROUP_SIZE_M!r}")
        if not is_int(self.NUM_STAGES) or self.NUM_STAGES < 1:
            raise ValueError(f"NUM_STAGES must be an int >= 1, got {self.NUM_STAGES!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, *, where: str = "config") -> OpConfig:
        """Build from a dict with upper-case keys (lower-case accepted); unknown keys raise ValueError."""
        names = {f.name for f in fields(cls)}
        norm = {}
        for k, v in d.items():
            key = k.upper()
            if key not in names:
                raise ValueError(f"{where}: unknown key {k!r}; expected a subset of {sorted(names)}")
            norm[key] = v
        return cls(**norm)

    def short(self) -> str:
        """Compact label, e.g. ``m16n64k128g1s1w4st2``."""
        return (
            f"m{self.BLOCK_SIZE_M}n{self.BLOCK_SIZE_N}k{self.BLOCK_SIZE_K}g{self.GROUP_SIZE_M}"
            f"s{self.SPLIT_K}w{self.NUM_WARPS}st{self.NUM_STAGES}"
        )


@dataclass(frozen=True)
class LayerConfig:
    """The six launches of one MoE+LoRA layer.

    The two base GEMMs share one expert-only alignment and the four LoRA ops share one
    (adapter, expert) alignment, so each group must agree on BLOCK_SIZE_M (as upstream, where a
    mismatch corrupts memory silently; here it raises ValueError). Each op field must be an
    :class:`OpConfig` (ValueError naming the field otherwise).
    """

    base_gate_up: OpConfig
    base_down: OpConfig
    gate_up_shrink: OpConfig
    gate_up_expand: OpConfig
    down_shrink: OpConfig
    down_expand: OpConfig
    source: str = "default"

    def __post_init__(self) -> None:
        for op in BASE_OPS + LORA_OPS:
            v = getattr(self, op)
            if not isinstance(v, OpConfig):
                hint = " (build it with OpConfig.from_dict)" if isinstance(v, dict) else ""
                raise ValueError(f"LayerConfig.{op} must be an OpConfig{hint}, got {type(v).__name__}: {v!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"LayerConfig.source must be a str, got {type(self.source).__name__}")
        if self.base_gate_up.BLOCK_SIZE_M != self.base_down.BLOCK_SIZE_M:
            raise ValueError(
                "base_gate_up and base_down must share BLOCK_SIZE_M "
                f"({self.base_gate_up.BLOCK_SIZE_M} != {self.base_down.BLOCK_SIZE_M})"
            )
        bms = {op: getattr(self, op).BLOCK_SIZE_M for op in LORA_OPS}
        if len(set(bms.values())) != 1:
            raise ValueError(f"the four LoRA ops must share BLOCK_SIZE_M, got {bms}")
        for op in ("gate_up_expand", "down_expand"):
            if getattr(self, op).SPLIT_K != 1:
                raise ValueError(
                    f"{op}: SPLIT_K must be 1 (split-K is for the shrink ops, stage fused's down GEMM and "
                    "stage gemv's GEMVs)"
                )

    @property
    def lora_block_size_m(self) -> int:
        return self.gate_up_shrink.BLOCK_SIZE_M

    @property
    def base_block_size_m(self) -> int:
        return self.base_gate_up.BLOCK_SIZE_M

    def replace(self, **changes) -> LayerConfig:
        return replace(self, **changes)

    @property
    def is_deterministic(self) -> bool:
        """True when no launch splits K (SPLIT_K = 1 on both shrinks and both base GEMMs): every launch
        of the layer then writes each output element from one program in a fixed order, so repeated
        calls on the same inputs and config give the same bits on the same GPU and software."""
        return all(getattr(self, op).SPLIT_K == 1 for op in LORA_OPS + BASE_OPS)

    def deterministic(self) -> LayerConfig:
        """This config with SPLIT_K = 1 on the two shrinks and the two base GEMMs (the only launches that
        split K: their relaxed fp32 atomic adds, vLLM PRs #27291/#27818, reach each output element in an
        order the hardware picks, so split-K results can differ in the last bits from call to call).
        Every other field is kept; ``source`` gets ``+deterministic`` appended. Returns ``self`` when
        it already is deterministic. The cost is the split-K speed-up of the thin shrink GEMMs."""
        if self.is_deterministic:
            return self
        return replace(
            self,
            gate_up_shrink=replace(self.gate_up_shrink, SPLIT_K=1),
            down_shrink=replace(self.down_shrink, SPLIT_K=1),
            base_gate_up=replace(self.base_gate_up, SPLIT_K=1),
            base_down=replace(self.base_down, SPLIT_K=1),
            source=self.source + "+deterministic",
        )

    def to_dict(self) -> dict:
        d = {op: getattr(self, op).to_dict() for op in BASE_OPS + LORA_OPS}
        d["source"] = self.source
        return d

    def short(self) -> str:
        return ";".join(f"{op}={getattr(self, op).short()}" for op in BASE_OPS + LORA_OPS)


@dataclass(frozen=True)
class DenseLoRAConfig:
    """Launch configs of the two dense LoRA kernels of one projection.

    Attributes:
        shrink: :class:`OpConfig` of ``_dense_shrink_kernel`` (SPLIT_K ≥ 1 allowed).
        expand: :class:`OpConfig` of ``_dense_expand_kernel`` (SPLIT_K must be 1).
        source: where it came from ("default", a file name...).
    Both share one alignment, so they must agree on BLOCK_SIZE_M.
    Raises:
        ValueError: naming the field: not an OpConfig, BLOCK_SIZE_M mismatch, expand SPLIT_K ≠ 1.
    """

    shrink: OpConfig
    expand: OpConfig
    source: str = "default"

    def __post_init__(self) -> None:
        for op in ("shrink", "expand"):
            v = getattr(self, op)
            if not isinstance(v, OpConfig):
                hint = " (build it with OpConfig.from_dict)" if isinstance(v, dict) else ""
                raise ValueError(
                    f"DenseLoRAConfig.{op} must be an OpConfig{hint}, got {type(v).__name__}: {v!r}"
                )
        if not isinstance(self.source, str):
            raise ValueError(f"DenseLoRAConfig.source must be a str, got {type(self.source).__name__}")
        if self.shrink.BLOCK_SIZE_M != self.expand.BLOCK_SIZE_M:
            raise ValueError(
                "DenseLoRAConfig: shrink and expand share one alignment and must share BLOCK_SIZE_M "
                f"({self.shrink.BLOCK_SIZE_M} != {self.expand.BLOCK_SIZE_M})"
            )
        if self.expand.SPLIT_K != 1:
            raise ValueError(f"DenseLoRAConfig.expand: SPLIT_K must be 1, got {self.expand.SPLIT_K}")

    @property
    def block_size_m(self) -> int:
        return self.shrink.BLOCK_SIZE_M

    @property
    def is_deterministic(self) -> bool:
        """True when the shrink does not split K (the expand never does)."""
        return self.shrink.SPLIT_K == 1

    def deterministic(self) -> DenseLoRAConfig:
        """This config with the shrink's SPLIT_K = 1 (split-K's relaxed fp32 atomics add in an order
        the hardware picks; with one program per output tile every call gives the same bits). Other
        fields kept; ``source`` gets ``+deterministic``; ``self`` when already deterministic."""
        if self.is_deterministic:
            return self
        return replace(self, shrink=replace(self.shrink, SPLIT_K=1), source=self.source + "+deterministic")

    def to_dict(self) -> dict:
        return {"shrink": self.shrink.to_dict(), "expand": self.expand.to_dict(), "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> DenseLoRAConfig:
        """From ``{"shrink": {...}, "expand": {...}[, "source": str]}`` (OpConfig keys)."""
        return cls(
            OpConfig.from_dict(d["shrink"], where="shrink"),
            OpConfig.from_dict(d["expand"], where="expand"),
            d.get("source", "dict"),
        )

    def short(self) -> str:
        return f"shrink={self.shrink.short()};expand={self.expand.short()}"

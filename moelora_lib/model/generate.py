"""Multi-adapter generation: prefill (replayed from a CUDA graph per padded prompt length), then a decode
step replayed from a CUDA graph per batch-size bucket, every request with its own adapter slot (or none).

Usage::

    gen = Generator(model)                    # model: MultiLoRAModel (or anything with its forward)
    gen.warmup(prefill_lengths=[1600])        # optional: capture the graphs up front (returns the plan)
    res = gen.generate(prompts, adapters=[0, 3, None], max_new_tokens=600)
    res.tokens[1], res.ttft_s[1], res.request_otps[1], res.aggregate_otps

What the model must provide (the spec of ``moelora_lib.model.modeling.MultiLoRAModel``)::

    model(input_ids [B, S] int64, start_pos [B] int64, lora_ids [B] int32 (-1 = none), *,
          cache_rows [B] int64, last_only=True) -> logits float32 [B, V]

writing the K/V of the S tokens into cache row ``cache_rows[b]`` at positions ``start_pos[b] ..
start_pos[b]+S-1``; and the attributes ``config.vocab_size``, ``max_batch`` (cache rows), ``max_seq``
(cache positions), ``max_tokens`` (B*S per call, at least ``max_batch``) and ``num_adapters`` (L slots);
optionally ``hold_slots(slots)`` (a context manager, see below), and ``restrict_slots(slots)`` (a context
manager) with ``lora_launches(slots)`` (a hashable) for LoRA variants (see below).

How a call runs (request i always owns cache row i):

1. **Prefill**. Requests whose prompts have the same length are prefilled together
   (``batch_prefill=False``: one request per call). With CUDA graphs (``pad_prefill``, on by default with
   them) a group's prompts are padded at the end to a static length (:func:`prefill_length`: multiples of
   64 up to 512 tokens, then eight lengths per octave, so at most 12.5 % padding above 512 tokens, capped
   at ``max_seq``), ``max_tokens // padded length`` rows per call, and the call is a replay of a CUDA graph
   captured per (rows, padded length) — lazily on first use or up front in :meth:`Generator.warmup`, which
   captures every row count a length can take — so one prefill costs one launch of host time instead of one
   per kernel (an eager layer call costs ~1 ms of host time on the lent H200's host: data/09_eager.csv).
   The padded tail is harmless: its tokens sit after the prompt (causal attention hides them from it),
   their K/V land at positions the decode overwrites before it reads them, and the logits are taken at each
   row's real last token (``last_index``). Without graphs, for a prompt longer than ``max_tokens``, or for
   a model whose forward lacks ``kv_len``/``last_index``, the prefill is eager: ``max_tokens // length``
   rows per call, a prompt longer than ``max_tokens`` fed in chunks (``start_pos`` says where each goes),
   ``kv_len = chunk end`` so attention reads only the positions written so far. The first token is sampled
   from the last prefill logits; the device is synchronized after each prefill group so that TTFT
   (``time.perf_counter`` from the call's start) covers the work.
2. **Decode**: one step for all active requests: ``input_ids [b, 1]`` (the last token), ``start_pos``
   (its position), ``lora_ids``, ``cache_rows``. With padding (on by default with CUDA graphs) the B
   active requests are padded up to the next bucket b of ``graph_batch_sizes`` (``max_batch`` is always
   a bucket) with dummy rows: token 0, position 0, no adapter, each pointing at a distinct cache row
   that no active request owns (b ≤ max_batch guarantees there are enough), so they only overwrite
   position 0 of spare rows. Each bucket has static input buffers; the step's state lives in them
   (the new token and ``start_pos + 1`` are written in place after a step), so a step is a graph replay
   plus a few small launches and no host→device copy. On CUDA the bucket's model forward and the
   greedy argmax are captured once in a CUDA graph (warm-up on a side stream first, as torch's CUDA
   graph docs ask; graphs share one memory pool) — lazily on first use, or all at once in
   :meth:`Generator.warmup`. The warm-up resolves, on the host, what each module launches at the
   bucket's T (the launch configs, and with the MoE layers' ``stage="auto"`` their stage for that T,
   :meth:`MoELoRALayer.stage_for <moelora_lib.MoELoRALayer.stage_for>`), so each graph captures the
   stage of its own T. Sampling with temperature runs after the replay on the graph's logits.
   On the CPU the identical code runs the forward eagerly instead of replaying.
3. **Host syncs**: without ``eos_token_id`` or ``stream`` the decode loop never waits for the device
   until the end (per-step completion times come from CUDA events read after the loop). With
   ``eos_token_id`` the host reads the per-row "hit eos" flags every ``eos_check_interval`` steps (one
   small copy, default every step); finished requests are then removed and the rest re-packed into
   the (possibly smaller) bucket. A larger interval saves syncs at the cost of up to interval-1
   wasted steps per finished request; tokens after its eos are dropped, so the output is the same
   (sampled output too: a request's sampling noise is keyed by its seed and output position only, see
   :func:`sample_tokens` and :func:`request_keys`, so re-packing changes none of its tokens).
   ``stream`` needs the tokens on the host, so it syncs every step.

Adapter slots: ``adapters[i]`` is a slot in [0, L), or None / -1 for the base model. When the model
has ``lora_modules()`` (MultiLoRAModel), a slot that holds nothing in any module is refused (an empty
slot would silently run the base model; pass None for that). A call holds the slots its requests use
until it returns (``MultiLoRAModel.hold_slots``): loading or unloading one of them meanwhile (from the
``stream`` callback) raises RuntimeError at that load and leaves the running requests untouched; other
slots can change. A call is not re-entrant: ``generate`` or ``warmup`` on the same model, or this
generator's ``reset_graphs``, from inside a running call raise RuntimeError; so does a direct forward of
the model (``MultiLoRAModel.exclusive_forwards``: the call's own forwards go through the callable it
yields, any other would overwrite the KV cache rows in use).

Non-finite logits: each prefill and decode step ORs "this row's logits hold a NaN or an infinity" into a
[max_batch] bool buffer indexed by cache row (one reduction over [b, V] on the device, captured in the
decode graphs too); the call reads it with its final sync into ``GenerationResult.non_finite`` and warns
(RuntimeWarning) naming the flagged requests.

LoRA variants: the host knows the adapter slots of every forward (those of its requests; padding rows
have none), so each prefill call and decode step runs its forward under ``model.restrict_slots(slots)``:
the LoRA launches (alignment, shrink, expand) of projections that none of the slots' adapters covers are
skipped, and a batch without adapters runs the base model alone while others are loaded (its rows are
bit for bit those of the unrestricted forward). The launches a set of slots gets,
``model.lora_launches(slots)`` (per LoRA module and projection, whether its LoRA launches run), is the
forward's variant: each decode bucket and prefill (rows, length) holds one CUDA graph per variant,
captured under the restriction, and a step replays the graph of its variant, so re-packing after some
requests finish can switch, e.g., to the base-only graph. Variants are few: all False (no adapter), that
of every loaded slot (shared by any batch whose adapters together cover the same projections, e.g. all of
eight full adapters or any one of them), and one per other coverage pattern. Eagerly (on the CPU) the same
restriction applies. A model without ``restrict_slots`` / ``lora_launches`` has one variant.

The graphs capture the addresses of the model's weights, adapter slots and KV cache, and the LoRA
modules' host-side choices of which launches to make, which depend on the set of loaded slots and what
each covers (``loaded_slots`` of every module) and on the variant. Loading adapters copies into the slot
buffers in place, so addresses stay valid; the generator records the modules' ``loaded_slots`` with its
graphs and drops the graphs when that changes (checked at each call, host-side). If the model
reallocates its buffers, call :meth:`Generator.reset_graphs`.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..common import is_int

__all__ = [
    "Generator",
    "GenerationResult",
    "sample_tokens",
    "request_keys",
    "prefill_length",
    "DEFAULT_GRAPH_BATCH_SIZES",
]

DEFAULT_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32)

# id() of each model with a generate call running (for the call's duration): re-entry is refused.
_RUNNING_MODELS: set[int] = set()


def prefill_length(n: int, max_seq: int) -> int:
    """The static (padded) length a prompt of ``n`` tokens is prefilled at under CUDA graphs: ``n`` rounded
    up to a multiple of max(64, 2^(⌊log2 n⌋ - 3)) — multiples of 64 up to 512, then eight lengths per
    octave: at most 63 padded tokens up to 512 and 12.5 % above (e.g. 1600 -> 1664), and few graphs (32
    up to 4096) — and at most ``max_seq``."""
    if not is_int(n) or n < 1:
        raise ValueError(f"n: expected a prompt length, an int >= 1, got {n!r}")
    if not is_int(max_seq) or max_seq < n:
        raise ValueError(f"max_seq: expected an int >= n = {n}, got {max_seq!r}")
    q = max(64, 1 << max(0, int(n).bit_length() - 4))
    return int(min(max_seq, -(-n // q) * q))


@dataclass
class GenerationResult:
    """Output tokens and timings of one :meth:`Generator.generate` call (all times in seconds,
    ``time.perf_counter`` based, device work synchronized).

    Per request i:
      tokens[i]          generated token ids (the eos token included when it ended the request)
      finished_eos[i]    True when it stopped at eos, False when it reached max_new_tokens
      ttft_s[i]          call start -> its first token sampled (prefill of its group done)
      request_decode_s[i] first token -> last token
      request_otps[i]    (len(tokens[i]) - 1) / request_decode_s[i]; nan with a single token
    Whole call:
      prefill_s          call start -> last first token (validation and all prefills)
      decode_s           last first token -> last token of all requests (the decode loop)
      total_s            call start -> results on the host
      output_tokens      Σ len(tokens[i])
      aggregate_otps     output_tokens / total_s
      decode_otps        Σ (len(tokens[i]) - 1) / decode_s (nan without decode steps)
      step_s[k]          duration of decode step k (the first step's includes a lazy graph capture)
      decode_batch_sizes[k] (active B, padded bucket b) of decode step k
      decode_slots[k]    the adapter slots (ascending) of decode step k's requests: the step ran the LoRA
                         launches they need and no other (none for ())
      non_finite[i]      True when some logits of request i (its prefill's last logits or a decode step's)
                         held a NaN or an infinity: its tokens from that point on are meaningless (the token
                         picked from such a row: :func:`sample_tokens`).
                         Computed on the device inside each step (inside the captured graphs too) and read
                         with the final sync; :meth:`Generator.generate` also warns (RuntimeWarning) naming
                         such requests. The other requests' tokens do not depend on it. With
                         ``eos_check_interval`` > 1 it also covers the steps a request ran after its eos
                         before the host saw it.
    """

    tokens: list[list[int]]
    finished_eos: list[bool]
    ttft_s: list[float]
    request_decode_s: list[float]
    request_otps: list[float]
    prefill_s: float
    decode_s: float
    total_s: float
    output_tokens: int
    aggregate_otps: float
    decode_otps: float
    step_s: list[float] = field(default_factory=list)
    decode_batch_sizes: list[tuple[int, int]] = field(default_factory=list)
    decode_slots: list[tuple[int, ...]] = field(default_factory=list)
    non_finite: list[bool] = field(default_factory=list)

    def summary(self) -> dict:
        """Aggregate numbers as one flat dict (a CSV row): means over requests plus the call totals."""

        def mean(xs):
            xs = [x for x in xs if not math.isnan(x)]
            return sum(xs) / len(xs) if xs else float("nan")

        return {
            "requests": len(self.tokens),
            "output_tokens": self.output_tokens,
            "ttft_s_mean": mean(self.ttft_s),
            "ttft_s_max": max(self.ttft_s) if self.ttft_s else float("nan"),
            "request_otps_mean": mean(self.request_otps),
            "aggregate_otps": self.aggregate_otps,
            "decode_otps": self.decode_otps,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "total_s": self.total_s,
        }


def _is_number(v) -> bool:
    """A real number (Python or numpy), not a bool."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


# ----------------------------------------------------------------------------------------------------
# Sampling

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 arithmetic never
# overflows and the product's low 32 bits are exact on every device.
_MUL1, _MUL2 = 0x2C1B3C6D, 0x297A2D39
# Domain constants: keep the seed, stream, position and vocabulary inputs of the hash apart.
_SALT_SEED, _SALT_STREAM, _SALT_POS, _SALT_VOCAB = 0x3A5C1E27, 0x61C88647, 0x1B56C4E9, 0x5851F42D


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xor-shift / multiply rounds) of ``x`` int64 holding values in
    [0, 2^32); returns a new int64 tensor of the same shape with values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 16)
    return x


def _seed_words(seed: int) -> tuple[int, int]:
    """An int seed in [-2^63, 2^64) as two 32-bit words (two's complement for negatives)."""
    s = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return s & _MASK32, s >> 32


def request_keys(seed: int | Sequence[int], n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-request sampling keys for :func:`sample_tokens`: [n] int64 in [0, 2^32) on ``device``.

    ``seed`` an int s: request i gets the key of the stream (s, i). ``seed`` a list of n ints: request i
    gets the key of (seed[i], 0), so a request with seed[i] = s samples the same tokens whether it runs
    alone or with others, and ``seed=s`` equals ``seed=[s]`` for one request. Seeds are ints in
    [-2^63, 2^64). Raises ValueError for another seed or n.
    """
    if not (is_int(n) and n >= 1):
        raise ValueError(f"n: expected an int >= 1, got {n!r}")
    _check_seed(seed, n)
    if is_int(seed):
        words = [(*_seed_words(seed), i) for i in range(n)]
    else:
        words = [(*_seed_words(s), 0) for s in seed]
    w = torch.tensor(words, dtype=torch.int64, device=device)
    key = _mix32(w[:, 0] ^ _SALT_SEED)
    key = _mix32(key ^ w[:, 1])
    return _mix32(key ^ (w[:, 2] & _MASK32) ^ _SALT_STREAM)


def _check_seed(seed, n: int) -> None:
    def ok(s):
        return is_int(s) and -(1 << 63) <= s < (1 << 64)

    if is_int(seed) and ok(seed):
        return
    if isinstance(seed, (list, tuple)) and len(seed) == n and all(ok(s) for s in seed):
        return
    raise ValueError(
        f"seed: expected None or an int in [-2^63, 2^64) (or a list of {n} such ints, one per request), "
        f"got {seed!r}"
    )


def _eos_ids(eos, vocab_size: int) -> tuple[int, ...]:
    """``eos_token_id`` (None, an int or a non-empty list/tuple of ints in [0, vocab_size)) as a tuple of
    ints (empty for None); ValueError naming it otherwise."""
    if eos is None:
        return ()
    ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    if not ids or not all(is_int(t) and 0 <= t < vocab_size for t in ids):
        raise ValueError(
            f"eos_token_id: expected None or a token id in [0, {vocab_size}) (an int or a non-empty list "
            f"of them), got {eos!r}"
        )
    return tuple(int(t) for t in ids)


def _counter_gumbel(keys: torch.Tensor, position: int | torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel noise [B, V] float32 that is a pure function of (keys[b], position, v): a 32-bit hash of
    the three (:func:`_mix32`), its top 23 bits as u = (k + 1/2) / 2^23 in (0, 1) exactly, then
    -log(-log u) (finite: in [-2.8, 16.7]). The integer part is bit-identical on every device; the two
    logs may differ by rounding between CPU and GPU. Torch ops only: no host sync, graph-capturable."""
    if isinstance(position, torch.Tensor):
        position = position.to(torch.int64)
    row = _mix32(_mix32(keys ^ _SALT_POS) ^ (position & _MASK32))  # [B]
    vocab = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=keys.device) ^ _SALT_VOCAB)
    x = _mix32(row[:, None] ^ vocab[None, :])  # [B, V]
    u = (x >> 9).float().add_(0.5).mul_(2.0**-23)
    return u.log_().neg_().clamp_(min=torch.finfo(torch.float32).tiny).log_().neg_()


def _scaled_logits(logits: torch.Tensor, temperature: float, row_max: torch.Tensor) -> torch.Tensor:
    """(logits - row max) / temperature in float32: <= 0 with the row's max at 0, so no finite positive
    temperature overflows to inf or gives NaN (for a row with a finite max). ``row_max``: the logits'
    amax over the last dim, keepdim. A temperature below float32's smallest normal number (1.2e-38; a
    subnormal divisor may be flushed to 0 on a GPU) gives its limit: 0 at the row's max, -inf elsewhere;
    one above float32's largest number is clamped to it."""
    f32 = np.finfo(np.float32)
    z = logits.float() - row_max.float()
    if temperature < float(f32.tiny):
        return z.masked_fill_(z < 0, -math.inf)
    return z.div_(float(np.float32(min(temperature, float(f32.max)))))


def sample_tokens(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    *,
    keys: torch.Tensor | None = None,
    position: int | torch.Tensor = 0,
) -> torch.Tensor:
    """Next tokens from ``logits`` [B, V] (float) -> [B] int64, without a host sync.

    ``temperature == 0``: argmax (greedy). Otherwise softmax(logits / temperature) restricted to the
    ``top_k`` largest logits (ties at the k-th all kept) and to the smallest set of tokens whose
    probability mass reaches ``top_p`` (the top token always kept), sampled with the Gumbel-max
    (exponential race) trick: argmax(z + g) with g Gumbel noise draws token v with probability p_v and
    needs no ``torch.multinomial`` (which syncs). The logits are shifted by their row max before the
    division, so a tiny temperature tends to the greedy token (tokens tied at the max drawn uniformly)
    with no inf/NaN for any finite temperature > 0.

    Noise: with ``keys`` ([B] int64 in [0, 2^32) on the logits' device, e.g. from :func:`request_keys`)
    it is a pure function of (keys[b], ``position`` (an int, or [B] int64), token id): a row's sample
    depends only on its key, position and logits, not on the other rows or the call order, identically
    on CPU and GPU up to the rounding of two logs. It costs about a dozen elementwise passes over
    [B, V] (int64 hashing, two logs). Without ``keys`` it comes from ``generator`` (None: torch's
    global RNG).

    Non-finite rows: a row whose maximum is not finite — a NaN anywhere, a +inf, or every logit -inf
    (e.g. the logits of an overflowed forward) — defines no distribution. Its token is its argmax, greedy
    or sampled alike, whatever the keys, position, temperature, top_k and top_p: the index of its first
    NaN, else of its first +inf, else 0. So such a row's token is deterministic but meaningless;
    :meth:`Generator.generate` flags its request (``GenerationResult.non_finite``). A -inf logit in a row
    with a finite max is a masked token (never drawn), not a non-finite row.

    Raises ValueError for ``logits`` that are not a floating-point tensor [B, V] (B, V >= 1), a
    temperature that is not a finite real number >= 0, a ``top_k`` that is not an int >= 1, a ``top_p``
    outside (0, 1], ``keys`` of the wrong shape, dtype or device, or a ``position`` that is neither an
    int nor an integer tensor [B] (or 0-d) on the logits' device.
    """
    if not (
        isinstance(logits, torch.Tensor)
        and logits.dim() == 2
        and logits.is_floating_point()
        and logits.shape[0] >= 1
        and logits.shape[1] >= 1
    ):
        got = type(logits).__name__
        if isinstance(logits, torch.Tensor):
            got = f"{logits.dtype} {tuple(logits.shape)}"
        raise ValueError(f"logits: expected a floating-point tensor [B, V] (B, V >= 1), got {got}")
    if isinstance(position, torch.Tensor):
        if not (
            position.dtype in (torch.int32, torch.int64)
            and tuple(position.shape) in ((), tuple(logits.shape[:1]))
            and position.device == logits.device
        ):
            raise ValueError(
                f"position: expected an int or an int32/int64 tensor [{logits.shape[0]}] (or 0-d) on "
                f"{logits.device}, got {position.dtype} {tuple(position.shape)} on {position.device}"
            )
    elif not is_int(position):
        raise ValueError(
            f"position: expected an int or an int32/int64 tensor [{logits.shape[0]}] (or 0-d) on "
            f"{logits.device}, got {position!r}"
        )
    if not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature: expected a finite real number >= 0, got {temperature!r}")
    if top_k is not None and not (is_int(top_k) and top_k >= 1):
        raise ValueError(f"top_k: expected None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p: expected None or a number in (0, 1], got {top_p!r}")
    if keys is not None and not (
        isinstance(keys, torch.Tensor)
        and keys.dtype == torch.int64
        and tuple(keys.shape) == tuple(logits.shape[:1])
        and keys.device == logits.device
    ):
        got = f"{keys.dtype} {tuple(keys.shape)} on {keys.device}" if isinstance(keys, torch.Tensor) else keys
        raise ValueError(f"keys: expected None or int64 [{logits.shape[0]}] on {logits.device}, got {got!r}")
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    row_max = logits.amax(dim=-1, keepdim=True)  # NaN for a row with a NaN
    z = _scaled_logits(logits, float(temperature), row_max)
    if top_k is not None and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, -math.inf)
    if top_p is not None and top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_z, dim=-1)  # finite: the row max is 0
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly better tokens
        sorted_z = sorted_z.masked_fill(mass_before >= top_p, -math.inf)
        z = torch.full_like(z, -math.inf).scatter(-1, order, sorted_z)
    if keys is not None:
        noise = _counter_gumbel(keys, position, z.shape[-1])
    else:  # -log q with q ~ Exp(1), clamped away from 0 so the noise stays finite
        q = torch.empty_like(z).exponential_(1.0, generator=generator)
        noise = q.clamp_(min=torch.finfo(q.dtype).tiny).log_().neg_()
    sampled = (z + noise).argmax(dim=-1)
    return torch.where(torch.isfinite(row_max[:, 0]), sampled, logits.argmax(dim=-1))


# ----------------------------------------------------------------------------------------------------
# Decode buckets


class _DecodeBucket:
    """Static decode inputs for batch size ``size`` (active rows first, then dummy rows), the adapter
    slots of the active rows and their LoRA variant (:meth:`Generator._variant_of`), and the CUDA graphs
    captured so far, one per variant, all reading these inputs. ``owner`` [size, max_batch] bool: row k's
    cache row one-hot for an active row, all False for a dummy row (where the step's non-finite flags go,
    :meth:`Generator._flag_non_finite`)."""

    def __init__(self, size: int, max_batch: int, device: torch.device):
        self.size = size
        self.owner = torch.zeros(size, max_batch, dtype=torch.bool, device=device)
        self.input_ids = torch.zeros(size, 1, dtype=torch.int64, device=device)  # last token per row
        self.start_pos = torch.zeros(size, dtype=torch.int64, device=device)  # its cache position
        self.lora_ids = torch.full((size,), -1, dtype=torch.int32, device=device)
        self.cache_rows = torch.arange(size, dtype=torch.int64, device=device)
        self.slots: frozenset[int] = frozenset()  # the forward runs restricted to them
        self.variant = None  # the key of its graph in ``graphs``
        #: variant -> (CUDA graph, its outputs: logits [size, V] float32, greedy [size] int64)
        self.graphs: dict = {}


class _PrefillBucket:
    """Static prefill inputs for ``rows`` prompts padded to ``length`` tokens (start position 0), the
    adapter slots of the call's requests and their LoRA variant (as :class:`_DecodeBucket`), and the
    CUDA graphs captured so far, one per variant, with their output (last-token logits [rows, V]
    float32)."""

    def __init__(self, rows: int, length: int, device: torch.device):
        self.rows, self.length = rows, length
        self.input_ids = torch.zeros(rows, length, dtype=torch.int64, device=device)
        self.start_pos = torch.zeros(rows, dtype=torch.int64, device=device)
        self.lora_ids = torch.full((rows,), -1, dtype=torch.int32, device=device)
        self.cache_rows = torch.arange(rows, dtype=torch.int64, device=device)
        self.last_index = torch.full((rows,), length - 1, dtype=torch.int64, device=device)
        self.slots: frozenset[int] = frozenset()
        self.variant = None
        self.graphs: dict = {}  # variant -> (CUDA graph, logits [rows, V] float32)


@dataclass(frozen=True)
class _Limits:
    vocab_size: int
    max_batch: int
    max_seq: int
    max_tokens: int
    num_adapters: int


def _model_limits(model) -> _Limits:
    def get(*names):
        for name in names:
            obj = model
            for part in name.split("."):
                obj = getattr(obj, part, None)
            if obj is not None:
                return int(obj)
        raise ValueError(f"model: expected an attribute {names[0]!r} (see moelora_lib.model.generate)")

    return _Limits(
        vocab_size=get("config.vocab_size", "vocab_size"),
        max_batch=get("max_batch"),
        max_seq=get("max_seq"),
        max_tokens=get("max_tokens"),
        num_adapters=get("num_adapters", "L"),
    )


def _model_device(model) -> torch.device:
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


class _Clock:
    """Host times of device work: CUDA events recorded without syncing, read after the loop (CUDA),
    or ``perf_counter`` (CPU, where the work is already done when the call returns)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def start(self) -> float:
        """Synchronize and anchor the events at the host time returned."""
        self.sync()
        self.t0 = time.perf_counter()
        if self.cuda:
            self.ev0 = torch.cuda.Event(enable_timing=True)
            self.ev0.record()
        return self.t0

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, mark) -> float:
        """Host time of a mark (after a final sync)."""
        if self.cuda:
            return self.t0 + self.ev0.elapsed_time(mark) / 1e3
        return mark


def _check_stream(stream) -> None:
    """ValueError naming ``stream`` unless it is a callable that accepts the generator's call
    ``stream(request_index, token)`` (two positional ints). Checked up front so a wrong signature fails
    before the prefill rather than at the first token. A callable whose signature cannot be read (some
    builtins and extension types) is accepted as is; ``*args`` accepts anything."""
    if not callable(stream):
        raise ValueError(f"stream: expected None or a callable stream(request_index, token), got {stream!r}")
    try:
        sig = inspect.signature(stream)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(0, 0)
    except TypeError as e:
        raise ValueError(
            f"stream: expected a callable taking two positional arguments, stream(request_index, token); "
            f"{getattr(stream, '__qualname__', type(stream).__name__)}{sig} cannot be called so ({e})"
        ) from None


# ----------------------------------------------------------------------------------------------------
# Generator


class Generator:
    """Generation with per-request adapters over a multi-LoRA model (see the module docstring).

    Args:
      model: a :class:`~moelora_lib.model.modeling.MultiLoRAModel` (or the same forward contract).
      graph_batch_sizes: decode bucket sizes; sizes above ``model.max_batch`` are dropped and
        ``max_batch`` is always added, so every batch has a bucket.
      use_cuda_graphs: capture the decode step per bucket; default: the model is on CUDA.
      pad_to_buckets: pad decode batches to the bucket sizes; default: ``use_cuda_graphs`` (on the CPU
        this runs the graph path's padding eagerly, which is what the CPU tests use).
      batch_prefill: prefill equal-length prompts together (else one request per call).
      use_cuda_graphs, pad_to_buckets, pad_prefill: None (the default described) or a bool; batch_prefill
        a bool (a string such as "no" is refused rather than read as True).
      pad_prefill: pad prompts to :func:`prefill_length` and, with CUDA graphs, replay a captured prefill
        per (rows, padded length); default: ``use_cuda_graphs`` (the CPU tests turn it on to run the padded
        path eagerly). Needs a model forward with ``kv_len`` and ``last_index`` (MultiLoRAModel).
      warmup_steps: eager forwards on a side stream before each capture.

    Raises ValueError naming the argument, before building any state: invalid arguments, or a model
    whose ``max_tokens`` is below its ``max_batch`` (a decode step of max_batch requests must fit one
    forward).

    ``captures``: the number of CUDA graphs captured so far (lazily in :meth:`generate` or in
    :meth:`warmup`; one per bucket and LoRA variant); a call that finds every graph it needs leaves it
    unchanged.
    """

    def __init__(
        self,
        model,
        *,
        graph_batch_sizes: Sequence[int] = DEFAULT_GRAPH_BATCH_SIZES,
        use_cuda_graphs: bool | None = None,
        pad_to_buckets: bool | None = None,
        batch_prefill: bool = True,
        pad_prefill: bool | None = None,
        warmup_steps: int = 2,
    ):
        self.model = model
        self.limits = _model_limits(model)
        mt, mb = self.limits.max_tokens, self.limits.max_batch
        if mt < mb:
            raise ValueError(
                f"model: max_tokens = {mt} < max_batch = {mb}; max_tokens must be >= max_batch, so that one "
                f"decode step of max_batch requests (one token each) fits one forward"
            )
        for name, flag in (
            ("use_cuda_graphs", use_cuda_graphs),
            ("pad_to_buckets", pad_to_buckets),
            ("pad_prefill", pad_prefill),
        ):
            if flag is not None and not isinstance(flag, bool):
                raise ValueError(f"{name}: expected None (the default), True or False, got {flag!r}")
        if not isinstance(batch_prefill, bool):
            raise ValueError(f"batch_prefill: expected True or False, got {batch_prefill!r}")
        self.device = _model_device(model)
        if use_cuda_graphs is None:
            use_cuda_graphs = self.device.type == "cuda"
        if use_cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"use_cuda_graphs: the model is on {self.device}, CUDA graphs need a CUDA model")
        self.use_cuda_graphs = use_cuda_graphs
        self.pad_to_buckets = self.use_cuda_graphs if pad_to_buckets is None else pad_to_buckets
        if not isinstance(graph_batch_sizes, (list, tuple, range)) or not all(
            is_int(b) and b >= 1 for b in graph_batch_sizes
        ):
            raise ValueError(f"graph_batch_sizes: expected positive ints (a list), got {graph_batch_sizes!r}")
        mb = self.limits.max_batch
        self.graph_batch_sizes = tuple(sorted({int(b) for b in graph_batch_sizes if b <= mb} | {mb}))
        self.batch_prefill = batch_prefill
        if not (is_int(warmup_steps) and warmup_steps >= 1):
            raise ValueError(f"warmup_steps: expected an int >= 1, got {warmup_steps!r}")
        self.warmup_steps = int(warmup_steps)
        try:  # MultiLoRAModel's optional host-side bound on the attended cache positions
            params = inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            params = {}
        self._has_kv_len = "kv_len" in params
        can_pad = self._has_kv_len and "last_index" in params
        if pad_prefill and not can_pad:
            raise ValueError(
                "pad_prefill: the model's forward must take kv_len and last_index (MultiLoRAModel)"
            )
        self.pad_prefill = (self.use_cuda_graphs and can_pad) if pad_prefill is None else bool(pad_prefill)
        # LoRA variants: a model that can restrict its forward to the step's adapter slots and says which
        # launches a set of slots gets (MultiLoRAModel); others have one variant (None)
        self._has_variants = callable(getattr(model, "restrict_slots", None)) and callable(
            getattr(model, "lora_launches", None)
        )
        self._buckets: dict[int, _DecodeBucket] = {}
        self._prefill_buckets: dict[tuple[int, int], _PrefillBucket] = {}
        self._pool = None
        self._side_stream = None
        self._graph_adapter_state: tuple | None = None
        self._running = False
        # Per cache row: some logits of the request owning it were not finite during the running call
        # (zeroed at each call's start; the decode graphs capture its address, so it is never replaced)
        self._non_finite = torch.zeros(mb, dtype=torch.bool, device=self.device)
        self._row_ids = torch.arange(mb, dtype=torch.int64, device=self.device)
        # The model's forward while a generate call runs: the callable of ``model.exclusive_forwards()``
        # (MultiLoRAModel; direct forwards then raise), else the model itself.
        self._forward = model
        #: CUDA graphs captured by this generator so far (decode and prefill, lazily or in warmup).
        self.captures = 0

    # -- decode step ---------------------------------------------------------------------------------

    def _variant_of(self, slots: frozenset[int]):
        """The LoRA variant of a forward whose requests use adapter ``slots``: the model's
        ``lora_launches(slots)`` (per LoRA module and projection, whether its LoRA launches run), the key
        of the forward's CUDA graphs; None for a model without ``restrict_slots`` / ``lora_launches`` (one
        variant). Equal variants mean the same launches, so their forwards share a graph."""
        return self.model.lora_launches(slots) if self._has_variants else None

    def _restricted(self, slots: frozenset[int]):
        """A context in which the model's forward serves only ``slots`` (``model.restrict_slots``): the
        LoRA launches of projections none of them covers are skipped."""
        return self.model.restrict_slots(slots) if self._has_variants else contextlib.nullcontext()

    def _set_slots(self, bucket: _DecodeBucket | _PrefillBucket, slots) -> None:
        """Record the adapter slots (ints >= 0) of a bucket's real rows and their variant."""
        bucket.slots = frozenset(slots)
        bucket.variant = self._variant_of(bucket.slots)

    def _flag_non_finite(self, logits: torch.Tensor, owner: torch.Tensor) -> None:
        """Set the non-finite flag of the cache rows whose logits hold a NaN or an infinity: ``logits``
        [b, V], ``owner`` [b, max_batch] bool (row k's cache row one-hot; all False: not a request's row).
        On the device, no host sync, graph-capturable: one reduction over [b, V] (aminmax, which
        propagates NaN) and a few [b, max_batch] elementwise ops; no scatter, so it is deterministic and
        needs no distinct-index guarantee."""
        lo, hi = torch.aminmax(logits, dim=-1)
        bad = torch.isfinite(lo).logical_and_(torch.isfinite(hi)).logical_not_()
        self._non_finite.logical_or_(owner.logical_and(bad[:, None]).any(dim=0))

    def _forward_decode(self, bucket: _DecodeBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The step that a graph captures: model forward on the static buffers (restricted to the
        bucket's adapter slots) + greedy argmax + the active rows' non-finite flags."""
        with self._restricted(bucket.slots):
            logits = self._forward(
                bucket.input_ids,
                bucket.start_pos,
                bucket.lora_ids,
                cache_rows=bucket.cache_rows,
                last_only=True,
            )
        self._flag_non_finite(logits, bucket.owner)
        return logits, logits.argmax(dim=-1)

    def _capture_graph(self, fn: Callable[[], object], what: str):
        """Warm up ``fn`` on a side stream (lazy init, compilation, autotuning happen outside the
        capture), then capture one call: (graph, its outputs). ``fn`` writes K/V at the buffers' current
        (row, position): at warm-up time the buffers hold either dummies (spare rows, position 0) or a real
        call about to run, whose writes the replay repeats identically."""
        if self._side_stream is None:  # one side stream: its cached warm-up blocks are reused
            self._side_stream = torch.cuda.Stream(self.device)
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_steps):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                outputs = fn()
        except RuntimeError as e:
            raise RuntimeError(
                f"capturing {what} failed (something in the model's forward is not graph-capturable, e.g. a "
                f"host sync); Generator(use_cuda_graphs=False) runs it eagerly: {e}"
            ) from e
        self.captures += 1
        return graph, outputs

    def _capture(self, bucket: _DecodeBucket) -> None:
        """Capture the decode step of ``bucket`` for its current variant (:meth:`_capture_graph`)."""
        graph, (logits, greedy) = self._capture_graph(
            lambda: self._forward_decode(bucket), f"the decode step at batch size {bucket.size}"
        )
        bucket.graphs[bucket.variant] = (graph, logits, greedy)

    def _forward_prefill(self, pb: _PrefillBucket) -> torch.Tensor:
        """The prefill a graph captures: the padded prompts from position 0 (restricted to the bucket's
        adapter slots), last real token's logits."""
        with self._restricted(pb.slots):
            return self._forward(
                pb.input_ids,
                pb.start_pos,
                pb.lora_ids,
                cache_rows=pb.cache_rows,
                last_only=True,
                kv_len=pb.length,
                last_index=pb.last_index,
            )

    def _run_prefill_bucket(self, pb: _PrefillBucket) -> torch.Tensor:
        """The prefill of the bucket's buffers: a replay of its current variant's graph (captured on first
        use), or the eager forward without CUDA graphs."""
        if not self.use_cuda_graphs:
            return self._forward_prefill(pb)
        entry = pb.graphs.get(pb.variant)
        if entry is None:
            entry = pb.graphs[pb.variant] = self._capture_graph(
                lambda: self._forward_prefill(pb), f"the prefill of {pb.rows} x {pb.length} tokens"
            )
        graph, logits = entry
        graph.replay()
        return logits

    def _prefill_bucket(self, rows: int, length: int) -> _PrefillBucket:
        pb = self._prefill_buckets.get((rows, length))
        if pb is None:
            pb = self._prefill_buckets[rows, length] = _PrefillBucket(rows, length, self.device)
        return pb

    def _padded(self, length: int) -> int | None:
        """The static length a prompt of ``length`` is prefilled at, or None (eager, unpadded)."""
        if not self.pad_prefill:
            return None
        n = prefill_length(length, self.limits.max_seq)
        return n if n <= self.limits.max_tokens else None

    def _step(self, bucket: _DecodeBucket) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step on the bucket's buffers -> (logits [b, V] float32, greedy [b] int64): a replay
        of the graph of the bucket's current variant (captured on first use), or the eager forward."""
        if self.use_cuda_graphs:
            entry = bucket.graphs.get(bucket.variant)
            if entry is None:
                self._capture(bucket)
                entry = bucket.graphs[bucket.variant]
            graph, logits, greedy = entry
            graph.replay()
            return logits, greedy
        return self._forward_decode(bucket)

    def _bucket_size(self, n: int) -> int:
        """The decode batch size that ``n`` active requests run at (their bucket, or n unpadded)."""
        return next(b for b in self.graph_batch_sizes if b >= n) if self.pad_to_buckets else n

    def _bucket_for(self, n: int) -> _DecodeBucket:
        size = self._bucket_size(n)
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = _DecodeBucket(size, self.limits.max_batch, self.device)
        return bucket

    def warmup(
        self,
        batch_sizes: Sequence[int] | None = None,
        *,
        prefill_lengths: Sequence[int] | str = (),
        max_prompts: int | None = None,
    ) -> dict:
        """Capture, with CUDA graphs, every graph that a :meth:`generate` call can need for decode batch
        sizes ``batch_sizes`` and prompt lengths ``prefill_lengths``, so such a call captures nothing
        (:attr:`captures` stays put; the graphs stay valid until the loaded slots change, see the module
        docstring). Each bucket gets two LoRA variants: that of every loaded slot and that of no adapter
        (one when nothing is loaded). A batch whose adapters cover fewer projections than all the loaded
        ones together (e.g. only a q/v adapter while another covers every projection) has a variant of
        its own, captured on first use.

        Args:
          batch_sizes: decode batch sizes, ints in [1, max_batch] (default: every bucket of
            ``graph_batch_sizes``); each is captured at its bucket.
          prefill_lengths: prompt lengths, ints in [1, max_seq], or ``"all"`` (every padded length up to
            ``max_seq``, as a server does at start-up so that no request pays a capture). A length's
            prompts are prefilled at its :func:`prefill_length` n, up to ``max_tokens // n`` prompts per
            call (one with ``batch_prefill=False``), so a call with up to ``max_batch`` prompts of equal
            length runs calls of every row count 1 .. min(max_batch, max_tokens // n); all of them are
            captured. A length whose padded length exceeds ``max_tokens`` (or every length without
            ``pad_prefill``) is prefilled eagerly, without a graph, and listed under ``"eager"``.
          max_prompts: the most prompts of one length a call will carry, an int in [1, max_batch]
            (default ``max_batch``): row counts above it are not captured (``max_prompts=1`` with
            ``prefill_lengths="all"``: one graph per padded length, a single-request server's start-up).

        Returns the plan, also without CUDA graphs (where nothing is captured)::

            {"decode": [bucket sizes, largest first],
             "prefill": {padded length: [row counts, ascending]},
             "eager": [prompt lengths prefilled eagerly, ascending],
             "variants": [adapter-slot sets (sorted tuples) whose variants each bucket gets, ascending:
                          (), and every loaded slot when that differs; [None] for a model without
                          variants (no ``restrict_slots`` / ``lora_launches``)],
             "captured": graphs captured by this call (0 without CUDA graphs, or when all exist)}

        Captures run largest first (the LoRA variant before the base one) so the smaller graphs reuse
        the shared memory pool. Writes dummy K/V into cache rows 0..b-1 (a request's prefill overwrites
        what its decode reads).

        Raises ValueError naming the argument for invalid input; RuntimeError while a generate call on
        the same model is running (e.g. from its ``stream`` callback: its cache rows and graphs are in
        use).
        """
        self._check_model_idle("warmup")
        sizes = self.graph_batch_sizes if batch_sizes is None else batch_sizes
        if not isinstance(sizes, (list, tuple, range)):
            raise ValueError(f"batch_sizes: expected None or a list of ints, got {sizes!r}")
        if not all(is_int(n) and 1 <= n <= self.limits.max_batch for n in sizes):
            raise ValueError(
                f"batch_sizes: expected ints in [1, max_batch={self.limits.max_batch}], got {sizes}"
            )
        ms = self.limits.max_seq
        if isinstance(prefill_lengths, str):
            if prefill_lengths != "all":
                raise ValueError(
                    f"prefill_lengths: expected 'all' or a list of ints, got {prefill_lengths!r}"
                )
            prefill_lengths = sorted({prefill_length(n, ms) for n in range(1, ms + 1)})
        if not isinstance(prefill_lengths, (list, tuple, range)):
            raise ValueError(f"prefill_lengths: expected 'all' or a list of ints, got {prefill_lengths!r}")
        if not all(is_int(n) and 1 <= n <= ms for n in prefill_lengths):
            raise ValueError(f"prefill_lengths: expected ints in [1, max_seq={ms}], got {prefill_lengths}")
        mb = self.limits.max_batch
        if max_prompts is None:
            max_prompts = mb
        if not is_int(max_prompts) or not 1 <= max_prompts <= mb:
            raise ValueError(
                f"max_prompts: expected None or an int in [1, max_batch={mb}], got {max_prompts!r}"
            )
        decode = sorted({self._bucket_size(int(n)) for n in sizes}, reverse=True)
        prefill: dict[int, set[int]] = {}
        eager: set[int] = set()
        for length in {int(n) for n in prefill_lengths}:
            n = self._padded(length)
            if n is None:
                eager.add(length)
            else:
                top = min(int(max_prompts), self._rows_per_call(length))
                prefill.setdefault(n, set()).update(range(1, top + 1))
        state = self._sync_graphs_with_adapters()
        variants = self._warmup_variants(state)
        plan = {
            "decode": decode,
            "prefill": {n: sorted(rows) for n, rows in sorted(prefill.items())},
            "eager": sorted(eager),
            "variants": sorted(tuple(sorted(s)) for s in variants) if self._has_variants else [None],
            "captured": 0,
        }
        if not self.use_cuda_graphs:
            return plan
        before = self.captures
        with torch.no_grad():
            pairs = [(r, n) for n, rs in prefill.items() for r in rs]
            for rows, n in sorted(pairs, key=lambda rn: (-rn[0] * rn[1], -rn[1])):
                pb = self._prefill_bucket(rows, n)
                for slots in variants:
                    self._set_slots(pb, slots)
                    if pb.variant not in pb.graphs:
                        pb.input_ids.zero_()
                        pb.lora_ids.fill_(-1)
                        pb.cache_rows.copy_(torch.arange(rows, device=self.device))
                        pb.last_index.fill_(n - 1)
                        self._run_prefill_bucket(pb)
            for size in decode:
                bucket = self._bucket_for(size)
                for slots in variants:
                    self._set_slots(bucket, slots)
                    if bucket.variant not in bucket.graphs:
                        bucket.input_ids.zero_()
                        bucket.start_pos.zero_()
                        bucket.lora_ids.fill_(-1)
                        bucket.cache_rows.copy_(torch.arange(bucket.size, device=self.device))
                        bucket.owner.zero_()  # dummy rows: no request's flag
                        self._capture(bucket)
            _Clock(self.device).sync()
        plan["captured"] = self.captures - before
        return plan

    def _warmup_variants(self, state: tuple | None) -> list[frozenset[int]]:
        """The adapter-slot sets whose variants warmup captures, the one with LoRA launches first: every
        loaded slot (the launches of any batch's slots, when the adapters cover the same projections) and
        none (a batch without adapters: no LoRA launch); one set when both have the same variant (nothing
        loaded) or the model has no variants."""
        if not self._has_variants:
            return [frozenset()]
        loaded = frozenset(slot for _, items in (state or ()) for slot, _ in items)
        if self._variant_of(loaded) == self._variant_of(frozenset()):
            return [frozenset()]
        return [loaded, frozenset()]

    def reset_graphs(self) -> None:
        """Drop every captured graph (after the model reallocated weights, adapters or cache) and, on a
        GPU, release the cached memory they held (``torch.cuda.empty_cache``); the next call captures
        again.

        Raises RuntimeError while this generator's :meth:`generate` is running (e.g. from its ``stream``
        callback: the graphs and their buffers are in use)."""
        if self._running:
            raise RuntimeError(
                "reset_graphs: this generator's generate call is running (called from its stream callback?) "
                "and replays these graphs; reset them after it returns"
            )
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        cuda = self.device.type == "cuda"
        if cuda and (self._buckets or self._prefill_buckets):
            torch.cuda.synchronize(self.device)  # no replay still running on the memory released below
        self._buckets.clear()
        self._prefill_buckets.clear()
        self._pool = None
        self._graph_adapter_state = None
        if cuda:
            torch.cuda.empty_cache()

    def _check_model_idle(self, action: str) -> None:
        """RuntimeError if a generate call on this generator's model is running (re-entry from its
        stream callback): its cache rows, graphs and static buffers are in use."""
        if id(self.model) in _RUNNING_MODELS:
            raise RuntimeError(
                f"{action}: a generate call on this model is running (called from its stream callback?); "
                f"its KV cache rows, CUDA graphs and static input buffers are in use: call {action} after "
                "it returns"
            )

    @contextlib.contextmanager
    def _running_call(self, lora: list[int]):
        """The body of a generate call: the model (and this generator) marked running, the requests'
        adapter slots held (``model.hold_slots``, where the model has it), and the model's forwards
        reserved to this call (``model.exclusive_forwards``, where the model has it: this generator's
        forwards go through the callable it yields, and any other forward, e.g. from the ``stream``
        callback, raises RuntimeError instead of overwriting the call's KV cache rows), until it exits.
        Graph replays run no Python forward, so the reservation costs one host-side check per eager
        forward and nothing per replay."""
        hold = getattr(self.model, "hold_slots", None)
        exclusive = getattr(self.model, "exclusive_forwards", None)
        slots = sorted({a for a in lora if a >= 0})
        key = id(self.model)
        _RUNNING_MODELS.add(key)
        self._running = True
        try:
            with contextlib.ExitStack() as stack:
                if callable(hold):
                    stack.enter_context(hold(slots))
                if callable(exclusive):
                    self._forward = stack.enter_context(exclusive())
                yield
        finally:
            self._forward = self.model
            _RUNNING_MODELS.discard(key)
            self._running = False

    def _adapter_state(self) -> tuple | None:
        """((module name, ((slot, coverage), ...)), ...): the LoRA modules' loaded slots (what a
        captured graph depends on), host-side; None for a model without ``lora_modules()``."""
        modules = getattr(self.model, "lora_modules", None)
        if modules is None:
            return None
        state = []
        for name, m in modules().items():
            slots = m.loaded_slots  # LoRALinear: [slot]; MoELoRALayer: {slot: (covers gate_up, down)}
            items = slots.items() if isinstance(slots, dict) else ((slot, True) for slot in slots)
            state.append((name, tuple(sorted(items))))
        return tuple(state)

    def _sync_graphs_with_adapters(self) -> tuple | None:
        """Drop the graphs if the loaded slots changed since they were captured; returns the state."""
        state = self._adapter_state()
        if self.use_cuda_graphs and state != self._graph_adapter_state:
            self._drop_graphs()
            self._graph_adapter_state = state
        return state

    def _load_bucket(
        self, active: list[int], col: int, out: torch.Tensor, prompt_lens: list[int], lora: list[int]
    ) -> tuple[_DecodeBucket, torch.Tensor]:
        """Pack the active requests (their token at column ``col`` of ``out``) into a bucket's buffers,
        pad it with dummy rows on spare cache rows, and set its slots (the requests' adapters) and variant.
        Returns (bucket, request index [B] on device)."""
        n = len(active)
        bucket = self._bucket_for(n)
        taken = set(active)
        spare = [r for r in range(self.limits.max_batch) if r not in taken][: bucket.size - n]
        dev = self.device
        idx = torch.tensor(active, dtype=torch.int64, device=dev)
        bucket.input_ids[:n, 0] = out[idx, col]
        bucket.input_ids[n:] = 0
        pos = [prompt_lens[i] + col for i in active] + [0] * len(spare)
        bucket.start_pos.copy_(torch.tensor(pos, dtype=torch.int64))
        bucket.lora_ids.copy_(torch.tensor([lora[i] for i in active] + [-1] * len(spare), dtype=torch.int32))
        bucket.cache_rows.copy_(torch.tensor(active + spare, dtype=torch.int64))
        owner = torch.zeros(bucket.size, self.limits.max_batch, dtype=torch.bool)
        owner[torch.arange(n), torch.tensor(active, dtype=torch.int64)] = True
        bucket.owner.copy_(owner)
        self._set_slots(bucket, (lora[i] for i in active if lora[i] >= 0))
        return bucket, idx

    # -- validation ----------------------------------------------------------------------------------

    def _validate(
        self, prompts, adapters, max_new_tokens, temperature, top_k, top_p, seed, eos, interval, stream, state
    ):
        lim = self.limits
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            hint = ""
            if isinstance(prompts, (torch.Tensor, np.ndarray)) and prompts.ndim == 1:
                hint = " (one prompt as a 1-D tensor/array: wrap it in a list, [prompt])"
            raise ValueError(
                f"prompts: expected a non-empty list of token-id lists, got {type(prompts).__name__}{hint}"
            )
        if all(is_int(p) for p in prompts):
            raise ValueError(
                f"prompts: expected a list of prompts (token-id lists or 1-D integer tensors), got a flat "
                f"list of {len(prompts)} ints; wrap it in a list for one prompt: [prompt]"
            )
        if len(prompts) > lim.max_batch:
            raise ValueError(f"prompts: {len(prompts)} requests exceed the model's max_batch={lim.max_batch}")
        if not isinstance(adapters, (list, tuple)) or len(adapters) != len(prompts):
            n = len(adapters) if isinstance(adapters, (list, tuple)) else type(adapters).__name__
            raise ValueError(
                f"adapters: expected one slot (or None) per prompt, {len(prompts)} in all, got {n}"
            )
        if not (is_int(max_new_tokens) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        ids: list[list[int]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, (torch.Tensor, np.ndarray)):
                if isinstance(p, np.ndarray):
                    bad = p.dtype.kind not in "iu"
                else:
                    bad = p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool
                if p.ndim != 1 or bad:
                    raise ValueError(
                        f"prompts[{i}]: expected a 1-D integer tensor/array, got {p.dtype} {tuple(p.shape)}"
                    )
                if isinstance(p, torch.Tensor) and p.device.type == "meta":
                    raise ValueError(f"prompts[{i}]: a meta tensor holds no token ids")
                p = p.tolist()
            if not isinstance(p, (list, tuple)) or not all(is_int(t) for t in p):
                got = type(p).__name__
                if isinstance(p, (list, tuple)):
                    got = next(f"{type(t).__name__} {t!r}" for t in p if not is_int(t))
                raise ValueError(
                    f"prompts[{i}]: expected a list of int token ids (or a 1-D integer tensor), got {got}"
                )
            if len(p) == 0:
                raise ValueError(f"prompts[{i}]: empty prompt (at least one token is needed)")
            for j, t in enumerate(p):
                if not 0 <= t < lim.vocab_size:
                    raise ValueError(
                        f"prompts[{i}][{j}] = {t} is out of range [0, vocab_size={lim.vocab_size})"
                    )
            if len(p) + max_new_tokens > lim.max_seq:
                raise ValueError(
                    f"prompts[{i}]: prompt length {len(p)} + max_new_tokens {max_new_tokens} exceeds the "
                    f"model's max_seq={lim.max_seq}"
                )
            ids.append([int(t) for t in p])
        lora: list[int] = []
        for i, a in enumerate(adapters):
            if a is None:
                a = -1
            if not is_int(a) or not -1 <= a < lim.num_adapters:
                raise ValueError(
                    f"adapters[{i}] = {a!r}: expected None, -1 or a slot in [0, {lim.num_adapters})"
                )
            lora.append(int(a))
        if state is not None:
            loaded = {slot for _, items in state for slot, _ in items}
            for i, a in enumerate(lora):
                if a >= 0 and a not in loaded:
                    raise ValueError(
                        f"adapters[{i}] = {a}: slot {a} holds no adapter (loaded: {sorted(loaded)}); "
                        f"pass None for the base model"
                    )
        if not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature: expected a finite number >= 0, got {temperature!r}")
        if top_k is not None and not (is_int(top_k) and top_k >= 1):
            raise ValueError(f"top_k: expected None or an int >= 1, got {top_k!r}")
        if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
            raise ValueError(f"top_p: expected None or a number in (0, 1], got {top_p!r}")
        if seed is not None:
            _check_seed(seed, len(prompts))
        if stream is not None:
            _check_stream(stream)
        _eos_ids(eos, lim.vocab_size)
        if not (is_int(interval) and interval >= 1):
            raise ValueError(f"eos_check_interval: expected an int >= 1, got {interval!r}")
        return ids, lora

    # -- prefill -------------------------------------------------------------------------------------

    def _prefill_groups(self, ids: list[list[int]]) -> list[list[int]]:
        """Request indices per prefill call group: equal lengths together (first-appearance order),
        at most max(1, max_tokens // length) rows per group."""
        if not self.batch_prefill:
            return [[i] for i in range(len(ids))]
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(ids):
            by_len.setdefault(len(p), []).append(i)
        groups = []
        for length, members in by_len.items():
            rows = self._rows_per_call(length)
            groups += [members[k : k + rows] for k in range(0, len(members), rows)]
        return groups

    def _rows_per_call(self, length: int) -> int:
        """At most this many prompts of ``length`` tokens share a prefill call: max(1, max_tokens //
        (padded) length), 1 without ``batch_prefill``."""
        if not self.batch_prefill:
            return 1
        return max(1, self.limits.max_tokens // (self._padded(length) or length))

    def _prefill(self, group: list[int], ids: list[list[int]], lora: list[int]) -> torch.Tensor:
        """Write the group's prompts into their cache rows; returns the last logits [G, V]. Columns go
        in chunks of max_tokens // G (a prompt longer than max_tokens is chunked). The forward serves
        only the group's adapter slots (its LoRA variant)."""
        dev = self.device
        g, length = len(group), len(ids[group[0]])
        tokens = torch.tensor([ids[i] for i in group], dtype=torch.int64, device=dev)
        rows = torch.tensor(group, dtype=torch.int64, device=dev)
        lora_ids = torch.tensor([lora[i] for i in group], dtype=torch.int32, device=dev)
        slots = frozenset(lora[i] for i in group if lora[i] >= 0)
        n = self._padded(length)
        if n is not None and g * n <= self.limits.max_tokens:  # padded: one (captured) call
            pb = self._prefill_bucket(g, n)
            pb.input_ids[:, :length] = tokens
            pb.input_ids[:, length:] = 0
            pb.lora_ids.copy_(lora_ids)
            pb.cache_rows.copy_(rows)
            pb.last_index.fill_(length - 1)
            self._set_slots(pb, slots)
            return self._run_prefill_bucket(pb)
        cols = max(1, self.limits.max_tokens // g)
        logits = None
        with self._restricted(slots):
            for c0 in range(0, length, cols):
                chunk = tokens[:, c0 : c0 + cols]
                start = torch.full((g,), c0, dtype=torch.int64, device=dev)
                kw = {"kv_len": c0 + chunk.shape[1]} if self._has_kv_len else {}
                logits = self._forward(chunk, start, lora_ids, cache_rows=rows, last_only=True, **kw)
        return logits

    # -- generate ------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        adapters: Sequence[int | None],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | Sequence[int] | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        eos_check_interval: int = 1,
        progress: bool = False,
        stream: Callable[[int, int], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens for each prompt with its adapter slot.

        Args:
          prompts: N token-id lists (or 1-D integer tensors / numpy arrays), N <= model.max_batch, each
            non-empty, ids in [0, V), len + max_new_tokens <= model.max_seq. Request i uses cache row i.
          adapters: N slots, each None or -1 (base) or in [0, L) holding an adapter (see the module
            docstring).
          max_new_tokens: >= 1; a request stops earlier when it samples an ``eos_token_id`` (kept).
          temperature: 0 = greedy (argmax); a finite number > 0 samples (with ``top_k`` / ``top_p``, see
            :func:`sample_tokens`; a tiny temperature tends to greedy).
          seed: the sampling noise of request i at output position p is a pure function of its key
            (:func:`request_keys`) and p, so its tokens depend only on its seed, prompt and adapter, never
            on the other requests, ``eos_check_interval`` or ``batch_prefill``. An int s: request i keyed
            by (s, i); a list of N ints: request i keyed by seed[i] alone (the same tokens alone or
            batched); None: an int drawn from torch's global CPU RNG once per call (so
            ``torch.manual_seed`` makes it repeatable). Ints in [-2^63, 2^64).
          eos_token_id: None, a token id, or a non-empty list of them: a request stops at the first token
            that is any of them (GPT-OSS and Qwen3 list several in generation_config.json:
            ``transformers.GenerationConfig.from_pretrained(folder).eos_token_id``).
          eos_check_interval: decode steps between host checks for eos (see the module docstring).
          progress: True for a text progress bar over decode steps (stdout); a bool.
          stream: called as stream(request_index, token) for every token, in order (syncs per step); it
            must accept those two positional arguments (checked before any work, from its signature
            where Python can read it). It must not run a forward of the model (MultiLoRAModel raises
            RuntimeError there): the call's requests use the KV cache rows a forward writes.

        Slots: the call holds its requests' adapter slots until it returns (``model.hold_slots`` where
        the model has it, as MultiLoRAModel does), so loading or unloading one of them meanwhile (e.g.
        from ``stream``) raises RuntimeError there and changes nothing: a request never mixes two
        adapters. The other slots stay free to load and unload; the change reaches this generator's
        graphs at its next call.

        Non-finite logits: when some logits of a request hold a NaN or an infinity (e.g. an fp16
        adapter whose update overflows), its ``GenerationResult.non_finite`` entry is True and a
        RuntimeWarning names it; the call still returns every request's tokens (the flagged ones are
        meaningless, the others unaffected). The flags are computed on the device in each step and read
        with the final sync, so they add no host sync.

        Raises ValueError naming the argument for invalid input (before any work); RuntimeError when
        called while a generate call on the same model is running (e.g. from its ``stream`` callback:
        the KV cache rows, graphs and static buffers are in use).
        """
        self._check_model_idle("generate")
        if not isinstance(progress, bool):
            raise ValueError(f"progress: expected True or False, got {progress!r}")
        t_call = time.perf_counter()
        state = self._sync_graphs_with_adapters()
        # the options both _validate and _generate take, in their order
        opts = (max_new_tokens, temperature, top_k, top_p, seed, eos_token_id, eos_check_interval)
        ids, lora = self._validate(prompts, adapters, *opts, stream, state)
        with self._running_call(lora):
            res = self._generate(t_call, ids, lora, *opts, progress, stream)
        bad = [i for i, f in enumerate(res.non_finite) if f]
        if bad:
            warnings.warn(
                f"generate: the logits of request(s) {bad} held NaN or inf (e.g. an fp16 overflow in the "
                "model or its adapter), so their tokens are meaningless; GenerationResult.non_finite flags "
                "them, the other requests are unaffected",
                RuntimeWarning,
                stacklevel=3,  # the caller of generate (torch.no_grad's wrapper in between)
            )
        return res

    def _generate(
        self,
        t_call: float,
        ids: list[list[int]],
        lora: list[int],
        max_new_tokens: int,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        seed: int | Sequence[int] | None,
        eos_token_id: int | Sequence[int] | None,
        eos_check_interval: int,
        progress: bool,
        stream: Callable[[int, int], None] | None,
    ) -> GenerationResult:
        """The body of :meth:`generate` on validated input (token-id lists, slot ints)."""
        n_req, dev = len(ids), self.device
        eos_ids = _eos_ids(eos_token_id, self.limits.vocab_size)
        eos_set = set(eos_ids)
        eos_t = torch.tensor(eos_ids, dtype=torch.int64, device=dev) if eos_ids else None
        keys = None
        if temperature > 0:
            if seed is None:  # host-side draw: no device sync
                seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64))
            keys = request_keys(seed, n_req, dev)

        def pick(logits: torch.Tensor, rows: torch.Tensor, position: int) -> torch.Tensor:
            """Tokens of requests ``rows`` ([n] int64 on the device) at output position ``position``."""
            return sample_tokens(logits, float(temperature), top_k, top_p, keys=keys[rows], position=position)

        clock = _Clock(dev)
        out = torch.full((n_req, max_new_tokens), -1, dtype=torch.int64, device=dev)
        ttft = [0.0] * n_req
        done = [False] * n_req  # host view: finished (eos seen by the host)

        self._non_finite.zero_()

        # 1. prefill, one group at a time; sync after each for TTFT
        for group in self._prefill_groups(ids):
            rows = torch.tensor(group, dtype=torch.int64, device=dev)
            logits = self._prefill(group, ids, lora)
            self._flag_non_finite(logits, rows[:, None] == self._row_ids[None, :])
            first = logits.argmax(dim=-1) if temperature == 0 else pick(logits, rows, 0)
            out[rows, 0] = first
            clock.sync()
            t = time.perf_counter() - t_call
            if eos_ids or stream is not None:
                for i, tok in zip(group, first.tolist()):
                    ttft[i] = t
                    if stream is not None:
                        stream(i, tok)
                    done[i] = tok in eos_set
            else:
                for i in group:
                    ttft[i] = t
        t_dec0 = clock.start()
        prefill_s = t_dec0 - t_call

        # 2. decode: `col` is the column of `out` holding every active request's last token
        marks, batch_sizes, step_slots = [], [], []
        bar = None
        if progress and max_new_tokens > 1:
            try:  # tqdm is an extra (notebooks); without it there is no bar
                from tqdm.std import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                bar = tqdm(
                    total=max_new_tokens - 1, desc="decode", file=sys.stdout, ascii=True, mininterval=2.0
                )
        interval = 1 if stream is not None else eos_check_interval
        col = 0
        active = [i for i in range(n_req) if not done[i]]
        while active and col < max_new_tokens - 1:
            bucket, idx = self._load_bucket(active, col, out, [len(p) for p in ids], lora)
            n, slots = len(active), tuple(sorted(bucket.slots))
            hit = torch.zeros(n, dtype=torch.bool, device=dev) if eos_ids else None
            while col < max_new_tokens - 1:
                logits, greedy = self._step(bucket)
                nxt = greedy[:n] if temperature == 0 else pick(logits[:n], idx, col + 1)
                col += 1
                out[idx, col] = nxt
                bucket.input_ids[:n, 0] = nxt
                bucket.start_pos[:n] += 1
                marks.append(clock.mark())
                batch_sizes.append((n, bucket.size))
                step_slots.append(slots)
                if bar is not None:
                    bar.update(1)
                if stream is not None:
                    for i, tok in zip(active, nxt.tolist()):
                        stream(i, tok)
                if hit is not None:
                    hit |= (nxt[:, None] == eos_t).any(dim=-1)
                    if col % interval == 0:
                        flags = hit.tolist()
                        if any(flags):
                            active = [i for i, f in zip(active, flags) if not f]
                            break  # re-pack the rest into a (smaller) bucket
        if bar is not None:
            bar.close()

        # 3. results: one sync, then host-side bookkeeping
        clock.sync()
        both = torch.cat([out, self._non_finite[:n_req, None].to(out.dtype)], dim=1).tolist()  # one copy
        out_host = [row[:-1] for row in both]
        non_finite = [bool(row[-1]) for row in both]
        t_end = time.perf_counter()
        step_end = [clock.seconds(m) for m in marks]
        tokens, finished, req_dec, req_otps = [], [], [], []
        for i in range(n_req):
            row = out_host[i]
            n_tok = next((j + 1 for j, t in enumerate(row) if t in eos_set), max_new_tokens)
            toks = row[:n_tok]
            assert -1 not in toks, "internal error: a request stopped before its last token"
            tokens.append(toks)
            finished.append(toks[-1] in eos_set)
            t_last = ttft[i] if n_tok == 1 else step_end[n_tok - 2] - t_call
            req_dec.append(t_last - ttft[i])
            req_otps.append((n_tok - 1) / req_dec[-1] if n_tok > 1 and req_dec[-1] > 0 else float("nan"))
        decode_s = (step_end[-1] if step_end else t_dec0) - t_dec0
        step_s = [b - a for a, b in zip([t_dec0] + step_end[:-1], step_end)]
        total_s = t_end - t_call
        n_out = sum(len(t) for t in tokens)
        return GenerationResult(
            tokens=tokens,
            finished_eos=finished,
            ttft_s=ttft,
            request_decode_s=req_dec,
            request_otps=req_otps,
            prefill_s=prefill_s,
            decode_s=decode_s,
            total_s=total_s,
            output_tokens=n_out,
            aggregate_otps=n_out / total_s,
            decode_otps=(n_out - n_req) / decode_s if decode_s > 0 else float("nan"),
            step_s=step_s,
            decode_batch_sizes=batch_sizes,
            decode_slots=step_slots,
            non_finite=non_finite,
        )

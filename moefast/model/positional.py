"""Positional tables: rotary embeddings (RoPE) and sinusoidal absolute encodings.

Dimension letters: B batch, T tokens, S table length (``max_seq_len``), F = head_dim / 2
frequencies, D d_model.

Cached path (``cache.tables=True``, the default): each table is computed once per
(kind, width, base, dtype) with NumPy, the phase ``position * frequency`` in float64, and kept in
:data:`TABLES`, a byte-budgeted LRU cache. Under ``jit`` the table is a NumPy constant, so it is
folded into the compiled program: no step computes a sine or cosine for positions. The model
gathers rows by position once per step and every layer uses them.

Uncached path (``cache.tables=False``, the baseline of ``moefast bench cache``): the phase, its sine
and cosine are computed inside the step in float32, by every layer that needs them.

Neither path ever computes a phase in bfloat16: at position 4095 a bf16 phase is off by up to
8 radians (bf16 keeps 8 significant bits), which scrambles the rotation.

Variants: YaRN frequency scaling (:class:`Yarn`, ``model.rope_type=yarn``) changes the frequencies
and scales cos/sin, still in one constant table; partial rotary (``model.partial_rotary_factor``)
is a table of the rotated width, :func:`apply_rope` passing the other features unchanged;
proportional RoPE (``model.global_rotary_fraction``) a table of the whole head whose later pairs
have frequency 0.
Checkpoints whose RoPE features are interleaved pairs (DeepSeek's ``rope_interleave``) are
converted once, at import, by permuting weight columns (:func:`rope_deinterleave_permutation`):
the runtime has one layout, rotate-half.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "TABLES",
    "TableCache",
    "Yarn",
    "apply_rope",
    "check_positions",
    "document_positions",
    "rope_cos_sin",
    "rope_deinterleave_permutation",
    "rope_table",
    "sinusoidal_encoding",
    "sinusoidal_table",
    "yarn_mscale",
]


class TableCache:
    """LRU cache of read-only NumPy tables whose rows depend only on the position.

    Entries are keyed by ``(kind, width, dtype, params)``; the length is the leading dimension.
    Because row ``p`` of a table does not depend on its length, a request for a length at most
    the cached one is served as a read-only prefix view of the cached table, and a request for a
    longer one replaces the shorter entry: the cache never holds two copies of the same rows.
    When the bytes held exceed ``budget_bytes``, least recently used entries are evicted; a
    table larger than the whole budget is returned without being kept.

    Args:
      budget_bytes: most bytes held at once.
    """

    def __init__(self, budget_bytes: int = 256 * 2**20):
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entries: collections.OrderedDict[tuple, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return sum(a.nbytes for a in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[tuple]:
        """Entry keys, least recently used first."""
        return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def get(self, kind: str, length: int, width: int, dtype, params: tuple,
            build: Callable[[int], np.ndarray]) -> np.ndarray:
        """The table ``build(length)`` of shape [length, ...], from the cache when possible.

        Args:
          kind: table family, e.g. ``"rope"``.
          length: rows wanted (positions ``0..length-1``).
          width: size of the feature dimension (part of the key).
          dtype: dtype of the returned table (part of the key).
          params: further hashable parameters the rows depend on (e.g. the RoPE base).
          build: computes the table for a given length; it must return ``length`` rows of dtype
            ``dtype``.

        Returns:
          A read-only array whose first dimension is ``length``.
        """
        if length < 1:
            raise ValueError(f"table length must be >= 1, got {length}")
        key = (kind, int(width), np.dtype(dtype).name, tuple(params))
        with self._lock:
            cached = self._entries.get(key)
            if cached is not None and cached.shape[0] >= length:
                self._entries.move_to_end(key)
                self.hits += 1
                return cached[:length]
            self.misses += 1
        table = np.ascontiguousarray(build(length))
        if table.shape[0] != length or table.dtype != np.dtype(dtype):
            raise AssertionError(f"table builder for {key} returned {table.shape} {table.dtype}")
        table.flags.writeable = False
        with self._lock:
            self._entries.pop(key, None)  # a shorter copy of the same rows
            if table.nbytes <= self.budget_bytes:
                self._entries[key] = table
                while sum(a.nbytes for a in self._entries.values()) > self.budget_bytes:
                    self._entries.popitem(last=False)
        return table


TABLES = TableCache()
"""The process-wide table cache used by the model."""


def _rope_inv_freq(head_dim: int, base: float, dtype=np.float64) -> np.ndarray:
    return (base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(dtype)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor ``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1
    (Peng et al. 2023, "YaRN", sec. 3.4: ``sqrt(1/t) = 0.1 ln(s) + 1``, here with DeepSeek's
    coefficient ``mscale``); a dimensionless multiplier."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
    Language Models", sec. 3.2 "NTK-by-parts" and 3.4), as Hugging Face's ``rope_type: yarn``
    computes it.

    Attributes:
      factor: s, the context extension (``rope_parameters.factor``), >= 1.
      original_max_position_embeddings: L, the pretraining context, in tokens.
      beta_fast, beta_slow: the ramp's bounds alpha/beta, in rotations over L (32 and 1).
      mscale, mscale_all_dim: DeepSeek's coefficients of :func:`yarn_mscale` (``None``/0: unset).
      truncate: the ramp's bounds rounded to whole pairs (floor and ceil; HF's ``truncate``, true
        by default); gpt-oss's config sets it false.
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_config(cls, model_cfg) -> "Yarn | None":
        """The scaling of a :class:`~moefast.config.ModelConfig` (``None`` unless ``rope_type`` is yarn)."""
        m = model_cfg
        if m.rope_type != "yarn":
            return None
        return cls(float(m.rope_factor), int(m.original_max_position_embeddings), float(m.beta_fast),
                   float(m.beta_slow), m.mscale, m.mscale_all_dim, bool(m.rope_truncate))

    @property
    def attention_factor(self) -> float:
        """The multiplier of cos and sin (so of every rotated query/key feature; the paper's
        sqrt(1/t), sec. 3.4): ``m(s, mscale) / m(s, mscale_all_dim)`` when both are set, else
        ``m(s, 1)`` (:func:`yarn_mscale`)."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_multiplier(self) -> float:
        """DeepSeek-V2/V3's multiplier of the MLA softmax scale: ``m(s, mscale_all_dim) ** 2`` when
        ``mscale_all_dim`` is set, else 1."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, dim: int, base: float) -> np.ndarray:
        """float64 [dim/2] frequencies: pair i keeps ``base**(-2i/dim)`` when its wavelength turns
        more than ``beta_fast`` times over L, is divided by s when it turns fewer than
        ``beta_slow`` times, and in between blends linearly in i (sec. 3.2, the ramp gamma)."""
        def pair_index(rotations):  # the i whose wavelength 2*pi*base**(2i/dim) turns `rotations` times over L
            return dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = pair_index(self.beta_fast), pair_index(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)  # 1: interpolate
        extrapolated = _rope_inv_freq(dim, base)
        return extrapolated / self.factor * ramp + extrapolated * (1.0 - ramp)

    def key(self) -> tuple:
        """Hashable parameters for :data:`TABLES`."""
        return ("yarn", self.factor, self.original_max_position_embeddings, self.beta_fast, self.beta_slow,
                self.mscale or 0.0, self.mscale_all_dim or 0.0, self.truncate)


def _pair_freq(head_dim: int, base: float, yarn: "Yarn | None", rotated: int | None) -> np.ndarray:
    """float64 [head_dim/2] frequencies: RoPE's or YaRN's, pairs from ``rotated`` on at 0."""
    inv_freq = _rope_inv_freq(head_dim, base) if yarn is None else yarn.inv_freq(head_dim, base)
    if rotated is not None:
        inv_freq = np.where(np.arange(head_dim // 2) < rotated, inv_freq, 0.0)
    return inv_freq


def rope_table(max_seq_len: int, head_dim: int, base: float, yarn: Yarn | None = None,
               rotated: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``position * base**(-2i/head_dim)`` (RoFormer eq. 15), from :data:`TABLES`.

    Args:
      max_seq_len: S, positions 0..S-1.
      head_dim: rotated width per head (even): the whole head, or the rotated part of it.
      base: wavelength base (10000 in RoFormer).
      yarn: YaRN scaling (:class:`Yarn`): its frequencies, and cos/sin times its
        ``attention_factor``; ``None``: plain RoPE.
      rotated: only pairs i < ``rotated`` turn, at the frequencies above; the others have
        frequency 0 (cos 1, sin 0: unchanged). Hugging Face's "proportional" RoPE (Gemma 4's
        full-attention layers, ``partial_rotary_factor`` of the pairs). ``None``: every pair.

    Returns:
      ``(cos, sin)``, each float32 [S, F]; the phase is computed in float64. Read-only views of one
      cached [S, 2, F] table.

    Raises:
      ValueError: ``head_dim`` is odd.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even for RoPE")

    def build(n: int) -> np.ndarray:
        phase = np.arange(n, dtype=np.float64)[:, None] * _pair_freq(head_dim, base, yarn, rotated)[None, :]
        table = np.stack([np.cos(phase), np.sin(phase)], axis=1)
        return (table if yarn is None else table * yarn.attention_factor).astype(np.float32)

    params = ((float(base),) if yarn is None else (float(base), *yarn.key())) + ((rotated,) if rotated is not None else ())
    table = TABLES.get("rope", max_seq_len, head_dim, np.float32, params, build)
    return table[:, 0], table[:, 1]


def rope_deinterleave_permutation(rope_dim: int) -> np.ndarray:
    """The permutation that takes RoPE features stored as interleaved pairs to moefast's
    rotate-half layout.

    Checkpoints with ``rope_interleave`` (DeepSeek-V2/V3, GLM-4.7-Flash) rotate features (2i, 2i+1)
    together by frequency i; moefast rotates (i, i + F). Reordering the output columns of the
    projections that produce rotated features (MLA's ``kv_a_proj_with_mqa`` rope columns and each
    head's rope columns of ``q_b_proj`` / ``q_proj``) by this permutation, once at import, makes
    :func:`apply_rope` compute exactly Hugging Face's de-interleaved rotation, and the same
    attention scores as the interleaved (complex) one of DeepSeek-V2.

    Args:
      rope_dim: R, the rotated features per head (even).

    Returns:
      int64 [R]: ``new[..., j] = interleaved[..., perm[j]]``, i.e. ``[0, 2, ..., R-2, 1, 3, ..., R-1]``.

    Raises:
      ValueError: ``rope_dim`` is odd or < 2.
    """
    if rope_dim < 2 or rope_dim % 2:
        raise ValueError(f"rope_dim={rope_dim} must be even and >= 2")
    return np.concatenate([np.arange(0, rope_dim, 2), np.arange(1, rope_dim, 2)])


def sinusoidal_table(max_seq_len: int, d_model: int, dtype=np.float32) -> np.ndarray:
    """Absolute sinusoidal encodings (Vaswani et al. 2017, sec. 3.5), from :data:`TABLES`:
    ``PE[p, 2i] = sin(p / 10000^(2i/D))``, ``PE[p, 2i+1] = cos(p / 10000^(2i/D))``.

    Returns:
      Read-only [S, D] table in ``dtype``; phases in float64, rounded once to ``dtype``.

    Raises:
      ValueError: ``d_model`` is odd.
    """
    if d_model % 2:
        raise ValueError(f"d_model={d_model} must be even for sinusoidal encodings")

    def build(n: int) -> np.ndarray:
        phase = np.arange(n, dtype=np.float64)[:, None] * _rope_inv_freq(d_model, 10000.0)[None, :]
        out = np.empty((n, d_model), np.float64)
        out[:, 0::2], out[:, 1::2] = np.sin(phase), np.cos(phase)
        return out.astype(dtype)

    return TABLES.get("sinusoidal", max_seq_len, d_model, dtype, (10000.0,), build)


def check_positions(positions, max_seq_len: int) -> None:
    """Raises ``ValueError`` when concrete positions fall outside ``[0, max_seq_len)``.

    JAX gathers clamp out-of-range indices silently; this check makes the mistake loud for eager
    calls. Under ``jit`` (traced positions) the encodings are NaN for such positions instead, so
    the loss becomes NaN rather than silently wrong.
    """
    if isinstance(positions, jax.core.Tracer):
        return
    p = np.asarray(positions)
    if p.size and (p.min() < 0 or p.max() >= max_seq_len):
        raise ValueError(f"positions must be in [0, model.max_seq_len={max_seq_len}), got range "
                         f"[{p.min()}, {p.max()}]; raise model.max_seq_len or shorten the sequence")


def document_positions(segment_ids_bt: jax.Array) -> jax.Array:
    """Each token's position inside its packed document: 0 where the segment id changes (and at
    t = 0), counting up until it changes again.

    Args:
      segment_ids_bt: [B, T] int segment ids, each document one run of equal ids (as
        :mod:`moefast.data.packing` numbers them; padding, id 0, is a run of its own).

    Returns:
      [B, T] int32 positions in [0, T).
    """
    b, t = segment_ids_bt.shape
    t_idx = jnp.arange(t, dtype=jnp.int32)[None, :]
    starts = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
    return t_idx - jax.lax.cummax(jnp.where(starts, t_idx, 0), axis=1)


def _gather_rows(table: np.ndarray, positions_bt: jax.Array) -> jax.Array:
    return jnp.take(table, positions_bt, axis=0, mode="fill", fill_value=jnp.nan)


def _phase_f32(positions_bt: jax.Array, width: int, base: float, max_seq_len: int) -> jax.Array:
    """[B, T, width/2] float32 phases computed in the step (uncached path); NaN out of range."""
    valid = (positions_bt >= 0) & (positions_bt < max_seq_len)
    inv_freq = jnp.exp(jnp.arange(0, width, 2, dtype=jnp.float32) * (-np.log(base) / width))
    phase = positions_bt.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
    return jnp.where(valid[..., None], phase, jnp.nan)


def rope_cos_sin(positions_bt: jax.Array, max_seq_len: int, head_dim: int, base: float, *,
                 cached: bool = True, yarn: Yarn | None = None, rotated: int | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin for each token's position, ready for :func:`apply_rope`.

    Args:
      positions_bt: [B, T] int positions in [0, max_seq_len).
      head_dim: the rotated width 2F (the whole head, or its rotated part).
      cached: gather from the constant :func:`rope_table` (True) or compute in the step (False).
      yarn: YaRN scaling (:class:`Yarn`) or ``None``.
      rotated: the pairs that turn (proportional RoPE, :func:`rope_table`); ``None``: all.

    Returns:
      ``(cos, sin)``, float32 [B, T, 1, F]; NaN rows for out-of-range positions.
    """
    if cached:
        cos, sin = rope_table(max_seq_len, head_dim, float(base), yarn, rotated)
        cos_btf, sin_btf = _gather_rows(cos, positions_bt), _gather_rows(sin, positions_bt)
    elif yarn is None and rotated is None:
        phase = _phase_f32(positions_bt, head_dim, float(base), max_seq_len)
        cos_btf, sin_btf = jnp.cos(phase), jnp.sin(phase)
    else:  # the frequencies are a constant; the phase, its cos and sin are computed in the step
        valid = (positions_bt >= 0) & (positions_bt < max_seq_len)
        inv_freq = jnp.asarray(_pair_freq(head_dim, float(base), yarn, rotated), jnp.float32)
        phase = jnp.where(valid[..., None], positions_bt.astype(jnp.float32)[..., None] * inv_freq[None, None, :], jnp.nan)
        factor = jnp.float32(1.0 if yarn is None else yarn.attention_factor)
        cos_btf, sin_btf = jnp.cos(phase) * factor, jnp.sin(phase) * factor
    return cos_btf[:, :, None, :], sin_btf[:, :, None, :]


def apply_rope(x_bthd: jax.Array, cos_bt1f: jax.Array, sin_bt1f: jax.Array) -> jax.Array:
    """Rotates query/key features by their positions (rotate-half layout: feature i and i + F
    form a pair).

    Args:
      x_bthd: [B, T, H, head_dim] queries or keys, any float dtype.
      cos_bt1f: float32 [B, T, 1, F] from :func:`rope_cos_sin`, 2F <= head_dim. With 2F <
        head_dim (partial rotary, Hugging Face's ``partial_rotary_factor``) the first 2F features
        rotate and the others pass unchanged.
      sin_bt1f: float32 [B, T, 1, F] from :func:`rope_cos_sin`, like ``cos_bt1f``.

    Returns:
      [B, T, H, head_dim] in ``x_bthd.dtype``; the rotation is computed in float32.
    """
    rot = 2 * cos_bt1f.shape[-1]
    if rot < x_bthd.shape[-1]:
        return jnp.concatenate([apply_rope(x_bthd[..., :rot], cos_bt1f, sin_bt1f), x_bthd[..., rot:]], axis=-1)
    x = x_bthd.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos_bt1f - x2 * sin_bt1f, x2 * cos_bt1f + x1 * sin_bt1f], axis=-1)
    return out.astype(x_bthd.dtype)


def sinusoidal_encoding(positions_bt: jax.Array, max_seq_len: int, d_model: int, dtype, *,
                        cached: bool = True) -> jax.Array:
    """[B, T, D] absolute encodings of the positions, in ``dtype``.

    Args:
      positions_bt: [B, T] int positions in [0, max_seq_len).
      cached: gather from the constant :func:`sinusoidal_table` (True) or compute in the step in
        float32 (False).
    """
    if cached:
        return _gather_rows(sinusoidal_table(max_seq_len, d_model, np.dtype(dtype)), positions_bt)
    phase = _phase_f32(positions_bt, d_model, 10000.0, max_seq_len)
    b, t, f = phase.shape
    return jnp.stack([jnp.sin(phase), jnp.cos(phase)], axis=-1).reshape(b, t, 2 * f).astype(dtype)

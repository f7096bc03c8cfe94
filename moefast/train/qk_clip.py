"""QK-clip (MuonClip; Kimi K2, arXiv 2507.20534, sec. 2.1, Algorithm 1): after an update, every
softmax-attention head whose largest pre-softmax logit of the step ``S_max_h`` exceeded tau has
the weights that make its queries and keys scaled down so that the same inputs would give a
largest logit of exactly tau.

Dimension letters: L_attn softmax-attention layers (:func:`moefast.model.layout.softmax_attention_layers`:
the main stack's, then the multi-token prediction blocks'), n layers of one parameter stack
(``model.scan_layers``), H query heads, G key/value heads, R = H / G query heads per key head,
Hd head width, N / R_rope / Hv MLA's no-RoPE, RoPE and value widths per head.

The per-head factor is ``gamma_h = min(1, tau / S_max_h)`` (paper, eq. 4 with its threshold).
A logit is bilinear in the query and key projections (RoPE and the biases are linear in them too),
so scaling head h's query columns by a and its key columns by b scales all of h's logits by a·b:

* **multi-head and grouped-query attention** (``qkv`` [D, (H + 2G)·Hd], q | k | v columns, head
  h = g·R + r reading key head g; its bias ``qkv_bias`` alike): the key head is shared by its R
  query heads, so it cannot take each one's ``sqrt(gamma_h)``. Key head g is scaled by
  ``s_g = sqrt(min_r gamma_{g,r})`` and query head h by ``gamma_h / s_g``: every head's logits
  scale by exactly ``gamma_h`` (the clipped ones end at tau, the others keep theirs: their queries
  make up for the shared key's shrinking), the group's most clipped head gets the paper's
  ``sqrt(gamma)`` on both sides, with R = 1 this is the paper's rule for every head, and a group
  with no clipped head keeps every weight bitwise (factors exactly 1). With ``attention_k_eq_v``
  (``qk`` [D, (H + G)·Hd]: the values are the keys' projection) scaling the keys would scale the
  values too, so only the queries move (``gamma_h`` each).
* **QK-norm** (``model.qk_norm``): an RMSNorm after the projection undoes any scaling of its
  columns, so the norm's scale moves instead (``zero_centered``: stored w applied as 1 + w, so
  ``w' = (1 + w)·f - 1``). ``"full"`` norms hold a scale per head feature ([H·Hd], [G·Hd]): the
  same per-head factors as the projection. ``"per_head"`` norms (Qwen3) hold one [Hd] scale that
  every head shares: the layer's logits can only scale together, by the smallest ``gamma`` of the
  layer (``sqrt`` on each side), so every head ends at or below tau but unclipped heads of a
  clipped layer shrink too.
* **MLA** (``q_b_proj`` [Q, H·(N+R_rope)] or ``q_proj``, ``kv_b_proj`` [C, H·(N+Hv)]): per head,
  the no-RoPE query and key columns (q^C, k^C) by ``sqrt(gamma_h)`` and the RoPE query columns
  (q^R) by ``gamma_h``; the RoPE key k^R (``kv_a_proj_with_mqa``) is shared by all heads and
  stays (paper, sec. 2.1, "MLA"); values untouched.
Gated DeltaNet layers have no softmax and no row. Parameters are the train state's pure dict
(:meth:`moefast.train.step.ModelDef.init_params`), unrolled (``blocks``) or scanned (``prefix``,
``groups``, ``tail`` stacks: :mod:`moefast.model.layout`), with the ``mtp`` modules' blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moefast.config import ExperimentConfig
from moefast.model.layout import layer_layout, softmax_attention_layers

__all__ = ["clip_factors", "gqa_factors", "qk_clip"]


def clip_factors(max_logits: jax.Array, tau: float | jax.Array) -> jax.Array:
    """``gamma = tau / S_max`` where ``S_max > tau``, else 1 (Kimi K2, arXiv 2507.20534, sec. 2.1).

    Args:
      max_logits: float32 [..., H] largest pre-softmax logits (−inf or NaN: 1, untouched).
      tau: the threshold, a logit (> 0).

    Returns:
      float32 [..., H] factors in (0, 1].
    """
    s, tau = jnp.asarray(max_logits, jnp.float32), jnp.asarray(tau, jnp.float32)
    return jnp.where(s > tau, tau / jnp.where(s > tau, s, 1.0), jnp.float32(1.0))


def gqa_factors(gamma_nh: jax.Array, num_kv_heads: int, *, move_keys: bool = True) -> tuple[jax.Array, jax.Array]:
    """Query and key head factors whose products are ``gamma`` (the module docstring's rule).

    Args:
      gamma_nh: float32 [n, H] per-head factors (:func:`clip_factors`), head h = g·R + r.
      num_kv_heads: G (dividing H).
      move_keys: ``False``: keys stay (factor 1) and queries take ``gamma`` (keys that are also
        the values: ``attention_k_eq_v``).

    Returns:
      ``(query factors [n, H], key factors [n, G])``: key head g by ``sqrt(min_r gamma_{g,r})``,
      query head h by ``gamma_h`` over its key head's factor; exactly 1 for a group without a
      clipped head.
    """
    n, h = gamma_nh.shape
    if not move_keys:
        return gamma_nh, jnp.ones((n, num_kv_heads), jnp.float32)
    gamma = gamma_nh.reshape(n, num_kv_heads, h // num_kv_heads)
    s_ng = jnp.sqrt(jnp.min(gamma, axis=-1))
    return (gamma / s_ng[..., None]).reshape(n, h), s_ng


@dataclasses.dataclass(frozen=True)
class _Site:
    """One attention module's parameters in the tree: ``path`` to its dict, the layers whose rows
    it holds (n of them: a stack's, in stack order) and whether its leaves carry the stack axis."""
    path: tuple
    layers: tuple[int, ...]
    stacked: bool


def _sites(cfg: ExperimentConfig, params: dict) -> list[_Site]:
    """The attention modules of ``params`` (either layout) whose layers have a softmax."""
    m = cfg.model
    if "blocks" in params:
        sites = [_Site(("blocks", i, "attn"), (i,), False) for i in sorted(params["blocks"])]
    else:
        layout = layer_layout(m)
        sites = [_Site(("prefix", "attn"), layout.prefix, True)] if "prefix" in params else []
        sites += [_Site(("groups", j, "attn"), ids, True) for j, ids in enumerate(layout.groups)
                  if j in params.get("groups", {})]
        sites += [_Site(("tail", j, "attn"), (i,), False) for j, i in enumerate(layout.tail)
                  if j in params.get("tail", {})]
    sites += [_Site(("mtp", k, "block", "attn"), (m.num_layers + k,), False) for k in sorted(params.get("mtp", {}))]
    attention = set(softmax_attention_layers(m))
    return [s for s in sites if s.layers and s.layers[0] in attention]


def _get(tree: dict, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def _set(tree: dict, path: tuple, value: Any) -> dict:
    """A copy of ``tree`` with ``value`` at ``path`` (only the dicts on the path copied)."""
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def _scale_columns(leaf: jax.Array, f_nc: jax.Array, stacked: bool) -> jax.Array:
    """``leaf`` [..., C] (with a leading stack axis of n when ``stacked``) times the column factors
    [n, C] (n = 1 unstacked), in float32, back in its dtype (a factor of 1 leaves a value bitwise)."""
    lead = (f_nc.shape[0], *(1,) * (leaf.ndim - 2)) if stacked else (1,) * (leaf.ndim - 1)
    return (leaf.astype(jnp.float32) * f_nc.reshape(*lead, f_nc.shape[1])).astype(leaf.dtype)


def _scale_projection(attn: dict, name: str, f_nc: jax.Array, stacked: bool) -> dict:
    """``attn`` with the output columns of projection ``name`` scaled (its bias ``{name}_bias`` too)."""
    out = dict(attn)
    for key in (name, name + "_bias"):
        if key in attn:
            out[key] = _scale_columns(attn[key], f_nc, stacked)
    return out


def _scale_norm(norm: dict, f_nc: jax.Array, stacked: bool, zero_centered: bool) -> dict:
    """An RMSNorm's ``{"scale": [N]}`` times factors [n, N] (or [n, 1]: one factor for all):
    ``w f``, or ``(1 + w) f - 1`` where the scale is applied as ``1 + w``."""
    w = norm["scale"]
    f = jnp.broadcast_to(f_nc, (f_nc.shape[0], w.shape[-1]))
    if not zero_centered:
        return {**norm, "scale": _scale_columns(w, f, stacked)}
    f = f if stacked else f[0]  # the stored scale's shape: [n, N] stacked, else [N]
    scaled = ((1.0 + w.astype(jnp.float32)) * f - 1.0).astype(w.dtype)
    return {**norm, "scale": jnp.where(f == 1.0, w, scaled)}  # (1 + w) - 1 would round w: kept bitwise


def _clip_gqa(cfg: ExperimentConfig, attn: dict, gamma_nh: jax.Array, site: _Site) -> dict:
    """Grouped-query attention (:class:`~moefast.model.attention.Attention`): projections or
    QK-norm scales, by the rules of the module docstring."""
    m = cfg.model
    g, hd = m.attention_shape(site.layers[0])
    k_eq_v = "qk" in attn and "qkv" not in attn
    if m.qk_norm == "per_head":  # one [Hd] scale shared by every head: the layer's smallest factor
        f = jnp.sqrt(jnp.min(gamma_nh, axis=-1, keepdims=True))  # [n, 1]
        return {**attn, "q_norm": _scale_norm(attn["q_norm"], f, site.stacked, m.zero_centered_norm),
                "k_norm": _scale_norm(attn["k_norm"], f, site.stacked, m.zero_centered_norm)}
    fq, fk = gqa_factors(gamma_nh, g, move_keys=not k_eq_v)
    fq, fk = jnp.repeat(fq, hd, axis=1), jnp.repeat(fk, hd, axis=1)  # per column: [n, H·Hd], [n, G·Hd]
    if m.qk_norm == "full":
        return {**attn, "q_norm": _scale_norm(attn["q_norm"], fq, site.stacked, m.zero_centered_norm),
                "k_norm": _scale_norm(attn["k_norm"], fk, site.stacked, m.zero_centered_norm)}
    values = () if k_eq_v else (jnp.ones_like(fk),)
    return _scale_projection(attn, "qk" if k_eq_v else "qkv", jnp.concatenate([fq, fk, *values], axis=1),
                             site.stacked)


def _clip_mla(cfg: ExperimentConfig, attn: dict, gamma_nh: jax.Array, site: _Site) -> dict:
    """Multi-head latent attention (:class:`~moefast.model.mla.MLAttention`): per head, q^C and
    k^C columns by ``sqrt(gamma)``, q^R columns by ``gamma``, values and the shared k^R untouched."""
    m = cfg.model
    n_, r, hv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
    root = jnp.sqrt(gamma_nh)[..., None]  # [n, H, 1]
    f_q = jnp.concatenate([jnp.broadcast_to(root, (*root.shape[:2], n_)),
                           jnp.broadcast_to(gamma_nh[..., None], (*root.shape[:2], r))], axis=-1)
    f_kv = jnp.concatenate([jnp.broadcast_to(root, (*root.shape[:2], n_)), jnp.ones((*root.shape[:2], hv))], axis=-1)
    q_name = "q_b_proj" if m.q_lora_rank else "q_proj"
    attn = _scale_projection(attn, q_name, f_q.reshape(f_q.shape[0], -1), site.stacked)
    return _scale_projection(attn, "kv_b_proj", f_kv.reshape(f_kv.shape[0], -1), site.stacked)


def qk_clip(cfg: ExperimentConfig, params: dict, max_logits_lh: jax.Array, tau: float | jax.Array) -> dict:
    """QK-clip (MuonClip; Kimi K2, arXiv 2507.20534, sec. 2.1): the parameters with every head
    whose largest logit exceeded ``tau`` scaled so that it would be ``tau`` (module docstring for
    the rule of each attention kind). Pure, jit-able; heads at or below ``tau`` (whole key groups
    of them) keep their weights bitwise.

    Args:
      cfg: the experiment (``model``: the layers' kinds and shapes).
      params: pure-dict float32 parameters as the train state holds them (either layout); not
        under ``lora`` (:func:`moefast.train.checks.check_run` refuses QK-clip with adapters).
      max_logits_lh: float32 [L_attn, H], the step's largest pre-softmax logit per
        softmax-attention layer and head (:attr:`moefast.model.ModelOutput.max_logits`, the
        step's ``loss_and_grads`` terms), rows as
        :func:`~moefast.model.layout.softmax_attention_layers`.
      tau: the threshold ``train.qk_clip``, a logit > 0 (Kimi K2: 100).

    Returns:
      The parameters, same structure and dtypes.

    Raises:
      ValueError: the model has no softmax attention layer, or ``max_logits_lh`` is not [L_attn, H].
    """
    layers = softmax_attention_layers(cfg.model)
    if not layers:
        raise ValueError("qk_clip: the model has no softmax attention layer (model.layer_types are all "
                         "linear_attention): no logit to clip; set train.qk_clip=null")
    want = (len(layers), cfg.model.num_heads)
    if tuple(np.shape(max_logits_lh)) != want:
        raise ValueError(f"qk_clip: max_logits_lh must be [L_attn, H] = {list(want)} (one row per softmax-attention "
                         f"layer {list(layers)}), got {list(np.shape(max_logits_lh))}")
    gamma_lh = clip_factors(max_logits_lh, tau)
    row = {layer: i for i, layer in enumerate(layers)}
    for site in _sites(cfg, params):
        attn = _get(params, site.path)
        gamma_nh = gamma_lh[np.asarray([row[i] for i in site.layers])]
        clip = _clip_mla if cfg.model.attention == "mla" else _clip_gqa
        params = _set(params, site.path, clip(cfg, attn, gamma_nh, site))
    return params

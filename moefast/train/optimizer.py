"""The optimizers (``train.optimizer``): AdamW, or Muon on the hidden weight matrices with AdamW on
the rest; both after global-norm clipping.

Muon (Jordan et al. 2024, modded-nanogpt; Liu et al. 2025, "Muon is Scalable for LLM Training",
arXiv 2502.16982, Algorithm 1) keeps one Nesterov momentum buffer per matrix and steps along its
orthogonalised direction (Newton–Schulz, 5 quintic iterations). Which parameter gets which is one
table, :data:`PARAM_KINDS`, from the module class and the parameter's name to its kind:

* ``"matrix"``: a projection [in, out] (a scanned stack's leading layers axis is a batch axis),
  orthogonalised per part when it is stored fused (:func:`matrix_parts`: attention's ``qkv`` as q,
  k and v; a fused ``gate | up`` as gate and up; Gated DeltaNet's ``in_proj`` as its qkv, z, b and
  a), as Hugging Face keeps them in separate ``nn.Linear``s;
* ``"experts"``: routed experts [E, in, out], each expert's matrix (and each part of it) on its own;
* ``"adamw"``: embeddings, LM head, norms, router, biases, sinks, ``A_log``/``dt_bias``,
  convolutions and scalars (Moonlight sec. 2.2 keeps AdamW for everything that is not a hidden
  matrix; Kimi K2 likewise).

Each Muon matrix is one orthogonalisation, ``optax.contrib``'s (same momentum, Newton–Schulz
coefficients and scale), so an expert's update equals ``optax.contrib.muon`` applied to that
matrix alone. Under a mesh of several devices the matrices of one shape are gathered into one
batch split over all the mesh's devices (:func:`orthogonalise`): each device orthogonalises its
share of whole matrices and the results go back to the parameters' shards (all-to-alls), instead of
every device running every matrix's Newton–Schulz on gathered weights.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from optax.contrib._muon import _DEFAULT_NS_COEFFS, orthogonalize_via_newton_schulz

from moefast import parallel
from moefast.config import ExperimentConfig
from moefast.model import build_model, lora
from moefast.model.layout import is_stacked_path

__all__ = ["MOONLIGHT_RMS", "MUON_MOMENTUM", "NS_STEPS", "PARAM_KINDS", "MuonSpec", "make_optimizer",
           "matrix_parts", "muon_specs", "orthogonalise", "scale_by_muon", "state_specs", "summary"]

MUON_MOMENTUM = 0.95  # Nesterov momentum of the Muon matrices (Moonlight, Kimi K2)
NS_STEPS = 5  # Newton–Schulz iterations with Keller Jordan's quintic coefficients
MOONLIGHT_RMS = 0.2  # the update RMS of train.muon_scale=moonlight (arXiv 2502.16982, eq. 4): AdamW's typical


_MATRIX, _EXPERTS, _ADAMW = "matrix", "experts", "adamw"

PARAM_KINDS: dict[str, dict[str, str]] = {
    "Attention": {"qkv": _MATRIX, "qk": _MATRIX, "gate": _MATRIX, "out": _MATRIX,
                  "sinks": _ADAMW, "qkv_bias": _ADAMW, "out_bias": _ADAMW},
    # HF DeepSeek's five Linears, each one matrix (Moonlight trained these with Muon as they are)
    "MLAttention": {"q_a_proj": _MATRIX, "q_b_proj": _MATRIX, "q_proj": _MATRIX, "kv_a_proj_with_mqa": _MATRIX,
                    "kv_b_proj": _MATRIX, "o_proj": _MATRIX},
    # DSA's lightning indexer: AdamW, as DeepSeek-V3.2 trained it; it learns only from its own KL
    # (train.indexer_stage), and without one no weight decay either (_decay_mask): it stays as imported
    "LightningIndexer": {"wq_b": _ADAMW, "wk": _ADAMW, "weights_proj": _ADAMW},
    "LayerNorm": {"scale": _ADAMW, "bias": _ADAMW},  # the indexer's key norm
    "GatedDeltaNet": {"in_proj": _MATRIX, "out": _MATRIX,
                      "conv": _ADAMW, "A_log": _ADAMW, "dt_bias": _ADAMW, "norm": _ADAMW},
    # KDA: q | k | v (each its own matrix), beta's, the rank-K forget and output gates' factors
    "KimiDeltaAttention": {"qkv": _MATRIX, "b": _MATRIX, "f_a": _MATRIX, "f_b": _MATRIX, "g_a": _MATRIX,
                           "g_b": _MATRIX, "out": _MATRIX,
                           "conv": _ADAMW, "A_log": _ADAMW, "dt_bias": _ADAMW, "norm": _ADAMW},
    "Mamba2": {"in_proj": _MATRIX, "out": _MATRIX,
               "conv": _ADAMW, "conv_bias": _ADAMW, "A_log": _ADAMW, "D": _ADAMW, "dt_bias": _ADAMW, "norm": _ADAMW},
    "DenseMLP": {"w_in": _MATRIX, "w_out": _MATRIX},
    "MoELayer": {"w_in": _EXPERTS, "w_out": _EXPERTS, "shared_w_in": _MATRIX, "shared_w_out": _MATRIX,
                 "fc1_latent_proj": _MATRIX, "fc2_latent_proj": _MATRIX,
                 "router": _ADAMW, "router_bias": _ADAMW, "router_scale": _ADAMW, "expert_scale": _ADAMW,
                 "b_in": _ADAMW, "b_out": _ADAMW, "shared_gate": _ADAMW, "routed_in_norm": _ADAMW,
                 "routed_out_norm": _ADAMW, "shared_out_norm": _ADAMW},
    # MTP's eh_proj maps the two normalised [D] streams to D: a hidden projection like any other
    "MTPModule": {"eh_proj": _MATRIX},
    "Transformer": {"embed": _ADAMW, "lm_head": _ADAMW},
    "RMSNorm": {"scale": _ADAMW},
    "ZeroCenteredRMSNorm": {"scale": _ADAMW},
    "Block": {"layer_scalar": _ADAMW},
}
"""Module class -> parameter name -> ``"matrix"``, ``"experts"`` (Muon) or ``"adamw"``. A
parameter missing from it is an error under ``train.optimizer=muon`` (:func:`muon_specs`), never a
silent AdamW."""


class MuonSpec(NamedTuple):
    """How one parameter is orthogonalised: every axis but the last two is a batch axis (a scanned
    stack's layers, the experts), the last two are [in, out]; ``parts`` are the output widths of the
    matrices it fuses, in column order (one entry: not fused). ``names`` (logical axes) and
    ``stacked`` give its sharding in the train state (:func:`moefast.parallel.state_spec`)."""
    parts: tuple[int, ...]
    names: tuple[str | None, ...] = ()
    stacked: bool = False


def matrix_parts(module: nnx.Module, name: str) -> tuple[int, ...]:
    """The output widths of the matrices ``module.{name}`` stores side by side: the adapters'
    split (:func:`moefast.model.lora.parts_of`), and the routed experts' fused gate | up as two
    (``relu2`` experts: one up projection)."""
    if type(module).__name__ == "MoELayer" and name == "w_in" and module.moe.gated:
        half = getattr(module, name).shape[-1] // 2
        return (half, half)
    return lora.parts_of(module, name)


@functools.lru_cache(maxsize=16)
def muon_specs(cfg: ExperimentConfig) -> dict[tuple, MuonSpec | None]:
    """Every parameter's path in the train state's ``params`` (a tuple of keys) -> its
    :class:`MuonSpec`, or ``None`` for AdamW (:data:`PARAM_KINDS`).

    Raises:
      ValueError: a parameter :data:`PARAM_KINDS` does not name (a new module or parameter), or a
        Muon one whose rank is not the kind's.
    """
    model = nnx.eval_shape(lambda: build_model(cfg, cfg.model.vocab_size or 256))
    specs = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module):
            continue
        cls = type(node).__name__
        for name, value in vars(node).items():
            if not isinstance(value, nnx.Param):
                continue
            kind = PARAM_KINDS.get(cls, {}).get(name)
            where = "/".join(map(str, (*path, name)))
            if kind is None:
                raise ValueError(
                    f"train.optimizer=muon: parameter {where} ({cls}.{name}, shape {value.shape}) is not in "
                    "moefast.train.optimizer.PARAM_KINDS, so it is not known whether Muon or AdamW should train it; "
                    "add it there (hidden matrices: 'matrix' or 'experts'; the rest: 'adamw'), or use "
                    "train.optimizer=adamw")
            stacked = int(is_stacked_path([jax.tree_util.DictKey(k) for k in path]))
            want = {_MATRIX: 2, _EXPERTS: 3, _ADAMW: value.ndim - stacked}[kind]
            if value.ndim - stacked != want:
                raise ValueError(f"train.optimizer=muon: {where} ({cls}.{name}) has shape {value.shape}, not the "
                                 f"{want} axes of a '{kind}' parameter in PARAM_KINDS")
            names = tuple(value.get_metadata().get("logical_axes") or (None,) * value.ndim)
            specs[(*path, name)] = None if kind == _ADAMW else MuonSpec(matrix_parts(node, name), names, bool(stacked))
    return specs


def _path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _spec_tree(cfg: ExperimentConfig, tree):
    """``tree``'s leaves replaced by their :class:`MuonSpec` (``None`` for AdamW)."""
    specs = muon_specs(cfg)
    return jax.tree_util.tree_map_with_path(lambda path, _: specs[_path_keys(path)], tree)


class ScaleByMuonState(NamedTuple):
    count: jax.Array  # [] int32, updates so far (the momentum's bias correction)
    mu: Any  # the momentum, like the parameters (float32)


def _pieces(x: jax.Array, spec: MuonSpec) -> list[jax.Array]:
    """A Muon parameter's matrices, one [..., in, out_p] array per part (the batch axes kept)."""
    bounds = np.cumsum((0, *spec.parts))
    return [x[..., a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _ns(x: jax.Array) -> jax.Array:
    """optax.contrib's orthogonalisation of each matrix [m, k] of ``x`` [..., m, k], vmapped over
    each batch axis in turn (merging split batch axes into one would make XLA gather them)."""
    f = functools.partial(orthogonalize_via_newton_schulz, ns_coeffs=jnp.asarray(_DEFAULT_NS_COEFFS),
                          ns_steps=NS_STEPS, preconditioning="frobenius", eps=1e-8)
    for _ in range(x.ndim - 2):
        f = jax.vmap(f)
    return f(x)


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _layout(spec: MuonSpec, shape: tuple[int, ...], mesh) -> tuple[tuple[str, ...], ...]:
    """The mesh axes splitting each dimension of the parameter in the train state."""
    entries = tuple(parallel.state_spec(spec.names, shape, mesh, layers=spec.stacked))
    return tuple(_axes(e) for e in entries + (None,) * (len(shape) - len(entries)))


def _homed(pieces: list[jax.Array], layout: tuple[tuple[str, ...], ...], mesh) -> list[jax.Array]:
    """Newton–Schulz of n same-shaped, same-split matrix batches [*batch, m, k], each matrix on one
    device: stacked [n, *batch, m, k] (no data moves), the stack and the leading unsplit batch axes
    merged into one axis that takes over every mesh axis the matrices were split on (one
    all-to-all; zero matrices pad it, which orthogonalise to zero), and back after."""
    lead = next((i for i, a in enumerate(layout[:-2]) if a), len(layout) - 2)  # leading unsplit batch axes
    rest = layout[lead:-2]
    used = {a for axes in rest for a in axes}
    home = tuple(n for n, size in zip(mesh.axis_names, mesh.axis_sizes) if size > 1 and n not in used)
    shape = pieces[0].shape
    x = jnp.stack(pieces).reshape(-1, *shape[lead:])
    rows = x.shape[0]
    pad = -rows % math.prod(mesh.shape[a] for a in home)
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad, *x.shape[1:]), x.dtype)])
    x = jax.lax.with_sharding_constraint(x, P(home or None, *(a or None for a in rest), None, None))
    out = _ns(x)[:rows].reshape(len(pieces), *shape)
    spec = P(*(a or None for a in layout))
    return [jax.lax.with_sharding_constraint(o, spec) for o in out]


def orthogonalise(updates: list[jax.Array], specs: list[MuonSpec], dtype=jnp.float32) -> list[jax.Array]:
    """Newton–Schulz-orthogonalised ``updates`` (each matrix, part by part), same shapes, float32.

    Args:
      updates: float32 arrays [..., in, out]; specs: their :class:`MuonSpec`.
      dtype: what the matrices travel and iterate in: the model's compute dtype (bfloat16, as
        Keller Jordan's and Moonlight's Muon iterate; float32 models: float32).

    Under an abstract mesh of more than one device (inside a jitted step under ``jax.set_mesh``),
    the matrices of one shape and split (:func:`moefast.parallel.state_spec`) are orthogonalised
    together, each on one device (:func:`_homed`), and returned in the parameters' split; else each
    parameter's batch where it is.
    """
    pieces = [_pieces(u.astype(dtype), s) for u, s in zip(updates, specs)]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        done = [[_ns(p) for p in ps] for ps in pieces]
    else:
        groups: dict[tuple, list[tuple[int, int]]] = {}
        for i, ps in enumerate(pieces):
            layout = _layout(specs[i], updates[i].shape, mesh)
            for j, p in enumerate(ps):
                groups.setdefault((p.shape, layout), []).append((i, j))
        done = [[None] * len(ps) for ps in pieces]
        for (_, layout), members in groups.items():
            for (i, j), o in zip(members, _homed([pieces[i][j] for i, j in members], layout, mesh)):
                done[i][j] = o
    return [(ps[0] if len(ps) == 1 else jnp.concatenate(ps, axis=-1)).astype(jnp.float32) for ps in done]


def _shape_scale(spec: MuonSpec, shape: tuple[int, ...], muon_scale: str) -> jax.Array:
    """Per output column, the update scale of its part [in, out_p]: Moonlight's
    ``0.2 sqrt(max(in, out_p))`` or Keller Jordan's ``sqrt(max(1, out_p / in))``."""
    d_in = shape[-2]
    if muon_scale == "moonlight":
        per_part = [MOONLIGHT_RMS * np.sqrt(max(d_in, n)) for n in spec.parts]
    else:
        per_part = [np.sqrt(max(1.0, n / d_in)) for n in spec.parts]
    return jnp.asarray(np.repeat(per_part, spec.parts), jnp.float32).reshape((1,) * (len(shape) - 1) + (-1,))


def scale_by_muon(cfg: ExperimentConfig, beta: float = MUON_MOMENTUM) -> optax.GradientTransformation:
    """Muon's direction for the parameters :func:`muon_specs` gives a spec (the others arrive as
    ``optax.MaskedNode`` from :func:`optax.partition`): Nesterov momentum with optax.contrib's
    bias correction (float32), each matrix orthogonalised in ``model.dtype`` (:func:`orthogonalise`)
    and scaled by ``train.muon_scale`` (:func:`_shape_scale`)."""
    masked = lambda x: isinstance(x, optax.MaskedNode)

    def init(params):
        return ScaleByMuonState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        del params
        mu = optax.tree.update_moment(grads, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                              optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                              optax.tree.bias_correction(grads, beta, count))
        flat, treedef = jax.tree_util.tree_flatten_with_path(mu_hat, is_leaf=masked)
        table = muon_specs(cfg)
        live = [(i, table[_path_keys(path)]) for i, (path, x) in enumerate(flat) if not masked(x)]
        leaves = [x for _, x in flat]
        out = orthogonalise([leaves[i] for i, _ in live], [s for _, s in live], jnp.dtype(cfg.model.dtype))
        for (i, spec), o in zip(live, out):
            leaves[i] = o * _shape_scale(spec, o.shape, cfg.train.muon_scale)
        return jax.tree.unflatten(treedef, leaves), ScaleByMuonState(count, mu)

    return optax.GradientTransformation(init, update)


def summary(cfg: ExperimentConfig, abstract_params) -> str:
    """The run's optimizer line: what trains with Muon and with AdamW (matrices, parameters)."""
    clip = "" if cfg.train.qk_clip is None else f"; QK-clip at tau = {cfg.train.qk_clip:g}"
    if cfg.train.optimizer != "muon":
        return f"optimizer: adamw on {_count(abstract_params) / 1e6:.2f}M parameters{clip}"
    specs = muon_specs(cfg)
    flat = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    muon = [(specs[_path_keys(p)], x) for p, x in flat if specs.get(_path_keys(p)) is not None]
    matrices = sum(len(s.parts) * math.prod(x.shape[:-2]) for s, x in muon)
    n_muon = sum(math.prod(x.shape) for _, x in muon)
    return (f"optimizer: muon on {matrices} matrices ({n_muon / 1e6:.2f}M parameters, train.muon_scale="
            f"{cfg.train.muon_scale}), adamw on the other {(_count(abstract_params) - n_muon) / 1e6:.2f}M{clip}")


def _count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


def state_specs(tx: optax.GradientTransformation, abstract_opt_state, param_specs):
    """``PartitionSpec``s of ``tx``'s state: each moment like its parameter (``param_specs``, the
    trainable parameters' specs), the leaves another partition keeps (``optax.MaskedNode``) as they
    are, scalars replicated."""
    masked = lambda x: isinstance(x, optax.MaskedNode)
    return optax.tree_utils.tree_map_params(tx, lambda p, spec: p if masked(p) else spec, abstract_opt_state,
                                            param_specs, transform_non_params=lambda _: P(),
                                            is_leaf=lambda x: isinstance(x, P) or masked(x))


def _decay_mask(cfg: ExperimentConfig, params):
    """Matrices decay, vectors (norm scales, biases) do not; a scanned stack's layers axis does not
    count. DSA's lightning indexers do not decay while they do not learn (``train.indexer_stage``
    ``"none"``): no gradient reaches them then, so decay alone would shrink them; without either,
    AdamW leaves them as imported."""
    frozen_indexer = cfg.train.indexer_stage == "none"

    def decays(path, p):
        return p.ndim - is_stacked_path(path) >= 2 and not (frozen_indexer and "indexer" in _path_keys(path))

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(cfg: ExperimentConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
    """``train.optimizer`` after global-norm clipping (``train.grad_clip``), at the learning rate
    ``schedule``: AdamW (decoupled weight decay on matrices only), or Muon on the :data:`PARAM_KINDS`
    matrices (Nesterov momentum 0.95, decoupled weight decay ``train.weight_decay``: ``-lr (O + wd
    W)``) with the same AdamW on the rest.

    Raises:
      ValueError: under Muon, a parameter :data:`PARAM_KINDS` does not name (when the optimizer
        first sees the parameters).
    """
    t = cfg.train
    adamw = optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay,
                        mask=functools.partial(_decay_mask, cfg))
    parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    if t.optimizer == "muon":
        muon = optax.chain(scale_by_muon(cfg), optax.add_decayed_weights(t.weight_decay),
                           optax.scale_by_learning_rate(schedule))
        labels = lambda params: jax.tree.map(lambda s: _ADAMW if s is None else "muon", _spec_tree(cfg, params),
                                             is_leaf=lambda x: x is None or isinstance(x, MuonSpec))
        parts.append(optax.partition({"muon": muon, _ADAMW: adamw}, labels))
    else:
        parts.append(adamw)
    return optax.chain(*parts)

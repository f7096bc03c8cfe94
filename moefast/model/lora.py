"""Low-rank adapters on a frozen base (``lora``: Hu et al. 2021, arXiv 2106.09685, eq. 3).

An adapter lives where its projection's GEMM is: :func:`project` (``dense`` plus the adapter) in
the token mixers, dense MLPs and shared experts, and the grouped expert path for the routed experts
(:class:`moefast.parallel.expert.ExpertProjection`: two thin batched/grouped GEMMs over the tokens
each expert received, never a dense [E, in, out] delta).

A targeted parameter ``W`` (``name`` in its module) gets two siblings, ``{name}_lora_a`` and
``{name}_lora_b``:

* a projection stored fused from P parts (``qkv`` = q | k | v, a fused gate | up), each part its
  own adapter as PEFT has one per module: ``A`` [in, P·r] (part p's columns p·r .. p·r + r - 1) and
  ``B`` [r, out] (the part's columns of the output), ``delta W[:, part p] = A_p B[:, part p]``;
* a routed expert tensor [E, in, out] (one part, as transformers fuses gate|up into one
  ``gate_up_proj``): ``A`` [E, in, r], ``B`` [E, r, out].

``W x + (alpha / r) (x A) B`` with ``B = 0`` at the start, so step 0 is the base model bitwise.
:data:`TARGETS` is the one table of what is adapted; the export and the trainable split read it.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moefast.config import ExperimentConfig, LoRAConfig
from moefast.parallel.precision import dense

__all__ = ["ABSMAX", "LORA_A", "LORA_B", "TARGETS", "adapted", "attach", "base_weight", "count",
           "sizes", "summary", "effective_weight",
           "expert_projection", "from_base", "is_adapter", "is_nf4", "join", "merged_params", "parts_of",
           "project", "recompute_dequantized", "split", "stored", "trainable"]

LORA_A, LORA_B = "_lora_a", "_lora_b"
ABSMAX = "_nf4_absmax"  # an NF4-stored base weight's block scales (lora.base_dtype: nf4)
NF4_WEIGHT = "lora_nf4_weight"  # the name of a dequantized NF4 weight (recomputed in the backward pass)


def _attention_parts(m, name, shape):
    h, g, hd = m.num_heads, m.num_kv_heads, m.head_dim
    return {"qkv": (h * hd, g * hd, g * hd), "qk": (h * hd, g * hd)}.get(name, (shape[-1],))


def _gdn_parts(m, name, shape):
    hv, vd = m.hv, m.v_dim
    return (m.channels, hv * vd, hv, hv) if name == "in_proj" else (shape[-1],)


def _gated_parts(name, shape):  # a fused gate | up: two parts
    return (shape[-1] // 2,) * 2 if name in ("w_in", "shared_w_in") else (shape[-1],)


TARGETS: dict[str, dict[str, str]] = {
    "Attention": {"qkv": "attention", "qk": "attention", "gate": "attention", "out": "attention"},
    "MLAttention": {n: "attention" for n in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                              "o_proj")},
    "GatedDeltaNet": {"in_proj": "attention", "out": "attention"},
    "KimiDeltaAttention": {"qkv": "attention", "out": "attention"},
    "DenseMLP": {"w_in": "mlp", "w_out": "mlp"},
    "MoELayer": {"shared_w_in": "shared_experts", "shared_w_out": "shared_experts", "w_in": "experts",
                 "w_out": "experts"},
}
"""Module class -> its adaptable parameters -> the ``lora.targets`` entry that adapts them."""

_PARTS: dict[str, Callable] = {
    "Attention": _attention_parts,
    "GatedDeltaNet": _gdn_parts,
    "KimiDeltaAttention": lambda m, name, shape: (shape[-1] // 3,) * 3 if name == "qkv" else (shape[-1],),
    "DenseMLP": lambda m, name, shape: (shape[-1],) if m.activation == "relu2" else _gated_parts(name, shape),
    "MoELayer": lambda m, name, shape: _gated_parts(name, shape) if name.startswith("shared") and m.moe.gated
    else (shape[-1],),
}


def parts_of(module: nnx.Module, name: str) -> tuple[int, ...]:
    """The output widths of the parts ``module.{name}`` fuses (one adapter each), in column order."""
    shape = getattr(module, name).shape
    if hasattr(module, name + LORA_B):  # the weight's own width (an NF4-stored one holds packed codes)
        shape = (*shape[:-1], getattr(module, name + LORA_B).shape[-1])
    fn = _PARTS.get(type(module).__name__)
    return fn(module, name, shape) if fn else (shape[-1],)


def _init_a(cfg: LoRAConfig, key, shape, fan_in: int, r: int) -> jax.Array:
    if cfg.init == "gaussian":  # PEFT: normal(0, 1/r)
        return jax.random.normal(key, shape, jnp.float32) / r
    bound = 1.0 / math.sqrt(fan_in)  # PEFT: kaiming_uniform_(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in))
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


def attach(module: nnx.Module, cfg: LoRAConfig, key: jax.Array) -> None:
    """Adds the adapters :data:`TARGETS` and ``cfg.targets`` name to ``module`` (float32 ``A``
    initialised by ``cfg.init`` from ``key`` folded with each parameter's place in the table, so
    the base's initialisation draws nothing more; ``B`` zero; each with its base weight's logical
    axes on the shared dimension and none on the rank); nothing when ``cfg.rank`` is 0."""
    if not cfg.enabled:
        return
    for site, (name, target) in enumerate(TARGETS.get(type(module).__name__, {}).items()):
        if target not in cfg.target_kinds or not hasattr(module, name):
            continue
        rngs = nnx.Rngs(params=jax.random.fold_in(key, site))
        w = getattr(module, name)
        axes = w.get_metadata().get("logical_axes") if hasattr(w, "get_metadata") else None
        axes = axes or (None,) * w.ndim
        r = cfg.rank_of(target)
        if target == "experts":
            e, d_in, d_out = w.shape
            a = _init_a(cfg, rngs.params(), (e, d_in, r), d_in, r)
            setattr(module, name + LORA_A, nnx.Param(a, logical_axes=(axes[0], axes[1], None)))
            setattr(module, name + LORA_B, nnx.Param(jnp.zeros((e, r, d_out), jnp.float32),
                                                     logical_axes=(axes[0], None, axes[2])))
        else:
            d_in, d_out = w.shape
            p = len(parts_of(module, name))
            a = _init_a(cfg, rngs.params(), (d_in, p * r), d_in, r)
            setattr(module, name + LORA_A, nnx.Param(a, logical_axes=(axes[0], None)))
            setattr(module, name + LORA_B, nnx.Param(jnp.zeros((r, d_out), jnp.float32), logical_axes=(None, axes[1])))
        setattr(module, name + "_lora_scale", cfg.scale(target))
        if cfg.base_dtype == "nf4":  # QLoRA: the adapted base weight as 4-bit codes and block scales
            from moefast.parallel.nf4 import nf4_quantize

            q = nf4_quantize(w[...])  # blocks along the last axis, which stays whole on each device
            packed = (*axes[:-1], None)
            setattr(module, name, nnx.Param(q.codes, logical_axes=packed))
            setattr(module, name + ABSMAX, nnx.Param(q.absmax, logical_axes=packed))


def _block_b(b: jax.Array, parts: tuple[int, ...]) -> jax.Array:
    """``B`` [r, O] of a P-part projection as the block matrix [P·r, O] whose row block p holds
    part p's columns of ``B`` (zeros elsewhere), so that ``A [in, P·r] @ it`` is the fused delta."""
    if len(parts) == 1:
        return b
    owner = np.repeat(np.arange(len(parts)), parts)  # [O]: each column's part (static)
    mask = jnp.asarray(owner[None, :] == np.arange(len(parts))[:, None], b.dtype)  # [P, O]
    return (mask[:, None, :] * b[None]).reshape(len(parts) * b.shape[0], b.shape[1])


def base_weight(module: nnx.Module, name: str, dtype) -> jax.Array:
    """``module.{name}`` as the GEMM reads it: the stored weight, or an NF4-stored one dequantized
    to ``dtype`` here, just before its GEMM (one weight at a time)."""
    w = getattr(module, name)[...]
    if not hasattr(module, name + ABSMAX):
        return w
    from moefast.parallel.nf4 import NF4, nf4_dequantize

    width = getattr(module, name + LORA_B).shape[-1]
    return checkpoint_name(nf4_dequantize(NF4(w, getattr(module, name + ABSMAX)[...], width), dtype), NF4_WEIGHT)


def is_nf4(module: nnx.Module) -> bool:
    """``module`` holds an NF4-stored weight (``lora.base_dtype: nf4``)."""
    return any(hasattr(module, n + ABSMAX) for n in TARGETS.get(type(module).__name__, {}))


def recompute_dequantized(fn: Callable) -> Callable:
    """``fn`` whose NF4 weights' dequantized copies (:func:`base_weight`) are not kept for the
    backward pass but dequantized again there from the codes (``jax.checkpoint`` saving anything
    else), so the backward never holds more than the layer's dequantized weights at a time, as
    QLoRA's backward dequantizes again (Dettmers et al. 2023, sec. 3)."""
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.save_anything_except_these_names(NF4_WEIGHT))


def _merged(w: jax.Array, a: jax.Array, b: jax.Array, parts: tuple[int, ...], scale: float) -> jax.Array:
    """``W + scale · A B`` in float32: a projection [in, out] with the block ``A`` [in, P·r] of its
    P ``parts``, or experts [E, in, out] with ``A`` [E, in, r], ``B`` [E, r, out]."""
    w, a, b = (jnp.asarray(x, jnp.float32) for x in (w, a, b))
    delta = jnp.einsum("eir,ero->eio", a, b) if w.ndim == 3 else a @ _block_b(b, parts)
    return w + jnp.float32(scale) * delta


def effective_weight(module: nnx.Module, name: str) -> jax.Array:
    """``W + (alpha / r) A B`` of a (non-expert) projection in float32, for the paths that use the
    weight itself rather than :func:`project`'s product (MLA's absorbed decoding, its context-parallel
    up-projection); the base weight alone where it has no adapter."""
    w = base_weight(module, name, jnp.float32).astype(jnp.float32)
    if not hasattr(module, name + LORA_A):
        return w
    return _merged(w, getattr(module, name + LORA_A)[...], getattr(module, name + LORA_B)[...],
                   parts_of(module, name), getattr(module, name + "_lora_scale"))


def project(module: nnx.Module, name: str, x: jax.Array, dtype, names: tuple, *, fp8: bool = False) -> jax.Array:
    """``x @ module.{name}`` by :func:`~moefast.parallel.precision.dense` (``names``: its logical
    axes; ``fp8``: the base GEMM by the FP8 recipe), plus ``(alpha / r) (x A) B`` where the
    parameter has an adapter (both thin GEMMs in ``dtype``, weight gradients float32).

    Args:
      x: [..., in] activations. Returns: [..., out] in ``dtype``.
    """
    if hasattr(module, name + ABSMAX):
        return recompute_dequantized(lambda x: _project(module, name, x, dtype, names, fp8))(x)
    return _project(module, name, x, dtype, names, fp8)


def _project(module, name, x, dtype, names, fp8):
    y = dense(x, base_weight(module, name, dtype), dtype, names, fp8=fp8)
    if not hasattr(module, name + LORA_A):
        return y
    parts = parts_of(module, name)
    xa = dense(x, getattr(module, name + LORA_A)[...], dtype, (names[0], None))
    xa = xa * jnp.asarray(getattr(module, name + "_lora_scale"), xa.dtype)
    delta = dense(xa, _block_b(getattr(module, name + LORA_B)[...], parts), dtype, (None, names[1]))
    return y + delta.astype(y.dtype)


def expert_projection(module: nnx.Module, name: str, bias: jax.Array | None = None):
    """The routed experts' ``module.{name}`` [E, in, out] as the expert path takes it
    (:class:`~moefast.parallel.expert.ExpertProjection`): weight, optional bias [E, out], and
    where adapted ``A`` [E, in, r] and ``(alpha / r) B`` [E, r, out]."""
    from moefast.parallel.expert import ExpertProjection

    w = base_weight(module, name, module.dtype)
    if not hasattr(module, name + LORA_A):
        return ExpertProjection(w, bias)
    scale = getattr(module, name + "_lora_scale")
    b = getattr(module, name + LORA_B)[...]
    return ExpertProjection(w, bias, getattr(module, name + LORA_A)[...], b * jnp.asarray(scale, b.dtype))


# ------------------------------------------------------------------------------------ pure params
def is_adapter(path: tuple) -> bool:
    """``path`` (keys of a pure parameter dict) is an adapter matrix."""
    last = str(path[-1])
    return last.endswith(LORA_A) or last.endswith(LORA_B)


_TRAIN_GROUPS: dict[str, Callable[[tuple], bool]] = {
    "router": lambda p: p[-1] in ("router", "router_bias"),
    "norms": lambda p: "norm" in str(p[-1]) or p[-1] in ("scale", "router_scale"),
    "embeddings": lambda p: p[-1] == "embed",
    "head": lambda p: p[-1] == "lm_head",
    "biases": lambda p: (str(p[-1]).endswith("bias") and p[-1] not in ("router_bias", "dt_bias")) or p[-1] in ("b_in", "b_out"),
}


def trainable(cfg: LoRAConfig, path: tuple) -> bool:
    """Whether the parameter at ``path`` trains: every one without adapters (``lora.rank`` 0),
    else the adapters and the groups ``lora.train`` names."""
    if not cfg.enabled:
        return True
    keys = tuple(getattr(k, "key", k) for k in path)
    return is_adapter(keys) or any(_TRAIN_GROUPS[g](keys) for g in cfg.train)


def split(cfg: LoRAConfig, params: dict) -> tuple[dict, dict]:
    """``(trainable, frozen)``: the pure dict ``params`` as two dicts of the same nesting holding
    the leaves :func:`trainable` says (and the rest)."""
    return partition(params, functools.partial(trainable, cfg))


def partition(params: dict, keep) -> tuple[dict, dict]:
    """``(kept, rest)``: the pure dict ``params`` as two dicts of the same nesting, the leaves whose
    path (a tuple of keys) ``keep`` is true for, and the others (:func:`join` is the inverse)."""
    def go(d, path):
        t, f = {}, {}
        for k, v in d.items():
            if isinstance(v, dict):
                a, b = go(v, path + (k,))
                if a:
                    t[k] = a
                if b:
                    f[k] = b
            elif keep(path + (k,)):
                t[k] = v
            else:
                f[k] = v
        return t, f

    return go(params, ())


def join(a: dict, b: dict) -> dict:
    """The union of two pure dicts of disjoint leaves (the inverse of :func:`split`)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = join(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def sizes(params: dict) -> dict:
    """Pure ``params`` (arrays or shapes) -> the same tree of ``(parameters, bytes)`` per leaf as
    stored: an NF4 weight's codes stand for its values (the width its adapter's ``B`` gives, no
    padding), its block scales for bytes only."""
    def go(d):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out[k] = go(v)
                continue
            nbytes = int(v.size * np.dtype(v.dtype).itemsize)
            n = 0 if str(k).endswith(ABSMAX) else int(v.size)
            if np.dtype(v.dtype) == np.uint8 and str(k) + LORA_B in d:
                n = int(np.prod(v.shape[:-1])) * d[str(k) + LORA_B].shape[-1]
            out[k] = (n, nbytes)
        return out
    return go(params)


def count(params: dict) -> tuple[int, int]:
    """``(parameters, bytes)`` summed over a tree of :func:`sizes`."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, tuple))
    return sum(n for n, _ in leaves), sum(b for _, b in leaves)


def summary(cfg: LoRAConfig, split_sizes: tuple[dict, dict]) -> str:
    """The run's ``lora:`` line: ranks and targets, what trains in full, the trainable parameters
    and their bytes (and their AdamW moments'), the frozen base's; ``split_sizes`` is the
    ``(trainable, frozen)`` split of :func:`sizes` of the stored parameters."""
    (n_train, b_train), (n_frozen, b_frozen) = map(count, split_sizes)
    kinds = ", ".join(cfg.targets or ("every projection",))
    if cfg.expert_rank not in (None, cfg.rank) and "experts" in cfg.target_kinds:
        kinds += f" (experts rank {cfg.expert_rank})"
    if cfg.train:
        kinds += f" | in full: {', '.join(cfg.train)}"
    return (f"lora: rank {cfg.rank} on {kinds} | trainable {n_train / 1e6:,.3f}M parameters ({b_train / 2**20:,.1f} "
            f"MiB float32, optimizer {2 * b_train / 2**20:,.1f} MiB) | frozen base {n_frozen / 1e6:,.2f}M parameters "
            f"({b_frozen / 2**20:,.1f} MiB, {cfg.base_dtype})")


def storage_dtype(cfg: LoRAConfig) -> Any:
    """The dtype frozen parameters are stored in (``lora.base_dtype``; nf4's unadapted ones: bfloat16)."""
    return jnp.float32 if cfg.base_dtype == "float32" else jnp.bfloat16


def _walk(d: dict, fn, path=()):
    return {k: _walk(v, fn, path + (k,)) if isinstance(v, dict) else fn(path + (k,), v) for k, v in d.items()}


def stored(cfg: LoRAConfig, params: dict) -> dict:
    """Pure ``params`` of an adapted model as the train state holds them: trainable leaves float32,
    frozen ones in :func:`storage_dtype` (NF4 codes and their float32 block scales as they are)."""
    def leaf(path, v):
        if trainable(cfg, path) or v.dtype == jnp.uint8 or str(path[-1]).endswith(ABSMAX):
            return v
        return v.astype(storage_dtype(cfg))
    return _walk(params, leaf) if cfg.enabled else params


def from_base(cfg: LoRAConfig, base: dict, fresh: dict) -> dict:
    """The stored parameters (:func:`stored`) of an adapted model whose base is ``base`` (pure
    float params of the model without adapters, e.g. imported) and whose adapters are ``fresh``'s
    (a new adapted model's pure params: its initial adapters; its other leaves only give shapes and
    dtypes, so ``jax.ShapeDtypeStruct`` s will do); NF4-stored bases are quantized from ``base`` here.

    Raises:
      ValueError: ``base`` lacks a parameter of the adapted model, or has another shape.
    """
    from moefast.parallel.nf4 import nf4_quantize

    def go(b, f, path):
        out = {}
        for k, v in f.items():
            if isinstance(v, dict):
                out[k] = go(b.get(k, {}), v, path + (k,))
            elif str(k).endswith(ABSMAX):
                continue  # with its codes, below
            elif is_adapter((k,)):
                out[k] = v
            elif k not in b:
                raise ValueError(f"the base parameters lack {'/'.join(map(str, path + (k,)))}")
            elif v.dtype == jnp.uint8:  # NF4: quantize the base weight itself
                q = nf4_quantize(jnp.asarray(b[k], jnp.float32))
                out[k], out[str(k) + ABSMAX] = q.codes, q.absmax
            else:
                if tuple(b[k].shape) != tuple(v.shape):
                    raise ValueError(f"base parameter {'/'.join(map(str, path + (k,)))} has shape "
                                     f"{list(b[k].shape)}, the model's is {list(v.shape)}")
                out[k] = jnp.asarray(b[k]).astype(v.dtype)
        return out
    return go(base, fresh, ())


def adapted(model: nnx.Module) -> list[tuple[tuple, nnx.Module, str]]:
    """``(path of the module, module, parameter name)`` of every adapted projection of ``model``
    (an unrolled model: no stacked layers), in graph order."""
    out = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            out += [(tuple(path), node, n) for n in TARGETS.get(type(node).__name__, {}) if hasattr(node, n + LORA_A)]
    return out


def merged_params(model: nnx.Module, params: dict) -> dict:
    """The pure float32 parameters of the model without adapters, each adapted weight merged:
    ``W + (alpha / r) A B`` computed in float32 from the base as stored (NF4 dequantized), per
    expert for the routed experts. ``model`` carries ``params`` (unrolled layout)."""
    merged_w = {}
    for path, module, name in adapted(model):
        a, b = (getattr(module, name + s)[...] for s in (LORA_A, LORA_B))
        merged_w[path + (name,)] = np.asarray(_merged(base_weight(module, name, jnp.float32), a, b,
                                                      parts_of(module, name), getattr(module, name + "_lora_scale")))

    def leaf(path, v):
        return merged_w.get(path, v)
    out = _walk(params, lambda p, v: None if is_adapter(p) or str(p[-1]).endswith(ABSMAX) else
                np.asarray(leaf(p, v), np.float32))
    prune = lambda d: {k: prune(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}  # noqa: E731
    return prune(out)

"""The pure training and evaluation steps, the optimizer and the train state.

The train state is a plain dict of arrays, ``{"params", "opt_state", "step"}``: ``params`` is the
pure-dict form of the NNX model state (``nnx.to_pure_dict``), rebuilt into a module inside the step
with ``nnx.merge(graphdef, params)``. Plain pytrees keep ``jax.jit`` cheap (no Python object-graph
walk per call) and round-trip through orbax without structure drift.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from flax import nnx

from moefast import parallel
from moefast.config import ExperimentConfig
from moefast.kernels.platform import target_platform
from moefast.model import ModelOutput, Transformer, build_model, init_routing_state, lora
from moefast.model.layout import is_stacked_path
from moefast.model.transformer import shift_left
from moefast.train import optimizer
from moefast.train.qk_clip import qk_clip

__all__ = [
    "BATCH_KEYS",
    "ModelDef",
    "eval_step",
    "learning_rate_schedule",
    "loss_and_grads",
    "loss_fn",
    "make_optimizer",
    "micro_batches",
    "mtp_loss_weights",
    "train_step",
    "schedule_count",
    "split_trainable",
    "update_routing_state",
    "with_schedule_count",
]

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_weight")
LN2 = math.log(2.0)


def learning_rate_schedule(cfg: ExperimentConfig) -> optax.Schedule:
    """Linear warm-up from 0 to ``train.learning_rate``, then cosine decay to
    ``min_lr_ratio * learning_rate`` at ``train.steps`` (Loshchilov & Hutter 2017, SGDR eq. 5)."""
    t = cfg.train
    warmup = min(t.warmup_steps, t.steps)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.learning_rate, warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1), end_value=t.learning_rate * t.min_lr_ratio)


def make_optimizer(cfg: ExperimentConfig) -> optax.GradientTransformation:
    """``train.optimizer`` (AdamW, or Muon with AdamW on the rest) after global-norm clipping, on
    :func:`learning_rate_schedule` (:func:`moefast.train.optimizer.make_optimizer`)."""
    return optimizer.make_optimizer(cfg, learning_rate_schedule(cfg))


class ModelDef:
    """A model's structure (NNX graphdef) without its parameters, plus helpers on pure params.

    Args:
      cfg: experiment config.
      vocab_size: the tokenizer's vocabulary size (``cfg.model.vocab_size`` where it is set, e.g.
        by :func:`moefast.load_hf`; a run's config leaves it ``None``: a ``Trainer``'s
        ``model_def`` or ``trainer.tokenizer.vocab_size``).

    Raises:
      TypeError: ``vocab_size`` is not an int.
    """

    def __init__(self, cfg: ExperimentConfig, vocab_size: int):
        if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool):
            raise TypeError(f"vocab_size: expected the tokenizer's vocabulary size (an int), got {vocab_size!r}; "
                            "a run's config has model.vocab_size=None (the tokenizer decides it): use a Trainer's "
                            "model_def, or ModelDef(cfg, trainer.tokenizer.vocab_size)")
        self.cfg = cfg
        self.vocab_size = vocab_size
        abstract = nnx.eval_shape(lambda: build_model(cfg, vocab_size))
        self.graphdef, self.abstract_model_state = nnx.split(abstract)  # keeps logical_axes metadata
        # as the state stores them (lora: the frozen base in lora.base_dtype)
        self.abstract_params = jax.eval_shape(lambda p: lora.stored(cfg.lora, p),
                                              nnx.to_pure_dict(self.abstract_model_state))
        # True for parameters stacked on a leading layers axis (model.scan_layers)
        self.stacked = jax.tree_util.tree_map_with_path(lambda path, _: is_stacked_path(path), self.abstract_params)

    def init_params(self, seed: int) -> dict:
        """Fresh parameters (pure dict): float32, but for a frozen base (``lora``) in ``lora.base_dtype``."""
        params = nnx.to_pure_dict(nnx.state(build_model(self.cfg, self.vocab_size, seed=seed)))
        return lora.stored(self.cfg.lora, params)

    def split(self, params: dict) -> tuple[dict, dict]:
        """``(trainable, frozen)`` parts of pure ``params`` (or of any tree of their structure):
        :func:`split_trainable`."""
        return split_trainable(self.cfg, params)

    def module(self, params: dict) -> Transformer:
        """The NNX module carrying ``params`` (cheap: no copy)."""
        return nnx.merge(self.graphdef, params)

    def init_state(self, seed: int) -> dict[str, Any]:
        """``{"params", "opt_state", "routing", "step"}``; ``routing`` is the non-trainable routing
        state (:func:`~moefast.model.init_routing_state`), which the optimizer never sees."""
        params = self.init_params(seed)
        return {"params": params, "opt_state": make_optimizer(self.cfg).init(self.split(params)[0]),
                "routing": init_routing_state(self.cfg), "step": jnp.zeros((), jnp.int32)}

    def abstract_state(self) -> dict[str, Any]:
        return jax.eval_shape(lambda: self.init_state(0))

    def param_state_specs(self, mesh: jax.sharding.Mesh) -> dict:
        """``PartitionSpec``s of the float32 parameters as the train state holds them: their logical
        axes' (:func:`moefast.parallel.param_specs`) plus the ZeRO split over ``data`` and
        ``expert`` (:func:`moefast.parallel.optimizer_spec`), as :func:`moefast.parallel.state_spec`
        gives the model inside the step. Each device keeps its share of the master weights and of
        the optimizer moments (same specs, so the update is elementwise on shards);
        the model gathers weights in the compute dtype where it uses them
        (:mod:`moefast.parallel.precision`) and the weight gradients are reduce-scattered into
        these shards."""
        specs = parallel.param_specs(self.abstract_model_state, mesh)
        return jax.tree.map(lambda spec, p, stacked: parallel.optimizer_spec(spec, p.shape, mesh, layers=stacked),
                            specs, self.abstract_params, self.stacked, is_leaf=lambda x: isinstance(x, P))


def split_trainable(cfg: ExperimentConfig, params: dict) -> tuple[dict, dict]:
    """``(trainable, frozen)`` parts of pure ``params`` (or of any tree of their structure) as
    ``cfg`` trains them: with ``lora`` the adapters and the groups ``lora.train`` names
    (:func:`moefast.model.lora.split`); in DSA's dense warm-up (``train.indexer_stage``
    ``"dense_warmup"``) the lightning indexers only; else everything (and ``{}``)."""
    if cfg.train.indexer_stage == "dense_warmup":
        return lora.partition(params, lambda path: "indexer" in (getattr(k, "key", k) for k in path))
    if not cfg.lora.enabled:
        return params, {}
    return lora.split(cfg.lora, params)


def _indexer_loss(out: ModelOutput, tokens: jax.Array) -> jax.Array | None:
    """Each DSA layer's indexer KL per token, float32 [L_attn] (its summed KL over ``tokens``, the
    real tokens of the batch, or with gradient accumulation of the global batch), or ``None``
    while the indexers do not train."""
    return None if out.indexer_loss is None else out.indexer_loss / jnp.maximum(tokens, 1.0)


def _loss_terms(out: ModelOutput, batch: dict[str, jax.Array], cfg: ExperimentConfig):
    w = batch["loss_weight"].astype(jnp.float32)
    ce_bt = optax.softmax_cross_entropy_with_integer_labels(out.logits, batch["targets"])
    ce_sum = jnp.sum(jnp.where(w > 0, ce_bt * w, 0.0))
    weight_sum = jnp.sum(w)
    return ce_sum, weight_sum


def mtp_loss_weights(batch: dict[str, jax.Array], k: int) -> jax.Array:
    """Weights of multi-token prediction module k's targets (DeepSeek-V3, arXiv 2412.19437, eq. 24).

    Row i's target is ``t_{i+k+1}`` = ``targets[:, i + k]``; it counts, with weight
    ``loss_weight[:, i + k]``, only when that weight is non-zero and position i + k is in the same
    packed document as position i (equal non-zero segment ids; documents are contiguous, so every
    token between them is too). The last k rows of a row have no target.

    Args:
      batch: ``loss_weight`` [B, T] (any float or int dtype) and ``segment_ids`` [B, T] int.
      k: the module's depth, 1 <= k < T.

    Returns:
      [B, T] float32 weights (0 where no target counts).
    """
    seg = batch["segment_ids"]
    same_doc = (shift_left(seg, k) == seg) & (seg != 0)
    return jnp.where(same_doc, shift_left(batch["loss_weight"].astype(jnp.float32), k, 0.0), 0.0)


def _mtp_terms(out: ModelOutput, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy and summed weight of each module's targets, float32 [D] each."""
    ce_sums, weight_sums = [], []
    for k, logits in enumerate(out.mtp_logits, start=1):
        w = mtp_loss_weights(batch, k)
        ce_bt = optax.softmax_cross_entropy_with_integer_labels(logits, shift_left(batch["targets"], k))
        ce_sums.append(jnp.sum(jnp.where(w > 0, ce_bt * w, 0.0)))
        weight_sums.append(jnp.sum(w))
    return jnp.stack(ce_sums), jnp.stack(weight_sums)


def _mtp_weight_totals(cfg: ExperimentConfig, batch: dict[str, jax.Array]) -> jax.Array | None:
    """Summed target weight of each module over ``batch``, float32 [D]; ``None`` without modules."""
    if not cfg.model.mtp_depth:
        return None
    return jnp.stack([jnp.sum(mtp_loss_weights(batch, k)) for k in range(1, cfg.model.mtp_depth + 1)])


def aux_loss_coef(cfg: ExperimentConfig, step: jax.Array) -> jax.Array:
    """The load-balancing coefficient at ``step``: ``moe.aux_loss_coef``, or, with
    ``moe.aux_loss_coef_start`` set, a linear decay from it to ``aux_loss_coef`` over
    ``moe.warmup_steps``."""
    moe = cfg.moe
    if moe.aux_loss_coef_start is None:
        return jnp.asarray(moe.aux_loss_coef, jnp.float32)
    frac = jnp.clip(1.0 - step.astype(jnp.float32) / moe.warmup_steps, 0.0, 1.0)
    return moe.aux_loss_coef + (moe.aux_loss_coef_start - moe.aux_loss_coef) * frac


def loss_fn(model_def: ModelDef, params: dict, batch: dict[str, jax.Array], step_key: jax.Array | None,
            routing_state: dict[str, jax.Array] | None = None, step: jax.Array | None = None,
            micro: tuple[jax.Array, jax.Array, int] | tuple[jax.Array, jax.Array, int, jax.Array] | None = None
            ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array, Any, jax.Array | None, jax.Array | None]]:
    """Training loss: mean cross-entropy over tokens with non-zero ``loss_weight`` plus
    the load-balancing coefficient (:func:`aux_loss_coef`) times the load-balancing loss and
    ``z_loss_coef`` times the z-loss, each averaged over MoE layers (the blocks of the multi-token
    prediction modules included), plus, with ``model.mtp_depth`` = D > 0, the multi-token
    prediction loss ``L_MTP = train.mtp_loss_coef / D * sum_k L_MTP^k`` (DeepSeek-V3, arXiv
    2412.19437, eq. 25), ``L_MTP^k`` the mean cross-entropy of module k over its targets
    (:func:`mtp_loss_weights`, eq. 24), plus, while DSA's indexers train (``train.indexer_stage``),
    their KL per real token, the mean over the layers (DeepSeek-V3.2-Exp tech report, eqs. 3-4;
    its gradient reaches the indexers only).

    Args:
      params: pure-dict parameters; batch: arrays [B, T] keyed by :data:`BATCH_KEYS`;
      step_key: this step's key (``None``: no dropout, no warm-up noise);
      routing_state: the train state's ``routing`` entry (``None``: no bias, uniform load);
      step: [] int32 optimizer step (expert warm-up and the aux coefficient schedule); ``None`` = 0.
      micro: ``batch`` is one of M micro-batches of a global batch (gradient accumulation):
        ``(weight_total, tokens_total, M)``, the global batch's summed ``loss_weight`` and its
        non-padding tokens ([] float32). Each term is then this micro-batch's share of the global
        batch's term, so the M values add up to it: cross-entropy sum / ``weight_total``, z-loss
        times this micro-batch's tokens / ``tokens_total``, load-balancing loss / M. With D > 0 a
        fourth entry, float32 [D], the global batch's summed target weight of each module: each
        ``L_MTP^k`` is then its cross-entropy sum over it.

    Returns:
      ``(loss, (cross_entropy, aux_loss, z_loss, moe_stats, mtp_losses, max_logits, indexer_losses))``, float32
      scalars; ``moe_stats`` is a :class:`~moefast.model.MoEStats` stacked over MoE layers (the main
      model's, then the D multi-token prediction blocks'), or ``None``; ``mtp_losses`` float32 [D],
      ``L_MTP^k`` of each module (not scaled by the coefficient), or ``None`` without modules;
      ``max_logits`` float32 [L_attn, H], each softmax-attention layer's largest pre-softmax logit
      per head over this batch (:attr:`~moefast.model.ModelOutput.max_logits`: QK-clip), not
      differentiated, or ``None`` without softmax attention layers; ``indexer_losses`` float32
      [L_attn], each layer's indexer KL per real token (this micro-batch's share with ``micro``),
      or ``None`` while the indexers do not train.
    """
    cfg = model_def.cfg
    step = jnp.zeros((), jnp.int32) if step is None else step
    warmup = (step < cfg.moe.warmup_steps) if cfg.moe.warmup_steps else None
    out = model_def.module(params)(batch["tokens"], batch["positions"], batch["segment_ids"],
                                   step_key=step_key, drop_tokens=True, routing_state=routing_state,
                                   routing_warmup=warmup)
    ce_sum, weight_sum = _loss_terms(out, batch, cfg)
    if out.moe is not None:
        aux, z = jnp.mean(out.moe.aux_loss), jnp.mean(out.moe.z_loss)
    else:
        aux = z = jnp.zeros((), jnp.float32)
    if micro is None:
        ce = ce_sum / jnp.maximum(weight_sum, 1.0)
    else:
        weight_total, tokens_total, m = micro[:3]
        ce = ce_sum / jnp.maximum(weight_total, 1.0)
        z = z * (_num_tokens(batch) / jnp.maximum(tokens_total, 1.0))
        aux = aux / m
    loss = ce + aux_loss_coef(cfg, step) * aux + cfg.moe.z_loss_coef * z
    mtp = None
    if out.mtp_logits is not None:
        mtp_ce_sum, mtp_weight_sum = _mtp_terms(out, batch)
        mtp = mtp_ce_sum / jnp.maximum(mtp_weight_sum if micro is None else micro[3], 1.0)  # [D]
        loss = loss + cfg.train.mtp_loss_coef * jnp.mean(mtp)
    indexer = _indexer_loss(out, _num_tokens(batch) if micro is None else micro[1])
    if indexer is not None:
        loss = loss + jnp.mean(indexer)
    return loss, (ce, aux, z, out.moe, mtp, out.max_logits, indexer)


def train_step(model_def: ModelDef, state: dict[str, Any], batch: dict[str, jax.Array],
               base_key: jax.Array) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """One optimizer step on :func:`loss_fn`. Pure: jit it with the state donated.

    The gradient is :func:`loss_and_grads`'s (``train.grad_accum_steps`` micro-batches summed).
    The update is ``train.optimizer``'s (:func:`make_optimizer`); with ``train.qk_clip`` the
    updated parameters are then QK-clipped with this step's largest logits
    (:func:`moefast.train.qk_clip.qk_clip`; Kimi K2, arXiv 2507.20534, Algorithm 1).
    A step whose loss or gradient norm is not finite changes nothing but the step counter:
    parameters, optimizer state (and its count, so the learning-rate schedule does not advance)
    and routing state keep their values, and ``metrics["nonfinite"]`` is 1.

    Args:
      model_def: the model's structure (static).
      state: ``{"params", "opt_state", "routing", "step"}``.
      batch: arrays [B, T] keyed by :data:`BATCH_KEYS`.
      base_key: PRNG key of the run; this step's key is ``fold_in(base_key, step)``, from which
        each dropout and warm-up site folds its own key.

    Returns:
      ``(new_state, metrics)``; metrics are scalars plus, per MoE layer, ``tokens_per_expert``
      [L_moe, E], ``dropped_fraction``, ``router_entropy``, ``aux_loss_per_layer`` and
      ``z_loss_per_layer`` [L_moe] (with multi-token prediction, the D MTP blocks are the last D of
      the L_moe rows); ``max_logit_per_layer`` [L_attn], each softmax-attention layer's largest
      pre-softmax logit over its heads and the batch (the main stack's layers in order, then the
      MTP blocks'; absent without such layers). With ``model.mtp_depth`` = D > 0 also
      ``mtp_loss`` (the mean of the D module losses, before ``train.mtp_loss_coef``) and
      ``mtp_loss_depth_1`` .. ``mtp_loss_depth_D``; ``total_loss`` includes the weighted MTP loss.
    """
    cfg = model_def.cfg
    step = state["step"]
    random = cfg.model.dropout > 0 or cfg.moe.warmup_steps > 0
    step_key = jax.random.fold_in(base_key, step) if random else None
    loss, (ce, aux, z, moe, mtp, max_logits, indexer), grads = loss_and_grads(
        model_def, state["params"], state["routing"], batch, step_key, step)
    tx = make_optimizer(cfg)
    grad_norm = optax.tree_utils.tree_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    train_params, frozen = model_def.split(state["params"])

    def update(old):
        params, opt_state, routing_state = old
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if cfg.train.qk_clip is not None:  # MuonClip: the heads over tau scaled back, from this step's logits
            params = qk_clip(cfg, params, max_logits, cfg.train.qk_clip)
        return params, opt_state, update_routing_state(cfg, routing_state, moe)

    old = (train_params, state["opt_state"], state["routing"])
    if target_platform() == "cpu":
        # XLA:CPU runs the conditional's update in place on the donated buffers; a select there
        # took more temporaries for no speed gain (docs/perf.md, "The optimizer update in place").
        params, opt_state, routing_state = jax.lax.cond(finite, update, lambda o: o, old)
    else:
        # On GPU a conditional is a thunk whose predicate is copied to the host every step, and
        # the whole state is copied through its result; a select fuses into the update's
        # elementwise kernels, which write in place into the donated state.
        params, opt_state, routing_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), update(old), old)
    metrics = {
        "loss": ce,
        "total_loss": loss,
        "aux_loss": aux,
        "z_loss": z,
        "grad_norm": grad_norm,
        "learning_rate": learning_rate_schedule(cfg)(schedule_count(state["opt_state"])),
        "aux_loss_coef": aux_loss_coef(cfg, step),
        "nonfinite": jnp.logical_not(finite).astype(jnp.int32),
        **_layer_metrics(moe, mtp, max_logits, indexer),
    }
    new_state = {"params": lora.join(params, frozen),
                 "opt_state": opt_state,
                 "step": step + 1,
                 "routing": routing_state}
    return new_state, metrics


def _layer_metrics(moe, mtp: jax.Array | None, max_logits: jax.Array | None,
                   indexer: jax.Array | None = None) -> dict[str, jax.Array]:
    """:func:`train_step`'s per-layer and per-module metrics (its docstring): the MoE layers'
    statistics, the multi-token prediction losses, each softmax-attention layer's largest
    logit (``max_logits`` [L_attn, H] -> ``max_logit_per_layer`` [L_attn], the max over heads)
    and DSA's indexer losses (``indexer_loss``, their mean, and ``indexer_loss_per_layer``)."""
    metrics = {}
    if moe is not None:
        metrics["tokens_per_expert"] = moe.tokens_per_expert
        metrics["dropped_fraction"] = moe.dropped_fraction
        metrics["router_entropy"] = moe.router_entropy
        metrics["aux_loss_per_layer"] = moe.aux_loss
        metrics["z_loss_per_layer"] = moe.z_loss
    if max_logits is not None:
        metrics["max_logit_per_layer"] = jnp.max(max_logits, axis=-1)
    if mtp is not None:
        metrics["mtp_loss"] = jnp.mean(mtp)
        for k in range(mtp.shape[0]):
            metrics[f"mtp_loss_depth_{k + 1}"] = mtp[k]
    if indexer is not None:
        metrics["indexer_loss"] = jnp.mean(indexer)
        metrics["indexer_loss_per_layer"] = indexer
    return metrics


def _constrain_grads(model_def: ModelDef, grads: dict) -> dict:
    """Gradients in the parameters' state shardings (:meth:`ModelDef.param_state_specs`, under a
    mesh of more than one device): summed over the token axes and split like the parameters, which
    XLA does with a reduce-scatter. The sum is float32 (:mod:`moefast.parallel.precision`). Asked
    for directly, the split no longer reaches the activations: the weight-gradient GEMMs are inside
    :func:`~moefast.parallel.precision.dense`'s backward, on the gathered weight (an all-reduce
    before the split, as before, made XLA keep whole float32 gradients: 0.64 GiB more all-reduced
    per Mixtral step, 4.4 GiB more peak memory)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return grads
    return jax.lax.with_sharding_constraint(grads, model_def.split(model_def.param_state_specs(mesh))[0])


def _num_tokens(batch: dict[str, jax.Array]) -> jax.Array:
    """Non-padding tokens of a batch (the ones routed), float32 []."""
    return jnp.sum(batch["segment_ids"] != 0).astype(jnp.float32)


def micro_batches(batch: dict[str, jax.Array], m: int) -> dict[str, jax.Array]:
    """[B, T] arrays -> [M, B/M, T]: micro-batch i holds rows i, i + M, i + 2M, ... so that, with
    the rows split over devices in contiguous blocks of a multiple of M rows, every device's
    micro-batch rows are its own (no data moves)."""
    def split(a):
        b = a.shape[0]
        out = jnp.moveaxis(a.reshape(b // m, m, *a.shape[1:]), 1, 0)
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty and mesh.size > 1:
            out = jax.lax.with_sharding_constraint(out, P(None, *parallel.batch_spec(mesh)))
        return out

    return {k: split(v) for k, v in batch.items()}


def loss_and_grads(model_def: ModelDef, params: dict, routing_state: dict, batch: dict[str, jax.Array],
                   step_key: jax.Array | None, step: jax.Array) -> tuple[jax.Array, tuple, dict]:
    """:func:`loss_fn` and its gradient with respect to ``params`` over the global ``batch``.

    With ``train.grad_accum_steps`` = M > 1 the batch is split by :func:`micro_batches` and the M
    micro-batches run one after another (``jax.lax.scan``); the gradients are summed and the
    returned losses and MoE statistics are the global batch's: cross-entropy and z-loss normalised
    by the whole batch (equal to M = 1's up to float rounding when routing drops nothing), the
    load-balancing loss (and ``aux_loss`` per layer) the mean of the micro-batches' values,
    assignments per expert summed, dropped fraction and router entropy weighted by each
    micro-batch's tokens. Micro-batch i's dropout and warm-up key is ``fold_in(step_key, i)``.
    The multi-token prediction losses are normalised by the whole batch's target weights too; the
    largest pre-softmax logits are the maximum over the micro-batches.

    Returns:
      ``(loss, (cross_entropy, aux_loss, z_loss, moe_stats, mtp_losses, max_logits, indexer_losses),
      grads)`` (see
      :func:`loss_fn`); ``grads`` in the parameters' shardings under a mesh.
    """
    params, frozen = model_def.split(params)  # the gradient is the trainable parameters' (lora: the adapters')
    grad_fn = jax.value_and_grad(lambda p, *a: loss_fn(model_def, lora.join(p, frozen), *a), has_aux=True)
    m = model_def.cfg.train.grad_accum_steps
    if m == 1:
        (loss, terms), grads = grad_fn(params, batch, step_key, routing_state, step)
        return loss, terms, _constrain_grads(model_def, grads)
    weight_total = jnp.sum(batch["loss_weight"].astype(jnp.float32))
    tokens_total = _num_tokens(batch)
    totals = (weight_total, tokens_total, m)
    mtp_totals = _mtp_weight_totals(model_def.cfg, batch)
    if mtp_totals is not None:
        totals = (*totals, mtp_totals)
    micro = micro_batches(batch, m)

    def body(grad_sum, xs):
        mb, i = xs
        key = None if step_key is None else jax.random.fold_in(step_key, i)
        (loss, (ce, aux, z, moe, mtp, max_logits, indexer)), g = grad_fn(params, mb, key, routing_state, step, totals)
        grad_sum = jax.tree.map(jnp.add, grad_sum, _constrain_grads(model_def, g))
        return grad_sum, (loss, ce, aux, z, moe, mtp, max_logits, indexer,
                          _num_tokens(mb) / jnp.maximum(tokens_total, 1.0))

    zeros = _constrain_grads(model_def, jax.tree.map(jnp.zeros_like, params))
    grads, (loss, ce, aux, z, moe, mtp, max_logits, indexer, share) = jax.lax.scan(body, zeros,
                                                                                 (micro, jnp.arange(m)))
    if moe is not None:  # [M, L_moe, ...] -> [L_moe, ...]
        w = share[:, None]
        moe = type(moe)(tokens_per_expert=jnp.sum(moe.tokens_per_expert, axis=0),
                        aux_loss=jnp.mean(moe.aux_loss, axis=0),
                        z_loss=jnp.sum(moe.z_loss * w, axis=0),
                        dropped_fraction=jnp.sum(moe.dropped_fraction * w, axis=0),
                        router_entropy=jnp.sum(moe.router_entropy * w, axis=0))
    mtp = None if mtp is None else jnp.sum(mtp, axis=0)  # [M, D] -> [D]
    max_logits = None if max_logits is None else jnp.max(max_logits, axis=0)  # [M, L_attn, H] -> [L_attn, H]
    indexer = None if indexer is None else jnp.sum(indexer, axis=0)  # [M, L_attn] -> [L_attn]
    return jnp.sum(loss), (jnp.sum(ce), jnp.sum(aux), jnp.sum(z), moe, mtp, max_logits, indexer), grads


def schedule_count(opt_state) -> jax.Array:
    """Updates applied so far (the learning-rate schedule's count; skipped steps do not count)."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    return next(v for path, v in found if _in_schedule(path))


def _in_schedule(path, _=None) -> bool:
    """Whether an optimizer-state path is inside a ``ScaleByScheduleState`` (the schedule's count)."""
    return any(getattr(k, "tuple_name", "") == "ScaleByScheduleState" for k in path)


def with_schedule_count(opt_state, count: jax.Array):
    """``opt_state`` with its learning-rate schedule's count (every ``ScaleByScheduleState``) set to
    ``count`` (a fresh optimizer state continuing a run's schedule: ``--reset-optimizer``)."""
    return optax.tree_utils.tree_set(opt_state, _in_schedule, count=jnp.asarray(count, jnp.int32))


def update_routing_state(cfg: ExperimentConfig, routing_state: dict[str, jax.Array], moe) -> dict[str, jax.Array]:
    """After a step, outside the optimizer: ``load_ema <- d * load_ema + (1 - d) * share`` (share of
    assignments per expert) and, for aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2),
    ``bias <- bias + rate * sign(mean_load - load)``; unchanged with ``lora.routing=frozen`` and in
    DSA's dense warm-up (``train.indexer_stage``).

    Args:
      routing_state: ``{"bias", "load_ema"}`` float32 [L_moe, E] (empty without MoE layers).
      moe: this step's :class:`~moefast.model.MoEStats` stacked over MoE layers (or ``None``).
    """
    if not routing_state or moe is None or (cfg.lora.enabled and cfg.lora.routing == "frozen") \
            or cfg.train.indexer_stage == "dense_warmup":  # the warm-up moves the indexers only
        return routing_state
    load = moe.tokens_per_expert.astype(jnp.float32)  # [L_moe, E]
    share = load / jnp.maximum(jnp.sum(load, axis=-1, keepdims=True), 1.0)
    d = cfg.moe.load_ema_decay
    new = dict(routing_state)
    new["load_ema"] = d * routing_state["load_ema"] + (1.0 - d) * share
    if cfg.moe.aux_free_bias_rate > 0:
        mean = jnp.mean(load, axis=-1, keepdims=True)
        new["bias"] = routing_state["bias"] + cfg.moe.aux_free_bias_rate * jnp.sign(mean - load)
    return new


def eval_step(model_def: ModelDef, params: dict, routing_state: dict, batch: dict[str, jax.Array],
              bytes_per_token: np.ndarray) -> dict[str, jax.Array]:
    """Summed validation cross-entropy (nats), weight and UTF-8 bytes of one batch.

    No randomness and no capacity dropping, so each token's loss does not depend on the rest of
    the batch. With multi-token prediction also ``mtp_ce_sum`` and ``mtp_weight_sum``, float32 [D]:
    each module's summed cross-entropy and target weight (:func:`mtp_loss_weights`).

    Args:
      bytes_per_token: int [V], text bytes each token id stands for (bits per byte).
    """
    out = model_def.module(params)(batch["tokens"], batch["positions"], batch["segment_ids"],
                                   drop_tokens=False, routing_state=routing_state)
    ce_sum, weight_sum = _loss_terms(out, batch, model_def.cfg)
    w = batch["loss_weight"].astype(jnp.float32)
    nbytes = jnp.sum(jnp.asarray(bytes_per_token, jnp.float32)[batch["targets"]] * w)
    if out.mtp_logits is not None:
        mtp_ce_sum, mtp_weight_sum = _mtp_terms(out, batch)
        return {"ce_sum": ce_sum, "weight_sum": weight_sum, "bytes": nbytes, "mtp_ce_sum": mtp_ce_sum,
                "mtp_weight_sum": mtp_weight_sum}
    return {"ce_sum": ce_sum, "weight_sum": weight_sum, "bytes": nbytes}

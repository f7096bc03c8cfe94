"""Evaluation of a run: validation cross-entropy and bits per byte over fixed batches."""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from moefast.train.step import LN2, ModelDef, eval_step

__all__ = ["Evaluator", "format_eval"]


class Evaluator:
    """The compiled evaluation step and the validation batches (read on first use, then kept).

    Args:
      model_def: the run's model.
      mesh: the run's mesh.
      state_sharding: shardings of the train state (its ``params`` and ``routing`` are used).
      batch_sharding, replicated: shardings of a batch ([B, T] arrays) and of the outputs.
      bytes_per_token: mean UTF-8 bytes per token of the tokenizer (bits per byte).
      batches: returns this process's validation batches (arrays [B_local, T] keyed by
        ``BATCH_KEYS``), called once.
      put_batch: makes global arrays in ``batch_sharding`` of one such batch.
    """

    def __init__(self, model_def: ModelDef, mesh: Mesh, state_sharding: dict[str, Any], *,
                 batch_sharding: NamedSharding, replicated: NamedSharding, bytes_per_token: float,
                 batches: Callable[[], list[dict[str, np.ndarray]]],
                 put_batch: Callable[[dict[str, np.ndarray]], dict[str, jax.Array]]):
        self.mesh, self._batches, self._put = mesh, batches, put_batch
        self._data: list[dict[str, np.ndarray]] | None = None
        self._step = jax.jit(
            functools.partial(eval_step, model_def, bytes_per_token=bytes_per_token),
            in_shardings=(state_sharding["params"], state_sharding["routing"], batch_sharding),
            out_shardings=replicated)

    def __call__(self, params: dict, routing_state: dict) -> dict[str, float]:
        """Validation loss (``eval_loss``, nats/token) and ``eval_bits_per_byte`` of ``params`` (in
        the state's shardings) with ``routing_state``, over all validation batches (one transfer).
        With multi-token prediction also ``eval_mtp_loss``: the mean over the D modules of each
        one's cross-entropy per target (nats; ``eval_loss`` stays the main model's)."""
        if self._data is None:
            self._data = self._batches()
        totals = None
        with jax.set_mesh(self.mesh):
            for batch in self._data:
                out = self._step(params, routing_state, self._put(batch))
                totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
        totals = jax.device_get(totals)
        ce = float(totals["ce_sum"]) / max(float(totals["weight_sum"]), 1.0)
        bpb = float(totals["ce_sum"]) / LN2 / max(float(totals["bytes"]), 1.0)
        out = {"eval_loss": ce, "eval_bits_per_byte": bpb}
        if "mtp_ce_sum" in totals:
            out["eval_mtp_loss"] = float(np.mean(totals["mtp_ce_sum"] / np.maximum(totals["mtp_weight_sum"], 1.0)))
        return out


def format_eval(metrics: dict[str, float]) -> str:
    """The console form of :class:`Evaluator`'s metrics: ``eval loss 2.4567 | eval bits/byte
    3.5432``, with ``eval mtp 2.890 | `` (``eval_mtp_loss``) before the bits per byte when the model
    has multi-token prediction modules."""
    mtp = metrics.get("eval_mtp_loss")
    return (f"eval loss {metrics['eval_loss']:.4f} | " + (f"eval mtp {mtp:.3f} | " if mtp is not None else "")
            + f"eval bits/byte {metrics['eval_bits_per_byte']:.4f}")

"""Plain-loop reference MoE shared by the model and policy tests."""

import jax.numpy as jnp
import numpy as np
from flax import nnx

from moefast.config import MoEConfig
from moefast.model import MoELayer


def make_layer(d=16, f=24, e=4, k=2, cf=1.25, min_cap=1, seed=0, dtype=jnp.float32):
    moe = MoEConfig(num_experts=e, top_k=k, capacity_factor=cf, min_capacity=min_cap)
    return MoELayer(d, f, moe, dtype=dtype, rngs=nnx.Rngs(seed))


def loop_reference(layer: MoELayer, x_td: np.ndarray, capacity: int, mask=None):
    """Per-token, per-choice loop over experts (float64), using the routing decisions of the NumPy
    reference in tests/routing (GShard order) re-derived here independently."""
    x = np.asarray(x_td, np.float64)
    router = np.asarray(layer.router[...], np.float64)
    w_in, w_out = np.asarray(layer.w_in[...], np.float64), np.asarray(layer.w_out[...], np.float64)
    t, e, k = x.shape[0], layer.num_experts, layer.top_k
    mask = np.ones(t, bool) if mask is None else mask
    logits = (x.astype(np.float32) @ router.astype(np.float32)).astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    choice = [sorted(range(e), key=lambda j: (-probs[i, j], j))[:k] for i in range(t)]
    fill = np.zeros(e, int)
    kept = np.zeros((t, k), bool)
    for kk in range(k):
        for i in range(t):
            if mask[i]:
                kept[i, kk] = fill[choice[i][kk]] < capacity
                fill[choice[i][kk]] += 1
    y = np.zeros_like(x)
    for i in range(t):
        gates = probs[i, choice[i]] / probs[i, choice[i]].sum()
        for kk in range(k):
            if kept[i, kk]:
                ex = choice[i][kk]
                h = x[i] @ w_in[ex]
                g, u = h[: layer.d_ff], h[layer.d_ff:]
                y[i] += gates[kk] * ((g / (1 + np.exp(-g)) * u) @ w_out[ex])
    return y, kept

"""Expert-load monitoring: per-layer load statistics and alerts for imbalanced or idle experts."""

from __future__ import annotations

import numpy as np

__all__ = ["ExpertLoadMonitor", "load_stats"]


def load_stats(tokens_per_expert: np.ndarray) -> dict[str, np.ndarray]:
    """Load statistics of one step.

    Args:
      tokens_per_expert: [L_moe, E] assignments per expert (before capacity) of each MoE layer.

    Returns:
      ``expert_fraction`` [L_moe, E] (each expert's share of the layer's assignments) and
      ``max_load_ratio`` [L_moe] (busiest expert's assignments over the mean per expert; 1 is
      perfectly balanced, ``num_experts / top_k`` is the most a token-choice top-k router can reach).
    """
    tpe = np.asarray(tokens_per_expert, np.float64)
    total = np.maximum(tpe.sum(axis=-1, keepdims=True), 1.0)
    mean = np.maximum(tpe.mean(axis=-1), 1e-12)
    return {"expert_fraction": tpe / total, "max_load_ratio": tpe.max(axis=-1) / mean}


class ExpertLoadMonitor:
    """Counts, per MoE layer, consecutive log intervals with max/mean load above
    ``max_load_ratio`` and, per expert, consecutive intervals without tokens; reports an alert when
    a count reaches ``patience`` — once per episode: the same condition alerts again only after it
    has cleared for at least one interval.

    Args:
      max_load_ratio: threshold of the max/mean load ratio (``monitor.max_load_ratio``).
      patience: consecutive intervals before an alert (``monitor.patience``).
      layer_names: what each row is, as alerts name it (``ModelConfig.moe_layer_names()``: the
        multi-token prediction blocks' rows are ``"MTP module k"``); ``"MoE layer i"`` when not given.
    """

    def __init__(self, max_load_ratio: float, patience: int, layer_names: list[str] | None = None):
        self.max_load_ratio, self.patience = max_load_ratio, patience
        self.layer_names = list(layer_names) if layer_names is not None else None
        self._over: np.ndarray | None = None  # [L] intervals in a row over the ratio
        self._idle: np.ndarray | None = None  # [L, E] intervals in a row without tokens

    def state_dict(self) -> dict:
        """The counters as JSON-serialisable lists (checkpointed with the run, so alerts after a
        resume are those of an uninterrupted run)."""
        if self._over is None:
            return {}
        return {"over": self._over.tolist(), "idle": self._idle.tolist()}

    def load_state_dict(self, state: dict) -> None:
        """Restores :meth:`state_dict`'s counters (an empty dict: none yet)."""
        if state:
            self._over, self._idle = np.asarray(state["over"], int), np.asarray(state["idle"], int)

    def update(self, tokens_per_expert: np.ndarray) -> list[dict]:
        """Feeds one interval's [L_moe, E] assignments; returns the alerts it raises, each a dict
        with ``layer`` (the row), ``layer_name`` (e.g. ``"MoE layer 3"``, ``"MTP module 1"``),
        ``reason`` (a sentence), ``max_load_ratio``, ``idle_experts`` and ``intervals``."""
        tpe = np.asarray(tokens_per_expert)
        ratio = load_stats(tpe)["max_load_ratio"]
        if self._over is None:
            self._over = np.zeros(tpe.shape[0], int)
            self._idle = np.zeros(tpe.shape, int)
        self._over = np.where(ratio > self.max_load_ratio, self._over + 1, 0)
        self._idle = np.where(tpe == 0, self._idle + 1, 0)
        alerts = []
        for layer in range(tpe.shape[0]):
            reasons = []
            n = int(self._over[layer])
            if n == self.patience:
                reasons.append(f"max/mean expert load {ratio[layer]:.2f} > monitor.max_load_ratio="
                               f"{self.max_load_ratio} for {n} log intervals in a row")
            idle = [int(e) for e in np.flatnonzero(self._idle[layer] == self.patience)]
            if idle:
                reasons.append(f"expert(s) {idle} got no tokens for {int(self._idle[layer][idle[0]])} log intervals "
                               "in a row")
            if reasons:
                name = self.layer_names[layer] if self.layer_names and layer < len(self.layer_names) \
                    else f"MoE layer {layer}"
                alerts.append({"layer": layer, "layer_name": name, "reason": "; ".join(reasons),
                               "max_load_ratio": float(ratio[layer]), "idle_experts": idle,
                               "intervals": max(n, int(self._idle[layer].max()))})
        return alerts

"""Plots of a run from its ``metrics.jsonl``: ``moefast plot --run-dir DIR`` and :func:`plot_run`.

One figure per question, each a PNG (matplotlib, no display needed):

* ``loss.png`` — is it learning? Training loss (nats per token, every log record) and validation
  loss against step, validation bits per byte below; a top axis in tokens seen.
* ``throughput.png`` — how fast? tokens/s per log interval against step, with MFU (percent of the
  device peak, where the run knew it) as the right-hand scale.
* ``expert_load.png`` — are the experts used evenly? One heatmap per MoE layer: the share of the
  layer's assignments (before capacity) that each expert got, per log record.
* ``routing.png`` — is routing healthy? Fraction of assignments dropped by capacity and the router
  entropy (nats; ``log(num_experts)`` is uniform) per MoE layer against step.

Expert-load alerts (``kind: alert`` records) are marked on every step axis (red dashes; on the
heatmaps, a red tick above the layer that raised one). A run resumed after a crash may log a
replayed step twice; the last record of a step wins (it is the one the run continued from).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FIGURES", "plot_run", "read_metrics", "run_figures"]

FIGURES = ("loss", "throughput", "expert_load", "routing")


def read_metrics(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """The records of ``<run_dir>/metrics.jsonl`` by kind (``train``, ``eval``, ``alert``,
    ``summary``, ``nonfinite``), in step order.

    ``train`` and ``eval`` records are deduplicated by step (the last one written wins: a resumed run
    replays the steps after its last checkpoint); alerts by (step, layer, reason). A last line cut
    short (the process was killed while writing it) is ignored.

    Raises:
      FileNotFoundError: there is no ``metrics.jsonl`` in ``run_dir``.
      ValueError: a line other than the last is not a JSON record (names the line).
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a moefast run directory with metrics "
                                "(moefast train --run-dir DIR writes them)")
    lines = path.read_text().splitlines()
    by_kind: dict[str, dict[Any, dict[str, Any]]] = {}
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            kind, step = rec["kind"], int(rec["step"])
        except (ValueError, KeyError, TypeError) as e:
            if i == len(lines) - 1:
                break  # cut short by a kill while writing
            raise ValueError(f"{path}, line {i + 1}: not a moefast metrics record ({type(e).__name__}: {e})") from None
        key = (step, rec.get("layer"), rec.get("reason")) if kind == "alert" else step
        by_kind.setdefault(kind, {})[key] = rec
    return {k: [v[key] for key in sorted(v, key=lambda x: x if isinstance(x, int) else (x[0], x[1] or 0, x[2] or ""))]
            for k, v in by_kind.items()}


def _tokens_per_step(run_dir: Path) -> int | None:
    """``data.batch_size * data.seq_len`` of ``config.yaml`` (what tokens/s counts), if readable."""
    import yaml

    try:
        data = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]
        return int(data["batch_size"]) * int(data["seq_len"])
    except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
        return None


def _series(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values of the records that have a finite scalar ``key``."""
    pts = [(r["step"], float(r[key])) for r in records
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)


def _per_layer(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps [S] and values [S, L_moe] of the records with a per-layer list ``key``."""
    rows = [(r["step"], r[key]) for r in records if isinstance(r.get(key), list) and r[key]]
    if not rows:
        return np.zeros(0), np.zeros((0, 0))
    width = max(len(v) for _, v in rows)
    rows = [(s, v) for s, v in rows if len(v) == width]
    return np.array([s for s, _ in rows], float), np.array([v for _, v in rows], float)


def _mark_alerts(ax, alert_steps: list[int]) -> None:
    for i, s in enumerate(alert_steps):
        ax.axvline(s, color="tab:red", linestyle="--", linewidth=0.8, alpha=0.6,
                   label="expert-load alert" if i == 0 else None)


def _token_axis(ax, tokens_per_step: int | None) -> None:
    if tokens_per_step:
        top = ax.secondary_xaxis("top", functions=(lambda s: s * tokens_per_step / 1e6,
                                                   lambda t: t * 1e6 / tokens_per_step))
        top.set_xlabel("tokens seen (millions)")


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in metrics.jsonl yet", ha="center", va="center", transform=ax.transAxes,
            color="0.4")


def run_figures(run_dir: str | Path) -> dict[str, Any]:
    """The figures of the module docstring as ``matplotlib.figure.Figure`` objects (not registered
    with pyplot: no display or backend is needed; in a notebook, show one by evaluating it or save it
    with ``fig.savefig``).

    Returns:
      ``{name: Figure}`` for the names in :data:`FIGURES`.

    Raises:
      FileNotFoundError, ValueError: as :func:`read_metrics`.
    """
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    rec = read_metrics(run_dir)
    train, evals = rec.get("train", []), rec.get("eval", [])
    alert_steps = sorted({a["step"] for a in rec.get("alert", [])})
    tps = _tokens_per_step(run_dir)
    title = run_dir.resolve().name
    figs: dict[str, Any] = {}

    # loss: training and validation loss, validation bits per byte
    fig = Figure(figsize=(8, 6.5), layout="constrained")
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    s, v = _series(train, "loss")
    if s.size:
        ax.plot(s, v, label="training loss", color="tab:blue")
    s, v = _series(evals, "eval_loss")
    if s.size:
        ax.plot(s, v, "o-", label="validation loss", color="tab:orange")
    if not train and not evals:
        _no_data(ax, "loss records")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(f"{title}: loss")
    _mark_alerts(ax, alert_steps)
    _token_axis(ax, tps)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper right")
    s, v = _series(evals, "eval_bits_per_byte")
    if s.size:
        ax2.plot(s, v, "o-", color="tab:orange", label="validation")
    else:
        _no_data(ax2, "validation records")
    ax2.set_ylabel("bits per byte")
    ax2.set_xlabel("step")
    _mark_alerts(ax2, alert_steps)
    ax2.grid(alpha=0.3)
    figs["loss"] = fig

    # throughput: tokens/s and MFU
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    s, v = _series(train, "tokens_per_s")
    if s.size:
        ax.plot(s, v, "o-", color="tab:green", label="tokens/s")
    else:
        _no_data(ax, "timed intervals")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s (per log interval)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title}: throughput")
    ax.grid(alpha=0.3)
    _mark_alerts(ax, alert_steps)
    # MFU is tokens/s times a constant (model FLOPs per token / device peak): a second scale, not a curve
    ratios = [r["mfu"] / r["tokens_per_s"] for r in train
              if isinstance(r.get("mfu"), float) and isinstance(r.get("tokens_per_s"), float) and r["tokens_per_s"] > 0]
    if ratios:
        k = 100 * ratios[-1]
        ax.secondary_yaxis("right", functions=(lambda x: x * k, lambda m: m / k)).set_ylabel("MFU (% of device peak)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower left")
    figs["throughput"] = fig

    # expert load: one heatmap per MoE layer
    steps, frac = _per_layer(train, "tokens_per_expert")  # [S, L, E] as nested lists
    layers = frac.shape[1] if frac.ndim == 3 else 0
    cols = min(layers, 4) or 1
    rows = max(1, math.ceil(layers / cols))
    fig = Figure(figsize=(4 * cols + 1, 2.6 * rows + 0.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    if layers:
        share = frac / np.maximum(frac.sum(axis=-1, keepdims=True), 1.0)  # [S, L, E]
        experts = share.shape[-1]
        vmax = max(2.0 / experts, float(share.max()))
        alert_layers = {(a["step"], a["layer"]) for a in rec.get("alert", [])}
        edges = np.concatenate([[steps[0] - (steps[1] - steps[0] if steps.size > 1 else 1)], steps])
        image = None
        for layer in range(layers):
            ax = axes[layer]
            image = ax.pcolormesh(edges, np.arange(experts + 1) - 0.5, share[:, layer, :].T, cmap="viridis",
                                  vmin=0.0, vmax=vmax, shading="flat")
            ax.set_title(f"MoE layer {layer}")
            ax.set_xlabel("step")
            ax.set_ylabel("expert")
            marks = [st for st in alert_steps if (st, layer) in alert_layers]
            if marks:
                ax.plot(marks, [experts - 0.5] * len(marks), "v", color="tab:red", clip_on=False, markersize=6,
                        label="alert")
        for ax in axes[layers:]:
            ax.set_visible(False)
        fig.colorbar(image, ax=axes[:layers].tolist(), label=f"share of assignments (uniform = 1/{experts})")
        fig.suptitle(f"{title}: expert load per log record (red ▼: expert-load alert)")
    else:
        _no_data(axes[0], "expert counts")
        fig.suptitle(f"{title}: expert load")
    figs["expert_load"] = fig

    # routing: dropped fraction and router entropy per layer
    fig = Figure(figsize=(8, 6.5), layout="constrained")
    ax, ax2 = fig.subplots(2, 1, sharex=True)
    for a, key, ylabel in ((ax, "dropped_fraction", "dropped by capacity (fraction)"),
                           (ax2, "router_entropy", "router entropy (nats)")):
        s, v = _per_layer(train, key)
        if s.size:
            for layer in range(v.shape[1]):
                a.plot(s, v[:, layer], label=f"MoE layer {layer}")
        else:
            _no_data(a, key)
        a.set_ylabel(ylabel)
        a.grid(alpha=0.3)
        _mark_alerts(a, alert_steps)
    experts = frac.shape[-1] if frac.ndim == 3 else None
    if experts:
        ax2.axhline(math.log(experts), color="0.5", linestyle=":", label=f"uniform: log {experts}")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title}: routing")
    ax2.set_xlabel("step")
    for a in (ax, ax2):
        handles, labels = a.get_legend_handles_labels()
        if handles:
            a.legend(fontsize="small", ncol=2 if len(handles) > 4 else 1, loc="best")
    figs["routing"] = fig
    return figs


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, *, dpi: int = 110) -> dict[str, Path]:
    """Writes the figures of :func:`run_figures` as PNGs.

    Args:
      run_dir: a moefast run directory (with ``metrics.jsonl``).
      out_dir: where to write (default ``<run_dir>/plots``; created if missing).
      dpi: resolution of the PNGs.

    Returns:
      ``{name: path}`` of the PNGs written (``<out_dir>/<name>.png`` for the names in :data:`FIGURES`).

    Raises:
      FileNotFoundError, ValueError: as :func:`read_metrics`.
    """
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    figs = run_figures(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, fig in figs.items():
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name], dpi=dpi)
    return paths

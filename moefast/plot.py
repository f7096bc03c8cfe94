"""Plots of a run from its ``metrics.jsonl``: ``moefast plot --run-dir DIR`` and :func:`plot_run`.

One figure per question, each a PNG (matplotlib, no display needed):

* ``loss.png`` — is it learning? Training loss (nats per token, every log record) and validation
  loss against step, with multi-token prediction (``model.mtp_depth`` > 0) also the MTP loss
  (``mtp_loss`` and ``eval_mtp_loss``: the mean over the modules) and, while DSA's indexers train
  (``train.indexer_stage``), their KL (``indexer_loss``) as curves of their own (a log
  scale when they span more than 30×, e.g. a diverged run; non-finite values break the line, and
  steps skipped as non-finite are crosses), validation bits per byte below; a top axis in tokens
  seen.
* ``throughput.png`` — how fast? tokens/s per log interval against step, with MFU (percent of the
  device peak, where the run knew it) as the right-hand scale.
* ``expert_load.png`` — are the experts used evenly? One heatmap per MoE layer (titled with its
  block index where the run's config.yaml says; the multi-token prediction blocks' rows, after the
  main model's, as ``MTP module k``): each expert's share of the layer's assignments (before
  capacity) per log record, relative to a uniform split (1 = 1/E), so any E reads alike.
* ``routing.png`` — is routing healthy? Fraction of assignments dropped by capacity and the router
  entropy (nats; ``log(num_experts)`` is uniform) per MoE layer (and MTP module) against step.
* ``attention.png`` — are the attention logits bounded? The largest pre-softmax logit of each
  softmax-attention layer (and MTP module) per log record (``max_logit_per_layer``: what QK-clip
  bounds; Kimi K2, arXiv 2507.20534, sec. 2.1), with ``train.qk_clip``'s tau where the run set it.

Expert-load alerts (``kind: alert`` records) are marked on every step axis (red dashes; on the
heatmaps, a red tick above the layer that raised one). A run resumed after a crash may log a
replayed step twice; the last record of a step wins (it is the one the run continued from).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FIGURES", "plot_run", "read_metrics", "run_figures"]

FIGURES = ("loss", "throughput", "expert_load", "routing", "attention")


def read_metrics(run_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """The records of ``<run_dir>/metrics.jsonl`` by kind (``train``, ``eval``, ``alert``,
    ``summary``, ``nonfinite``), in step order.

    ``train`` and ``eval`` records are deduplicated by step (the last one written wins: a resumed run
    replays the steps after its last checkpoint); alerts by (step, layer, reason). A last line cut
    short (the process was killed while writing it) is ignored.

    Raises:
      FileNotFoundError: there is no ``metrics.jsonl`` in ``run_dir``.
      ValueError: it cannot be read, or a line other than the last is not a JSON record (names
        the line).
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {run_dir} is not a moefast run directory with metrics "
                                "(moefast train --run-dir DIR writes them)")
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read {path} ({e.strerror or e})") from None
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
    return {k: sorted(v.values(), key=lambda r: r["step"]) for k, v in by_kind.items()}  # stable: order kept


def _run_shape(run_dir: Path) -> tuple[int | None, list[int] | None, list[str] | None, float | None]:
    """From ``config.yaml``, if readable: tokens per step (``data.batch_size * data.seq_len``, what
    tokens/s counts), the block index of each MoE layer of the main model, the name of each row
    of the per-layer statistics (``ModelConfig.moe_layer_names``: MTP modules after the main
    model's MoE layers) and QK-clip's tau (``train.qk_clip``, ``None``: off)."""
    import yaml

    from moefast.config import ExperimentConfig

    try:
        cfg = ExperimentConfig.from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    except Exception:  # a missing or hand-edited config: plot without it
        return None, None, None, None
    blocks = [i for i in range(cfg.model.num_layers) if cfg.model.is_moe_layer(i)]
    return cfg.data.batch_size * cfg.data.seq_len, blocks, cfg.model.moe_layer_names(), cfg.train.qk_clip


def _series(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values of the records that have a scalar ``key`` (non-finite values as NaN, so a
    line breaks there instead of bridging them)."""
    pts = [(r["step"], float(r[key]) if math.isfinite(r[key]) else math.nan) for r in records
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
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


def _token_axis(ax, tokens_per_step: int | None, last_step: float) -> None:
    if tokens_per_step:
        unit, name = (1e6, "millions") if last_step * tokens_per_step >= 1e6 else (1e3, "thousands")
        top = ax.secondary_xaxis("top", functions=(lambda s: s * tokens_per_step / unit,
                                                   lambda t: t * unit / tokens_per_step))
        top.set_xlabel(f"tokens seen ({name})")


def _mark_skipped(ax, steps: list[int]) -> None:
    """Non-finite steps (skipped updates) as crosses along the bottom of the axes."""
    if steps:
        ax.plot(steps, [0.02] * len(steps), "x", color="tab:red", transform=ax.get_xaxis_transform(),
                label="non-finite step (skipped)")


def _layer_colors(n: int) -> list:
    from matplotlib import colormaps

    return [colormaps["tab10"](i) for i in range(n)] if n <= 10 else \
        [colormaps["viridis"](i / max(n - 1, 1)) for i in range(n)]


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in metrics.jsonl", ha="center", va="center", transform=ax.transAxes,
            color="0.4")


@dataclasses.dataclass
class _Run:
    """What the figures of one run are drawn from."""

    train: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    alerts: list[dict[str, Any]]
    alert_steps: list[int]
    skipped: list[int]  # non-finite steps
    tokens_per_step: int | None
    moe_blocks: list[int] | None  # block index of each MoE layer of the main model
    layer_names: list[str] | None  # name of each per-layer row (config.yaml's; MTP modules last)
    last_step: int
    title: str
    qk_clip: float | None = None  # train.qk_clip's tau (config.yaml's), None: off or unknown

    @functools.cached_property
    def mtp_depth(self) -> int:
        """D as the training records say (their ``mtp_loss_depth_1..D``); 0 without MTP."""
        return max((int(k.rsplit("_", 1)[1]) for r in self.train for k in r
                    if k.startswith("mtp_loss_depth_") and k.rsplit("_", 1)[1].isdigit()), default=0)

    def layer_name(self, row: int, rows: int) -> str:
        """The name of per-layer row ``row`` of ``rows``: the config's, else ``MoE layer i`` with the
        last D rows ``MTP module k`` when the records have ``mtp_loss_depth_1..D`` (without
        config.yaml)."""
        if self.layer_names and len(self.layer_names) == rows:
            return self.layer_names[row]
        depth = self.mtp_depth
        if 0 < depth < rows and row >= rows - depth:
            return f"MTP module {row - (rows - depth) + 1}"
        return f"MoE layer {row}"


def _loss_figure(run: _Run):
    """``loss.png``: training and validation loss (and MTP loss), validation bits per byte."""
    from matplotlib.figure import Figure

    train, evals, alert_steps, title = run.train, run.evals, run.alert_steps, run.title

    fig = Figure(figsize=(8, 6.5), layout="constrained")
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    s, v = _series(train, "loss")
    finite = [x for x in v if math.isfinite(x) and x > 0]
    if s.size:
        ax.plot(s, v, ".-", label="training loss", color="tab:blue")
    s, v = _series(evals, "eval_loss")
    finite += [x for x in v if math.isfinite(x) and x > 0]
    if s.size:
        ax.plot(s, v, "o-", label="validation loss", color="tab:orange")
    # multi-token prediction (model.mtp_depth > 0): the mean over the modules, before train.mtp_loss_coef;
    # DSA's indexers while they train (train.indexer_stage): their KL, the mean over the layers
    for records, key, style, label, color in (
            (train, "mtp_loss", ".--", "training MTP loss", "tab:purple"),
            (evals, "eval_mtp_loss", "o--", "validation MTP loss", "tab:brown"),
            (train, "indexer_loss", ".:", "training indexer loss (KL)", "tab:green")):
        s, v = _series(records, key)
        finite += [x for x in v if math.isfinite(x) and x > 0]
        if s.size:
            ax.plot(s, v, style, label=label, color=color)
    log_scale = bool(finite) and max(finite) / min(finite) > 30  # e.g. a diverged run: keep the rest readable
    if log_scale:
        ax.set_yscale("log")
    _mark_skipped(ax, run.skipped)
    ax.set_ylabel("cross-entropy (nats / token)" + (", log scale" if log_scale else ""))
    ax.set_title(f"{title}: loss")
    _mark_alerts(ax, alert_steps)
    _token_axis(ax, run.tokens_per_step, run.last_step)
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
    return fig


def _throughput_figure(run: _Run):
    """``throughput.png``: tokens/s, MFU as a second scale."""
    from matplotlib.figure import Figure

    train, alert_steps, title = run.train, run.alert_steps, run.title

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
        # each start of a run measures its own peak on a CPU: the scale is the latest start's
        same = max(ratios) <= 1.02 * min(ratios)
        ax.secondary_yaxis("right", functions=(lambda x: x * k, lambda m: m / k)).set_ylabel(
            "MFU (% of device peak)" if same else "MFU (% of peak, latest start's scale)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower left")
    return fig


def _expert_load_figure(run: _Run):
    """``expert_load.png``: one heatmap per MoE layer."""
    from matplotlib.figure import Figure

    train, alert_steps, title = run.train, run.alert_steps, run.title

    steps, frac = _per_layer(train, "tokens_per_expert")  # [S, L, E] as nested lists
    layers = frac.shape[1] if frac.ndim == 3 else 0
    cols = min(layers, 4) or 1
    rows = max(1, math.ceil(layers / cols))
    fig = Figure(figsize=(4 * cols + 1, 2.6 * rows + 0.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    if layers:
        experts = frac.shape[-1]
        # load relative to a uniform split: 1 = 1/E of the layer's assignments, whatever E
        share = experts * frac / np.maximum(frac.sum(axis=-1, keepdims=True), 1.0)  # [S, L, E]
        vmax = float(min(max(2.0, np.percentile(share, 99)), experts))
        alert_layers = {(a["step"], a["layer"]) for a in run.alerts}
        edges = np.concatenate([[steps[0] - (steps[1] - steps[0] if steps.size > 1 else 1)], steps])
        image = None
        for layer in range(layers):
            ax = axes[layer]
            image = ax.pcolormesh(edges, np.arange(experts + 1) - 0.5, share[:, layer, :].T, cmap="viridis",
                                  vmin=0.0, vmax=vmax, shading="flat")
            name = run.layer_name(layer, layers)
            known = run.moe_blocks and run.layer_names and len(run.layer_names) == layers  # config.yaml fits
            block = f" (block {run.moe_blocks[layer]})" if known and layer < len(run.moe_blocks) else ""
            ax.set_title(f"{name}{block}")
            ax.set_xlabel("step")
            ax.set_ylabel("expert")
            marks = [st for st in alert_steps if (st, layer) in alert_layers]
            if marks:
                ax.plot(marks, [experts - 0.5] * len(marks), "v", color="tab:red", clip_on=False, markersize=6,
                        label="alert")
        for ax in axes[layers:]:
            ax.set_visible(False)
        fig.colorbar(image, ax=axes[:layers].tolist(), extend="max" if vmax < share.max() else "neither",
                     label=f"load / uniform (1 = 1/{experts} of assignments)")
        fig.suptitle(f"{title}: expert load per log record (red ▼: expert-load alert)")
    else:
        _no_data(axes[0], "expert counts (no MoE layer?)")
        fig.suptitle(f"{title}: expert load")
    return fig


def _routing_figure(run: _Run):
    """``routing.png``: dropped fraction and router entropy per layer."""
    from matplotlib.figure import Figure

    train, alert_steps, title = run.train, run.alert_steps, run.title

    fig = Figure(figsize=(8, 6.5), layout="constrained")
    ax, ax2 = fig.subplots(2, 1, sharex=True)
    for a, key, ylabel in ((ax, "dropped_fraction", "dropped by capacity (fraction)"),
                           (ax2, "router_entropy", "router entropy (nats)")):
        s, v = _per_layer(train, key)
        if s.size:
            for layer, color in zip(range(v.shape[1]), _layer_colors(v.shape[1])):
                a.plot(s, v[:, layer], ".-", color=color, label=run.layer_name(layer, v.shape[1]))
        else:
            _no_data(a, key)
        a.set_ylabel(ylabel)
        a.grid(alpha=0.3)
        _mark_alerts(a, alert_steps)
    _, frac = _per_layer(train, "tokens_per_expert")
    experts = frac.shape[-1] if frac.ndim == 3 else None
    if experts:
        ax2.axhline(math.log(experts), color="0.5", linestyle=":", label=f"uniform: log {experts}")
        ax2.set_ylim(0, 1.05 * math.log(experts))  # from 0: how far from uniform, not a zoom on noise
    ax.set_ylim(bottom=0)
    ax.set_title(f"{title}: routing")
    ax2.set_xlabel("step")
    for a in (ax, ax2):
        _legend(a)
    return fig


def _legend(ax) -> None:
    """The axes' legend: beside them when there are many layers (not over the data), else inside."""
    handles, _ = ax.get_legend_handles_labels()
    if len(handles) > 6:
        ax.legend(fontsize="small", loc="center left", bbox_to_anchor=(1.01, 0.5))
    elif handles:
        ax.legend(fontsize="small", loc="best")


def _attention_figure(run: _Run):
    """``attention.png``: the largest pre-softmax logit per softmax-attention layer, and tau."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    s, v = _per_layer(run.train, "max_logit_per_layer")  # [S, L_attn]
    if s.size:
        rows = v.shape[1]
        names = next((r["attention_layer_names"] for r in reversed(run.train)
                      if isinstance(r.get("attention_layer_names"), list) and len(r["attention_layer_names"]) == rows),
                     [f"attention row {i}" for i in range(rows)])
        for layer, color in zip(range(rows), _layer_colors(rows)):
            ax.plot(s, v[:, layer], ".-", color=color, label=names[layer])
    else:
        _no_data(ax, "max_logit_per_layer (a model of linear attention layers only has none)")
    if run.qk_clip is not None:
        ax.axhline(run.qk_clip, color="tab:red", linestyle="--", label=f"train.qk_clip: tau = {run.qk_clip:g}")
    _mark_skipped(ax, run.skipped)
    _mark_alerts(ax, run.alert_steps)
    ax.set_xlabel("step")
    ax.set_ylabel("largest pre-softmax logit (q·k·scale)")
    ax.set_title(f"{run.title}: attention logits")
    ax.grid(alpha=0.3)
    _legend(ax)
    return fig


def run_figures(run_dir: str | Path) -> dict[str, Any]:
    """The figures of the module docstring as ``matplotlib.figure.Figure`` objects (not registered
    with pyplot: no display or backend is needed; in a notebook, show one by evaluating it or save it
    with ``fig.savefig``).

    Returns:
      ``{name: Figure}`` for the names in :data:`FIGURES`.

    Raises:
      FileNotFoundError, ValueError: as :func:`read_metrics`; ValueError also when it holds no
        training or evaluation record yet.
    """
    run_dir = Path(run_dir)
    rec = read_metrics(run_dir)
    train, evals = rec.get("train", []), rec.get("eval", [])
    if not train and not evals:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no training or evaluation records yet (the first comes "
                         "after train.log_every steps)")
    tokens_per_step, moe_blocks, layer_names, qk_clip = _run_shape(run_dir)
    run = _Run(train=train, evals=evals, alerts=rec.get("alert", []),
               alert_steps=sorted({a["step"] for a in rec.get("alert", [])}),
               skipped=sorted({r["step"] for r in rec.get("nonfinite", [])}), tokens_per_step=tokens_per_step,
               moe_blocks=moe_blocks, layer_names=layer_names, last_step=max(r["step"] for r in train + evals),
               title=run_dir.resolve().name, qk_clip=qk_clip)
    return {"loss": _loss_figure(run), "throughput": _throughput_figure(run), "expert_load": _expert_load_figure(run),
            "routing": _routing_figure(run), "attention": _attention_figure(run)}


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None, *, dpi: int = 110) -> dict[str, Path]:
    """Writes the figures of :func:`run_figures` as PNGs.

    Args:
      run_dir: a moefast run directory (with ``metrics.jsonl``).
      out_dir: where to write (default ``<run_dir>/plots``; created if missing).
      dpi: resolution of the PNGs.

    Returns:
      ``{name: path}`` of the PNGs written (``<out_dir>/<name>.png`` for the names in :data:`FIGURES`).

    Raises:
      FileNotFoundError, ValueError: as :func:`run_figures`.
      OSError: ``out_dir`` cannot be created or written (the message names it).
    """
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "plots"
    figs = run_figures(run_dir)
    paths = {}
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, fig in figs.items():
            paths[name] = out / f"{name}.png"
            fig.savefig(paths[name], dpi=dpi)
    except OSError as e:
        raise OSError(f"cannot write the plots to {out} ({e.strerror or e}); choose another directory "
                      "(moefast plot --out)") from None
    return paths

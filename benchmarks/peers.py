"""moefast side by side with Hugging Face transformers' Mixtral, same CPU: a development benchmark.
One file on purpose (~740 lines): both sides' runners and the comparison stay together so that what
is timed on each side can be read side by side.

Run from a checkout of the repository (it is not part of the installed package; it needs the peers
extra, ``pip install -c constraints.txt -e '.[peers]'``)::

    python benchmarks/peers.py [--config YAML] [section.key=value ...] [--rounds N] [--steps N]
                               [--json OUT | --profile DIR] [--cpu-devices N]

Per round (``rounds``, default 3), three measurements, each in a fresh Python process (a clean
process and allocator per side); the order of the three rotates from round to round so drift of
the machine's speed hits every side alike:

* **moefast bare step** — :class:`moefast.train.Trainer` for the config, its compiled train step
  (``trainer.compiled_train_step()``), :data:`WARMUP_STEPS` warm-up steps, then ``steps`` timed
  steps, each ended by ``jax.block_until_ready``. Median seconds per step → tokens/s.
* **moefast train** — the real ``moefast train`` command (``train.steps = steps +``
  :data:`WARMUP_STEPS`, one log line at the end, evaluation and the checkpoint only at the end); its
  run summary's ``tokens_per_s`` (mean throughput after the compiling first step, evaluation and
  checkpoint excluded). This is the figure a user gets.
* **HF Mixtral** — ``transformers.MixtralForCausalLM`` built from a ``MixtralConfig`` with the
  moefast config's shapes (:func:`hf_config_kwargs`), float32, ``attn_implementation="sdpa"``,
  ``experts_implementation="grouped_mm"``, ``torch.optim.AdamW`` with the config's peak learning
  rate (constant: no schedule), betas and weight decay (decay on matrices only, as moefast; torch's
  default for-loop AdamW on CPU), global-norm gradient clipping at
  ``train.grad_clip`` (as moefast); train mode. A step is forward + loss + backward + clipping +
  ``optimizer.step()`` + ``zero_grad()``; timed like the bare step. The loss is computed here, not
  by HF: token cross-entropy of ``outputs.logits`` against moefast's ``targets`` (already shifted
  by one, so no ``labels`` are passed and HF shifts nothing), weighted by moefast's
  ``loss_weight``, plus ``moe.aux_loss_coef`` × ``outputs.aux_loss`` (HF's Switch load-balancing
  loss, on because ``output_router_logits=True``). HF has no z-loss. torch keeps its default
  thread count (the physical cores), recorded as ``torch_threads``.

Both sides train on the same token batches: the parent process writes the first moefast batches
(``tokens``, ``targets``, ``segment_ids``, ``positions``, ``loss_weight`` from
:func:`moefast.data.train_dataset`) to an ``.npz`` file; the bare step and HF read them from there
(the ``moefast train`` run reads the same stream itself). Known differences in the work done:
moefast routes with a capacity (``moe.capacity_factor``; padded expert buffers, overflow dropped)
and masks attention per packed document (``segment_ids``), HF routes dropless (grouped matmuls over
the exact assignments) with a plain causal mask and positions ``0..T-1``; moefast adds the router
z-loss. ``moe.capacity_factor=1.0`` narrows the first difference.

Another busy process on the machine slows every side, PyTorch's OpenMP threads far more than
XLA's (on 2 cores, HF steps took 4-8 s instead of 0.6 s next to a test run): each side's 1-minute
load average at its start is recorded (``load_before``); compare only quiet rounds.

Per-step CPU figures (bare step and HF, over the timed steps): user and system seconds from
``os.times()`` and minor page faults from ``getrusage(RUSAGE_SELF).ru_minflt``. The moefast
processes run as ``moefast train`` does, with its host ``malloc`` settings
(:func:`moefast.host_memory.configure`, recorded as ``host_malloc``); the HF process never imports
JAX nor configures them, and runs with glibc's defaults.

``--profile DIR`` runs instead of the rounds: one extra process per side that times ``steps``
steps without a profiler (step time and CPU figures) and then traces :data:`PROFILE_STEPS` more — a
``jax.profiler`` trace of the compiled step, a ``torch.profiler`` trace of the HF step — and
groups the traced time by kind of work (:data:`KINDS`, see
:func:`moefast.bench.xla_profile.classify_hlo` and
:func:`torch_kind`) into ``DIR/profile.md`` and ``DIR/profile.json``; the raw traces stay in
``DIR`` for perfetto / chrome://tracing.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

# This file is also the child processes' script (run by path). At the top only the standard
# library and moefast.bench.xla_profile (standard library only, no JAX): the HF child never imports
# JAX, and importing moefast changes nothing process-wide.
if __name__ == "__main__":  # run by path: moefast from this checkout unless it is installed
    sys.path.append(str(Path(__file__).resolve().parent.parent))

from moefast.bench.xla_profile import KINDS  # noqa: E402  (by operation, comparable with torch's op kinds)

__all__ = ["KINDS", "PeersRecord", "StepTiming", "bench_peers", "format_profile_table", "format_table",
           "hf_config_kwargs", "main", "profile_peers", "require_peer_packages", "torch_kind"]

WARMUP_STEPS = 3  # untimed steps per process before the timed ones (and extra train steps)
PROFILE_STEPS = 3  # profiled steps per side (--profile), after the unprofiled timed ones
SIDES = ("moefast_bare", "moefast_train", "hf")
INSTALL_HINT = "pip install -c constraints.txt -e '.[peers]'"


@dataclasses.dataclass
class StepTiming:
    """Timed steps of one side in one process."""

    tokens_per_s: float  # tokens per step / median seconds per step
    step_s: float  # median seconds per step
    mean_step_s: float  # mean seconds per step (the CPU figures below are per step of this mean)
    steps: int  # timed steps behind the median
    user_s_per_step: float  # CPU user seconds per step, all threads (os.times over the timed steps)
    sys_s_per_step: float  # CPU system (kernel) seconds per step
    minor_faults_per_step: float  # minor page faults per step (getrusage ru_minflt)


@dataclasses.dataclass
class PeersRecord:
    """One round: the three sides on one config."""

    round: int  # 1-based
    config: str
    tokens_per_step: int  # batch_size × seq_len
    platform: str  # JAX's platform and device count in the moefast processes
    cpu_count: int  # os.cpu_count()
    shapes: dict[str, Any]  # the MixtralConfig arguments (the moefast config's shapes)
    moefast_params: int  # parameters of the moefast model
    hf_params: int  # parameters of the HF model (tied embeddings counted once)
    jax_version: str
    torch_version: str
    transformers_version: str
    torch_threads: int  # torch.get_num_threads() in the HF process
    host_malloc: str | None  # moefast.host_memory.status() in the bare-step process
    hf_attn_implementation: str  # what the HF model resolved (expected "sdpa")
    hf_experts_implementation: str  # expected "grouped_mm"
    moefast_bare: StepTiming
    hf: StepTiming
    moefast_train_tokens_per_s: float  # the moefast train run summary's tokens_per_s
    moefast_train_steps: int  # train.steps of that run (the first, compiling, step is not in the mean)
    moefast_train_wall_s: float  # wall time of the whole moefast train process
    moefast_final_loss: float  # cross-entropy of the bare step's last timed step, nats/token (sanity)
    hf_final_loss: float  # the same for HF (without its aux loss)
    order: list[str]  # the order the sides ran in this round
    load_before: dict[str, float]  # per side: the 1-minute load average when its process started (another
    # busy process on the machine slows every side, torch's OpenMP threads most)

    @property
    def train_over_hf(self) -> float:
        return self.moefast_train_tokens_per_s / self.hf.tokens_per_s

    @property
    def bare_over_hf(self) -> float:
        return self.moefast_bare.tokens_per_s / self.hf.tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"train_over_hf": self.train_over_hf, "bare_over_hf": self.bare_over_hf}


def require_peer_packages() -> None:
    """Checks that the PyTorch side can run.

    Raises:
      ConfigError: PyTorch or transformers is not installed (the message says how to install them).
    """
    import importlib.util

    from moefast.config import ConfigError

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"benchmarks/peers.py needs {' and '.join(missing)} (not installed); install the "
                          f"peers extra: {INSTALL_HINT}")


def hf_config_kwargs(cfg, vocab_size: int) -> dict[str, Any]:
    """``MixtralConfig`` arguments with the moefast config's shapes.

    Args:
      cfg: the moefast experiment.
      vocab_size: the tokenizer's vocabulary size (``model.vocab_size`` wins when set).

    Raises:
      ConfigError: the moefast model has dense feed-forward layers (Mixtral is MoE in every layer).
    """
    from moefast.config import ConfigError

    m, moe = cfg.model, cfg.moe
    if m.num_dense_layers or m.moe_every != 1:
        raise ConfigError(f"benchmarks/peers.py compares all-MoE models (Mixtral has an MoE in every layer): needs "
                          f"model.num_dense_layers=0 and model.moe_every=1, got {m.num_dense_layers} and {m.moe_every}")
    return {"vocab_size": m.vocab_size or vocab_size, "hidden_size": m.d_model, "intermediate_size": m.d_ff,
            "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads, "num_key_value_heads": m.kv_heads,
            "head_dim": m.head_dim, "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "max_position_embeddings": m.max_seq_len,
            "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rope_base)},
            "rms_norm_eps": m.norm_eps, "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
            "output_router_logits": True, "router_aux_loss_coef": moe.aux_loss_coef, "router_jitter_noise": 0.0,
            "attention_dropout": 0.0, "sliding_window": None, "use_cache": False}


# ---------------------------------------------------------------------------------------- parent side

def _write_batches(cfg, path: Path, count: int) -> None:
    """Writes the first ``count`` training batches (arrays [N, B, T]) to ``path`` (.npz)."""
    import numpy as np

    from moefast.data import load_corpus, train_dataset

    corpus = load_corpus(cfg.data)
    it = iter(train_dataset(corpus, cfg.data, seed=cfg.train.seed))
    batches = [next(it) for _ in range(count)]
    np.savez(path, **{k: np.stack([b[k] for b in batches]) for k in batches[0]})


def _run_child(kind: str, spec: dict[str, Any], tmp: Path, tag: str) -> dict[str, Any]:
    """Runs this file as a fresh process for one side; returns the JSON record it writes."""
    spec_path, out_path = tmp / f"{tag}.spec.json", tmp / f"{tag}.out.json"
    spec_path.write_text(json.dumps(spec | {"out": str(out_path)}))
    cmd = [sys.executable, str(Path(__file__).resolve()), _CHILD, kind, str(spec_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0 or not out_path.is_file():
        raise RuntimeError(f"benchmarks/peers.py: the {kind} process failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(out_path.read_text())


def _run_train(run_dir: Path, steps: int, config: str | None, overrides: list[str],
               cpu_devices: int | None) -> tuple[dict[str, Any], float]:
    """A real ``moefast train`` process; returns its run summary record and its wall time."""
    from moefast.bench.process import train_process

    return train_process(run_dir, [*(["--cpu-devices", str(cpu_devices)] if cpu_devices else []), *overrides,
                                   f"train.steps={steps}", "train.stop_at=null", f"train.log_every={steps}",
                                   "train.eval_every=0", "train.eval_batches=1", "train.checkpoint_every=0"], config)


def _prepare(config: str | None, overrides: list[str], tmp: Path, batches: int) -> tuple[Any, dict[str, Any]]:
    from moefast.config import load_config
    from moefast.data import get_tokenizer

    cfg = load_config(config, overrides)
    shapes = hf_config_kwargs(cfg, get_tokenizer(cfg.data.tokenizer).vocab_size)
    batches_path = tmp / "batches.npz"
    _write_batches(cfg, batches_path, batches)
    return cfg, {"config": config, "overrides": overrides, "batches": str(batches_path), "shapes": shapes,
                 "lr": cfg.train.learning_rate, "b1": cfg.train.b1, "b2": cfg.train.b2,
                 "weight_decay": cfg.train.weight_decay, "grad_clip": cfg.train.grad_clip,
                 "aux_loss_coef": cfg.moe.aux_loss_coef, "seed": cfg.train.seed, "warmup": WARMUP_STEPS}


def bench_peers(config: str | None = None, overrides: list[str] | None = None, *, rounds: int = 3,
                steps: int = 30, cpu_devices: int | None = None,
                log: Callable[[str], None] | None = print) -> list[PeersRecord]:
    """Runs the rounds; see the module docstring.

    Args:
      config: YAML config (``None``: configs/tiny.yaml); overrides: ``section.key=value`` strings,
        applied to every moefast process (and so to the HF shapes).
      rounds: rounds of the three sides.
      steps: timed steps per side and round (bare and HF); the train run has ``steps +``
        :data:`WARMUP_STEPS` steps.
      cpu_devices: ``--cpu-devices`` for the moefast processes (``None``: what ``moefast train`` picks).
      log: printer of one line per round.

    Raises:
      ConfigError: missing packages, a bad config or override, a config Mixtral cannot mirror.
      RuntimeError: a child process failed (its stderr is in the message).
    """
    require_peer_packages()
    overrides = list(overrides or [])
    out = []
    with tempfile.TemporaryDirectory(prefix="moefast-peers-") as tmp_str:
        tmp = Path(tmp_str)
        cfg, spec = _prepare(config, overrides, tmp, WARMUP_STEPS + steps)
        spec |= {"steps": steps, "cpu_devices": cpu_devices}
        for r in range(rounds):
            order = list(SIDES[r % 3:] + SIDES[:r % 3])
            res: dict[str, Any] = {}
            load: dict[str, float] = {}
            for side in order:
                load[side] = os.getloadavg()[0]
                if side == "moefast_train":
                    res[side] = _run_train(tmp / f"train{r}", steps + WARMUP_STEPS, config, overrides, cpu_devices)
                else:
                    res[side] = _run_child(side, spec | {"run_dir": str(tmp / f"bare{r}")}, tmp, f"{side}{r}")
            bare, hf, (summary, train_wall) = res["moefast_bare"], res["hf"], res["moefast_train"]
            rec = PeersRecord(
                round=r + 1, config=cfg.name, tokens_per_step=cfg.data.batch_size * cfg.data.seq_len,
                platform=bare["platform"], cpu_count=os.cpu_count() or 0, shapes=spec["shapes"],
                moefast_params=bare["params"], hf_params=hf["params"], jax_version=bare["jax_version"],
                torch_version=hf["torch_version"], transformers_version=hf["transformers_version"],
                torch_threads=hf["torch_threads"], host_malloc=bare["host_malloc"],
                hf_attn_implementation=hf["attn_implementation"],
                hf_experts_implementation=hf["experts_implementation"],
                moefast_bare=StepTiming(**bare["timing"]), hf=StepTiming(**hf["timing"]),
                moefast_train_tokens_per_s=float(summary["tokens_per_s"]), moefast_train_steps=steps + WARMUP_STEPS,
                moefast_train_wall_s=train_wall, moefast_final_loss=bare["final_loss"], hf_final_loss=hf["final_loss"],
                order=order, load_before=load)
            out.append(rec)
            if log:
                log(f"round {rec.round}/{rounds}: moefast bare step {rec.moefast_bare.tokens_per_s:,.0f} tokens/s | "
                    f"moefast train {rec.moefast_train_tokens_per_s:,.0f} tokens/s | HF Mixtral "
                    f"{rec.hf.tokens_per_s:,.0f} tokens/s | train / HF {rec.train_over_hf:.2f}× | "
                    f"bare / HF {rec.bare_over_hf:.2f}×")
    return out


def format_table(records: list[PeersRecord]) -> str:
    """Markdown table: one row per round and a row of medians over the rounds."""
    head = ["round", "moefast bare tokens/s", "moefast train tokens/s", "HF Mixtral tokens/s", "train / HF",
            "bare / HF", "bare CPU user+sys s/step", "HF CPU user+sys s/step", "bare faults/step",
            "HF faults/step"]

    def row(name, bare, train, hf, r_train, r_bare, bare_cpu, hf_cpu, bare_f, hf_f):
        return (f"| {name} | {bare:,.0f} | {train:,.0f} | {hf:,.0f} | {r_train:.2f}× | {r_bare:.2f}× | "
                f"{bare_cpu:.3f} | {hf_cpu:.3f} | {bare_f:,.0f} | {hf_f:,.0f} |")

    def values(r: PeersRecord):
        return (r.moefast_bare.tokens_per_s, r.moefast_train_tokens_per_s, r.hf.tokens_per_s, r.train_over_hf,
                r.bare_over_hf, r.moefast_bare.user_s_per_step + r.moefast_bare.sys_s_per_step,
                r.hf.user_s_per_step + r.hf.sys_s_per_step, r.moefast_bare.minor_faults_per_step,
                r.hf.minor_faults_per_step)

    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    lines += [row(str(r.round), *values(r)) for r in records]
    if len(records) > 1:
        cols = list(zip(*(values(r) for r in records)))
        lines.append(row("median", *(statistics.median(c) for c in cols)))
    return "\n".join(lines)


def run_cli(*, json_out: str | None, rounds: int, steps: int, config: str | None = None,
            overrides: list[str] | None = None, profile_dir: str | None = None,
            cpu_devices: int | None = None) -> int:
    """``python benchmarks/peers.py``: the rounds (or, with ``profile_dir``, the profile instead)."""
    if profile_dir is not None:
        prof = profile_peers(config, overrides, profile_dir, steps=steps, cpu_devices=cpu_devices)
        table = format_profile_table(prof)
        print(f"\nwhere the step time goes, config {prof['config']} ({prof['tokens_per_step']} tokens/step), "
              f"{prof['profiled_steps']} profiled steps per side after {prof['timed_steps']} unprofiled timed ones\n")
        print(table)
        print(f"\nwrote {Path(profile_dir) / 'profile.md'} and {Path(profile_dir) / 'profile.json'}")
        return 0
    records = bench_peers(config, overrides, rounds=rounds, steps=steps, cpu_devices=cpu_devices)
    r0 = records[0]
    print(f"\nmoefast vs HF transformers Mixtral ({r0.transformers_version}, torch {r0.torch_version}, "
          f"{r0.torch_threads} torch threads, experts {r0.hf_experts_implementation}, attention "
          f"{r0.hf_attn_implementation}), config {r0.config} ({r0.tokens_per_step} tokens/step, "
          f"{r0.moefast_params:,} / {r0.hf_params:,} parameters), {r0.platform}, jax {r0.jax_version}; "
          f"medians of {steps} timed steps per side and round\n")
    table = format_table(records)
    print(table)
    if len(records) > 1:
        med = statistics.median
        print(f"\nmedians over {len(records)} rounds: moefast bare step "
              f"{med(r.moefast_bare.tokens_per_s for r in records):,.0f} tokens/s | moefast train "
              f"{med(r.moefast_train_tokens_per_s for r in records):,.0f} tokens/s | HF Mixtral "
              f"{med(r.hf.tokens_per_s for r in records):,.0f} tokens/s | train / HF "
              f"{med(r.train_over_hf for r in records):.2f}× | bare / HF {med(r.bare_over_hf for r in records):.2f}×")
    if json_out:
        from moefast.bench.process import write_results

        write_results(json_out, [r.to_dict() for r in records], table)
    return 0


# ---------------------------------------------------------------------------------------- profile

def profile_peers(config: str | None, overrides: list[str] | None, out_dir: str | Path, *,
                  steps: int = 30, profile_steps: int = PROFILE_STEPS,
                  cpu_devices: int | None = None) -> dict[str, Any]:
    """One process per side: ``steps`` unprofiled timed steps (step time, CPU figures), then
    ``profile_steps`` traced ones grouped by :data:`KINDS`. Writes ``out_dir/profile.md`` and
    ``out_dir/profile.json`` (and the raw traces, ``out_dir/moefast_trace/`` and
    ``out_dir/hf_trace.json``).

    Returns:
      ``{"config", "tokens_per_step", "profiled_steps", "timed_steps", "shapes", "moefast": {...},
      "hf": {...}}``; each side has ``profile`` (``kinds``: ms per step per kind, from
      :func:`moefast.bench.xla_profile.xla_trace_times` / :func:`torch_profile_times`), ``timing``
      (a :class:`StepTiming` of the unprofiled steps, as a dict) and ``profiled_step_s``.
    """
    require_peer_packages()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    overrides = list(overrides or [])
    with tempfile.TemporaryDirectory(prefix="moefast-peers-") as tmp_str:
        tmp = Path(tmp_str)
        cfg, spec = _prepare(config, overrides, tmp, WARMUP_STEPS + steps + profile_steps)
        spec |= {"steps": steps, "profile_steps": profile_steps, "cpu_devices": cpu_devices}
        res = {
            "moefast": _run_child("moefast_bare", spec | {"run_dir": str(tmp / "bare"),
                                                          "profile_dir": str(out_dir / "moefast_trace")}, tmp, "pm"),
            "hf": _run_child("hf", spec | {"profile_dir": str(out_dir)}, tmp, "ph"),
        }
    prof = {"config": cfg.name, "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len,
            "profiled_steps": profile_steps, "timed_steps": steps,
            "shapes": spec["shapes"], **res}
    (out_dir / "profile.json").write_text(json.dumps(prof, indent=1))
    (out_dir / "profile.md").write_text(format_profile_table(prof) + "\n")
    return prof


def format_profile_table(prof: dict[str, Any]) -> str:
    """Markdown: ms per step by kind of work, moefast next to HF, then the CPU figures and notes."""
    mf, hf = prof["moefast"], prof["hf"]
    mk, hk = mf["profile"]["kinds"], hf["profile"]["kinds"]
    mo = mf["profile"]["kinds_launching_thread"]
    lines = ["| kind | moefast ms/step | HF ms/step | moefast ms/step, launching thread only |", "|---|---:|---:|---:|"]
    for k in KINDS:
        lines.append(f"| {k} | {mk.get(k, 0.0):.1f} | {hk.get(k, 0.0):.1f} | {mo.get(k, 0.0):.1f} |")
    lines.append(f"| **all traced ops** | {sum(mk.values()):.1f} | {sum(hk.values()):.1f} | {sum(mo.values()):.1f} |")
    lines.append(f"| XLA worker time in no op of its own and none elsewhere (not attributed) | "
                 f"{mf['profile']['unattributed_worker_ms']:.1f} | — | — |")
    mt, ht = mf["timing"], hf["timing"]
    lines += [
        f"| wall time per step, profiled, ms | {1e3 * mf['profiled_step_s']:.1f} | "
        f"{1e3 * hf['profiled_step_s']:.1f} | |",
        f"| wall time per step, not profiled, ms (median / mean of {mt['steps']}) | {1e3 * mt['step_s']:.1f} / "
        f"{1e3 * mt['mean_step_s']:.1f} | {1e3 * ht['step_s']:.1f} / {1e3 * ht['mean_step_s']:.1f} | |",
        f"| CPU user ms/step, all threads (os.times, not profiled, mean) | {1e3 * mt['user_s_per_step']:.1f} | "
        f"{1e3 * ht['user_s_per_step']:.1f} | |",
        f"| CPU system ms/step (os.times, not profiled) | {1e3 * mt['sys_s_per_step']:.1f} | "
        f"{1e3 * ht['sys_s_per_step']:.1f} | |",
        f"| minor page faults/step (not profiled) | {mt['minor_faults_per_step']:,.0f} | "
        f"{ht['minor_faults_per_step']:,.0f} | |",
        f"| threads | {mf['profile']['threads']} XLA threads with ops in the trace | {hf['torch_threads']} "
        f"(torch.get_num_threads()) | |",
    ]
    top = lambda side: ", ".join(f"{n} {ms:.1f}" for n, ms in side["profile"]["top_other"]) or "none"
    lines += [
        "",
        "Thread time per kind, ms per step. moefast: each XLA:CPU op event of the trace (an HLO instruction of the "
        "compiled step, kind from its opcode or, for a fusion, the ops inside it: a dot or matmul custom call makes "
        "it matmul; optimizer = instructions whose innermost source frame is in optax (not optax.losses) or in "
        "moefast's train_step (clipping, AdamW, the non-finite guard) — copies of the optimizer state carry no "
        "source frame and count as copies; then gather/scatter, reduction, other (custom calls such as TopK, sort), "
        "elementwise, and pure data movement as copy), plus the time XLA's other worker threads spend in thread-pool "
        "regions outside ops of their own while that op runs (intra-op parallel shards, split evenly between "
        "concurrent ops). HF: self time of each torch op on the threads the profiler traces (the main thread); "
        "the share of OpenMP/MKL worker threads is not traced (compare the os.times rows); ops under AdamW.step, "
        "clip_grad_norm_ and zero_grad count as optimizer; fused SDPA attention counts as matmul. Trace gaps are "
        "not idle time: the OS counts both sides' CPU time in the os.times rows.",
        "",
        f"Largest 'other' entries, ms/step — moefast: {top(mf)}; HF: {top(hf)}.",
    ]
    return "\n".join(lines)


# torch: op name -> kind --------------------------------------------------------------------------

_T_MATMUL = re.compile(r"^aten::(_?grouped_mm|mm|bmm|addmm|addbmm|baddbmm|matmul|linear|dot|vdot|mv|addmv|"
                       r"_?scaled_dot_product.*|_efficient_attention.*|_flash_attention.*|_?convolution.*)$")
_T_GATHER = {"index", "index_select", "gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce",
             "index_add", "index_add_", "index_put", "index_put_", "_index_put_impl_", "index_copy", "index_copy_",
             "index_fill_", "embedding", "embedding_backward", "embedding_dense_backward", "masked_select", "take",
             "take_along_dim", "masked_scatter", "index_reduce"}
_T_REDUCE = {"sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "softmax", "_softmax", "log_softmax",
             "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data", "nll_loss", "nll_loss_forward",
             "nll_loss_backward", "nll_loss_nd", "cross_entropy_loss", "cumsum", "cumprod", "histc", "bincount",
             "linalg_vector_norm", "norm", "_foreach_norm", "logsumexp", "var", "std", "prod", "all", "any",
             "count_nonzero", "_fused_rms_norm", "rms_norm"}
_T_MOVE = {"copy_", "clone", "contiguous", "cat", "stack", "_to_copy", "to", "t", "transpose", "permute", "expand",
           "expand_as", "view", "view_as", "reshape", "_reshape_alias", "_unsafe_view", "as_strided", "slice",
           "select", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "narrow", "repeat",
           "repeat_interleave", "constant_pad_nd", "pad", "flatten", "unflatten", "unbind", "detach", "alias",
           "lift_fresh", "flip", "roll", "movedim", "unfold", "_unsafe_split", "tensor_split", "_foreach_copy_"}
_T_ELEMENTWISE = {"add", "add_", "mul", "mul_", "div", "div_", "sub", "sub_", "rsub", "neg", "exp", "exp_", "log",
                  "log_", "pow", "pow_", "sqrt", "sqrt_", "rsqrt", "silu", "silu_", "silu_backward", "sigmoid",
                  "sigmoid_backward", "tanh", "tanh_backward", "cos", "sin", "where", "masked_fill", "masked_fill_",
                  "fill_", "zero_", "lerp", "lerp_", "addcdiv", "addcdiv_", "addcmul", "addcmul_", "clamp",
                  "clamp_", "clamp_min", "clamp_min_", "clamp_max", "maximum", "minimum", "abs", "sign", "eq", "ne",
                  "lt", "gt", "le", "ge", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or",
                  "bitwise_not", "threshold_backward", "gelu", "gelu_backward", "relu", "reciprocal", "square",
                  "erf", "uniform_", "normal_", "bernoulli_", "dropout", "native_dropout",
                  "native_dropout_backward", "ones_like", "zeros_like", "full_like", "isfinite", "isnan", "nan_to_num",
                  "floor_divide", "remainder", "fmod", "copysign", "exp2", "expm1", "log1p", "sgn"}


def torch_kind(name: str) -> str:
    """Kind (one of :data:`KINDS` other than ``optimizer``, which comes from the op's caller) of
    a ``torch.profiler`` event name such as ``aten::mm``; not an ``aten::`` op (autograd engine
    wrappers, ``record_function`` ranges) → ``other``."""
    if _T_MATMUL.match(name):
        return "matmul"
    if not name.startswith("aten::"):
        return "other"
    op = name[len("aten::"):]
    base = op[len("_foreach_"):] if op.startswith("_foreach_") else op
    if op in _T_GATHER:
        return "gather/scatter"
    if op in _T_REDUCE:
        return "reduction"
    if op in _T_MOVE:
        return "copy/transpose/concatenate"
    if op in _T_ELEMENTWISE or base in _T_ELEMENTWISE:
        return "elementwise/fusion"
    return "other"


def torch_profile_times(events, steps: int, optimizer_range: str) -> dict[str, Any]:
    """Self time per kind of ``torch.profiler`` events (``prof.events()``), ms per step; events
    under the ``optimizer_range`` ``record_function`` count as ``optimizer``."""
    per_kind = {k: 0.0 for k in KINDS}
    other_ops: dict[str, float] = collections.defaultdict(float)
    threads = set()
    for e in events:
        if e.name == optimizer_range:
            continue
        threads.add(e.thread)
        p, under_opt = e.cpu_parent, False
        while p is not None:
            if p.name == optimizer_range:
                under_opt = True
                break
            p = p.cpu_parent
        kind = "optimizer" if under_opt else torch_kind(e.name)
        ms = e.self_cpu_time_total / 1e3 / steps
        per_kind[kind] += ms
        if kind == "other":
            other_ops[e.name] += ms
    return {"kinds": per_kind, "threads": len(threads),
            "top_other": sorted(other_ops.items(), key=lambda kv: -kv[1])[:5]}


# ---------------------------------------------------------------------------------------- children

def _timed(step: Callable[[int], None], first: int, steps: int) -> tuple[dict[str, float], list[float]]:
    """Runs ``step(i)`` for i in [first, first + steps), each timed; CPU figures over them all."""
    import resource

    times = []
    c0, f0 = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i in range(first, first + steps):
        t0 = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - t0)
    c1, f1 = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    med = statistics.median(times)
    return {"step_s": med, "mean_step_s": sum(times) / steps, "steps": steps,
            "user_s_per_step": (c1.user - c0.user) / steps, "sys_s_per_step": (c1.system - c0.system) / steps,
            "minor_faults_per_step": (f1 - f0) / steps}, times


def _warm_timed_profiled(step: Callable[[int], None], spec: dict[str, Any], profiler: Callable[[], Any]):
    """Warm-up steps, the timed steps (:func:`_timed`) and, with ``spec["profile_dir"]``, the
    profiled steps inside ``profiler()`` (a context manager factory).

    Returns:
      ``(timing, out, prof)``: the timing dict, ``{"profiled_step_s": ...}`` (or ``{}``) and what
      the profiler's ``__enter__`` returned (or ``None``).
    """
    for i in range(spec["warmup"]):
        step(i)
    timing, _ = _timed(step, spec["warmup"], spec["steps"])
    out: dict[str, Any] = {}
    prof = None
    if spec.get("profile_dir"):
        first = spec["warmup"] + spec["steps"]
        with profiler() as prof:
            t0 = time.perf_counter()
            for i in range(first, first + spec["profile_steps"]):
                step(i)
            out["profiled_step_s"] = (time.perf_counter() - t0) / spec["profile_steps"]
    return timing, out, prof


def _child_moefast(spec: dict[str, Any]) -> dict[str, Any]:
    from moefast import host_memory

    host_memory.configure()  # first, as moefast train does: before JAX starts its CPU threads
    from moefast.config import load_config
    from moefast.parallel.cpu_devices import set_cpu_devices

    cfg = load_config(spec["config"], spec["overrides"])
    mesh_devices = 1
    for size in (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert):
        mesh_devices *= max(size, 1)
    set_cpu_devices(spec["cpu_devices"], mesh_devices)  # as moefast train would
    import jax
    import numpy as np

    from moefast.train import Trainer

    trainer = Trainer(cfg, spec["run_dir"], log=None, progress=False)
    data = np.load(spec["batches"])
    n = len(data["tokens"])
    batches = [trainer.put_batch({k: data[k][i] for k in data.files}) for i in range(n)]
    step_fn = trainer.compiled_train_step()
    tokens = cfg.data.batch_size * cfg.data.seq_len
    with jax.set_mesh(trainer.mesh):
        box = {"state": trainer.init_state()}

        def step(i):
            box["state"], box["metrics"] = step_fn(box["state"], batches[i % n], trainer.base_key)
            jax.block_until_ready((box["state"], box["metrics"]))

        timing, out, _ = _warm_timed_profiled(
            step, spec, lambda: jax.profiler.trace(spec["profile_dir"], create_perfetto_trace=True))
        if spec.get("profile_dir"):
            from moefast.bench.xla_profile import classify_hlo, latest_trace, xla_trace_times

            out["trace"] = latest_trace(spec["profile_dir"])
            out["profile"] = xla_trace_times(out["trace"], classify_hlo(step_fn.as_text()), spec["profile_steps"])
    loss = float(box["metrics"]["loss"])
    return out | {
        "timing": {"tokens_per_s": tokens / timing["step_s"], **timing},
        "platform": f"{jax.devices()[0].platform} ({jax.device_count()} device(s))",
        "params": int(sum(x.size for x in jax.tree.leaves(trainer.model_def.abstract_params))),
        "jax_version": jax.__version__, "host_malloc": host_memory.status(), "final_loss": loss}


def _child_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(spec["seed"])
    shapes = spec["shapes"]
    mc = MixtralConfig(**shapes, attn_implementation="sdpa", experts_implementation="grouped_mm", dtype="float32")
    model = MixtralForCausalLM(mc).to(torch.float32)
    model.train()
    vocab = shapes["vocab_size"]
    params = list(model.parameters())  # a tied embedding appears once
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": spec["weight_decay"]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=spec["lr"], betas=(spec["b1"], spec["b2"]))
    data = np.load(spec["batches"])
    n = len(data["tokens"])
    batches = [{k: torch.from_numpy(np.ascontiguousarray(data[k][i])) for k in ("tokens", "targets", "loss_weight")}
               for i in range(n)]
    for b in batches:
        b["tokens"], b["targets"] = b["tokens"].long(), b["targets"].long()
    tokens = batches[0]["tokens"].numel()
    coef, clip = spec["aux_loss_coef"], spec["grad_clip"]
    box: dict[str, Any] = {}

    def step(i):
        b = batches[i % n]
        out = model(input_ids=b["tokens"], use_cache=False)
        ce = F.cross_entropy(out.logits.reshape(-1, vocab), b["targets"].reshape(-1), reduction="none")
        w = b["loss_weight"].reshape(-1)
        ce = (ce * w).sum() / w.sum().clamp(min=1.0)
        loss = ce + coef * out.aux_loss
        loss.backward()
        with torch.profiler.record_function(_OPT_RANGE):
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            opt.zero_grad()
        box["loss"] = ce.detach()

    from torch.profiler import ProfilerActivity, profile

    timing, out, prof = _warm_timed_profiled(step, spec, lambda: profile(activities=[ProfilerActivity.CPU]))
    if spec.get("profile_dir"):
        trace = os.path.join(spec["profile_dir"], "hf_trace.json")
        prof.export_chrome_trace(trace)
        out["profile"] = torch_profile_times(prof.events(), spec["profile_steps"], _OPT_RANGE)
        out["trace"] = trace
    return out | {
        "timing": {"tokens_per_s": tokens / timing["step_s"], **timing},
        "params": int(sum(p.numel() for p in params)), "torch_version": torch.__version__,
        "transformers_version": transformers.__version__, "torch_threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": model.config._experts_implementation, "final_loss": float(box["loss"])}


_OPT_RANGE = "moefast.peers.optimizer"  # record_function around clipping + AdamW.step + zero_grad


def _child_main(argv: list[str]) -> int:
    kind, spec_path = argv
    spec = json.loads(Path(spec_path).read_text())
    result = {"moefast_bare": _child_moefast, "hf": _child_hf}[kind](spec)
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


_CHILD = "--child"  # first argument of the child processes: `peers.py --child KIND SPEC.json`


def _parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python benchmarks/peers.py",
        description="tokens/s of moefast (bare compiled step and moefast train) vs Hugging Face transformers' Mixtral "
                    "with the same shapes and batches on this machine (needs pip install -c constraints.txt -e "
                    "'.[peers]'); the module docstring says how it measures")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="config overrides for the moefast side (the HF model follows its shapes)")
    p.add_argument("--config", default=None, help="YAML config (default: configs/tiny.yaml)")
    p.add_argument("--json", default=None, metavar="OUT", help="write records to OUT (and a table to OUT's .md)")
    p.add_argument("--steps", type=int, default=30,
                   help="timed steps per side and round (default 30; with --profile: unprofiled timed steps before "
                        f"{PROFILE_STEPS} profiled ones)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds of the three sides, each side a fresh process (default 3)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="instead of the rounds, one profiled process per side (jax.profiler / torch.profiler); time "
                        "per step by kind of work in DIR/profile.md, traces in DIR")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="virtual CPU devices of the moefast processes (default: what moefast train picks)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line (``python benchmarks/peers.py --help``); returns the exit status."""
    from moefast.config import ConfigError

    args, extra = _parser().parse_known_args(argv)
    strays = [a for a in extra if a.startswith("-") or "=" not in a]
    if strays:
        _parser().error(f"unrecognized arguments: {' '.join(strays)}")
    try:
        if args.steps < 1 or args.rounds < 1:
            raise ConfigError(f"--steps and --rounds must be >= 1, got {args.steps} and {args.rounds}")
        if args.cpu_devices is not None and args.cpu_devices < 1:
            raise ConfigError(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
        if args.json == "" or args.profile == "":
            raise ConfigError("--json and --profile need a path (got an empty string)")
        if args.profile is not None and args.json:
            raise ConfigError("--profile writes DIR/profile.json and DIR/profile.md itself; drop --json")
        if args.profile is not None and os.path.exists(args.profile) and not os.path.isdir(args.profile):
            raise ConfigError(f"--profile {args.profile} exists and is not a directory; choose another path")
        if args.json:
            out_dir = os.path.dirname(os.path.abspath(args.json))
            if not os.path.isdir(out_dir):
                raise ConfigError(f"--json {args.json}: the directory {out_dir} does not exist; create it or choose "
                                  "another path")
            if os.path.isdir(args.json) or args.json.endswith(".md"):
                raise ConfigError(f"--json {args.json}: give a file name for the JSON records (e.g. out.json); the "
                                  "markdown table is written next to it with the suffix .md")
        return run_cli(json_out=args.json, rounds=args.rounds, steps=args.steps, config=args.config,
                       overrides=[*args.overrides, *extra], profile_dir=args.profile, cpu_devices=args.cpu_devices)
    except (ConfigError, ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    if sys.argv[1:2] == [_CHILD]:
        sys.exit(_child_main(sys.argv[2:]))
    sys.exit(main())

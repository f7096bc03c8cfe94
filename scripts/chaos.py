#!/usr/bin/env python
"""Chaos soak: a training run killed with SIGKILL again and again, restarted with the same command
each time, must end exactly where an uninterrupted run ends.

Runs ``moefast train`` of a small config (one CPU device, asynchronous checkpoints) twice in
``--work-dir``: once uninterrupted (``reference/``) and once (``chaos/``) killed ``--kills`` times
at moments drawn from ``--seed`` and restarted after each kill until it finishes. Each kill aims at
one phase, in a seeded shuffled rotation so every phase gets its share:

* ``startup``: a random moment between the process start and its first training step (imports,
  corpus, compilation or compilation-cache load, before or after the restore);
* ``restore``: just after the console line that precedes restoring the checkpoint;
* ``step``: just after the log line of a random training step;
* ``save``: while an asynchronous checkpoint is being written (orbax's
  ``<step>.orbax-checkpoint-tmp`` directory exists);
* ``eval``: just after the log line of a step that is evaluated (the evaluation runs then).

Then it checks, and exits 1 unless all hold:

* the final checkpoint's parameters, optimizer state, routing state and step are bit-identical to
  the reference's;
* ``metrics.jsonl`` holds each step's ``train`` record exactly once, in step order, with the
  reference's values (all but the timing fields: tokens/s, MFU, page faults), and the same
  ``eval`` and ``alert`` records (records of replayed steps are removed on resume, see
  :mod:`moefast.train.metrics`);
* no unfinished (``*.orbax-checkpoint-tmp``) or set-aside (``*.corrupt-*``) step directory is left,
  at most ``checkpoint.keep`` steps remain and each restores; measured after every start, the
  checkpoints directory took at most ``keep + 2`` steps' space (``keep`` complete steps, one write
  a kill cut short, one older step whose deletion a kill interrupted);

and reports the kills per phase, the steps trained again after kills (a lower bound: a step killed
before its log line is not seen) and the wall-time overhead against the reference::

    python scripts/chaos.py --work-dir /tmp/chaos --kills 20 --seed 0 --json /tmp/chaos/report.json

``tests/train/test_chaos.py`` runs it in the default suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

PHASES = ("startup", "restore", "step", "save", "eval")
TIMING_KEYS = {"tokens_per_s", "mfu", "page_faults_per_step"}
TMP = ".orbax-checkpoint-tmp"

# A model whose step takes milliseconds on a CPU; routing state is exercised by the aux-loss-free
# bias (updated every step outside the optimizer).
CONFIG = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.head_dim=16", "model.d_ff=64",
          "model.max_seq_len=64", "moe.num_experts=4", "moe.top_k=2", "moe.aux_free_bias_rate=0.001",
          "data.seq_len=32", "data.batch_size=8", "train.warmup_steps=5", "train.eval_batches=2",
          "train.log_every=1", "checkpoint.async_save=true",
          "train.peak_tflops=1.0"]  # MFU's peak given: no matmul timed at each start


class Attempt:
    """One start of ``moefast train``: its process, console lines (with arrival times) and stderr."""

    def __init__(self, cmd: list[str], env: dict[str, str], log_dir: Path, index: int):
        self.t0, self.wall_t0 = time.perf_counter(), time.time()
        self.stderr_path = log_dir / f"attempt-{index:02d}.stderr"
        self._err = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter() - self.t0, line.rstrip("\n")))

    def finish(self, timeout: float) -> float:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        self._err.close()
        self.stderr_path.with_suffix(".stdout").write_text("".join(f"{t:8.3f} {line}\n" for t, line in self.lines))
        return time.perf_counter() - self.t0

    def steps_logged(self) -> list[int]:
        return [int(m.group(1)) for _, line in self.lines if (m := re.match(r"step\s+(\d+) \| loss", line))]

    def first_step_s(self) -> float | None:
        return next((t for t, line in self.lines if re.match(r"step\s+\d+ \| loss", line)), None)

    def resumed_from(self) -> int | None:
        """The step this start resumed from (0: a new run), ``None`` when it was killed before saying."""
        for _, line in self.lines:
            if m := re.match(r"resuming from step (\d+)", line):
                return int(m.group(1))
        return 0 if any(line.startswith("per device:") for _, line in self.lines) else None


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass  # deleted meanwhile
    return total


def _writing(ckpts: Path, since: float, min_step: int = 0) -> bool:
    """A checkpoint write of a step >= ``min_step``, begun after ``since`` (wall clock), is in
    progress (a leftover of an earlier, killed start does not count)."""
    try:
        return any(TMP in n and int(n.split(".")[0]) >= min_step and os.stat(ckpts / n).st_ctime >= since
                   for n in os.listdir(ckpts))
    except OSError:  # no directory yet, or the write finished between listing and stat
        return False


def _kill_when(attempt: Attempt, phase: str, rng: random.Random, *, ckpts: Path, eval_every: int,
               startup_s: float, last: int, goal: int) -> str | None:
    """Waits for ``phase``'s moment and SIGKILLs the process; returns what the kill landed after
    (its last console line, or the unfinished checkpoint directory), or ``None`` when the process
    ended first. Step, save and evaluation kills land at step ``goal`` or later (the plan spreads the
    goals over the run), and at most one checkpoint interval or evaluation after the resumed step."""
    target_step = None
    delay = {"startup": rng.uniform(0.0, startup_s), "restore": rng.uniform(0.0, 0.1),
             "step": rng.uniform(0.0, 0.02), "save": rng.uniform(0.0, 0.005), "eval": rng.uniform(0.0, 0.05)}[phase]
    step_offset = rng.randint(1, 10)
    armed_at = 0.0 if phase == "startup" else None
    while attempt.proc.poll() is None:
        now = time.perf_counter() - attempt.t0
        logged = attempt.steps_logged()
        if phase == "startup" and logged:  # training began before the drawn moment: kill now
            armed_at, delay = now, 0.0
        if armed_at is None:
            if phase == "restore" and any(line.startswith("MFU:") for _, line in attempt.lines):
                armed_at = now
            elif phase in ("step", "eval"):
                if logged and target_step is None:
                    start = logged[0] - 1
                    begin = max(start + 1, goal)
                    if phase == "step":
                        target_step = min(max(start + step_offset, goal), last)
                    else:  # the first evaluation from there
                        target_step = next((s for s in range(begin, last + 1) if s % eval_every == 0), last)
                if target_step is not None and logged and logged[-1] >= target_step:
                    armed_at = now
            elif phase == "save" and _writing(ckpts, attempt.wall_t0, goal):
                armed_at = now
        if armed_at is not None and now >= armed_at + delay:
            if phase == "save" and not _writing(ckpts, attempt.wall_t0, goal):
                armed_at = None  # the write finished meanwhile: wait for the next one
                continue
            attempt.proc.send_signal(signal.SIGKILL)
            landed = attempt.lines[-1][1][:80] if attempt.lines else "(no output yet)"
            if phase == "save":
                landed = "writing " + ", ".join(n for n in os.listdir(ckpts) if TMP in n)
            return landed
        time.sleep(0.0005)
    return None


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _compare_metrics(chaos: Path, reference: Path, last: int) -> list[str]:
    problems = []
    got, want = _records(chaos), _records(reference)
    steps = [r["step"] for r in got]
    if steps != sorted(steps):
        problems.append("metrics.jsonl is not in step order")
    train = [r for r in got if r["kind"] == "train"]
    if [r["step"] for r in train] != list(range(1, last + 1)):
        problems.append(f"train records are not steps 1..{last} once each: {[r['step'] for r in train][:200]}")
    for kind in ("train", "eval", "alert", "nonfinite"):
        a = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in got if r["kind"] == kind]
        b = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in want if r["kind"] == kind]
        if a != b:
            diff = next((f"step {x['step']}" for x, y in zip(a, b) if x != y), f"{len(a)} vs {len(b)} records")
            problems.append(f"{kind} records differ from the uninterrupted run's (first at {diff})")
    return problems


def _compare_states(chaos: Path, reference: Path, step: int) -> tuple[list[str], int]:
    """Restores both runs' checkpoint ``step`` and compares every array bit for bit."""
    import jax
    import numpy as np

    from moefast.train import Trainer, load_run_config
    from moefast.train.checkpoint import Checkpointer

    cfg = load_run_config(reference)
    trainer = Trainer(cfg, reference, log=None, progress=False)
    target = trainer.abstract_state()
    a = Checkpointer(chaos / "checkpoints", async_save=False).restore(target, cfg, step=step).state
    b = Checkpointer(reference / "checkpoints", async_save=False).restore(target, cfg, step=step).state
    problems, n = [], 0
    for part in ("params", "opt_state", "routing", "step"):
        la, lb = jax.tree_util.tree_leaves_with_path(a[part]), jax.tree_util.tree_leaves_with_path(b[part])
        if [p for p, _ in la] != [p for p, _ in lb]:
            problems.append(f"{part}: tree structures differ")
            continue
        for (path, x), (_, y) in zip(la, lb):
            n += 1
            x, y = np.asarray(x), np.asarray(y)
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                problems.append(f"{part}{jax.tree_util.keystr(path)} differs")
    return problems, n


def _check_checkpoints(chaos: Path, keep: int) -> list[str]:
    from moefast.train import Trainer, load_run_config
    from moefast.train.checkpoint import Checkpointer

    ckpts = chaos / "checkpoints"
    names = sorted(os.listdir(ckpts))
    problems = [f"left in {ckpts}: {n}" for n in names if TMP in n or ".corrupt-" in n]
    steps = [int(n) for n in names if n.isdigit()]
    if len(steps) > keep:
        problems.append(f"{len(steps)} steps kept, checkpoint.keep={keep}: {steps}")
    cfg = load_run_config(chaos)
    target = Trainer(cfg, chaos, log=None, progress=False).abstract_state()
    for s in steps:
        try:
            Checkpointer(ckpts, async_save=False).restore(target, cfg, step=s)
        except Exception as e:  # noqa: BLE001 - reported
            problems.append(f"step {s} does not restore: {e}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", required=True, type=Path, help="new or empty directory for both runs")
    p.add_argument("--kills", type=int, default=20, help="SIGKILLs to survive (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill plan (default 0)")
    p.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (default 10)")
    p.add_argument("--eval-every", type=int, default=20, help="steps between evaluations (default 20)")
    p.add_argument("--keep", type=int, default=3, help="checkpoint.keep (default 3)")
    p.add_argument("--json", type=Path, default=None, help="write the report here too")
    p.add_argument("--timeout-s", type=float, default=900, help="give up after this long (default 900)")
    args = p.parse_args(argv)
    if min(args.kills, args.steps, args.checkpoint_every, args.eval_every, args.keep) < 1:
        p.error("--kills, --steps, --checkpoint-every, --eval-every and --keep must be >= 1")
    work = args.work_dir.absolute()
    if work.exists() and not work.is_dir():
        p.error(f"--work-dir {work} exists and is not a directory")
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        p.error(f"--work-dir {work} is not empty")
    t_begin = time.perf_counter()
    corpus = work / "corpus"
    corpus.mkdir()
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("[a-c]*.py"))[:8]:
        shutil.copy(f, corpus / f.name)
    env = dict(os.environ)  # other XLA flags pass through; a virtual-device count would contradict --cpu-devices 1
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if not f.startswith("--xla_force_host_platform_device_count"))
    env["PYTHONUNBUFFERED"] = "1"
    config = [*CONFIG, f"data.source={corpus}", f"train.steps={args.steps}",
              f"train.checkpoint_every={args.checkpoint_every}", f"train.eval_every={args.eval_every}",
              f"checkpoint.keep={args.keep}"]

    def command(run: Path) -> list[str]:
        return [sys.executable, "-m", "moefast", "train", "--run-dir", str(run), "--cpu-devices", "1",
                "--no-progress", *config]

    logs = work / "logs"
    logs.mkdir()
    reference, chaos = work / "reference", work / "chaos"
    ref = Attempt(command(reference), env, logs, 0)
    ref_wall = ref.finish(timeout=args.timeout_s)
    if ref.proc.returncode != 0:
        print(f"the uninterrupted run failed (exit {ref.proc.returncode}); see {ref.stderr_path}", file=sys.stderr)
        return 1
    startup_s = next(t for t, line in ref.lines if re.match(r"step\s+1 \|", line))
    ckpt_bytes = max(_dir_bytes(reference / "checkpoints" / n) for n in os.listdir(reference / "checkpoints"))

    rng = random.Random(args.seed)
    plan: list[str] = []
    while len(plan) < args.kills:
        rotation = list(PHASES)
        rng.shuffle(rotation)
        plan += rotation
    plan = plan[:args.kills]
    kills: list[dict] = []
    attempts, total_wall, executed, max_ckpt_bytes, problems = 0, 0.0, 0, 0, []
    restarts_to_step: list[float] = []  # seconds from a restart to its first step's log line
    while True:
        if time.perf_counter() - t_begin > args.timeout_s:
            problems.append(f"gave up after {args.timeout_s:.0f} s with {len(kills)} kills")
            break
        attempts += 1
        ckpts_at_start = sorted(int(n) for n in os.listdir(chaos / "checkpoints") if n.isdigit()) \
            if (chaos / "checkpoints").is_dir() else []
        a = Attempt(command(chaos), env, logs, attempts)
        phase = plan[len(kills)] if len(kills) < len(plan) else None
        landed = None
        if phase is not None:
            # goals spread over the run, up to one evaluation interval before its end
            goal = (len(kills) + 1) * max(args.steps - args.eval_every, 1) // (args.kills + 1)
            landed = _kill_when(a, phase, rng, ckpts=chaos / "checkpoints", eval_every=args.eval_every,
                                startup_s=startup_s, last=args.steps, goal=goal)
        wall = a.finish(timeout=args.timeout_s)
        total_wall += wall
        logged = a.steps_logged()
        if a.first_step_s() is not None and attempts > 1:
            restarts_to_step.append(a.first_step_s())
        executed += max(logged[-1] - (a.resumed_from() or 0), 0) if logged else 0
        if (chaos / "checkpoints").exists():
            max_ckpt_bytes = max(max_ckpt_bytes, _dir_bytes(chaos / "checkpoints"))
        if landed is not None:
            kills.append({"phase": phase, "resumed_from": a.resumed_from(), "landed_after": landed,
                          "seconds": round(wall, 2), "checkpoints_at_start": ckpts_at_start})
            print(f"kill {len(kills):>2} ({phase:>7}) after {wall:5.2f} s: {landed}", flush=True)
            continue
        if a.proc.returncode != 0:
            problems.append(f"attempt {attempts} exited with {a.proc.returncode} on its own; see {a.stderr_path}: "
                            + a.stderr_path.read_text()[-2000:])
            break
        if phase is None:
            break  # the final, uninterrupted attempt finished
        # the process finished before the planned moment
        problems.append(f"the run finished before kill {len(kills) + 1} ({phase}) could land")
        break
    if not problems:
        problems += _compare_metrics(chaos, reference, args.steps)
        state_problems, arrays = _compare_states(chaos, reference, args.steps)
        problems += state_problems
        problems += _check_checkpoints(chaos, args.keep)
        if max_ckpt_bytes > (args.keep + 2) * ckpt_bytes:
            problems.append(f"checkpoints took {max_ckpt_bytes} bytes, more than keep + 2 = {args.keep + 2} steps of "
                            f"{ckpt_bytes} bytes")
    else:
        arrays = 0
    by_phase = {ph: sum(k["phase"] == ph for k in kills) for ph in PHASES}
    report = {
        "kills": len(kills), "kills_by_phase": by_phase, "attempts": attempts, "steps": args.steps,
        "steps_replayed_at_least": max(executed - args.steps, 0),
        "arrays_compared_bitwise": arrays,
        "reference_wall_s": round(ref_wall, 2), "chaos_wall_s": round(total_wall, 2),
        "overhead": round(total_wall / ref_wall, 2),
        "uninterrupted_start_to_first_step_s": round(startup_s, 2),
        "restart_to_first_step_s_median": (round(sorted(restarts_to_step)[len(restarts_to_step) // 2], 2)
                                           if restarts_to_step else None),
        "checkpoint_bytes": ckpt_bytes, "max_checkpoints_dir_bytes": max_ckpt_bytes,
        "run_dir_bytes": _dir_bytes(chaos), "reference_run_dir_bytes": _dir_bytes(reference),
        "seed": args.seed, "problems": problems, "kill_log": kills, "ok": not problems,
        "soak_wall_s": round(time.perf_counter() - t_begin, 1),
    }
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(f"{len(kills)} kills survived ({', '.join(f'{k} {v}' for k, v in by_phase.items())}) in {attempts} "
          f"starts; >= {report['steps_replayed_at_least']} steps replayed; wall {total_wall:.1f} s vs "
          f"{ref_wall:.1f} s uninterrupted ({report['overhead']}x); {arrays} arrays bit-identical"
          if not problems else "FAILED:\n  " + "\n  ".join(problems))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())

"""The training loop: step, log, evaluate, save, stop, over small parts with one job each.

Typical use from a script or notebook::

    from moefast import load_config, Trainer
    cfg = load_config(overrides=["train.steps=100"])
    summary = Trainer(cfg, run_dir="runs/demo").run()

The parts: :mod:`~moefast.train.resume` (fresh state or exact resume from the run dir's latest
checkpoint), :mod:`~moefast.train.timing` (metrics read back one step late, log lines, tokens/s,
the non-finite-step policy), :mod:`~moefast.train.evaluation`, :mod:`~moefast.train.signals`
(SIGTERM / SIGINT stop after a step with a checkpoint), :mod:`~moefast.train.profiling`,
:mod:`~moefast.train.run_dir` (the run dir's checks, ``config.yaml`` and write errors),
:mod:`~moefast.train.checks` (what the platform cannot run, refused before anything compiles) and
:mod:`~moefast.train.checkpoint`. :class:`Trainer` owns the mesh, the shardings and the compiled
steps, and :meth:`Trainer.run` holds the loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moefast import host_memory, parallel
from moefast.parallel import xla_flags
from moefast.config import ExperimentConfig
from moefast.data import Corpus, eval_batches, get_tokenizer, load_corpus, train_dataset
from moefast.parallel.distributed import assert_same_config
from moefast.train import run_dir as run_dir_lib
from moefast.train.checkpoint import Checkpointer, CheckpointError, quiet_orbax_aftermath
from moefast.train.checks import check_run, config_warnings
from moefast.train.compile_cache import configure_compilation_cache
from moefast.train.evaluation import Evaluator, format_eval
from moefast.model import init_routing_state
from moefast.model import lora
from moefast.model.flops import model_flops_per_token
from moefast.train import mfu as mfu_lib
from moefast.train.metrics import MetricsWriteError, MetricsWriter
from moefast.train.prefetch import DevicePrefetcher
from moefast.train.profiling import ProfileWindow
from moefast.train import optimizer
from moefast.train.resume import OptimizerReset, start_or_resume
from moefast.train.run_dir import load_run_config
from moefast.train.signals import StopRequest
from moefast.train.step import BATCH_KEYS, ModelDef, make_optimizer, split_trainable, train_step
from moefast.train.summary import TrainingError, TrainSummary
from moefast.train.timing import StepBook

__all__ = ["Trainer", "TrainSummary", "TrainingError", "config_warnings", "load_run_config"]  # config_warnings: checks.py


@dataclasses.dataclass(frozen=True)
class _Every:
    """When the loop evaluates and saves: every ``eval_every`` / ``checkpoint_every`` optimizer
    steps (0: never) and after the run's last step."""
    eval_every: int
    checkpoint_every: int
    last: int

    def save(self, done: int) -> bool:
        return bool(self.checkpoint_every and done % self.checkpoint_every == 0) or done == self.last

    def evaluate(self, done: int) -> bool:
        return bool(self.eval_every and done % self.eval_every == 0) or done == self.last


@dataclasses.dataclass
class _Run:
    """One invocation of :meth:`Trainer.run`: what the loop reads and advances."""
    t_start: float  # time.perf_counter() at the start of run()
    start: int  # optimizer steps done before this run
    last: int  # the step this run ends at (train.stop_at or train.steps)
    state: dict[str, Any]  # the train state (donated to each step)
    data_state: Any  # the data iterator's position after the last dispatched step
    ckpt: Checkpointer
    writer: MetricsWriter
    book: StepBook
    batches: DevicePrefetcher
    step_fn: Any  # the compiled train step (None when nothing is left to train)
    every: _Every
    profile: ProfileWindow
    stop: StopRequest
    say: Callable[[str], None]
    bar: Any  # tqdm progress bar or None
    memory: dict[str, int] | None
    done: int = 0  # optimizer steps done in total
    stopped_by: str | None = None
    eval_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    eval_at: int | None = None  # the step eval_metrics belong to
    tokens_per_s: float | None = None
    faults_per_step: float | None = None


def tokenizer_record(tokenizer, name: str) -> dict[str, Any]:
    """What a run's checkpoints record of its tokenizer: ``name`` (``data.tokenizer``), its
    ``vocab_size`` and an ``identity`` (:func:`moefast.data.prepared.tokenizer_identity` of its files,
    with a ``chat_template.jinja`` beside them folded in: it decides what an SFT run trains on);
    ``None`` for a kind of tokenizer whose files are not known (its size is still checked)."""
    from moefast.data import DataError
    from moefast.data.prepared import tokenizer_identity
    from moefast.data.sft import CHAT_TEMPLATE_FILE

    try:
        identity = tokenizer_identity(tokenizer)
    except DataError:
        identity = None
    template = Path(getattr(tokenizer, "path", "") or "").parent / CHAT_TEMPLATE_FILE
    if identity and identity != "byte" and template.is_file():
        h = hashlib.sha256(f"{identity}\0{CHAT_TEMPLATE_FILE}\0".encode())
        h.update(template.read_bytes())
        identity = "sha256:" + h.hexdigest()
    return {"name": name, "vocab_size": tokenizer.vocab_size, "identity": identity}


class Trainer:
    """Owns a run: corpus, model definition, mesh, compiled steps, checkpoints and metrics.

    Args:
      cfg: the experiment.
      run_dir: where checkpoints, ``metrics.jsonl``, TensorBoard events and ``config.yaml`` go;
        ``None`` = ``runs/<cfg.name>``. An existing run dir with checkpoints is resumed.
      log: console printer (``print``-like); ``None`` prints nothing.
      progress: show a tqdm progress bar (only when the output is a terminal).
      corpus: reuse an already loaded corpus (tests, notebooks).
      devices: devices of the mesh (default: all devices of all processes).
      profile: ``(start, end)``: write a ``jax.profiler`` trace of optimizer steps ``start`` to
        ``end`` (1-based, inclusive) into ``<run_dir>/profile`` (TensorBoard's profile plugin and
        ui.perfetto.dev read it). The devices finish the steps before ``start`` first, and the
        trace stops once step ``end`` is done (or the run ends).
      reset_optimizer: resume the run dir's checkpoint with a fresh optimizer state (weights, routing
        state, step, data position and learning-rate schedule kept); needed to change
        ``train.optimizer`` (:func:`moefast.train.resume.start_or_resume`).

    Raises:
      ValueError: ``profile`` is not ``1 <= start <= end``.
      ConfigError: ``run_dir`` does not exist and cannot be created (a path component is a file,
        or the directory above it is not writable); a config this mesh's platform cannot run
        (:func:`moefast.train.checks.check_run`: Pallas or Triton routing, FP8, the hierarchical
        exchange), before anything compiles; a relative ``data.source``/``data.tokenizer`` of an
        existing run that is not found from the working directory
        (:func:`moefast.train.run_dir.absolute_data_paths`; found ones are made absolute in
        :attr:`cfg`).
      CheckpointError: ``run_dir`` exists and is not a directory, or holds files but no run
        (:func:`moefast.train.run_dir.check_run_dir`): refused before anything is read or restored.

    Errors name the run dir "run dir" (``run_dir`` here, ``--run-dir`` on the command line) and
    config keys as ``section.key``, the same for Python and command-line users.
    """

    def __init__(self, cfg: ExperimentConfig, run_dir: str | Path | None = None, *,
                 log: Callable[[str], None] | None = print, progress: bool = True,
                 corpus: Corpus | None = None, devices: list | None = None,
                 profile: tuple[int, int] | None = None, reset_optimizer: bool = False):
        if profile is not None and not (isinstance(profile, tuple) and len(profile) == 2 and 1 <= profile[0] <= profile[1]):
            raise ValueError(f"profile={profile!r}: expected (start, end) optimizer steps with 1 <= start <= end, "
                             "e.g. (10, 12)")
        self.profile, self.reset_optimizer = profile, reset_optimizer
        self.cfg = cfg
        self.run_dir = Path(run_dir or Path("runs") / cfg.name)
        run_dir_lib.check_run_dir(self.run_dir)  # an existing read-only one is refused by run(), not here
        xla_flags.configure(cfg.overlap.xla_flags, log=log or (lambda s: None))  # before JAX starts, if it has not
        self.is_main = jax.process_index() == 0
        self._log = log if (log is not None and self.is_main) else (lambda s: None)
        # Checkpoint warnings (e.g. a corrupt step skipped) go to the console log; without one, to
        # Python warnings.
        self._ckpt_log = self._log if log is not None else None
        self.progress = progress and self.is_main
        assert_same_config(cfg.to_dict())
        # paths as typed are stored absolute: the run (config.yaml, checkpoints) works from any directory
        self.cfg = cfg = run_dir_lib.absolute_data_paths(cfg, self.run_dir)
        self.compile_cache_dir = configure_compilation_cache(cfg.cache.compile_dir)
        # The host malloc policy is the process's: the CLI sets it, a script opts in
        # (moefast.host_memory.configure() before any JAX computation); a Trainer only reports it.
        self.host_malloc = host_memory.status() or "system (not configured)"
        self.mesh = parallel.make_mesh(cfg, devices)
        self.platform = parallel.platform(self.mesh)  # what the steps are compiled for
        for note in check_run(cfg, self.mesh):  # refuses what this platform cannot run, before anything compiles
            self._log(note)
        if corpus is not None:
            self.corpus = corpus  # else read on first use (cached_property): compiling needs only the tokenizer
        self.data_cfg = cfg.data  # with a run-dir-relative tokenizer path resolved
        tok = cfg.data.tokenizer
        if tok != "byte" and not Path(tok).is_absolute() and (self.run_dir / tok).exists():
            self.data_cfg = dataclasses.replace(cfg.data, tokenizer=str((self.run_dir / tok).resolve()))
        self.tokenizer = corpus.tokenizer if corpus is not None else get_tokenizer(self.data_cfg.tokenizer)
        self.model_def = ModelDef(cfg, self.tokenizer.vocab_size)
        self.replicated = NamedSharding(self.mesh, P())
        self.batch_sharding = NamedSharding(self.mesh, parallel.batch_spec(self.mesh))
        self.state_sharding = self._state_sharding()
        self.trace_count = 0
        self.flops_per_token = model_flops_per_token(cfg, self.tokenizer.vocab_size)

        def counted_step(state, batch, key):
            self.trace_count += 1  # runs only while tracing: counts (re)compilations
            return train_step(self.model_def, state, batch, key)

        self._train_step = jax.jit(counted_step, donate_argnums=0,
                                   in_shardings=(self.state_sharding, self.batch_sharding, self.replicated),
                                   out_shardings=(self.state_sharding, self.replicated))
        self._evaluator = Evaluator(
            self.model_def, self.mesh, self.state_sharding, batch_sharding=self.batch_sharding,
            replicated=self.replicated, bytes_per_token=self.tokenizer.bytes_per_token,
            put_batch=lambda b: self.put_batch(b),
            batches=lambda: eval_batches(self.corpus, self.cfg.data, self.cfg.train.eval_batches,
                                         process_index=jax.process_index(), process_count=jax.process_count()))
        self.base_key = jax.random.key(cfg.train.seed)
        self._compiled_step = None

    @functools.cached_property
    def _tokenizer_record(self) -> dict[str, Any]:
        return tokenizer_record(self.tokenizer, self.cfg.data.tokenizer)

    def identity(self, *, corpus: bool = True) -> dict[str, Any]:
        """What the run's checkpoints record of its data: the tokenizer (name, size and hash: a
        checkpoint restored with another is refused before its arrays are read) and, with
        ``corpus``, the prepared corpus's identity (a resume on a corpus prepared again is
        refused); ``corpus=False`` does not read the corpus."""
        out: dict[str, Any] = {"tokenizer": self._tokenizer_record}
        if corpus and self.corpus.prepared_identity is not None:
            out["corpus"] = self.corpus.prepared_identity
        return out

    @functools.cached_property
    def corpus(self) -> Corpus:
        """The run's corpus (``data.*``), read on first use."""
        return load_corpus(self.data_cfg)

    @functools.cached_property
    def peak(self) -> mfu_lib.Peak:
        """Peak FLOP/s of the mesh's devices, the denominator of MFU (on CPU measured on first use)."""
        return mfu_lib.peak_flops(self.mesh.devices.flat, self.cfg.train.peak_tflops)

    # ------------------------------------------------------------------ state
    def put_batch(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows of a global batch (arrays [B_local, T] keyed by ``BATCH_KEYS``) as
        global arrays in the batch sharding."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(batch[k]))
                for k in BATCH_KEYS}

    def _state_sharding(self) -> dict[str, Any]:
        """Shardings of the train state: parameters by their logical axes (``fsdp`` splits
        ``embed``, ``expert`` splits experts) plus the ZeRO split over ``data`` and ``expert``
        (:meth:`~moefast.train.step.ModelDef.param_state_specs`); optimizer moments like their
        parameter; scalars replicated."""
        param_spec = self.model_def.param_state_specs(self.mesh)
        abstract = self.model_def.abstract_state()
        specs = {"params": param_spec, "opt_state": self._opt_spec(self.cfg, abstract["opt_state"]), "step": P(),
                 "routing": jax.tree.map(lambda _: P(), abstract["routing"])}
        return parallel.shardings(self.mesh, specs)

    def _opt_spec(self, cfg: ExperimentConfig, abstract_opt_state):
        """``PartitionSpec``s of ``cfg``'s optimizer state (:func:`moefast.train.optimizer.state_specs`);
        ``cfg`` may train other parameters than this run (a checkpoint's, ``train.indexer_stage``)."""
        trainable = split_trainable(cfg, self.model_def.param_state_specs(self.mesh))[0]
        return optimizer.state_specs(make_optimizer(cfg), abstract_opt_state, trainable)

    def init_state(self) -> dict[str, Any]:
        """Fresh train state, created directly in its shardings (no device holds a full copy of
        a split parameter)."""
        seed = self.cfg.train.seed
        with jax.set_mesh(self.mesh):
            return jax.jit(lambda: self.model_def.init_state(seed), out_shardings=self.state_sharding)()

    def abstract_state(self) -> dict[str, Any]:
        """Shapes, dtypes and shardings of the train state (the restore target)."""
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.model_def.abstract_state(), self.state_sharding)

    def lower_train_step(self) -> jax.stages.Lowered:
        """The train step lowered for this run's exact shapes and shardings (nothing runs; works for
        compile-only devices too)."""
        batch = {k: jax.ShapeDtypeStruct((self.cfg.data.batch_size, self.cfg.data.seq_len),
                                         np.float32 if k == "loss_weight" else np.int32,
                                         sharding=self.batch_sharding)
                 for k in BATCH_KEYS}
        key = jax.ShapeDtypeStruct(self.base_key.shape, self.base_key.dtype, sharding=self.replicated)
        with jax.set_mesh(self.mesh):
            return self._train_step.lower(self.abstract_state(), batch, key)

    def compiler_options(self) -> dict[str, bool | int | str]:
        """XLA options the train step is compiled with: the collective-overlap flags
        (:data:`~moefast.parallel.xla_flags.GPU_FLAGS`) when the mesh is on GPUs and
        ``overlap.xla_flags`` is on, except those ``XLA_FLAGS`` sets itself; with
        ``model.sequence_slices`` > 1, identical collectives merged (the slices' weight gathers)."""
        return xla_flags.compile_options(self.cfg.overlap.xla_flags, self.platform, self.cfg.overlap.collectives_in_flight,
                                         dedupe_collectives=self.cfg.model.sequence_slices > 1)

    def compiled_train_step(self):
        """The train step compiled ahead of time for this run's exact shapes and shardings (traced
        once; a batch of another shape or dtype is an error, never a silent recompilation)."""
        if self._compiled_step is None:
            self._compiled_step = self.lower_train_step().compile(self.compiler_options())
        return self._compiled_step

    def memory_per_device(self) -> dict[str, int]:
        """Bytes per device: parameters and optimizer state (from their shardings) and the compiled
        train step's arguments and temporaries (``compiled.memory_analysis()``)."""
        abstract = self.abstract_state()

        def shard_bytes(tree):
            return int(sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
                           for a in jax.tree.leaves(tree)))

        out = {"param_bytes": shard_bytes(abstract["params"]), "optimizer_bytes": shard_bytes(abstract["opt_state"])}
        mem = self.compiled_train_step().memory_analysis()
        if mem is not None:
            out["compiled_argument_bytes"] = int(mem.argument_size_in_bytes)
            out["compiled_temp_bytes"] = int(mem.temp_size_in_bytes)
        return out

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, params: dict, routing_state: dict) -> dict[str, float]:
        """Validation loss (nats/token) and bits per byte over ``train.eval_batches`` batches
        (:class:`~moefast.train.evaluation.Evaluator`)."""
        return self._evaluator(params, routing_state)

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainSummary:
        """Trains from the latest checkpoint in the run dir (or from scratch) to ``train.stop_at``
        (or ``train.steps``), evaluating, logging and checkpointing on the configured intervals.

        SIGTERM or SIGINT (once) during the run ends it after the current step with a checkpoint
        (:attr:`TrainSummary.stopped_by` says which); one that arrives before the first step (while
        compiling) ends it before any step, leaving the run dir as it was. A second SIGINT raises
        ``KeyboardInterrupt`` without waiting for the checkpoint being written (the line logged
        names the last complete one).

        A start that resumes from step N first removes from ``metrics.jsonl`` the records of the
        steps after N (left by a start that was killed before its next checkpoint; they are
        replayed), see :mod:`moefast.train.metrics`. ``train.stop_at`` belongs to this call: the
        run dir's ``config.yaml`` does not keep it, so a later start without it trains on to
        ``train.steps``.

        Process-wide state is changed only while this runs and restored on every exit: the
        SIGTERM / SIGINT handlers (main thread, one process) and the filters of orbax's repeated
        failure reports (:func:`~moefast.train.checkpoint.quiet_orbax_aftermath`).

        Raises:
          TrainingError: ``train.max_consecutive_nonfinite`` non-finite steps in a row.
          CheckpointError: an incompatible or unreadable checkpoint, a failed checkpoint write, a
            run dir that cannot be written (checked before anything is read or written), or a
            failed write of ``metrics.jsonl``, TensorBoard events or ``config.yaml`` (disk full,
            read-only): the message names the file or step and the last complete checkpoint.
          ConfigError: the run dir cannot be created.
        """
        stop = StopRequest()
        with stop.installed(), quiet_orbax_aftermath():  # (also orbax's log of a second Ctrl-C during a save)
            run = self._start(stop)
            try:
                with contextlib.ExitStack() as cleanup:  # on any exit of the loop, newest first
                    if run.bar is not None:
                        cleanup.callback(run.bar.close)
                    cleanup.callback(run.batches.close)
                    cleanup.callback(run.profile.close)
                    self._loop(run)
            except BaseException as failure:
                self._abort(failure, run)
            return self._finish(run)

    def _loop(self, run: _Run) -> None:
        """Steps ``run.start + 1`` to ``run.last``: step (nothing read back), log (one step late),
        evaluate, save, stop after a signal; then the totals (and an evaluation when nothing was left to train)."""
        with jax.set_mesh(self.mesh):
            for step in range(run.start, run.last):
                if step == run.start and run.stop.signal:  # before the first step: nothing new to save
                    run.stopped_by = run.stop.signal
                    run.say(f"{run.stopped_by}: stopped before the first step of this run; no step was run")
                    break
                run.profile.before(step + 1, run.state)
                # Steady state: nothing comes back from the devices (metrics stay there until a
                # log, save or evaluation point), so the host runs ahead and the devices never wait.
                with jax.transfer_guard_device_to_host("disallow"):
                    batch, run.data_state = next(run.batches)
                    run.state, metrics = run.step_fn(run.state, batch, self.base_key)
                    run.book.record(step + 1, metrics)
                done = run.done = step + 1
                run.profile.after(done, run.state)
                save_now, eval_now = run.every.save(done), run.every.evaluate(done)
                if step == run.start or save_now or eval_now:
                    run.book.flush()  # the first step (time to first step), and before saving or evaluating
                else:
                    run.book.flush(before=done)  # a log point one step late: this step is already queued
                if eval_now:  # before the checkpoint of this step: its record belongs to it
                    self._evaluate_at(run, done)
                if save_now:
                    self._save(run, done)
                if self._stopping(run, done, saved=save_now):
                    break
            run.book.flush()
        run.tokens_per_s, run.faults_per_step = run.book.totals()
        if run.start >= run.last:
            run.eval_metrics, run.eval_at = self.evaluate(run.state["params"], run.state["routing"]), run.start

    def _evaluate_at(self, run: _Run, done: int) -> None:
        with run.book.paused():  # evaluation is not in tokens/s or faults per step
            run.eval_metrics, run.eval_at = self.evaluate(run.state["params"], run.state["routing"]), done
            run.writer.write("eval", done, run.eval_metrics)
            run.say(f"step {done:>6} | {format_eval(run.eval_metrics)}")

    def _save(self, run: _Run, done: int) -> None:
        # Every record of the steps up to this one is written (and durable) before the
        # checkpoint exists, so a resume from it replays exactly the steps whose records it drops.
        run.writer.sync()
        run.ckpt.save(done, run.state, run.data_state, self.cfg, force=True,
                      loop_state={"monitor": run.book.monitor.state_dict()}, identity=self.identity())

    def _stopping(self, run: _Run, done: int, *, saved: bool) -> bool:
        """Whether a signal stops the run after step ``done``; if so, its checkpoint is written
        (unless ``saved`` already) and waited for."""
        run.stopped_by = run.stop.requested(done)  # after evaluation: a signal then stops here too
        if not run.stopped_by:
            return False
        run.book.flush()
        run.say(f"{run.stopped_by}: stopping after step {done}; writing its checkpoint"
                + (" (Ctrl-C again quits without waiting for it)" if run.stopped_by == "SIGINT" else ""))
        if not saved:
            self._save(run, done)
        run.ckpt.wait()
        run.say(f"{run.stopped_by}: stopped after step {done} with a checkpoint in {run.ckpt.directory / str(done)}; "
                "start it again with the same run dir to resume")
        return True

    def _start(self, stop: StopRequest) -> _Run:
        """Everything before the first step: the run dir checked, the state fresh or restored, the
        run's config.yaml and metrics writer, the compiled step, the data prefetcher."""
        t_start = time.perf_counter()
        cfg, tc = self.cfg, self.cfg.train
        # the data first: a corpus error leaves no run dir behind (nor an empty checkpoints/)
        data_iter = iter(train_dataset(self.corpus, cfg.data, seed=tc.seed,
                                       process_index=jax.process_index(),
                                       process_count=jax.process_count()))
        run_dir_lib.check_writable(self.run_dir)
        ckpt = Checkpointer(self.run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                            async_save=cfg.checkpoint.async_save, log=self._ckpt_log)
        self._log_setup()
        begin = start_or_resume(cfg, ckpt, data_iter, init_state=self.init_state,
                                abstract_state=self.abstract_state, log=self._log, identity=self.identity(),
                                reset_optimizer=OptimizerReset.of(self) if self.reset_optimizer else None)
        start, last = begin.step, tc.last_step
        self._log_peak()
        writer = self._open_metrics(ckpt, start)
        if start >= last:
            self._log(f"run is already at step {start} (train.stop_at/train.steps = {last}); nothing to train")
        bar, say = self._progress_bar(start, last)
        book = StepBook(cfg, t_start=t_start, last=last, writer=writer, say=say, bar=bar, ckpt=ckpt,
                        flops_per_token=self.flops_per_token, peak=self.peak)
        book.monitor.load_state_dict(begin.loop_state.get("monitor") or {})
        training = last > start
        step_fn = self.compiled_train_step() if training else None
        memory = self.memory_per_device() if training else None
        if memory:
            self._log("per device: " + ", ".join(f"{k.removesuffix('_bytes')} {v / 2**20:.1f} MiB"
                                                 for k, v in memory.items()))
        data_state = data_iter.get_state()
        prefetch = cfg.data.prefetch_batches(self.platform) if training else 0
        batches = DevicePrefetcher(data_iter, self.put_batch, prefetch)
        profile = ProfileWindow(self.profile, first=start + 1, last=last, out=self.run_dir / "profile", book=book,
                                say=say, log=self._log)
        return _Run(t_start=t_start, start=start, last=last, state=begin.state, data_state=data_state, ckpt=ckpt,
                    writer=writer, book=book, batches=batches, step_fn=step_fn,
                    every=_Every(tc.eval_every, tc.checkpoint_every, last), profile=profile, stop=stop, say=say,
                    bar=bar, memory=memory, done=start)

    def _log_setup(self) -> None:
        cfg = self.cfg
        self._log(f"corpus: {self.corpus.summary()}")
        n_params = lora.count(lora.sizes(self.model_def.abstract_params))[0]  # an NF4 base counted by its values
        self._log(f"model: {n_params / 1e6:.2f}M parameters | mesh {dict(self.mesh.shape)} on "
                  f"{jax.device_count()} {jax.devices()[0].platform} device(s) | compilation cache "
                  f"{self.compile_cache_dir or 'off'} | host malloc {self.host_malloc}")
        if not cfg.lora.enabled:
            self._log(optimizer.summary(cfg, self.model_def.split(self.model_def.abstract_params)[0]))
            if cfg.train.indexer_stage != "none":
                self._log(f"indexer_stage: {cfg.train.indexer_stage}: " + (
                    "dense attention; only the lightning indexers train (their KL to it), the rest frozen"
                    if cfg.train.indexer_stage == "dense_warmup" else
                    "sparse attention; everything trains, each indexer by its KL over its selected keys"))
        else:
            self._log(lora.summary(cfg.lora, self.model_def.split(lora.sizes(self.model_def.abstract_params))))
        for warning in config_warnings(cfg) + self.corpus.warnings(cfg.data):
            self._log(f"warning: {warning}")

    def _log_peak(self) -> None:
        """The MFU line: FLOPs per token and the peak (on CPU measured by compiling and timing a matmul,
        so only once the state is fresh or restored: a refused resume compiles nothing)."""
        peak = self.peak
        self._log(f"MFU: {self.flops_per_token / 1e6:,.1f} MFLOP per token (6 x active parameters + attention); peak "
                  + (f"{peak.flops_per_s / 1e12:,.3g} TFLOP/s" + (f" ({peak.devices} x {peak.per_device_tflops:,.4g})"
                                                                   if peak.devices > 1 else "")
                     if peak.flops_per_s else "unknown") + f" [{peak.source}]")

    def _open_metrics(self, ckpt: Checkpointer, start: int) -> MetricsWriter:
        """Writes the run's config.yaml (only once the config is known to fit the run dir's
        checkpoints) and opens the metrics writer at step ``start``."""
        try:
            if self.is_main:
                run_dir_lib.write_run_config(self.run_dir, self.cfg)
            writer = MetricsWriter(self.run_dir, enabled=self.is_main, resume_step=start)
        except OSError as e:
            raise self._write_error(e, ckpt, start) from None
        if writer.removed:
            self._log(f"metrics: removed {writer.removed} record(s) after step {start} from {writer.path}, left by a "
                      "start that ended before its next checkpoint (those steps are trained and logged again now)")
        return writer

    def _progress_bar(self, start: int, last: int) -> tuple[Any, Callable[[str], None]]:
        """The tqdm bar (``None`` without one) and the printer of the loop's lines (above the bar)."""
        bar = None
        if self.progress and last > start:
            from tqdm.auto import tqdm

            bar = tqdm(total=last, initial=start, desc="train", unit="step", dynamic_ncols=True, leave=False,
                       disable=None)  # None: no bar when the output is not a terminal
        say = bar.write if bar is not None and not bar.disable else self._log
        if bar is not None and self._log is not print:
            say = self._log
        return bar, say

    def _finish(self, run: _Run) -> TrainSummary:
        """Waits for the last checkpoint and writes the run's summary record."""
        run.ckpt.close()  # waits for the checkpoint still being written
        latest = run.ckpt.latest_step()
        end = run.done if run.stopped_by else max(run.start, run.last)
        book = run.book
        summary = TrainSummary(
            steps=end, steps_this_run=max(end - run.start, 0),
            final_loss=book.final_loss, eval_loss=run.eval_metrics.get("eval_loss"),
            eval_bits_per_byte=run.eval_metrics.get("eval_bits_per_byte"), eval_step=run.eval_at,
            tokens_per_s=run.tokens_per_s, first_step_s=book.first_step_s, wall_s=time.perf_counter() - run.t_start,
            checkpoint=str(run.ckpt.directory / str(latest)) if latest is not None else None, memory=run.memory,
            skipped_steps=book.skipped_steps, stopped_by=run.stopped_by, page_faults_per_step=run.faults_per_step,
            mfu=mfu_lib.mfu(run.tokens_per_s, self.flops_per_token, self.peak),
            model_flops_per_token=self.flops_per_token)
        try:
            run.writer.write("summary", summary.steps, {k: v for k, v in dataclasses.asdict(summary).items()
                                                        if k not in ("steps", "memory")})
            run.writer.close()
        except MetricsWriteError as e:
            raise self._write_error(e, run.ckpt, end) from None
        return summary

    def _abort(self, failure: BaseException, run: _Run) -> None:
        """Ends a run that failed after ``run.done`` steps with one exception: ``failure`` itself,
        or for a failed write to the run dir, a :class:`CheckpointError` naming the directory and
        the last complete checkpoint."""
        writer, ckpt, done, say = run.writer, run.ckpt, run.done, run.say
        try:
            writer.close()
        except MetricsWriteError:
            pass  # the failure below is the one to report (a failed write is reported as such)
        if isinstance(failure, KeyboardInterrupt):  # a second Ctrl-C: quit without waiting for the write
            good = ckpt.complete_steps()
            say("interrupted: not waiting for the checkpoint being written; the run resumes from "
                + (f"{ckpt.directory / str(good[-1])}" if good else "the start (no complete checkpoint)")
                + " (same command)")
            raise failure
        pending = None
        try:
            ckpt.close()  # waits for a checkpoint still being written, also when a step failed
        except CheckpointError as e:
            pending = e
        if isinstance(failure, MetricsWriteError):
            raise self._write_error(failure, ckpt, done) from None
        if pending is not None and not isinstance(failure, CheckpointError):
            say(f"warning: {pending}")
        raise failure

    def _write_error(self, e: OSError, ckpt: Checkpointer, done: int) -> CheckpointError:
        """A failed write to the run dir (metrics, TensorBoard events, config.yaml) as one error naming
        the directory, the step and the last complete checkpoint."""
        return run_dir_lib.write_error(e, self.run_dir, ckpt.directory, done)

    def initialize(self, params: dict, routing: dict | None = None) -> Path:
        """Starts a new run from given parameters: writes its step-0 checkpoint (``params`` with a
        fresh optimizer state, ``routing`` or a fresh routing state, and step 0; no data position,
        so training reads the data from its start) and ``config.yaml``. ``moefast train --run-dir``
        then continues it (``moefast import-hf`` uses this for imported weights).

        Args:
          params: parameters with the structure of :attr:`model_def` (e.g. from
            :func:`moefast.interop.hf.load_hf_params`), float32, ideally already in
            ``state_sharding["params"]``.
          routing: routing state like :func:`~moefast.model.init_routing_state`'s (``{"bias",
            "load_ema"}`` float32 [L_moe, E], e.g. an imported selection bias from
            :func:`moefast.interop.hf.load_hf_routing`); ``None``: a fresh one (zero bias).

        Returns:
          The checkpoint's directory.

        Raises:
          CheckpointError: the run dir already holds a checkpoint (nothing is overwritten), or it
            cannot be written.
          ConfigError: the run dir cannot be created.
          ValueError: ``params`` (or ``routing``) do not have the model's structure and shapes.
        """
        def same(a, b) -> bool:
            a, b = (jax.tree.map(lambda x: (x.shape, x.dtype), t) for t in (a, b))
            return jax.tree.structure(a) == jax.tree.structure(b) and jax.tree.leaves(a) == jax.tree.leaves(b)

        if self.cfg.lora.enabled and not same(self.model_def.abstract_params, params):
            params = self.with_adapters(params)
        if not same(self.model_def.abstract_params, params):
            raise ValueError("params do not have the structure, shapes and dtypes of this config's model")
        if routing is not None and not same(jax.eval_shape(lambda: init_routing_state(self.cfg)), routing):
            raise ValueError("routing does not have the structure, shapes and dtypes of this config's routing state")
        run_dir_lib.check_writable(self.run_dir)
        ckpt = Checkpointer(self.run_dir / "checkpoints", keep=self.cfg.checkpoint.keep, async_save=False,
                            log=self._ckpt_log)
        with quiet_orbax_aftermath():
            try:
                if ckpt.latest_step() is not None:
                    raise CheckpointError(f"{ckpt.directory} already holds checkpoints (latest step "
                                          f"{ckpt.latest_step()}); use a new run dir")
                sharding = self.state_sharding
                with jax.set_mesh(self.mesh):
                    params = jax.device_put(params, sharding["params"])
                    rest = jax.jit(lambda p: {"opt_state": make_optimizer(self.cfg).init(self.model_def.split(p)[0]),
                                              "routing": init_routing_state(self.cfg),
                                              "step": jnp.zeros((), jnp.int32)},
                                   out_shardings={k: sharding[k] for k in ("opt_state", "routing", "step")})(params)
                    if routing is not None:
                        rest["routing"] = jax.device_put(routing, sharding["routing"])
                ckpt.save(0, {"params": params, **rest}, None, self.cfg, identity=self.identity(corpus=False))
                ckpt.wait()
            finally:
                ckpt.close()
        if self.is_main:
            run_dir_lib.write_run_config(self.run_dir, self.cfg)
        return ckpt.directory / "0"

    @functools.cached_property
    def base_param_sharding(self) -> dict:
        """Shardings of the parameters of the model without adapters (what :meth:`initialize` takes
        with ``lora``; e.g. :func:`moefast.interop.hf.load_hf_params`'s ``shardings``); without
        adapters, ``state_sharding["params"]``."""
        if not self.cfg.lora.enabled:
            return self.state_sharding["params"]
        base = ModelDef(self.cfg.replace(lora=type(self.cfg.lora)()), self.model_def.vocab_size)
        return parallel.shardings(self.mesh, base.param_state_specs(self.mesh))

    def with_adapters(self, base: dict) -> dict:
        """The adapted model's stored parameters from the base model's ``base`` (float32, e.g.
        imported): base weights in ``lora.base_dtype``, fresh adapters from ``train.seed``
        (:func:`moefast.model.lora.from_base`)."""
        from moefast.model import lora

        seed = self.cfg.train.seed
        with jax.set_mesh(self.mesh):
            adapters = jax.jit(lambda: self.model_def.split(self.model_def.init_params(seed))[0],
                               out_shardings=self.model_def.split(self.state_sharding["params"])[0])()
            frozen = self.model_def.split(self.model_def.abstract_params)[1]  # shapes and dtypes
            try:
                return jax.jit(lambda b, a: lora.from_base(self.cfg.lora, b, lora.join(a, frozen)),
                               out_shardings=self.state_sharding["params"])(base, adapters)
            except ValueError as e:
                raise ValueError(f"params are neither this config's model nor its base model without adapters: {e}") \
                    from None

    def restore_params(self, *, corpus: bool = False) -> tuple[int, dict, dict]:
        """Step, parameters and routing state of the latest checkpoint in the run dir.

        Args:
          corpus: also refuse a checkpoint trained on another prepared corpus than the one
            ``data.source`` holds now (reads the corpus): before an evaluation (``moefast eval``),
            whose validation split would otherwise silently be another one. Generation and export
            need no data and leave it ``False``.

        Raises:
          CheckpointError: no checkpoint, an incompatible one (config, tokenizer; with ``corpus``,
            a corpus prepared again since), checked before any array is read.
        """
        identity = self.identity(corpus=corpus)
        ckpt = Checkpointer(self.run_dir / "checkpoints", keep=self.cfg.checkpoint.keep, async_save=False,
                            log=self._ckpt_log)
        with quiet_orbax_aftermath():
            try:
                r = ckpt.restore(self.abstract_state(), self.cfg, tokenizer=identity["tokenizer"],
                                 corpus=identity.get("corpus"))
            finally:
                ckpt.close()
        return r.step, r.state["params"], r.state["routing"]

"""The command line as a user runs it: a real subprocess per command."""

import json
import os
import subprocess
import sys

import pytest

SMALL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.head_dim=16",
         "model.d_ff=64", "model.max_seq_len=128", "moe.num_experts=4", "data.seq_len=32",
         "train.warmup_steps=1", "train.eval_batches=1"]


def moefast(*args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # let --cpu-devices decide
    return subprocess.run([sys.executable, "-m", "moefast", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, text_dir):
    run = tmp_path_factory.mktemp("cli") / "run"
    p = moefast("train", "--run-dir", str(run), "--cpu-devices", "2", "--no-progress", *SMALL,
                f"data.source={text_dir}", "train.steps=6", "train.log_every=3", "train.eval_every=3",
                "--profile", "4:5")
    assert p.returncode == 0, p.stderr
    return run, p.stdout


def test_train_prints_logs_and_summary(trained_run):
    run, out = trained_run
    assert "step      3 | loss" in out and "tokens/s" in out and "| MFU " in out
    assert f"profile of steps 4 to 5 written to {run / 'profile'}" in out
    assert list((run / "profile").rglob("*.trace.json.gz"))  # --profile 4:5: a jax.profiler trace
    assert "eval bits/byte" in out
    summary = [line for line in out.splitlines() if line.startswith("done:")]
    assert summary and "steps 6" in summary[0] and "checkpoint" in summary[0] and "wall" in summary[0]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6] and all("tokens_per_s" in r and "mfu" in r for r in train)
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "6").is_dir()


def test_generate_and_eval(trained_run):
    run, _ = trained_run
    g = moefast("generate", "--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "20", "--cpu-devices", "1")
    assert g.returncode == 0, g.stderr
    assert g.stdout.startswith("def ")
    e = moefast("eval", "--run-dir", str(run), "--cpu-devices", "1")
    assert e.returncode == 0, e.stderr
    assert e.stdout.startswith("step 6 | eval loss")


def test_restart_of_a_finished_run_trains_nothing(trained_run, text_dir):
    run, _ = trained_run
    p = moefast("train", "--run-dir", str(run), "--cpu-devices", "2", "--no-progress", *SMALL,
                f"data.source={text_dir}", "train.steps=6", "train.log_every=3", "train.eval_every=3")
    assert p.returncode == 0, p.stderr
    assert "already at step 6" in p.stdout and "steps 6 (0 this run)" in p.stdout


def _files(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_failed_resume_leaves_the_run_usable(trained_run, text_dir):
    run, _ = trained_run
    before = (run / "config.yaml").read_text()
    checkpoints = _files(run / "checkpoints")
    p = moefast("train", "--run-dir", str(run), "--cpu-devices", "2", "--no-progress", *SMALL,
                f"data.source={text_dir}", "train.steps=6", "moe.num_experts=8")
    assert p.returncode == 2 and "different 'moe' config" in p.stderr
    assert (run / "config.yaml").read_text() == before
    assert _files(run / "checkpoints") == checkpoints  # nothing on disk damaged
    e = moefast("eval", "--run-dir", str(run), "--cpu-devices", "1")
    assert e.returncode == 0, e.stderr


def test_overrides_may_sit_among_options_and_steps_change_is_reported(trained_run, text_dir):
    run, _ = trained_run
    p = moefast("train", *SMALL[:5], "--run-dir", str(run), *SMALL[5:], "--cpu-devices", "2", "--no-progress",
                f"data.source={text_dir}", "train.steps=7", "train.log_every=3", "train.eval_every=3")
    assert p.returncode == 0, p.stderr
    assert "train.steps changed from 6 to 7" in p.stdout and "steps 7 (1 this run)" in p.stdout


@pytest.mark.parametrize("args,message", [
    (["train", "trian.steps=3"], "unknown section 'trian' (did you mean 'train'?)"),
    (["train", "--cpu-devices", "0"], "--cpu-devices must be >= 1"),
    (["train", "--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
     "--coordinator must be HOST:PORT"),
    (["train", "--coordinator", "localhost:1", "--num-processes", "0", "--process-id", "0"],
     "--num-processes must be >= 1"),
    (["train", "--distributed-timeout", "0"], "--distributed-timeout must be >= 1"),
    (["train", "--num-processes", "2"], "must be given together"),
    (["train", "--cpu-devices", "2", "moe.routing_impl=pallas"], "moe.routing_impl: 'pallas' runs in the Pallas interpreter"),
    (["train", "moe.routing_impl=triton"], "moe.routing_impl: impl='triton' runs on a GPU only"),
    (["train", "train.stepz=3"], "train.stepz: unknown key"),
    (["train", "moe.top_k=9"], "moe.top_k: must be in [1, moe.num_experts=8]"),
    (["train", "--config", "nope.yaml"], "config file nope.yaml not found"),
    (["train", "data.source=/nonexistent/dir"], "/nonexistent/dir"),
    (["eval", "--run-dir", "/nonexistent/run"], "not a moefast run directory"),
    (["generate", "--run-dir", "/nonexistent/run", "--prompt", "x"], "not a moefast run directory"),
    (["train", "mesh.expert=3"], "mesh.expert: 3 does not divide moe.num_experts=8; use a divisor of 8"),
    (["train", "--cpu-devices", "3", "mesh.data=3"], "not divisible by the 3 batch shards"),
    (["train", "cache.tables=maybe"], "cache.tables: expected bool"),
    (["train", "monitor.patience=0"], "monitor.patience: must be >= 1"),
    (["train", "data.source={empty}"], "holds no regular non-hidden files"),
    (["train", "data.source={corrupt}"], "a.jsonl:2: not valid JSON"),
    (["train", "cache.compile_dir=None"], "write null or false (unquoted) to turn the cache off"),
    (["train", "--profile", "5:2"], "--profile 5:2: expected START:END, optimizer steps with 1 <= START <= END"),
    (["bench", "cache", "--ablate"], "--ablate applies to bench gpu-compile, train only"),
    (["bench", "train", "--pairs", "3"], "--pairs applies to bench cache only, not to bench train"),
    (["bench", "train", "--ablate", "moe.capacity_factor=0"], "one-hot dispatch, which needs a capacity"),
    (["bench", "gpu-compile", "--ablate", "moe.capacity_factor=0"], "compile it without --ablate"),
    (["bench", "cache", "--json", "/nonexistent/dir/x.json"], "the directory /nonexistent/dir does not exist"),
    (["bench", "routing", "--json", "/tmp/table.md"], "give a file name for the JSON records"),
    (["bench", "cache", "--json", "/tmp"], "give a file name for the JSON records"),
])
def test_bad_input_gets_one_clear_error(args, message, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{not json\n')
    args = [a.format(empty=tmp_path / "empty", corrupt=tmp_path / "a.jsonl") for a in args]
    p = moefast(*args[:1], *(["--run-dir", str(tmp_path / "r")] if args[0] == "train" else []), *args[1:])
    assert p.returncode == 2, p.stderr
    assert message in p.stderr
    assert "Traceback" not in p.stderr
    assert len([line for line in p.stderr.splitlines() if line.strip()]) == 1, p.stderr
    if any(a.startswith("data.source=") for a in args):  # a corpus error leaves no run dir (nor checkpoints/)
        assert not (tmp_path / "r").exists()


def test_run_dir_that_is_a_file(tmp_path, text_dir):
    f = tmp_path / "afile"
    f.write_text("x")
    p = moefast("train", "--run-dir", str(f), "--cpu-devices", "1", *SMALL, f"data.source={text_dir}")
    assert p.returncode == 2
    assert "exists and is not a directory" in p.stderr
    assert "Traceback" not in p.stderr
    assert f.read_text() == "x"


@pytest.mark.parametrize("text,message", [("model: [oops", "is not valid YAML"), ("{}", "holds no config")])
def test_garbled_run_config_is_one_clear_error(tmp_path, text, message):
    (tmp_path / "config.yaml").write_text(text)
    p = moefast("eval", "--run-dir", str(tmp_path))
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr
    assert len([line for line in p.stderr.splitlines() if line.strip()]) == 1, p.stderr
    assert (tmp_path / "config.yaml").read_text() == text


def test_eval_and_generate_of_a_triton_run_fall_back_off_gpu(capsys):
    import dataclasses

    from moefast import cli
    from moefast.config import load_config

    cfg = load_config(None, ["moe.routing_impl=triton", "mesh.expert=2"])
    got = cli._inference_config(cfg)
    assert got.moe.routing_impl == "auto" and got.mesh.expert == 2  # the run's expert axis fits the 8 devices
    assert dataclasses.replace(got.moe, routing_impl="triton") == cfg.moe  # nothing else changed
    assert "moe.routing_impl=triton cannot run here" in capsys.readouterr().err


def test_stop_at_belongs_to_one_invocation(tmp_path, text_dir):
    """train.stop_at=2 ends that invocation at step 2; the run dir's config.yaml does not keep it, so
    the same command without it trains on to train.steps, also in a run dir whose config.yaml an
    older moefast wrote with stop_at in it."""
    run = tmp_path / "run"
    common = ["--run-dir", str(run), "--cpu-devices", "1", "--no-progress", *SMALL, f"data.source={text_dir}",
              "train.log_every=1", "train.eval_every=0"]
    p = moefast("train", *common, "train.steps=4", "train.stop_at=2")
    assert p.returncode == 0, p.stderr
    assert "steps 2 (2 this run)" in p.stdout
    assert "stop_at" not in (run / "config.yaml").read_text()
    # As an older moefast left it: the stopped invocation's stop_at in the run's config.
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("train:\n", "train:\n  stop_at: 2\n"))
    p = moefast("train", *common)  # no stop_at, train.steps=4 from the run's config
    assert p.returncode == 0, p.stderr
    assert "resuming from step 2" in p.stdout and "steps 4 (2 this run)" in p.stdout, p.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    assert sorted(int(d.name) for d in (run / "checkpoints").iterdir()) == [2, 4]
    assert "stop_at" not in (run / "config.yaml").read_text()


def test_run_dir_under_a_file_is_one_clear_error(tmp_path, text_dir):
    (tmp_path / "file.txt").write_text("x")
    run = tmp_path / "file.txt" / "run"
    p = moefast("train", "--run-dir", str(run), "--cpu-devices", "1", *SMALL, f"data.source={text_dir}")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip() == (f"error: run dir {run} cannot be created: {tmp_path / 'file.txt'} is a file, "
                                "not a directory; choose a run dir under a directory")


@pytest.mark.parametrize("command", ["train", "import-hf"])
def test_interrupt_while_a_command_starts_is_one_line(command, tmp_path):
    """Ctrl-C before the command runs (here as it sets up JAX's CPU devices, in reality mostly while
    JAX is imported): one line, exit 130, nothing written, no traceback."""
    run = tmp_path / "run"
    args = [command, *([] if command == "train" else [str(tmp_path)]), "--run-dir", str(run)]
    code = ("import os, signal, sys\n"
            # a terminal's Ctrl-C: the default handler, whatever disposition this worker passes down
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "import moefast.parallel.cpu_devices as c\n"
            "c.set_cpu_devices = lambda *a: os.kill(os.getpid(), signal.SIGINT)\n"
            "from moefast.cli import main\n"
            f"sys.argv = ['moefast', *{args!r}]\n"
            "sys.exit(main())\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    said = "interrupted" + (f": nothing was imported into {run}" if command == "import-hf" else "")
    assert p.returncode == 130 and p.stderr == said + "\n", p.stderr
    assert not run.exists()


@pytest.mark.parametrize("command", ["train", "import-hf"])
def test_interrupt_turned_into_an_import_error_is_one_line(command, tmp_path, monkeypatch, capsys):
    """numpy and jaxlib turn a Ctrl-C that lands while they are imported into ImportError (a
    newcomer's import-hf at ~1 s): still one line and exit 130, not a traceback with exit 1."""
    import moefast.parallel.cpu_devices as c
    from moefast import cli

    def import_interrupted(*a, **k):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise ImportError("numpy._core.multiarray failed to import") from e

    monkeypatch.setattr(c, "set_cpu_devices", import_interrupted)
    run = tmp_path / "run"
    args = [command, *([] if command == "train" else [str(tmp_path)]), "--run-dir", str(run)]
    assert cli.main(args) == 130
    said = "interrupted" + (f": nothing was imported into {run}" if command == "import-hf" else "")
    assert capsys.readouterr().err == said + "\n"
    assert not run.exists()

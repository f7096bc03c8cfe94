"""A run is independent of the working directory and knows what it was trained with: its data paths
are stored absolute, its checkpoints record the tokenizer (refused before any array is read when it
changed) and the prepared corpus (a resume on a corpus prepared again is refused)."""

import json
import types

import jax
import jax.numpy as jnp
import pytest
import yaml
from tokenizers import Tokenizer, models, pre_tokenizers

from moefast.config import ConfigError
from moefast.train import Trainer, load_run_config
from moefast.train.checkpoint import Checkpointer, CheckpointError
from moefast.train.resume import start_or_resume
from moefast.train.run_dir import write_run_config


def _tokenizer(directory, words):
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    return directory


def test_a_run_works_from_any_directory_and_an_older_one_names_its_relative_path(small_config, text_dir, tmp_path,
                                                                                 monkeypatch):
    """A newcomer's finding: config.yaml stored data.source and data.tokenizer as typed, so `cd / &&
    moefast eval --run-dir /abs/run` failed with "unknown tokenizer 'tok' (no such path: '/tok')"."""
    work = tmp_path / "work"
    _tokenizer(work / "tok", ["def", "class", "return"])
    (work / "corpus").symlink_to(text_dir)
    run = tmp_path / "run"
    monkeypatch.chdir(work)
    trainer = Trainer(small_config("data.source=corpus", "data.tokenizer=tok"), run, log=None, progress=False,
                      devices=jax.devices()[:1])
    assert (trainer.cfg.data.source, trainer.cfg.data.tokenizer) == (str(work / "corpus"), str(work / "tok"))
    run.mkdir()
    write_run_config(run, trainer.cfg)  # what the run's first start writes
    monkeypatch.chdir("/")
    assert Trainer(load_run_config(run), run, log=None, progress=False,
                   devices=jax.devices()[:1]).tokenizer.vocab_size == trainer.tokenizer.vocab_size
    # a run dir written by an older moefast: its paths as typed, one clear error from elsewhere
    raw = yaml.safe_load((run / "config.yaml").read_text())
    raw["data"]["tokenizer"] = "tok"
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        Trainer(load_run_config(run), run, log=None, progress=False, devices=jax.devices()[:1])
    msg = str(e.value)
    assert "data.tokenizer: 'tok' is a relative path, and '/tok' does not exist" in msg, msg
    assert f"set data.tokenizer there to its absolute path" in msg and str(run / "config.yaml") in msg


def test_a_checkpoint_of_an_older_run_with_relative_paths_still_restores(small_config, tmp_path, monkeypatch):
    """Checkpoints of older runs hold data.source as typed: from the directory it was typed in, that
    is the same path as the absolute one a run now stores."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    state = {"w": jnp.zeros((4,))}
    ckpt = Checkpointer(tmp_path / "ck", async_save=False)
    ckpt.save(1, state, {"pos": 1}, small_config("data.source=corpus"))
    abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    assert ckpt.restore(abstract, small_config(f"data.source={tmp_path / 'corpus'}")).step == 1
    with pytest.raises(CheckpointError, match=r"different 'data' config \(keys \['source'\]\)"):
        ckpt.restore(abstract, small_config(f"data.source={tmp_path / 'other'}"))
    # what the error for such a run advises (the absolute path in config.yaml) also works from another
    # directory, where the typed path cannot be made absolute
    monkeypatch.chdir("/")
    assert ckpt.restore(abstract, small_config(f"data.source={tmp_path / 'corpus'}")).step == 1
    ckpt.close()


def _embed(rows):
    return {"params": {"embed": jax.ShapeDtypeStruct((rows, 4), jnp.float32)}}


def test_a_checkpoint_of_another_tokenizer_is_refused_before_its_arrays_are_read(small_config, tmp_path):
    """A newcomer's finding: a tokenizer changed after training made eval fail with orbax's shape
    error and advice to move the (intact) checkpoints away."""
    cfg = small_config()
    trained = {"name": "/t/tok", "vocab_size": 10, "identity": "sha256:" + "a" * 64}
    ckpt = Checkpointer(tmp_path / "new", async_save=False)
    ckpt.save(1, {"params": {"embed": jnp.zeros((10, 4))}}, {"pos": 1}, cfg, identity={"tokenizer": trained})
    with pytest.raises(CheckpointError) as e:
        ckpt.restore(_embed(12), cfg, tokenizer={**trained, "vocab_size": 12, "identity": "sha256:" + "b" * 64})
    msg = str(e.value)
    assert "trained with a tokenizer of 10 ids ('/t/tok'), but data.tokenizer '/t/tok' now has 12 ids" in msg, msg
    assert "the checkpoint is fine: point data.tokenizer in" in msg and "\n" not in msg
    with pytest.raises(CheckpointError, match=r"another tokenizer .*same 10 ids, but its files hash to sha256:bbb"):
        ckpt.restore(_embed(10), cfg, tokenizer={**trained, "identity": "sha256:" + "b" * 64})
    assert ckpt.restore(_embed(10), cfg, tokenizer=trained).step == 1
    # what the error advises: data.tokenizer pointed at a copy of the tokenizer it was trained with
    copy = small_config("data.tokenizer=/elsewhere/tok-copy")
    assert ckpt.restore(_embed(10), copy, tokenizer={**trained, "name": "/elsewhere/tok-copy"}).step == 1
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["1"]  # nothing moved aside
    ckpt.close()
    old = Checkpointer(tmp_path / "old", async_save=False)  # written before checkpoints recorded a tokenizer
    old.save(1, {"params": {"embed": jnp.zeros((10, 4))}}, {"pos": 1}, cfg)
    with pytest.raises(CheckpointError, match=r"has an embedding of 10 token ids, but this run's model has 12 "
                                              r"\(data.tokenizer '/t/tok': 12 ids"):
        old.restore(_embed(12), cfg, tokenizer={**trained, "vocab_size": 12})
    old.close()


def test_resume_on_a_corpus_prepared_again_is_refused(small_config, tmp_path):
    """A newcomer's finding: after `moefast prepare ... --force` a resume went on silently with a data
    position that referred to the old corpus."""
    cfg = small_config()
    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save(1, {"w": jnp.zeros((4,))}, {"pos": 1}, cfg, identity={"corpus": "sha256:old"})
    positions = []
    kw = dict(init_state=lambda: pytest.fail("not a fresh start"), log=lambda s: None,
              abstract_state=lambda: {"w": jax.ShapeDtypeStruct((4,), jnp.float32)})
    data_iter = types.SimpleNamespace(set_state=positions.append)
    with pytest.raises(CheckpointError) as e:  # before any array is read: a target that fits none reads none
        start_or_resume(cfg, ckpt, data_iter, identity={"corpus": "sha256:new"},
                        **{**kw, "abstract_state": lambda: {"w": jax.ShapeDtypeStruct((5, 5), jnp.int8)}})
    assert "is not the prepared corpus checkpoint" in str(e.value) and "prepared again" in str(e.value)
    assert positions == []
    assert start_or_resume(cfg, ckpt, data_iter, identity={"corpus": "sha256:old"}, **kw).step == 1
    assert positions == [{"pos": 1}]
    ckpt.close()


def test_eval_of_a_run_whose_tokenizer_changed_says_so(small_config, tmp_path):
    """Through the Trainer: what its checkpoints record of the tokenizer (Trainer.identity); eval's
    restore (Trainer.restore_params) with the tokenizer's files changed since (one word more, or
    the same size with another word) is refused in one line naming it, before any array is read
    (so a checkpoint holding only the embedding stands in for a trained one)."""
    tok = _tokenizer(tmp_path / "tok", ["def", "class", "return"])
    cfg = small_config(f"data.tokenizer={tok}", "model.num_layers=1")
    devices = jax.devices()[:1]
    trainer = Trainer(cfg, tmp_path / "run", log=None, progress=False, devices=devices)
    assert trainer.identity(corpus=False)["tokenizer"]["identity"].startswith("sha256:")
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", async_save=False)
    ckpt.save(1, {"params": {"embed": jnp.zeros((4, 32))}}, {"pos": 1}, trainer.cfg, identity=trainer.identity())
    ckpt.close()
    _tokenizer(tok, ["def", "class", "return", "yield"])
    with pytest.raises(CheckpointError, match=r"trained with a tokenizer of 4 ids .* now has 5 ids"):
        Trainer(cfg, tmp_path / "run", log=None, progress=False, devices=devices).restore_params()
    _tokenizer(tok, ["def", "class", "yield"])
    with pytest.raises(CheckpointError, match=r"another tokenizer than data.tokenizer .* \(same 4 ids"):
        Trainer(cfg, tmp_path / "run", log=None, progress=False, devices=devices).restore_params()


def test_eval_of_a_run_whose_prepared_corpus_was_prepared_again_says_so(small_config, tmp_path, capsys):
    """A newcomer's finding: `moefast eval` of a run trained on prepared shards, after `moefast prepare
    --force` had changed them, evaluated silently on another validation split. Now one error line,
    before any array is read (a checkpoint holding only the embedding stands in for a trained one);
    generation and export (restore_params() without corpus=True) do not read the data."""
    from moefast import cli
    from moefast.data.prepared import prepare

    src, ds, run = tmp_path / "src", tmp_path / "ds", tmp_path / "run"
    src.mkdir()
    for i in range(20):
        (src / f"doc{i:02d}.txt").write_text(f"document {i}: " + "def f(x): return x\n" * 20)
    prepare(str(src), ds, val_fraction=0.2, progress=False)
    trainer = Trainer(small_config(f"data.source={ds}", "model.num_layers=1"), run, log=None, progress=False)
    run.mkdir()
    write_run_config(run, trainer.cfg)
    ckpt = Checkpointer(run / "checkpoints", async_save=False)
    ckpt.save(1, {"params": {"embed": jnp.zeros((4, 32))}}, {"pos": 1}, trainer.cfg, identity=trainer.identity())
    ckpt.close()
    (src / "doc03.txt").write_text("another text altogether")
    prepare(str(src), ds, val_fraction=0.2, force=True, progress=False)
    assert cli.main(["eval", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: data.source {ds} is not the prepared corpus checkpoint {run / 'checkpoints' / '1'} "
                          "was trained on (its manifest.json differs: prepared again since"), err
    assert "an evaluation would use another validation split" in err and err.count("\n") == 1
    with pytest.raises(CheckpointError) as e:  # without the corpus check: on to the arrays (here missing)
        Trainer(load_run_config(run), run, log=None, progress=False).restore_params()
    assert "prepared corpus" not in str(e.value)

"""``moefast bench data``: the data path for corpora larger than memory (``moefast prepare``).

Three measurements, each written as JSON records and markdown tables:

1. **Prepare throughput.** A synthetic corpus of ``prepare_mb`` MB of text in files of ~256 KB
   (one document each) is tokenized by a byte-level BPE tokenizer trained here on its first few MB
   (``tokenizers``; nothing is downloaded), once by :func:`moefast.data.prepared.prepare` and once by
   Hugging Face ``datasets`` (``load_dataset("text", sample_by="document")``, ``map(batched=True,
   num_proc=2)`` with the same tokenizer's ``encode_batch_fast``, ``save_to_disk``; ``encode_batch``,
   which also computes character offsets, runs at about half that rate), alternating for
   ``rounds`` rounds, each in a fresh child process (as ``moefast prepare`` runs: without the
   ``moefast`` command's malloc settings) and timed inside it end to end from the text files to the
   files written: MB of text/s and tokens/s. Without ``datasets`` installed that row says so and is
   skipped.
2. **Training from shards.** For each size in ``sizes_gb`` (GB of uint16 token shards, i.e.
   ``size / 2`` byte tokens; the text is generated as random slices of a 16 MB pool of synthetic
   words), a child process opens the corpus the way a ``moefast train`` does (malloc settings included)
   (``load_corpus`` -> ``train_dataset`` -> first batch of ``configs/tiny.yaml``'s shape: 8 rows of
   256 tokens) and reports the seconds to its first batch, its peak resident memory
   (``VmHWM`` of ``/proc/self/status``, not ``ru_maxrss``, which on Linux keeps the forking parent's
   peak across ``exec``; it includes the interpreter and imports: the
   ``baseline`` row is a child that imports the same modules and opens nothing) and the loader's
   batches/s over ``batches`` further batches. Once from the prepared directory, once from the same
   text files in memory (today's unprepared path). The in-memory path is skipped when its peak,
   extrapolated from the smaller size's bytes of peak per byte of text (at least 4: the packed int32
   stream), would exceed half of this machine's available memory (``/proc/meminfo``), and the record
   says so.
3. **What the step needs.** ``moefast bench train --steps 5 --rounds 1`` on ``configs/tiny.yaml``
   in a child process (skipped with ``train_step=False``): steps/s of the train step, against the
   loader's batches/s.

Everything generated goes into ``work_dir`` (a new temporary directory by default), removed at the
end unless ``keep`` is set.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["DataBenchResult", "bench_data", "format_tables", "run_cli"]

_FILE_BYTES = 256 << 10  # one synthetic document per file
_POOL_BYTES = 16 << 20
_BPE_VOCAB = 8192
_BPE_TRAIN_BYTES = 4 << 20
_SEQ_LEN, _BATCH = 256, 8  # configs/tiny.yaml's batch shape


@dataclasses.dataclass
class DataBenchResult:
    date: str
    commit: str | None
    cpus: int
    mem_available_gb: float
    prepare: list[dict[str, Any]]  # {tool, round, seconds, mb_per_s, tokens_per_s} or {tool, skipped}
    loader: list[dict[str, Any]]  # {size_gb, path, tokens, first_batch_s, peak_rss_mb, batches_per_s} / skipped
    train_step: dict[str, Any] | None  # {steps_per_s, tokens_per_s, tokens_per_step} or {skipped}


def _word_pool(seed: int = 0) -> bytes:
    """16 MB of synthetic text: Zipf-distributed pseudo-words, lines of 5-20 words."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", np.uint8)
    words = [bytes(letters[rng.integers(0, 26, size=int(n))]) for n in rng.integers(1, 11, size=20000)]
    ranks = np.minimum(rng.zipf(1.2, size=_POOL_BYTES // 5), len(words)) - 1
    out, size, i = [], 0, 0
    while size < _POOL_BYTES:
        n = int(rng.integers(5, 21))
        line = b" ".join(words[int(r)] for r in ranks[i:i + n]) + b".\n"
        i = (i + n) % (len(ranks) - 21)
        out.append(line)
        size += len(line)
    return b"".join(out)[:_POOL_BYTES]


def _write_text(directory: Path, total_bytes: int, pool: bytes, seed: int) -> list[Path]:
    """Files of ~256 KB (random slices of ``pool``, cut at a newline) summing to ~``total_bytes``."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths, written = [], 0
    while written < total_bytes:
        n = min(_FILE_BYTES, total_bytes - written)
        start = int(rng.integers(0, len(pool) - n))
        data = pool[start:start + n]
        cut = data.rfind(b"\n")
        data = data[:cut + 1] if cut > 0 else data
        path = directory / f"doc{len(paths):07d}.txt"
        path.write_bytes(data)
        paths.append(path)
        written += max(len(data), 1)
    return paths


def _train_bpe(files: list[Path], out_dir: Path) -> str:
    from tokenizers import ByteLevelBPETokenizer

    def texts():
        size = 0
        for p in files:
            if size >= _BPE_TRAIN_BYTES:
                return
            t = p.read_text()
            size += len(t)
            yield t

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(texts(), vocab_size=_BPE_VOCAB, min_frequency=2, show_progress=False,
                            special_tokens=["<|endoftext|>"])
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    tok.save(str(path))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                                "pad_token": "<|endoftext|>"}))
    return str(out_dir)


_PREPARE_CHILD = """
import json, sys
from moefast.bench import data
args = json.loads(sys.argv[1])
print("RESULT " + json.dumps(getattr(data, args.pop("fn"))(**args)))
"""


def _in_child(fn: str, **kwargs) -> Any:
    """Runs ``fn(**kwargs)`` of this module in a fresh interpreter and returns its (JSON) result.

    Each prepare path runs in its own process, as ``moefast prepare`` does: this process has other
    state (the ``moefast`` command's malloc settings, see :mod:`moefast.host_memory`, made
    ``moefast prepare`` 3.4x slower in a one-off check of 2026-12-03: one malloc arena shared by the
    tokenizer's threads).
    """
    proc = subprocess.run([sys.executable, "-c", _PREPARE_CHILD, json.dumps({"fn": fn, **kwargs})],
                          capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"{fn} child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _prepare_moefast(text_dir: str, out: str, tokenizer: str) -> tuple[float, int]:
    from moefast.data.prepared import prepare

    t0 = time.perf_counter()
    m = prepare(text_dir, out, tokenizer=tokenizer, progress=False, force=True)
    return time.perf_counter() - t0, m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"]


def _prepare_datasets(files: list[str], out: str, tokenizer: str, cache: str) -> tuple[float, int]:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tok = Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json"))

    def encode(batch):
        return {"input_ids": [e.ids for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}

    t0 = time.perf_counter()
    ds = datasets.load_dataset("text", data_files=files, sample_by="document", split="train", cache_dir=cache)
    ds = ds.map(encode, batched=True, num_proc=2, remove_columns=["text"])
    ds.save_to_disk(out)
    seconds = time.perf_counter() - t0
    tokens = sum(len(x) for x in ds["input_ids"])
    return seconds, tokens


def _datasets_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("datasets") is not None


_CHILD = """
import json, resource, sys, time
args = json.loads(sys.argv[1])
t0 = time.perf_counter()
from moefast import host_memory
host_memory.configure()  # as the moefast train command does, before anything else runs
from moefast.config import DataConfig
from moefast.data import load_corpus, train_dataset
imported = time.perf_counter()
out = {}
if args["source"] is not None:
    cfg = DataConfig(source=args["source"], tokenizer="byte", seq_len=args["seq_len"], batch_size=args["batch"])
    corpus = load_corpus(cfg)
    it = iter(train_dataset(corpus, cfg, seed=0))
    next(it)
    first = time.perf_counter()
    for _ in range(args["batches"]):
        next(it)
    out = {"first_batch_s": first - imported, "batches_per_s": args["batches"] / (time.perf_counter() - first),
           "tokens": int(corpus.train.num_tokens + corpus.val.num_tokens)}
# VmHWM: this process's own peak (ru_maxrss keeps the forking parent's peak across exec on Linux)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
out["peak_rss_mb"] = (int(hwm[0].split()[1]) if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024
print("RESULT " + json.dumps(out))
"""


def _loader_child(source: str | None, batches: int) -> dict[str, Any]:
    args = {"source": source, "seq_len": _SEQ_LEN, "batch": _BATCH, "batches": batches}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], capture_output=True, text=True,
                          env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"loader child for {source!r} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _mem_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _train_step_child(work: Path) -> dict[str, Any]:
    out = work / "train_step.json"
    cmd = [sys.executable, "-m", "moefast", "bench", "train", "--steps", "5", "--rounds", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads(out.read_text())
    v = r["records"][0]
    return {"tokens_per_s": v["tokens_per_s"], "tokens_per_step": r["tokens_per_step"],
            "steps_per_s": v["tokens_per_s"] / r["tokens_per_step"], "config": r["config"]}


def _commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def bench_data(*, sizes_gb: tuple[float, ...] = (0.2, 2.0), prepare_mb: float = 100.0, rounds: int = 2,
               batches: int = 50, train_step: bool = True, work_dir: str | None = None, keep: bool = False,
               log: Callable[[str], None] | None = print) -> DataBenchResult:
    """Runs the three measurements of the module docstring.

    Args:
      sizes_gb: prepared corpora to train from, GB of uint16 token shards each (size / 2 tokens).
      prepare_mb: MB of text tokenized by both prepare paths per round.
      rounds: rounds of the prepare comparison (moefast and ``datasets`` alternate in each).
      batches: batches timed after the first, per loader child.
      train_step: also measure the tiny config's train step (a ``moefast bench train`` child).
      work_dir: where the corpora are generated (a new temporary directory if None).
      keep: leave ``work_dir``'s generated files in place.
      log: printer of one line per measurement.

    Raises:
      ValueError: a non-positive size, ``prepare_mb``, ``rounds`` or ``batches``.
      RuntimeError: a child process failed (its stderr is in the message).
    """
    if not sizes_gb or min(sizes_gb) <= 0 or prepare_mb <= 0 or rounds < 1 or batches < 1:
        raise ValueError(f"bench data: --sizes, --prepare-mb, --rounds and --steps must be positive, got {sizes_gb}, "
                         f"{prepare_mb}, {rounds}, {batches}")
    say = log or (lambda s: None)
    work = Path(tempfile.mkdtemp(prefix="moefast-bench-data-", dir=work_dir))
    try:
        pool = _word_pool()
        # 1. prepare throughput
        text = work / "prepare_text"
        files = _write_text(text, int(prepare_mb * 1e6), pool, seed=1)
        text_bytes = sum(p.stat().st_size for p in files)
        tokenizer = _train_bpe(files, work / "bpe")
        prep: list[dict[str, Any]] = []
        tools = ["moefast prepare", "datasets map(num_proc=2)"]
        have_datasets = _datasets_available()
        if not have_datasets:
            prep.append({"tool": tools[1], "skipped": "the datasets package is not installed "
                                                      "(pip install datasets)"})
            say(f"{tools[1]}: skipped, datasets is not installed")
        for r in range(rounds):
            for tool in (tools if r % 2 == 0 else tools[::-1]):
                if tool == tools[1] and not have_datasets:
                    continue
                out = work / f"prepared-{r}-{tools.index(tool)}"
                if tool == tools[0]:
                    seconds, tokens = _in_child("_prepare_moefast", text_dir=str(text), out=str(out),
                                                tokenizer=tokenizer)
                else:
                    seconds, tokens = _in_child("_prepare_datasets", files=[str(p) for p in files], out=str(out),
                                                tokenizer=tokenizer, cache=str(work / "hf-cache" / str(r)))
                    shutil.rmtree(work / "hf-cache" / str(r), ignore_errors=True)
                shutil.rmtree(out, ignore_errors=True)
                rec = {"tool": tool, "round": r + 1, "text_mb": text_bytes / 1e6, "seconds": seconds,
                       "mb_per_s": text_bytes / 1e6 / seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
                prep.append(rec)
                say(f"round {r + 1} {tool}: {rec['mb_per_s']:.2f} MB/s, {rec['tokens_per_s']:,.0f} tokens/s "
                    f"({seconds:.2f} s)")
        shutil.rmtree(text, ignore_errors=True)

        # 2. training from shards vs in memory
        from moefast.data.prepared import prepare

        loader: list[dict[str, Any]] = []
        base = _loader_child(None, batches)
        loader.append({"size_gb": 0.0, "path": "baseline (imports only)", "peak_rss_mb": base["peak_rss_mb"]})
        avail = _mem_available_bytes()
        rss_per_text_byte = None
        for i, size in enumerate(sorted(sizes_gb)):
            text_dir = work / f"text-{i}"
            t_bytes = int(size * 1e9 / 2)  # byte tokens: one per byte, uint16 shards
            _write_text(text_dir, t_bytes, pool, seed=10 + i)
            prepared = work / f"prepared-{i}"
            t0 = time.perf_counter()
            prepare(str(text_dir), prepared, tokenizer="byte", progress=False)
            say(f"{size:g} GB of tokens prepared in {time.perf_counter() - t0:.1f} s")
            rec = {"size_gb": size, "path": "prepared shards", **_loader_child(str(prepared), batches)}
            loader.append(rec)
            say(f"{size:g} GB prepared: first batch {rec['first_batch_s']:.2f} s, peak RSS {rec['peak_rss_mb']:,.0f} "
                f"MB, {rec['batches_per_s']:,.0f} batches/s")
            need = None if rss_per_text_byte is None else rss_per_text_byte * t_bytes
            if need is not None and need > avail / 2:
                loader.append({"size_gb": size, "path": "in memory", "skipped":
                               f"estimated peak {need / 1e9:.1f} GB (from the smaller corpus) > half of the "
                               f"{avail / 1e9:.1f} GB available"})
                say(f"{size:g} GB in memory: skipped (estimated {need / 1e9:.1f} GB)")
            else:
                rec = {"size_gb": size, "path": "in memory", **_loader_child(str(text_dir), batches)}
                loader.append(rec)
                # at least the packed int32 stream (4 bytes per byte token), whatever the small run shows
                rss_per_text_byte = max((rec["peak_rss_mb"] - base["peak_rss_mb"]) * 2**20 / t_bytes, 4.0)
                say(f"{size:g} GB in memory: first batch {rec['first_batch_s']:.2f} s, peak RSS "
                    f"{rec['peak_rss_mb']:,.0f} MB, {rec['batches_per_s']:,.0f} batches/s")
            if not keep:
                shutil.rmtree(text_dir, ignore_errors=True)
                shutil.rmtree(prepared, ignore_errors=True)

        # 3. the train step's need
        step = None
        if train_step:
            step = _train_step_child(work)
            say(f"train step ({step['config']}): {step['steps_per_s']:.2f} steps/s")
        return DataBenchResult(date=datetime.date.today().isoformat(), commit=_commit(), cpus=os.cpu_count() or 0,
                               mem_available_gb=avail / 1e9, prepare=prep, loader=loader, train_step=step)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def format_tables(r: DataBenchResult) -> str:
    """Markdown: prepare throughput (median per tool), loader per corpus and path, the step's need."""
    lines = ["| prepare | rounds | MB of text/s | tokens/s | seconds |", "|---|---:|---:|---:|---:|"]
    for tool in dict.fromkeys(x["tool"] for x in r.prepare):
        rs = [x for x in r.prepare if x["tool"] == tool]
        if "skipped" in rs[0]:
            lines.append(f"| {tool} | skipped: {rs[0]['skipped']} | | | |")
            continue
        med = lambda k: statistics.median(x[k] for x in rs)  # noqa: E731
        lines.append(f"| {tool} | {len(rs)} | {med('mb_per_s'):.2f} | {med('tokens_per_s'):,.0f} | "
                     f"{med('seconds'):.2f} |")
    lines += ["", "| corpus (GB of tokens) | path | tokens | time to first batch (s) | peak RSS (MB) | batches/s |",
              "|---:|---|---:|---:|---:|---:|"]
    for x in r.loader:
        if "skipped" in x:
            lines.append(f"| {x['size_gb']:g} | {x['path']} | skipped: {x['skipped']} | | | |")
        elif "first_batch_s" not in x:
            lines.append(f"| – | {x['path']} | | | {x['peak_rss_mb']:,.0f} | |")
        else:
            lines.append(f"| {x['size_gb']:g} | {x['path']} | {x['tokens']:,} | {x['first_batch_s']:.2f} | "
                         f"{x['peak_rss_mb']:,.0f} | {x['batches_per_s']:,.0f} |")
    rates = [x["batches_per_s"] for x in r.loader if x.get("path") == "prepared shards"]
    if r.train_step is not None and rates:
        s = r.train_step
        lines += ["", "| train step ({}) steps/s | slowest prepared loader batches/s | loader / step |".format(
            s["config"]), "|---:|---:|---:|",
            f"| {s['steps_per_s']:.2f} | {min(rates):,.0f} | {min(rates) / s['steps_per_s']:,.0f}× |"]
    return "\n".join(lines)


def run_cli(*, json_out: str | None, sizes_gb: tuple[float, ...], prepare_mb: float, rounds: int, batches: int,
            work_dir: str | None = None, train_step: bool = True) -> int:
    """``moefast bench data``: the measurements, the tables, the records to ``json_out``."""
    r = bench_data(sizes_gb=sizes_gb, prepare_mb=prepare_mb, rounds=rounds, batches=batches, work_dir=work_dir,
                   train_step=train_step)
    header = (f"data path, {r.date}, commit {r.commit}, {r.cpus} CPUs, {r.mem_available_gb:.1f} GB available; "
              f"batches of {_BATCH} x {_SEQ_LEN} tokens")
    tables = format_tables(r)
    print(f"\n{header}\n\n{tables}")
    if json_out:
        from moefast.bench.process import write_results

        write_results(json_out, dataclasses.asdict(r), f"{header}\n\n{tables}")
    return 0

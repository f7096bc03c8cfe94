"""``moefast bench gpu-compile``: compile (never run) a config's train step for NVIDIA GPUs on any
machine, and report what the compiled program does per device.

XLA's GPU compiler runs without a GPU: the CUDA PJRT plugin gives compile-only devices for a
target description (``jax.experimental.topologies.get_topology_desc``; H100 SXM and H200 are in
:data:`GPUS`, files under ``moefast/bench/gpu_targets/`` with their sources). The train step is
built by :class:`~moefast.train.Trainer` over a mesh of those devices, so every backend choice
takes its GPU path (they follow the mesh's platform, :func:`moefast.parallel.platform`), and is
compiled with the options a GPU run uses (:meth:`~moefast.train.Trainer.compiler_options`).

The report, per device:

* compile time (trace + lower + compile, seconds of this host);
* memory from ``compiled.memory_analysis()``: arguments, outputs, aliased (donated) bytes,
  temporaries, and the peak = arguments + outputs - aliased + temporaries, against JAX's default
  allocation of 75 % of the GPU's memory (``XLA_PYTHON_CLIENT_MEM_FRACTION``);
* host-syncing control flow: ``conditional`` instructions (XLA:GPU runs each as a thunk whose
  predicate is copied to the host), and copies of the step's arguments (a ``copy`` of a parameter
  of the entry computation or of a conditional's branch: the train state copied through a
  conditional);
* every collective (kind, dtype, bytes, asynchronous or synchronous, compute scheduled between
  start and done), summarised by kind and dtype;
* custom calls (cuBLAS/cuDNN GEMMs, Triton kernels, ...);
* XLA's latency-hiding-scheduler estimate of the step (:mod:`moefast.bench.gpu_schedule`): its
  speed-of-light estimator's microseconds, each loop body weighted by its trip count, the
  collectives the compute stream waits on, split by kind and by network tier (inside a host,
  between hosts, under the ``--network`` model), and from it an estimated step time, tokens/s,
  TFLOP/s per GPU and MFU. These are **estimates** of XLA's cost model, taken on a costing twin of
  the step (:func:`moefast.parallel.precision.costing_twin`: XLA's table mis-costs the float32
  weight-gradient GEMMs) without autotuning; ``scripts/gpu_check.py`` puts a measured step beside
  the estimate when a GPU is lent.

Needs the CUDA PJRT plugin (``jax-cuda12-pjrt`` and ``jax-cuda12-plugin`` of the installed jax's
version) and ``JAX_PLATFORMS=cpu`` set before JAX starts (the CLI sets it). On a machine without an
NVIDIA driver the plugin logs a few lines at every ``import jax``, so keep it out of the
environment you train in: :func:`plugin_path` looks for it in ``$MOEFAST_GPU_COMPILE_PATH`` or
``<venv>/gpu-compile`` (``pip install --target``; README "Compiling for GPUs without a GPU").
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import os
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

__all__ = ["GPUS", "GpuCompileResult", "PREALLOCATED_FRACTION", "compile_only_devices", "format_report",
           "gpu_compile", "plugin_path", "prepare_process", "target_config"]

# --gpu name -> target description file in moefast/bench/gpu_targets/
GPUS = {"h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb"}
PREALLOCATED_FRACTION = 0.75  # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION
PLUGIN_ENV = "MOEFAST_GPU_COMPILE_PATH"
INSTALL_HINT = ("pip install -c constraints.txt --no-deps --target \"$VIRTUAL_ENV/gpu-compile\" "
                "jax-cuda12-pjrt jax-cuda12-plugin nvidia-cuda-nvcc-cu12 jax-triton  (the versions of the installed jax; see README, "
                "\"Compiling for GPUs\")")


@contextlib.contextmanager
def _quiet_native_stderr():
    """File descriptor 2 to /dev/null: the CUDA plugin's C++ logging ("Could not find cuda drivers
    on your machine", several times) when it loads on a machine without an NVIDIA driver. Python
    errors are raised as exceptions and reported after it is restored."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def plugin_path() -> str | None:
    """Directory holding the CUDA PJRT plugin outside site-packages: ``$MOEFAST_GPU_COMPILE_PATH``,
    else ``<sys.prefix>/gpu-compile`` when it exists; ``None`` otherwise."""
    path = os.environ.get(PLUGIN_ENV) or os.path.join(sys.prefix, "gpu-compile")
    return path if os.path.isdir(os.path.join(path, "jax_plugins")) else None


_NETWORK: list[str | None] = [None]  # the network model XLA_FLAGS carries in this process


def prepare_process(network: str | None = None) -> None:
    """Before JAX starts: ``JAX_PLATFORMS=cpu`` (the CUDA plugin must not try to open a GPU),
    :func:`plugin_path` on ``sys.path`` so that JAX discovers the plugin, and the cluster model
    ``network`` (a key of :data:`~moefast.bench.gpu_schedule.NETWORKS`; ``None``: XLA's defaults)
    in ``XLA_FLAGS``, the only place XLA reads it from. The CLI calls this; in a script, call it
    before importing jax.

    Raises:
      RuntimeError: JAX's backends have already started (too late to add the plugin), or
        ``XLA_FLAGS`` already sets the estimator's options.
      ValueError: an unknown ``network``.
    """
    from moefast.bench.gpu_schedule import network_flag

    xb = sys.modules.get("jax._src.xla_bridge")
    if xb is not None and xb.backends_are_initialized():
        raise RuntimeError("moefast bench gpu-compile must set up JAX before it starts: run it in a fresh "
                           "process (the CLI does), or call prepare_process() before any JAX computation")
    if network is not None:
        flag = network_flag(network)
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_gpu_analytical_latency_estimator_options" in flags:
            raise RuntimeError("XLA_FLAGS already sets --xla_gpu_analytical_latency_estimator_options: give the "
                               "cluster model either there or with --network, not both")
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    _NETWORK[0] = network
    os.environ["JAX_PLATFORMS"] = "cpu"
    path = plugin_path()
    if path and path not in sys.path:
        sys.path.append(path)
        # the jax_plugins namespace package may already be imported without this directory
        plugins = sys.modules.get("jax_plugins")
        if plugins is not None and hasattr(plugins, "__path__"):
            plugins.__path__.append(os.path.join(path, "jax_plugins"))
    with _quiet_native_stderr():  # importing JAX loads (and logs about) the plugin
        import jax  # noqa: F401


def target_config(gpu: str) -> str:
    """The ``GpuTargetConfigProto`` text of ``gpu``: a key of :data:`GPUS`, or the path of such a
    file (``scripts/gpu_check.py`` saves a real GPU's as ``gpu_target_config.txtpb``).

    Raises:
      ValueError: neither a known GPU nor a readable file.
    """
    if gpu in GPUS:
        return (Path(__file__).parent / "gpu_targets" / GPUS[gpu]).read_text()
    if os.path.isfile(gpu):
        return Path(gpu).read_text()
    raise ValueError(f"--gpu {gpu!r}: known GPUs are {sorted(GPUS)}, or give a GpuTargetConfigProto text file")


def device_memory_bytes(gpu: str) -> int:
    """``device_memory_size`` of ``gpu``'s target description, bytes."""
    return int(re.search(r"device_memory_size:\s*(\d+)", target_config(gpu)).group(1))


def parse_devices(devices: str) -> tuple[int, int]:
    """``"8"`` (one host) or ``"2x8"`` (hosts x GPUs per host) -> (hosts, GPUs per host).

    Raises:
      ValueError: not of either form, or a count below 1.
    """
    m = re.fullmatch(r"\s*(?:(\d+)\s*[x×]\s*)?(\d+)\s*", devices)
    if not m or int(m.group(2)) < 1 or (m.group(1) is not None and int(m.group(1)) < 1):
        raise ValueError(f"--devices {devices!r}: expected N (GPUs on one host) or HOSTSxGPUS, e.g. 8 or 2x8")
    return int(m.group(1) or 1), int(m.group(2))


def compile_only_devices(gpu: str, hosts: int, gpus_per_host: int) -> list:
    """``hosts x gpus_per_host`` compile-only devices of ``gpu`` (nothing can run on them).

    Raises:
      RuntimeError: the CUDA PJRT plugin is missing, or JAX was started for another platform.
    """
    import jax
    from jax.experimental import topologies

    text = target_config(gpu)
    if not re.search(r"device_memory_size:\s*\d+", text):
        raise ValueError(f"--gpu {gpu}: not a GPU target description (no gpu_device_info with a "
                         "device_memory_size; see moefast/bench/gpu_targets/h100_sxm.txtpb)")
    try:
        with _quiet_native_stderr():  # JAX's backends start here (the plugin logs again)
            jax.devices("cpu")
            topo = topologies.get_topology_desc(platform="cuda", topology=f"1x{hosts}x{gpus_per_host}",
                                                target_config=text)
    except Exception as e:  # the plugin raises plain RuntimeErrors / XlaRuntimeErrors
        why = str(e).splitlines()[0]
        if "GpuTargetConfigProto" in why:
            raise ValueError(f"--gpu {gpu}: not a GPU target description XLA can read ({why})") from None
        if os.environ.get("JAX_PLATFORMS", "").strip().lower() != "cpu":
            raise RuntimeError(f"compiling for GPUs without one needs JAX_PLATFORMS=cpu set before JAX starts "
                               f"(JAX said: {why})") from None
        where = os.environ.get(PLUGIN_ENV)
        hint = (f"${PLUGIN_ENV} is {where}, which does not hold it: install it there with pip install -c "
                f"constraints.txt --no-deps --target {where} jax-cuda12-pjrt jax-cuda12-plugin nvidia-cuda-nvcc-cu12 jax-triton, or unset "
                f"{PLUGIN_ENV}") if where else f"install it with: {INSTALL_HINT}"
        raise RuntimeError(f"compiling for GPUs needs the CUDA PJRT plugin ({why}); {hint}") from None
    return list(topo.devices)


@dataclasses.dataclass
class CollectiveRow:
    kind: str
    dtype: str
    count: int
    bytes: int  # all instances together, per device
    asynchronous: int  # how many run asynchronously (a start/done pair XLA did not mark synchronous)
    compute_between_min: int  # compute ops between start and done, over the asynchronous ones
    compute_between_max: int


@dataclasses.dataclass
class GpuCompileResult:
    config: str
    overrides: list[str]
    gpu: str
    device_kind: str
    hosts: int
    gpus_per_host: int
    mesh: dict[str, int]
    tokens_per_step: int
    compile_s: float
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int  # arguments + outputs - aliased + temporaries
    param_bytes: int  # parameters and optimizer state, from the state's shardings
    optimizer_bytes: int
    device_memory_bytes: int
    limit_bytes: int  # PREALLOCATED_FRACTION of the device memory
    fits: bool
    headroom: float  # 1 - peak / limit
    conditionals: int
    state_copies: int  # copies of the step's arguments (entry or conditional-branch parameters)
    state_copy_bytes: int
    collectives: list[CollectiveRow]
    custom_calls: dict[str, int]
    flops: float | None  # XLA's FLOP count of the compiled module, per device
    # the grouped GEMM kernels (XLA counts no FLOPs in a custom call), from their launch grids:
    # {"bound": the work of every (row tile, expert) pair, "exact": the same launches on their buffers' rows
    # (the real rows without an expert axis; with one, the receive buffer sized for the worst case)}
    grouped_flops: dict[str, float]
    # the fused attention kernels (moefast.kernels.attention), from their launches' names (blocks, query
    # offset, window) and operand shapes: the (query, key) blocks their loops visit; loop bodies once
    attention_flops: float
    # the expert exchange's forward dispatches (op name moe_dispatch, outside AD's transpose):
    # {"forward": how many, "overlapped": asynchronous with compute scheduled between start and done}
    dispatches: dict[str, int]
    # context parallelism through linear attention (moefast.parallel.linear_context): per layer and device,
    # the bytes of the forward all-gathers of the pieces' states and of the convolution's halo (the largest
    # instance of each), and how many of each the program holds (loop bodies once)
    context_exchange: dict[str, int]
    loops: int  # while loops (scanned layers, accumulation): XLA's FLOP count takes their bodies once
    # XLA's own scheduler_statistics of the program as compiled, every computation once and in its order
    # before scheduling (kept for comparison; the estimate is ``estimate``)
    schedule: dict[str, float]
    autotuned: bool  # --autotune results loaded
    compiler_options: dict[str, str]
    jax: str
    date: str
    flags_note: str = ""
    # which latency estimator produced ``schedule``: "speed-of-light" (XLA's default for H100/H200,
    # microseconds) or "fixed costs" (XLA's fallback: its speed-of-light estimator takes only modules
    # whose collectives it supports, and a ragged-all-to-all is not one), whose units differ
    estimator: str = ""
    network: str = ""  # the cluster model (--network), "" for XLA's defaults
    # the trip-weighted estimate of the costing twin (gpu_schedule.ScheduleEstimate as a dict), and of
    # the program as compiled (its step and GEMM rates: what XLA's table makes of the float32 GEMMs)
    estimate: dict | None = None
    estimate_as_compiled: dict | None = None
    model_flops_per_step: float = 0.0  # moefast.model.flops.model_flops_per_token x tokens
    peak_tflops: float | None = None  # dense bf16 per GPU (moefast.train.mfu.PEAK_TFLOPS)


def _state_copies(module, text: str) -> tuple[int, int]:
    """Copies (``copy``, ``copy-start``) of the step's own arguments: in the entry computation and
    in the branches of conditionals, a copy whose operand is that computation's parameter (or a
    tuple element of it), as when a conditional copies the train state into its result; arrays of
    one element (the step counter, whose old value the step still reads after writing the new one;
    a layer scalar's moments, ``model.layer_scalar``) are not counted. Returns (count, bytes)."""
    from moefast.parallel.hlo import shape_bytes

    branches = set(re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", text))
    for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
        branches |= set(re.findall(r"%?([\w.\-]+)", group))
    count = size = 0
    for comp in {module.entry, *branches}:
        names = module.computations.get(comp, [])
        params = {n for n in names if module.instrs[n].opcode == "parameter"}
        params |= {n for n in names if module.instrs[n].opcode == "get-tuple-element"
                   and module.instrs[n].operands and module.instrs[n].operands[0] in params}
        for n in names:
            ins = module.instrs[n]
            if ins.opcode in ("copy", "copy-start") and ins.operands and ins.operands[0] in params \
                    and not re.match(r"\(?\s*[a-z0-9]+\[(1(,1)*)?\]", ins.shape):  # one element aside (the step counter)
                count += 1
                size += shape_bytes(ins.shape) // (2 if ins.opcode == "copy-start" else 1)  # (dst, src, ctx)
    return count, size


def _custom_calls(text: str) -> dict[str, int]:
    calls = collections.Counter(re.findall(r'custom_call_target="([^"]+)"', text))
    # Triton fusions (XLA's own GEMM/softmax emitters and Pallas kernels) are fusions, not custom calls
    calls.update({"triton fusion (" + k + ")": v for k, v in
                  collections.Counter(re.findall(r'"kind":"(__triton[\w_]*)"', text)).items()})
    # Pallas/Triton kernels by name (the attention's moefast_flash_*, the routing kernel, ...)
    calls.update(collections.Counter(
        "kernel " + m.group(1) for line in text.splitlines() if 'custom_call_target="__gpu$xla.gpu.triton"' in line
        for m in [re.search(r'name = \\?"([\w.-]+)\\?"[^"]*$', line)] if m))
    # jax-triton's launches (the FP8 GEMMs, moefast.kernels.fp8_matmul) by their named scope and the
    # dtypes of their two matrix operands (the second and fourth)
    for line in text.splitlines():
        m = re.search(r"(moefast_fp8_gemm_\w+?)/", line) if 'custom_call_target="triton_kernel_call"' in line else None
        if m:
            ops = re.findall(r"(\w+)\[[\d,]*\]", line.split("operand_layout_constraints={", 1)[-1])
            kinds = f"{ops[1]} x {ops[3]}" if len(ops) >= 4 else f"{ops[0]} -> f8e4m3fn" if ops else "?"
            calls[f"kernel {m.group(1)} (jax-triton, {kinds})"] += 1
    return dict(sorted(calls.items()))


_GMM = re.compile(r'name = \\?"grouped_matmul_m(\d+)_n(\d+)_k(\d+)\\?"')
_GMM_DW = re.compile(r'name = \\?"grouped_matmul_dw_m(\d+)_p(\d+)_r(\d+)_i\d+_o\d+\\?"')


def _grouped_flops(text: str) -> dict[str, float]:
    """FLOPs of the grouped GEMM launches (:mod:`moefast.kernels.grouped_matmul.pallas`), read from
    each launch's kernel name (tile sizes), grid and result shape: ``bound`` counts every (row tile,
    expert) pair of the launch grid, ``exact`` the rows of the launch's buffer only (the real rows
    when dropless runs without an expert axis; with one, the receive buffer is sized for the worst
    case and the real rows vary by step); loop bodies once, as XLA's count."""
    bound = exact = 0.0
    for line in text.splitlines():
        if 'custom_call_target="__gpu$xla.gpu.triton"' not in line:
            continue
        m = _GMM.search(line) or _GMM_DW.search(line)
        if not m:
            continue
        dims = [int(d) for d in re.search(r"=\s*\w+\[([\d,]*)\]", line).group(1).split(",") if d]  # result
        grid = [int(x) for x in re.findall(r"grid_[xyz] = (\d+)", line)]
        if m.re is _GMM:
            rows, bn, k = map(int, m.groups())
            bound += 2.0 * grid[0] * rows * k * grid[1] * bn
            exact += 2.0 * dims[0] * k * dims[1]
        else:
            rows, pairs, n = map(int, m.groups())
            bound += 2.0 * pairs * rows * dims[1] * dims[2]
            exact += 2.0 * n * dims[1] * dims[2]
    return {"bound": bound, "exact": exact} if bound else {}


def _attention_flops(text: str) -> float:
    """FLOPs of the fused attention kernels' launches (:func:`kernel_costs.attention_kernel_flops`
    of each: its name and its operands' shapes), loop bodies once, as XLA's count."""
    from moefast.bench.kernel_costs import attention_kernel_flops

    total = 0.0
    for line in text.splitlines():
        if 'custom_call_target="__gpu$xla.gpu.triton"' in line and "moefast_flash_" in line:
            total += attention_kernel_flops(line, line.split("custom-call(", 1)[-1])
    return total


def _dispatches(module) -> dict[str, int]:
    from moefast.parallel.expert import DISPATCH

    fwd = [c for c in module.collectives() if DISPATCH in c.op_name and "transpose" not in c.op_name]
    return {"forward": len(fwd), "overlapped": sum(c.is_async and c.compute_between > 0 for c in fwd)}


def _scoped_bytes(c, scope: str) -> int:
    """Bytes of collective ``c``'s result that come from operations named ``scope``. XLA's
    combiners merge collectives into one of a tuple result and name it ``prefix/(name_1:name_2:
    ...)``, a name per tuple element in order; a collective not merged is all one operation's."""
    from moefast.parallel.hlo import shape_bytes

    parts = re.findall(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?\[[\d,]*\])", c.shape)
    inner = c.op_name[c.op_name.find("(") + 1:].rstrip(")") if "(" in c.op_name else ""
    names = inner.split(":") if ":" in inner else []
    if len(names) != len(parts) or not parts:
        return c.bytes
    return sum(shape_bytes(p) for p, n in zip(parts, names) if scope in n)


def _context_exchange(module) -> dict[str, int]:
    from moefast.parallel.linear_context import HALO, STATES

    out, collectives = {}, module.collectives()
    for key, scope in (("states", STATES), ("halo", HALO)):
        fwd = [c for c in collectives if scope in c.op_name and "transpose" not in c.op_name]
        if fwd:
            out[key], out[key + "_count"] = max(_scoped_bytes(c, scope) for c in fwd), len(fwd)
    return out


def _collective_rows(module) -> list[CollectiveRow]:
    """Collectives grouped by kind and dtype; XLA combines many arrays into one tuple-shaped
    collective, so each dtype in it counts its own bytes (and the collective once per dtype)."""
    from moefast.parallel.hlo import shape_bytes

    groups: dict[tuple[str, str], list[tuple[int, object]]] = collections.defaultdict(list)
    for c in module.collectives():
        by_dtype: dict[str, int] = collections.Counter()
        for dtype, dims in re.findall(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]", c.shape):
            by_dtype[dtype] += shape_bytes(f"{dtype}[{dims}]")
        for dtype, size in by_dtype.items():
            groups[(c.kind, dtype)].append((size, c))
    rows = []
    for (kind, dtype), items in sorted(groups.items()):
        between = [c.compute_between for _, c in items if c.is_async]
        rows.append(CollectiveRow(kind, dtype, len(items), sum(size for size, _ in items), len(between),
                                  min(between, default=0), max(between, default=0)))
    return rows


def _flops(compiled) -> float | None:
    """XLA's FLOP count of the optimised module (``cost_analysis()`` returns None for compile-only
    devices; XLA's HLO cost analysis of the compiled module, run through the host's CPU client,
    counts the same FLOPs)."""
    try:
        cost = compiled.cost_analysis()
        if cost and cost.get("flops"):
            return float(cost["flops"])
        import jax
        from jax._src.lib import _jax  # private: the only route for compile-only executables in 0.10.2

        cpu = jax.devices("cpu")[0].client
        modules = compiled.runtime_executable().hlo_modules()
        return float(sum(_jax.hlo_module_cost_analysis(cpu, m).get("flops", 0.0) for m in modules))
    except Exception:
        return None


def gpu_compile(config: str | None = None, overrides: list[str] | None = None, *, gpu: str = "h100",
                devices: str = "8", autotune: str | None = None, network: str | None = None,
                twin: bool = True, log: Callable[[str], None] | None = None,
                gemm_utilization: float | None = None) -> GpuCompileResult:
    """Compiles ``config`` + ``overrides``'s train step for ``devices`` GPUs of kind ``gpu`` and reads
    the compiled program (module docstring).

    Args:
      config: YAML config path (default ``configs/tiny.yaml``).
      overrides: ``section.key=value`` strings.
      gpu: a key of :data:`GPUS` or a target description file (:func:`target_config`).
      devices: ``"N"`` GPUs on one host or ``"HOSTSxGPUS"``.
      autotune: XLA autotuning results dumped on a real GPU (``scripts/gpu_check.py`` saves them;
        ``xla_gpu_load_autotune_results_from``): the GEMM tiles a GPU chose replace the defaults
        where the same fusions appear, which makes the scheduler's estimate closer to a GPU's.
      network: the cluster model (:data:`~moefast.bench.gpu_schedule.NETWORKS`); it must be the one
        :func:`prepare_process` put in ``XLA_FLAGS`` (XLA reads it once per process).
      twin: take XLA's estimate on the costing twin (a second compilation; see
        :func:`~moefast.parallel.precision.costing_twin`); False: on the program as compiled, whose
        float32-result GEMMs XLA's table mis-costs (one compilation).

    Raises:
      ValueError: bad ``gpu`` / ``devices``, or ``network`` not the one this process was prepared with.
      moefast.config.ConfigError: the config does not fit the mesh of these devices.
      RuntimeError: the CUDA PJRT plugin is missing (:func:`compile_only_devices`).
    """
    import jax
    import numpy as np

    from moefast.bench.gpu_schedule import network_options, pgle_profile, read_estimate
    from moefast.config import ConfigError, load_config
    from moefast.parallel.hlo import HloModule
    from moefast.parallel.precision import costing_twin
    from moefast.train import Trainer
    from moefast.train.mfu import peak_flops

    log = log or (lambda s: None)
    target_config(gpu)  # a bad --gpu fails before anything is compiled
    if (network or None) != _NETWORK[0]:
        raise ValueError(f"network {network!r}: this process was prepared for {_NETWORK[0]!r}; XLA reads the cluster "
                         "model once per process (prepare_process(network=...) before JAX starts)")
    hosts, per_host = parse_devices(devices)
    if network:
        opts = network_options(network)
        node = int(float(opts.get("partition_size", opts.get("gpus_per_node", 8))))
        if hosts > 1 and node != per_host:
            raise ValueError(f"--network {network} puts {node} GPUs in a node, --devices {devices} {per_host} on a host: "
                             f"XLA's estimate would take hosts for nodes of {node}; use --devices {hosts}x{node} or a network "
                             f"file with gpus_per_node = partition_size = {per_host}")
    if autotune is not None and not os.path.isfile(autotune):
        raise ValueError(f"--autotune {autotune}: no such file")
    cfg = load_config(config, list(overrides or []))
    # no persistent cache: every figure comes from this compilation
    cfg = cfg.replace(cache=dataclasses.replace(cfg.cache, compile_dir=None))
    devs = compile_only_devices(gpu, hosts, per_host)
    with tempfile.TemporaryDirectory(prefix="moefast-gpu-compile-") as tmp:
        t0 = time.perf_counter()
        try:
            trainer = Trainer(cfg, Path(tmp) / "run", log=None, progress=False, devices=devs)
        except ConfigError as e:
            raise ConfigError(f"{e} (compiling for --devices {devices} = {hosts * per_host} GPUs)") from None
        options = dict(trainer.compiler_options())
        if autotune:
            options["xla_gpu_load_autotune_results_from"] = os.path.abspath(autotune)
        log(f"compiling the train step of {cfg.name} for {hosts * per_host} x {gpu} "
            f"(mesh {dict(trainer.mesh.shape)}) ...")
        dump = os.path.join(tmp, "dump")
        compiled = _compile(trainer.lower_train_step(), options, dump, autotune)
        compile_s = time.perf_counter() - t0
        abstract = trainer.abstract_state()
        text = compiled.as_text()
        module = HloModule(text)
        ragged = any(i.opcode.startswith("ragged-all-to-all") for i in module.instrs.values())
        hosts_of = [d.process_index for d in trainer.mesh.devices.flat]
        mesh_shape = dict(trainer.mesh.shape)
        axes_of = [{a: int(c) for a, c in zip(mesh_shape, np.unravel_index(p, tuple(mesh_shape.values())))
                    if mesh_shape[a] > 1} for p in range(trainer.mesh.size)]
        net = network_options(network) if network else None
        peak_tflops = peak_flops(devs).per_device_tflops
        hbm = _memory_bandwidth(gpu)
        as_compiled = read_estimate(dump, text, hosts_of, time_unit=not ragged, network=net, peak_tflops=peak_tflops,
                                    axes_of_partition=axes_of, hbm_bytes_per_s=hbm,
                gemm_utilization=gemm_utilization)
        estimated, unprofiled = as_compiled, None
        if twin:
            log("compiling its costing twin for XLA's estimate (weight-gradient GEMMs with bf16 results) ...")
            with costing_twin():  # a fresh Trainer: a fresh trace under the twin's switch
                twin_trainer = Trainer(cfg, Path(tmp) / "twin", log=None, progress=False, devices=devs)
                lowered = twin_trainer.lower_train_step()
            twin_dump = os.path.join(tmp, "twin-dump")
            # XLA's split-K rewrite turns a GEMM with a long contraction and few rows (a sequence
            # slice's) into partial products with float32 results, which its estimator mis-costs
            # as the twin exists to avoid: the twin keeps each GEMM whole
            twin_options = {**options, "xla_gpu_experimental_force_split_k": 1}
            twin_text = _compile(lowered, twin_options, twin_dump, autotune).as_text()
            estimated = read_estimate(twin_dump, twin_text, hosts_of, time_unit=not ragged, network=net,
                                      peak_tflops=peak_tflops, axes_of_partition=axes_of, hbm_bytes_per_s=hbm,
                gemm_utilization=gemm_utilization)
            if net and estimated is not None and estimated.profile and estimated.fingerprint:
                # XLA scheduled the twin believing its own costs (a flat 10 µs per attention kernel, a
                # fixed 5,000 µs per collective it cannot cost): once more, with the replay's costs as
                # its profile (what JAX's PGLE would hand it from a run on GPUs)
                log("recompiling the twin with those costs as XLA's profile (PGLE) ...")
                unprofiled = estimated
                profile_path = os.path.join(tmp, "pgle.pbtxt")
                Path(profile_path).write_text(pgle_profile(estimated))
                pgle_dump = os.path.join(tmp, "pgle-dump")
                pgle_text = _compile(lowered, {**twin_options, "xla_gpu_pgle_profile_file_or_directory_path": profile_path},
                                     pgle_dump, autotune).as_text()
                estimated = read_estimate(pgle_dump, pgle_text, hosts_of, time_unit=not ragged, network=net,
                                          peak_tflops=peak_tflops, axes_of_partition=axes_of, hbm_bytes_per_s=hbm,
                gemm_utilization=gemm_utilization)

    def shard_bytes(tree):
        return int(sum(np.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree)))

    ma = compiled.memory_analysis()
    peak = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    total = device_memory_bytes(gpu)
    limit = int(total * PREALLOCATED_FRACTION)
    copies, copy_bytes = _state_copies(module, text)
    return GpuCompileResult(
        config=cfg.name, overrides=list(overrides or []), gpu=gpu, device_kind=devs[0].device_kind,
        hosts=hosts, gpus_per_host=per_host, mesh=dict(trainer.mesh.shape),
        tokens_per_step=cfg.data.batch_size * cfg.data.seq_len, compile_s=compile_s,
        argument_bytes=int(ma.argument_size_in_bytes), output_bytes=int(ma.output_size_in_bytes),
        alias_bytes=int(ma.alias_size_in_bytes), temp_bytes=int(ma.temp_size_in_bytes), peak_bytes=int(peak),
        param_bytes=shard_bytes(abstract["params"]), optimizer_bytes=shard_bytes(abstract["opt_state"]),
        device_memory_bytes=total, limit_bytes=limit, fits=peak <= limit, headroom=1.0 - peak / limit,
        conditionals=sum(i.opcode == "conditional" for i in module.instrs.values()),
        state_copies=copies, state_copy_bytes=copy_bytes, collectives=_collective_rows(module),
        custom_calls=_custom_calls(text), flops=_flops(compiled), grouped_flops=_grouped_flops(text),
        attention_flops=_attention_flops(text),
        dispatches=_dispatches(module), context_exchange=_context_exchange(module),
        loops=sum(i.opcode == "while" for i in module.instrs.values()),
        schedule={} if as_compiled is None else as_compiled.once, autotuned=bool(autotune),
        compiler_options={k: str(v) for k, v in options.items()}, jax=jax.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        flags_note="" if options or not cfg.overlap.xla_flags else "GPU overlap flags all set by XLA_FLAGS",
        estimator="fixed costs" if ragged else "speed-of-light", network=network or "",
        estimate=None if estimated is None else {
            **{k: v for k, v in dataclasses.asdict(estimated).items() if k != "profile"}, "twin": twin,
            "profiled": unprofiled is not None,
            "unprofiled": None if unprofiled is None else {"step": unprofiled.step, "exposed": unprofiled.exposed,
                                                           "recosted": unprofiled.recosted}},
        estimate_as_compiled=None if as_compiled is None or not twin else {
            "step": as_compiled.step, "gemms": [dataclasses.asdict(g) for g in as_compiled.gemms]},
        model_flops_per_step=trainer.flops_per_token * cfg.data.batch_size * cfg.data.seq_len,
        peak_tflops=peak_tflops)


def _memory_bandwidth(gpu: str) -> float | None:
    """Bytes/s of the ``--gpu`` target's memory (its file's ``memory_bandwidth``, what XLA's
    performance model reads); ``None`` for a target file without it."""
    m = re.search(r"memory_bandwidth:\s*(\d+)", target_config(gpu))
    return float(m.group(1)) if m else None


def _compile(lowered, options: dict, dump: str, autotune: str | None):
    """``lowered`` compiled with ``options``, XLA dumping the optimized module and the scheduler's
    schedule into ``dump``."""
    try:
        # XLA's own log lines (memory-limit and rematerialisation notes for a GPU it cannot see)
        # are left out: the report says what they would
        with _quiet_native_stderr():
            return lowered.compile({**options, "xla_dump_to": dump, "xla_dump_hlo_as_text": True,
                                    "xla_dump_latency_hiding_schedule": True})
    except Exception as e:
        if autotune and "autotun" in str(e).lower():
            raise ValueError(f"--autotune {autotune}: XLA cannot use it ({str(e).splitlines()[0]}); give the "
                             "autotune_results.txtpb that scripts/gpu_check.py saves") from None
        raise


def _gib(b: float) -> str:
    return f"{b / 2**30:,.2f} GiB"


def format_report(r: GpuCompileResult) -> str:
    """Markdown: a memory and control-flow table, the collectives by kind and dtype, custom calls,
    and the scheduler's estimate."""
    n = r.hosts * r.gpus_per_host
    lines = [f"### {r.config}{' ' + ' '.join(r.overrides) if r.overrides else ''} on {n} x {r.gpu} "
             f"({r.hosts} host{'s' if r.hosts > 1 else ''} x {r.gpus_per_host}), mesh {r.mesh}",
             "",
             "| per device | value |", "|---|---:|",
             f"| compile time (this host) | {r.compile_s:,.1f} s |",
             f"| parameters / optimizer state (from the shardings) | {_gib(r.param_bytes)} / {_gib(r.optimizer_bytes)} |",
             f"| arguments / outputs / aliased (donated) | {_gib(r.argument_bytes)} / {_gib(r.output_bytes)} / "
             f"{_gib(r.alias_bytes)} |",
             f"| temporaries | {_gib(r.temp_bytes)} |",
             f"| **peak** (arguments + outputs - aliased + temporaries) | **{_gib(r.peak_bytes)}** |",
             f"| limit: {PREALLOCATED_FRACTION:.0%} of {_gib(r.device_memory_bytes)} (JAX's default preallocation) | "
             f"{_gib(r.limit_bytes)} |",
             f"| fits / headroom | {'yes' if r.fits else '**no**'} / {r.headroom:.1%} |",
             f"| conditionals (host-synced control flow) | {r.conditionals} |",
             f"| copies of the step's arguments (train state) | {r.state_copies} ({_gib(r.state_copy_bytes)}) |",
             f"| XLA FLOPs per step{' (while-loop bodies counted once: ' + str(r.loops) + ' loops)' if r.loops else ''} | "
             f"{'n/a' if r.flops is None else f'{r.flops:.4g}'} |"]
    if r.grouped_flops:
        g = r.grouped_flops
        lines.append(f"| grouped GEMM kernels' FLOPs (not in XLA's count): launch grids / their buffers' rows (the "
                     f"real rows without an expert axis; with one, the worst-case receive buffer) | "
                     f"{g['bound']:.4g} / {g['exact']:.4g} ({g['bound'] / g['exact']:.3f}x) |")
    if r.attention_flops:
        lines.append(f"| fused attention kernels' FLOPs (not in XLA's count; the blocks their loops visit, loop bodies "
                     f"once) | {r.attention_flops:.4g} |")
    if r.dispatches.get("forward"):
        lines.append(f"| expert exchange: forward dispatches with compute scheduled inside (loop bodies once) | "
                     f"{r.dispatches['overlapped']} of {r.dispatches['forward']} |")
    if r.context_exchange:
        x = r.context_exchange
        lines.append(f"| linear attention on the context axis, per layer: the pieces' states / the convolution's halo "
                     f"all-gathered (forward, result per device; {x.get('states_count', 0)} / "
                     f"{x.get('halo_count', 0)} in the program, loop bodies once) | {x.get('states', 0) / 2**20:,.2f} MiB "
                     f"/ {x.get('halo', 0) / 2**10:,.1f} KiB |")
    lines += ["", "| collective | dtype | count | result MiB per device and step (loop bodies once) | asynchronous | "
              "compute ops between start and done |",
              "|---|---|---:|---:|---:|---|"]
    for c in r.collectives:
        between = f"{c.compute_between_min}-{c.compute_between_max}" if c.asynchronous else "—"
        lines.append(f"| {c.kind} | {c.dtype} | {c.count} | {c.bytes / 2**20:,.1f} | {c.asynchronous} of {c.count} | "
                     f"{between} |")
    if not r.collectives:
        lines.append("| (none) | | | | | |")
    lines += ["", "custom calls and Triton fusions: "
              + (", ".join(f"`{k}` x{v}" for k, v in r.custom_calls.items()) or "none")]
    if r.estimate and not r.network and r.hosts > 1 and r.gpus_per_host != 8:
        lines += ["", f"note: XLA's default network puts 8 GPUs in a node, these hosts have {r.gpus_per_host}: its own "
                      "figures cost collectives between them as inside a node (the re-costed step uses the real hosts); "
                      "give --network with a file of gpus_per_node = partition_size = "
                      f"{r.gpus_per_host}"]
    if r.estimate:
        from moefast.bench.gpu_report import format_estimate

        lines += format_estimate(r.estimate, tokens=r.tokens_per_step, gpus=r.hosts * r.gpus_per_host,
                                 model_flops=r.model_flops_per_step, peak_tflops=r.peak_tflops, network=r.network,
                                 as_compiled=r.estimate_as_compiled, custom_calls=r.custom_calls)
    return "\n".join(lines)


def run_cli(*, json_out: str | None, config: str | None, overrides: list[str] | None, gpu: str,
            devices: str, autotune: str | None = None, network: str | None = None, twin: bool = True,
            gemm_utilization: float | None = None) -> int:
    r = gpu_compile(config, overrides, gpu=gpu, devices=devices, autotune=autotune, network=network, twin=twin,
                    gemm_utilization=gemm_utilization,
                    log=print)
    header = (f"GPU compile check (compiled for compile-only devices, nothing run), jax {r.jax}, {r.date}; "
              f"{r.tokens_per_step:,} tokens/step; XLA options: "
              + (" ".join(f"{k}={v}" for k, v in r.compiler_options.items()) or "none"))
    report = format_report(r)
    print(f"\n{header}\n\n{report}")
    if json_out:
        from moefast.bench.process import write_results

        write_results(json_out, dataclasses.asdict(r), f"{header}\n\n{report}\n")
    if not r.fits:
        print(f"error: the step needs {_gib(r.peak_bytes)} per GPU, more than the {_gib(r.limit_bytes)} JAX allocates "
              f"({PREALLOCATED_FRACTION:.0%} of the {r.device_kind}'s {_gib(r.device_memory_bytes)}); try "
              "model.scan_layers=true, model.remat, a smaller data.batch_size or more GPUs (README: Fitting "
              "bigger models)", file=sys.stderr)
        return 1
    return 0

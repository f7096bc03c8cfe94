"""What a run asks of the platform its step is compiled for, checked before anything compiles or is
restored (and :func:`config_warnings`: settings that are valid but almost certainly not meant): one small function a check, each refusing with one :class:`~moefast.config.ConfigError`
line that names the setting and what to use instead, or returning a note for the log.

:class:`~moefast.train.Trainer` calls :func:`check_run` as soon as its mesh exists. A new check is
one function ``(cfg, mesh) -> note or None`` added to :data:`CHECKS`.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from moefast import host_memory, parallel
from moefast.config import ConfigError, ExperimentConfig
from moefast.model.layout import softmax_attention_layers
from moefast.parallel import fp8_gemm

__all__ = ["CHECKS", "check_run", "config_warnings"]


def _host_malloc(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> str | None:
    """A note: on CPU, the host malloc keeps glibc's defaults."""
    if parallel.platform(mesh) == "cpu" and host_memory.status() in (None, "too-late"):
        return ("note: the host malloc keeps glibc's defaults, so XLA:CPU's freed step memory goes back to the OS "
                "after every step (slower steps on CPU; docs/perf.md, 'Host memory'): call "
                "moefast.host_memory.configure() before any JAX computation (the moefast command does)")
    return None


def _pallas_routing(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> None:
    """``moe.routing_impl=pallas`` on a CPU mesh of several devices (the interpreter cannot run in
    the expert-parallel ``shard_map``)."""
    if cfg.moe.routing_impl == "pallas" and parallel.platform(mesh) == "cpu" and mesh.size > 1:
        raise ConfigError("moe.routing_impl: 'pallas' runs in the Pallas interpreter on CPU, which cannot run "
                          f"inside the expert-parallel shard_map over {mesh.size} devices; use "
                          "'reference' or 'auto' here, or a mesh of one CPU device (devices=jax.devices()[:1]; "
                          "--cpu-devices 1 on the command line)")


def _fp8_dispatch(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> None:
    """``moe.dispatch_dtype=float8_e4m3fn`` on GPUs without FP8 (compute capability below 8.9)."""
    device = mesh.devices.flat[0]
    cc = getattr(device, "compute_capability", None) if parallel.platform(mesh) == "gpu" else None
    if cfg.moe.dispatch_dtype == "float8_e4m3fn" and cc is not None and float(cc) < 8.9:
        raise ConfigError(f"moe.dispatch_dtype: float8_e4m3fn needs FP8 hardware (compute capability 8.9 or later: "
                          f"Ada, Hopper, Blackwell); these {device.device_kind} GPUs are {cc}: "
                          "use moe.dispatch_dtype=compute")


def _fp8_gemms(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> str | None:
    """``model.precision=fp8``: refuses GPUs without FP8 tensor cores; a note on what runs the GEMMs
    (:func:`~moefast.parallel.fp8_gemm.check_device`)."""
    if cfg.model.precision == "fp8":
        return fp8_gemm.check_device(parallel.platform(mesh), mesh.devices.flat[0])
    return None


def _hierarchical(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> None:
    """``moe.exchange=hierarchical`` fits this mesh (:func:`~moefast.parallel.expert.check_hierarchical`,
    with each device's tokens per MoE call: a micro-batch's, over ``model.sequence_slices``) and, on
    GPUs, each block of ``moe.gpus_per_host`` consecutive expert ranks is one host's (one process's)
    devices."""
    if cfg.moe.exchange != "hierarchical":
        return
    from moefast.parallel.expert import check_hierarchical

    ep, g = mesh.shape.get("expert", 1), cfg.moe.gpus_per_host
    # per MoE call: a micro-batch's rows, in model.sequence_slices slices
    tokens = (cfg.data.batch_size // cfg.train.grad_accum_steps * cfg.data.seq_len // mesh.size
              // cfg.model.sequence_slices)
    try:
        check_hierarchical(cfg.moe, ep, tokens)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if parallel.platform(mesh) == "gpu":
        procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
        lines = procs.reshape(-1, ep // g, g)  # each expert axis: its blocks of g consecutive ranks
        whole = (lines == lines[..., :1]).all() and all(len(set(line[:, 0])) == ep // g for line in lines)
        if not whole:
            raise ConfigError(f"moe.exchange=hierarchical: moe.gpus_per_host={g} does not match this mesh's hosts: "
                              f"each block of {g} consecutive expert ranks must be one host's GPUs and the "
                              f"{ep // g} blocks of an expert axis on {ep // g} different hosts; set "
                              "moe.gpus_per_host to the GPUs per host, with the expert axis innermost (mesh order "
                              "data, fsdp, expert)")


def _triton_routing(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> None:
    """``moe.routing_impl=triton`` where its kernel cannot run (not a GPU, no jax-triton)."""
    if cfg.moe.routing_impl != "triton":
        return
    from moefast.kernels.routing import triton as triton_kernel

    platform = parallel.platform(mesh)
    why = triton_kernel.available(platform)
    if why:
        others = "'auto' or 'reference'" if platform == "cpu" and mesh.size > 1 else "'auto', 'reference' or 'pallas'"
        raise ConfigError(f"moe.routing_impl: {why}; use {others} here")


Check = Callable[[ExperimentConfig, jax.sharding.Mesh], str | None]

# In the order they run: the first refusal is the one reported.
def _lora_without_rank(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> None:
    """``lora.*`` keys set with ``lora.rank`` 0: the run would silently train every parameter in
    float32 (about 16 bytes a parameter with AdamW) instead of adapters."""
    given = cfg.lora.set_without_rank()
    if given:
        raise ConfigError(f"lora.{given[0]}: is set but lora.rank is 0 (no adapters: every parameter trains); set "
                          f"lora.rank (e.g. 16) to fine-tune with adapters, or leave out "
                          f"{', '.join('lora.' + g for g in given)}")


def _qk_clip_without_attention(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> None:
    """``train.qk_clip`` on a model without a softmax attention layer (every ``model.layer_types``
    entry ``linear_attention``, no multi-token prediction block): no logit to clip."""
    if cfg.train.qk_clip is not None and not softmax_attention_layers(cfg.model):
        raise ConfigError(f"train.qk_clip={cfg.train.qk_clip}: the model has no softmax attention layer "
                          "(model.layer_types are all linear_attention), so there is no attention logit to clip; set "
                          "train.qk_clip=null")


def _qk_clip_with_lora(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> None:
    """``train.qk_clip`` with adapters: clipping scales the query and key weights, which under
    ``lora`` are the frozen base's (an adapter exported alone would then no longer give this model)."""
    if cfg.train.qk_clip is not None and cfg.lora.enabled:
        raise ConfigError("train.qk_clip: QK-clip rescales the attention's query and key weights, which lora keeps "
                          "frozen (an exported adapter would no longer reproduce the run); it is a pretraining "
                          "stabiliser: set train.qk_clip=null with lora.rank > 0")


def _muon_params(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> None:
    """``train.optimizer=muon``: every parameter is in :data:`~moefast.train.optimizer.PARAM_KINDS`
    (a new module's parameter is refused, never trained by AdamW unannounced), and no adapters
    (Muon's orthogonalised step is a pretraining optimizer; an adapter's B starts at 0, and the
    low-rank factors' product is not what Muon orthogonalises)."""
    if cfg.train.optimizer != "muon":
        return
    if cfg.lora.enabled:
        raise ConfigError("train.optimizer=muon with lora.rank > 0: Muon orthogonalises whole weight matrices in "
                          "pretraining; adapters train with train.optimizer=adamw")
    from moefast.train.optimizer import muon_specs

    try:
        muon_specs(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None


CHECKS: tuple[Check, ...] = (_host_malloc, _pallas_routing, _fp8_dispatch, _fp8_gemms, _hierarchical,
                             _triton_routing, _lora_without_rank, _qk_clip_without_attention, _qk_clip_with_lora,
                             _muon_params)


def check_run(cfg: ExperimentConfig, mesh: jax.sharding.Mesh) -> list[str]:
    """Refuses a config that the platform of ``mesh`` cannot run, before anything compiles or is
    restored.

    Args:
      cfg: the experiment.
      mesh: the run's mesh (:func:`moefast.parallel.make_mesh`); its devices decide the platform
        (:func:`moefast.parallel.platform`), and a GPU's ``compute_capability`` is read.

    Returns:
      Notes for the run's log (``"note: ..."``), in the order of :data:`CHECKS`.

    Raises:
      ConfigError: the first check that refuses: ``moe.routing_impl=pallas`` on a CPU mesh of
        several devices; FP8 dispatch (``moe.dispatch_dtype``) or GEMMs (``model.precision``) on
        GPUs without FP8 (compute capability below 8.9); ``moe.exchange=hierarchical`` that does
        not fit the mesh or its hosts; ``moe.routing_impl=triton`` where its kernel cannot run;
        ``train.qk_clip`` on a model without softmax attention, or with adapters;
        ``train.optimizer=muon`` with adapters or with a parameter its table does not know.
    """
    return [note for check in CHECKS if (note := check(cfg, mesh))]


def config_warnings(cfg: ExperimentConfig) -> list[str]:
    """Settings that are valid but almost certainly not meant (the run logs each as a warning)."""
    out = []
    tc, moe = cfg.train, cfg.moe
    if moe.warmup_steps > tc.steps:
        out.append(f"moe.warmup_steps={moe.warmup_steps} > train.steps={tc.steps}: routing is randomised "
                   f"({moe.warmup_routing} warm-up) for the whole run, so the router never trains on its own "
                   "choices; lower moe.warmup_steps")
    if cfg.lora.enabled and cfg.lora.routing == "update" and moe.aux_free_bias_rate > 0:
        out.append(f"lora with moe.aux_free_bias_rate={moe.aux_free_bias_rate}: the selection bias keeps moving while the "
                   "adapters train; a PEFT adapter (export-hf --adapter) does not carry it, so the base with the "
                   "adapter routes otherwise than this run, and a family whose router has no selection bias cannot "
                   "be exported at all; lora.routing=frozen keeps the imported bias")
    if tc.optimizer != "muon" and tc.muon_scale != "moonlight":
        out.append(f"train.muon_scale={tc.muon_scale} has no effect with train.optimizer={tc.optimizer}")
    elif tc.optimizer == "muon" and tc.muon_scale == "none" and tc.learning_rate < 0.01:
        out.append(f"train.muon_scale=none with train.learning_rate={tc.learning_rate:g}: without Moonlight's scale "
                   "Muon's updates have an RMS of about 1/sqrt(max(m, n)) of AdamW's and want a rate of about 0.02 "
                   "(Keller Jordan's); train.muon_scale=moonlight takes AdamW's rate as it is")
    m = cfg.model
    if m.index_topk is not None and m.index_topk >= cfg.data.seq_len:
        out.append(f"model.index_topk={m.index_topk} >= data.seq_len={cfg.data.seq_len}: every query keeps every key "
                   "it may see, so the sparse attention is dense attention (and the indexer's sparse-stage KL is its "
                   "dense one); lower model.index_topk below the row length for sparse attention")
    if m.linear_attention_kind != "gated_deltanet" and "linear_attention" not in (m.layer_types or ()):
        out.append(f"model.linear_attention_kind={m.linear_attention_kind} has no effect: no layer is linear_attention "
                   "(model.layer_types); list the linear layers there")
    if tc.warmup_steps > tc.steps:  # the schedule cuts the warm-up to train.steps (learning_rate_schedule)
        n = tc.steps
        out.append(f"train.warmup_steps={tc.warmup_steps} > train.steps={n}: the warm-up is cut to the run's {n} "
                   f"steps, so the learning rate climbs linearly from 0 for the whole run (step k at (k-1)/{n} of "
                   f"train.learning_rate={tc.learning_rate}, the last step at {(n - 1) / n:.3g} of it) and never "
                   "decays (no cosine phase); lower train.warmup_steps below train.steps")
    return out

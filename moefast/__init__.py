"""moefast: fast mixture-of-experts language-model training in JAX/Flax.

The public API is importable from the top level; heavy modules load on first use, so
``import moefast`` is cheap and leaves JAX's device setup (e.g. ``jax_num_cpu_devices``) open.
Importing it changes nothing process-wide (no ``malloc`` policy, hooks or warning filters). The
``moefast`` command keeps freed host memory mapped between steps on CPU; a script opts in by
calling ``moefast.host_memory.configure()`` before any JAX computation (:mod:`moefast.host_memory`).

Example::

    import moefast
    moefast.host_memory.configure()  # optional, first: faster CPU steps (see moefast.host_memory)
    cfg = moefast.load_config(overrides=["train.steps=100"])
    summary = moefast.Trainer(cfg, run_dir="runs/demo").run()
"""

import importlib

from moefast import host_memory  # standard library only; configures nothing until called

__version__ = "0.1.0"

_API = {
    "ConfigError": "moefast.config",
    "ExperimentConfig": "moefast.config",
    "MoEConfig": "moefast.config",
    "load_config": "moefast.config",
    "Transformer": "moefast.model",
    "build_model": "moefast.model",
    "load_corpus": "moefast.data",
    "ModelDef": "moefast.train",
    "Trainer": "moefast.train",
    "TrainSummary": "moefast.train",
    "generate": "moefast.train",
    "load_run_config": "moefast.train",
    "MoELayer": "moefast.model",
    "MoEStats": "moefast.model",
    "compute_capacity": "moefast.routing",
    "route": "moefast.routing",
    "RoutingResult": "moefast.routing",
    "plot_run": "moefast.plot",
    "load_hf": "moefast.interop",
    "load_hf_routing": "moefast.interop",
    "save_hf": "moefast.interop",
}

__all__ = sorted(_API)


def __getattr__(name):
    if name == "plot":  # the module (moefast.plot.run_figures, ...), importable without JAX
        return importlib.import_module("moefast.plot")
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'moefast' has no attribute {name!r}")

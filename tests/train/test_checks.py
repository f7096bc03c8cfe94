"""The platform checks a run passes before anything compiles (moefast.train.checks), on meshes of
fake GPUs: each refusal is one ConfigError naming the setting and what to use instead."""

import types

import numpy as np
import pytest

from moefast.config import ConfigError, load_config
from moefast.train.checks import check_run


def gpus(compute_capability: str, kind: str, n: int = 8, per_host: int = 8):
    """A mesh of ``n`` fake GPUs on hosts of ``per_host`` (data x expert = 2 x n/2)."""
    devs = np.array([types.SimpleNamespace(platform="gpu", compute_capability=compute_capability, device_kind=kind,
                                           process_index=i // per_host) for i in range(n)])
    return types.SimpleNamespace(devices=devs.reshape(2, 1, n // 2), size=n,
                                 shape={"data": 2, "fsdp": 1, "expert": n // 2})


A100, H100 = ("8.0", "NVIDIA A100-SXM4-80GB"), ("9.0", "NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("overrides,match", [
    (["moe.dispatch_dtype=float8_e4m3fn"], "moe.dispatch_dtype: float8_e4m3fn needs FP8 hardware .* these NVIDIA "
                                            "A100-SXM4-80GB GPUs are 8.0: use moe.dispatch_dtype=compute"),
    (["model.precision=fp8"], "model.precision: fp8 trains for FP8 tensor cores .* use model.precision=bf16"),
])
def test_fp8_is_refused_on_gpus_without_it(overrides, match):
    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError, match=match):
        check_run(cfg, gpus(*A100))
    notes = check_run(cfg, gpus(*H100))  # FP8 hardware: runs (fp8 GEMMs say what computes them)
    assert all(n.startswith("note: model.precision=fp8") for n in notes) and len(notes) == (
        "model.precision=fp8" in overrides)


def test_hierarchical_exchange_must_match_the_hosts():
    cfg = load_config(None, ["mesh.data=2", "mesh.expert=4", "moe.exchange=hierarchical", "moe.gpus_per_host=2"])
    assert check_run(cfg, gpus(*H100, per_host=2)) == []  # each block of 2 expert ranks is one host's
    with pytest.raises(ConfigError, match="moe.gpus_per_host=2 does not match this mesh's hosts"):
        check_run(cfg, gpus(*H100, per_host=8))  # one host holds all 8

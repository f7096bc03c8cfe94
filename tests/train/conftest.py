import shutil
import sysconfig
from pathlib import Path

import pytest

from moefast.config import load_config

SMALL_MODEL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.head_dim=16",
               "model.d_ff=64", "model.max_seq_len=64", "moe.num_experts=4", "moe.top_k=2",
               "data.seq_len=32", "data.batch_size=8", "train.warmup_steps=2", "train.eval_batches=2"]


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    """A small real-text corpus: 24 standard-library modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("corpus")
    for p in sorted(root.glob("[a-m]*.py"))[:24]:
        shutil.copy(p, out / p.name)
    return out


@pytest.fixture
def small_config(text_dir):
    def make(*overrides):
        return load_config(None, SMALL_MODEL + [f"data.source={text_dir}", *overrides])
    return make

"""Config: every shipped YAML loads; typos, wrong types and impossible values fail clearly."""


import pytest

from moefast.config import CONFIG_DIR, ConfigError, ExperimentConfig, load_config

CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


def test_configs_dir_is_not_empty():
    assert CONFIGS, f"no YAML configs in {CONFIG_DIR}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.name == path.stem
    assert ExperimentConfig.from_dict(cfg.to_dict()) == cfg  # round-trips (run dirs store it)


def test_tiny_is_the_default_and_matches_the_design():
    cfg = load_config()
    m, moe, d = cfg.model, cfg.moe, cfg.data
    assert (m.d_model, m.num_layers, m.num_heads, m.head_dim, m.d_ff) == (256, 4, 4, 64, 512)
    assert (moe.num_experts, moe.top_k) == (8, 2)
    assert (d.tokenizer, d.seq_len, d.batch_size) == ("byte", 256, 8)


def test_overrides_apply_and_parse_types():
    cfg = load_config(None, ["train.steps=200", "moe.top_k=1", "train.learning_rate=1e-3",
                             "model.tie_embeddings=false", "train.stop_at=null"])
    assert (cfg.train.steps, cfg.moe.top_k, cfg.train.learning_rate) == (200, 1, 1e-3)
    assert cfg.model.tie_embeddings is False and cfg.train.stop_at is None
    assert load_config(None, ["moe.capacity_factor=null"]).moe.capacity_factor == 1.25
    assert load_config(None, ["moe.capacity_factor=2"]).moe.capacity_factor == 2.0


@pytest.mark.parametrize("override,match", [
    ("train.stepz=1", r"train\.stepz: unknown key \(did you mean 'steps'\?\); valid keys of 'train': \[.*'steps'"),
    ("trian.steps=1", r"override 'trian.steps=1': unknown section 'trian' \(did you mean 'train'\?\)"),
    ("train.step=1", r"train\.step: unknown key \(did you mean 'steps'\?\)"),
    ("train.seed=-1", r"train\.seed: must be in \[0, 2\*\*32\)"),
    ("train.steps=abc", r"train\.steps: expected int, got 'abc'"),
    ("train.steps=1.5", r"train\.steps: expected int"),
    ("model.tie_embeddings=3", r"model\.tie_embeddings: expected bool"),
    ("model.dtype=float16", r"model\.dtype: 'float16' is not one of \['float32', 'bfloat16'\]"),
    ("moe.top_k=9", r"moe\.top_k: must be in \[1, moe\.num_experts=8\]"),
    ("moe.capacity_factor=-1", r"moe\.capacity_factor: must be a finite number > 0, or 0 for dropless"),
    ("moe.routing_policy=random", r"moe\.routing_policy: 'random' is not one of \['position', 'priority'\]"),
    ("moe.load_ema_decay=1", r"moe\.load_ema_decay: must be in \[0, 1\)"),
    ("data.seq_len=2048", r"data\.seq_len: 2048 exceeds model\.max_seq_len=1024"),
    ("model.num_kv_heads=3", r"model\.num_kv_heads: must divide model\.num_heads=4"),
    ("train.stop_at=1000", r"train\.stop_at: must be null or in \[1, train\.steps=600\]"),
    ("model.mtp_depth=-1", r"model\.mtp_depth: must be >= 0 \(0 = no multi-token prediction\), got -1"),
    ("model.mtp_depth=256", r"model\.mtp_depth: 256 leaves no target inside a row of data\.seq_len=256"),
    ("train.mtp_loss_coef=-0.1", r"train\.mtp_loss_coef: must be a finite number >= 0"),
    ("train.mtp_loss_coef=.nan", r"train\.mtp_loss_coef: must be a finite number >= 0"),
    ("steps=3", r"expected section\.key=value"),
    ("train.steps", r"expected section\.key=value"),
])
def test_bad_values_fail_with_the_key_named(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_routing_options():
    assert load_config(None, ["moe.capacity_factor=0"]).moe.dropless
    with pytest.raises(ConfigError, match=r"moe\.capacity_mode: dynamic capacity needs a capacity"):
        load_config(None, ["moe.capacity_factor=0", "moe.capacity_mode=dynamic"])
    with pytest.raises(ConfigError, match=r"moe\.capacity_factor_min/max"):
        load_config(None, ["moe.capacity_mode=dynamic", "moe.capacity_factor_max=1.0"])


@pytest.mark.parametrize("overrides,key", [
    (["model.attention=mla", "model.num_kv_heads=2"], "model.num_kv_heads"),
    (["model.attention=mla", "model.attention_bias=qkv"], "model.attention_bias"),
    (["model.attention=mla", "model.qk_norm=per_head"], "model.qk_norm"),
    (["model.attention=mla", "model.qk_rope_head_dim=5"], "model.qk_rope_head_dim"),
    (["model.attention=mla", "model.kv_lora_rank=0"], "model.kv_lora_rank"),
    (["model.attention=mla", "model.q_lora_rank=-1"], "model.q_lora_rank"),
    (["model.attention=mla", "model.partial_rotary_factor=0.5"], "model.partial_rotary_factor"),
    (["model.attention=mla", "model.position_encoding=sinusoidal"], "model.position_encoding"),
    # DeepSeek Sparse Attention: MLA with a query latent, positive sizes, the indexer wide enough for RoPE
    (["model.index_topk=8"], "model.index_topk"),
    (["model.attention=mla", "model.q_lora_rank=16", "model.index_topk=0"], "model.index_topk"),
    (["model.attention=mla", "model.q_lora_rank=16", "model.index_topk=8", "model.index_n_heads=0"],
     "model.index_n_heads"),
    (["model.attention=mla", "model.q_lora_rank=16", "model.index_topk=8", "model.index_head_dim=32"],
     "model.index_head_dim"),  # < qk_rope_head_dim=64
    (["model.attention=mla", "model.index_topk=8"], "model.q_lora_rank"),
    (["model.attention=mla", "model.q_lora_rank=16", "model.index_topk=8", "model.sequence_slices=2"],
     "model.sequence_slices"),
    (["model.position_encoding=none", "model.partial_rotary_factor=0.5"], "model.partial_rotary_factor"),  # NoPE
    (["model.rope_type=yarn", "model.original_max_position_embeddings=256", "model.rope_factor=4",
      "model.position_encoding=none"], "model.rope_type"),
    (["model.attention=mqa"], "model.attention"),
    (["model.partial_rotary_factor=0.03"], "model.partial_rotary_factor"),  # 64 * 0.03 = 1 feature
    (["model.partial_rotary_factor=1.5"], "model.partial_rotary_factor"),
    (["model.rope_type=yarn", "model.rope_factor=4"], "model.original_max_position_embeddings"),
    (["model.rope_type=yarn", "model.original_max_position_embeddings=256", "model.rope_factor=0.5"],
     "model.rope_factor"),
    (["model.rope_type=yarn", "model.original_max_position_embeddings=256"], "model.rope_factor"),  # 1: a no-op
    (["model.rope_type=yarn", "model.original_max_position_embeddings=256", "model.position_encoding=sinusoidal"],
     "model.rope_type"),
    (["model.rope_type=yarn", "model.original_max_position_embeddings=256", "model.rope_factor=4", "model.beta_slow=0"],
     "model.beta_fast"),
    # sliding windows: one per sliding layer, below the context; sinks and windows are GQA's
    (["model.num_layers=2", "model.layer_types=[sliding_attention,full_attention]"], "model.sliding_window"),
    (["model.num_layers=2", "model.layer_types=[sliding_attention,full_attention]", "model.max_seq_len=512",
      "model.sliding_window=512"], "model.sliding_window"),
    (["model.attention=mla", "model.attention_sinks=true"], "model.attention_sinks"),
    (["model.num_layers=2", "model.layer_types=[sliding_attention,cross_attention]"], "model.layer_types\\[1\\]"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_impossible_attention_and_rope_choices_name_the_field(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', '[.]')}: "):
        load_config(None, overrides)


def test_attention_and_rope_options_load():
    m = load_config(None, ["model.attention=mla", "model.q_lora_rank=null", "model.rope_type=yarn",
                           "model.rope_factor=40", "model.original_max_position_embeddings=4096",
                           "model.mscale=1.0", "model.mscale_all_dim=1.0"]).model
    assert (m.rotary_dim, m.q_lora_rank, m.kv_heads) == (64, None, 4)
    assert load_config(None, ["model.head_dim=128", "model.partial_rotary_factor=0.5"]).model.rotary_dim == 64
    assert load_config(None).model.rotary_dim == 64 and load_config(None).model.attention == "gqa"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found; shipped configs: .*tiny.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model:\n  d_modle: 3\n")
    with pytest.raises(ConfigError, match=r"model\.d_modle: unknown key"):
        load_config(wrong)


def test_mesh_shapes(devices):
    from moefast.parallel import make_mesh

    with pytest.raises(ConfigError, match=r"data\.batch_size: 12 is not divisible by the 8 batch shards"):
        make_mesh(load_config(None, ["data.batch_size=12"]))
    with pytest.raises(ConfigError, match=r"mesh: data×fsdp×expert = 3×1×1 = 3 must equal the 8 devices"):
        make_mesh(load_config(None, ["mesh.data=3"]))
    with pytest.raises(ConfigError, match=r"mesh.expert: 4 does not divide moe.num_experts=6"):
        make_mesh(load_config(None, ["moe.num_experts=6", "mesh.expert=4"]))
    with pytest.raises(ConfigError, match=r"at most one axis may be -1"):
        make_mesh(load_config(None, ["mesh.expert=-1"]))
    with pytest.raises(ConfigError, match=r"cannot fill 8 devices"):
        make_mesh(load_config(None, ["mesh.expert=3"]))
    mesh = make_mesh(load_config(None, ["mesh.expert=4"]))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "expert": 4}
    assert dict(make_mesh(load_config(None, ["mesh.data=1", "mesh.fsdp=-1"])).shape) == {"data": 1, "fsdp": 8, "expert": 1}


@pytest.mark.parametrize("value,expected", [("auto", "auto"), ("null", None), ("false", None), ("off", None),
                                            ("/tmp/xla", "/tmp/xla"), ("./None", "./None")])
def test_compile_dir_values(value, expected):
    assert load_config(None, [f"cache.compile_dir={value}"]).cache.compile_dir == expected


def test_prefetch_auto_means_one_on_accelerators_and_none_on_cpu():
    d = load_config(None, []).data
    assert d.prefetch == "auto" and d.prefetch_batches("cpu") == 0 and d.prefetch_batches("gpu") == 1
    assert load_config(None, ["data.prefetch=3"]).data.prefetch_batches("cpu") == 3
    for bad in ("data.prefetch=-1", "data.prefetch=sometimes"):
        with pytest.raises(ConfigError, match="data.prefetch"):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="int or 'auto'"):  # names what is accepted
        load_config(None, ["data.prefetch=1.5"])


def test_shipped_configs_load_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("h200_1b.yaml").name == "h200_1b"
    assert load_config("configs/tiny_deepseek_v3.yaml").model.attention == "mla"  # as the checkout names it
    with pytest.raises(ConfigError, match="config file nope.yaml not found"):
        load_config("nope.yaml")
    with pytest.raises(ConfigError, match="config file other/tiny.yaml not found"):
        load_config("other/tiny.yaml")  # only configs/ stands for the shipped directory


def test_overrides_must_be_a_list_of_strings():
    """A bare string used to be iterated character by character."""
    with pytest.raises(ConfigError, match=r"expected a list of 'section.key=value' strings \(a single override: "
                                          r"\['train.steps=10'\]\), got str"):
        load_config(overrides="train.steps=10")
    with pytest.raises(ConfigError, match="got list"):
        load_config(overrides=["train.steps=10", 3])
    assert load_config(overrides=("train.steps=10",)).train.steps == 10


def test_mtp_coefficient_without_modules_is_accepted():
    """train.mtp_loss_coef is ignored at model.mtp_depth=0 (a shared base config may set it)."""
    cfg = load_config(None, ["train.mtp_loss_coef=1.0"])
    assert cfg.model.mtp_depth == 0 and cfg.train.mtp_loss_coef == 1.0
    assert load_config(None, ["model.mtp_depth=255"]).model.mtp_depth == 255  # one target per row at most

"""Config composition (Hydra over plugin config groups) and schema validation, on loong-llm's configs.

The error tests pin the user-facing contract: a bad key or value names its dotted path and, where
one is close, the valid key the user probably meant.
"""

from __future__ import annotations

import dataclasses
import functools
from importlib import resources

import pytest
import yaml

from loong.core.config import (
    ParallelConfig,
    TrainConfig,
    compose_config,
    config_groups,
    from_dict,
    to_dict,
)
from loong.core.errors import LoongError
from loong.llm.models.config import DenseModelConfig, RopeScaling
from loong.llm.schema import LLMRunConfig

MODULE, NAME = "loong.llm.configs", "pretrain"

# Published parameter counts (embeddings included; tied embeddings counted once).
PUBLISHED_SIZES = {
    "llama2_7b": 6.74e9,
    "llama2_13b": 13.0e9,
    "llama2_70b": 68.98e9,
    "llama3_8b": 8.03e9,
    "llama3_1_8b": 8.03e9,
    "llama3_70b": 70.6e9,
    "llama3_1_70b": 70.6e9,
    "llama3_2_1b": 1.24e9,
    "qwen2_5_0_5b": 0.49e9,
    "qwen2_5_7b": 7.61e9,
    "qwen2_5_72b": 72.7e9,
    "qwen3_0_6b": 0.60e9,
    "qwen3_1_7b": 1.7e9,
    "qwen3_8b": 8.2e9,
    "qwen3_32b": 32.8e9,
    "qwen3_30b_a3b": 30.5e9,  # MoE: total parameters (3.3B active)
    "deepseek_v3": 671e9,  # 37B active; counted with its MTP module (685B), see loong-llm's test_deepseek_v3
    "deepseek_v3_2": 671e9,  # V3 + 0.85B of lightning indexers; with MTP ~684B, see loong-llm's test_deepseek_v32
}
# shapes of our own, no published size
REDUCED_PRESETS = {"tiny", "qwen3_30b_a3b_4l", "deepseek_v3_4l", "deepseek_v3_2_4l"}


@functools.cache
def _compose(*overrides: str) -> tuple[LLMRunConfig, dict]:
    return compose_config(MODULE, NAME, list(overrides), LLMRunConfig)


def _error(*overrides: str) -> str:
    with pytest.raises(LoongError) as err:
        compose_config(MODULE, NAME, list(overrides), LLMRunConfig)
    return str(err.value)


def _packaged_yaml(name: str) -> dict:
    return yaml.safe_load((resources.files(MODULE) / name).read_text())


def _presets() -> list[str]:
    return config_groups(MODULE)["model"]


# --- composition --------------------------------------------------------------------------------


def test_defaults_compose() -> None:
    cfg, plain = _compose()
    assert isinstance(cfg, LLMRunConfig)
    assert isinstance(cfg.model, DenseModelConfig)
    assert cfg.model.preset == "tiny"
    assert cfg.task == "llm.pretrain"
    assert cfg.engine == "megatron"
    # pretrain.yaml states only what differs; the schema's defaults fill the rest.
    yaml_train = _packaged_yaml("pretrain.yaml")["train"]
    assert "steps" in yaml_train
    for key, value in yaml_train.items():
        assert getattr(cfg.train, key) == value, f"train.{key}"
    for key in {f.name for f in dataclasses.fields(TrainConfig)} - set(yaml_train):
        assert getattr(cfg.train, key) == getattr(TrainConfig(), key), f"train.{key}"
    assert cfg.parallel == ParallelConfig()
    assert cfg.data.path is None and cfg.data.tokenizer is None
    # the model group's default option is tiny.yaml, verbatim
    for key, value in _packaged_yaml("model/tiny.yaml").items():
        assert plain["model"][key] == value, f"model.{key}"
    assert "hydra" not in plain
    assert plain == to_dict(cfg)


def test_overrides_apply() -> None:
    cfg, plain = _compose("model=qwen3_0_6b", "train.lr=1e-4", "train.min_lr=1e-5", "parallel.tp=2", "data.path=/x/c.jsonl")
    assert cfg.model.preset == "qwen3_0_6b"
    assert cfg.model.family == "qwen3"
    assert cfg.model.qk_norm is True
    assert cfg.model.head_dim == 128
    assert cfg.model.tie_word_embeddings is True
    assert cfg.train.lr == pytest.approx(1e-4)
    assert cfg.train.steps == _compose()[0].train.steps  # untouched keys keep their composed value
    assert cfg.parallel.tp == 2
    assert cfg.data.path == "/x/c.jsonl"
    assert plain["model"]["head_dim"] == 128


def test_override_inside_a_preset_and_int_to_float_coercion() -> None:
    cfg, _ = _compose("model=llama3_1_8b", "model.rope_scaling.factor=2", "train.lr=1")
    assert cfg.model.rope_scaling == RopeScaling(factor=2.0)
    assert isinstance(cfg.train.lr, float) and cfg.train.lr == 1.0


def test_config_groups_list_the_model_presets() -> None:
    groups = config_groups(MODULE)
    assert set(groups) == {"model"}
    presets = groups["model"]
    assert presets == sorted(presets)
    assert {"tiny", "llama3_8b", "llama2_7b", "qwen3_0_6b", "qwen2_5_7b", "llama3_2_1b", "llama3_70b"} <= set(
        presets
    )
    assert set(PUBLISHED_SIZES) | REDUCED_PRESETS == set(presets), (
        "a preset was added or removed: update PUBLISHED_SIZES"
    )


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "dotted", "closest"),
    [
        ("parallel.tpp=2", "parallel.tpp", "parallel.tp"),
        ("train.seq_len=4", "train.seq_len", "train.seq_length"),
        ("model.hiden_size=3", "model.hiden_size", "model.hidden_size"),
        ("trian.steps=3", "trian.steps", "train.steps"),
    ],
)
def test_unknown_key_names_the_dotted_path_and_the_closest_key(
    override: str, dotted: str, closest: str
) -> None:
    msg = _error(override)
    assert f"unknown config key '{dotted}'" in msg
    assert f"did you mean '{closest}'?" in msg


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("train.steps=1.5", "train.steps: expected an integer, got 1.5"),
        ("train.steps=abc", "train.steps: expected an integer, got 'abc'"),
        ("parallel.sequence_parallel=maybe", "parallel.sequence_parallel: expected true/false, got 'maybe'"),
        ("train.lr=fast", "train.lr: expected a number, got 'fast'"),
        ("model.num_layers=true", "model.num_layers: expected an integer, got True"),
    ],
)
def test_wrong_type_names_the_dotted_path(override: str, expected: str) -> None:
    assert _error(override) == expected


def test_wrong_literal_lists_choices_and_the_closest() -> None:
    msg = _error("data.format=jsn")
    assert msg.startswith("data.format: 'jsn' is not one of ['auto', 'text', 'jsonl']")
    assert "did you mean 'jsonl'?" in msg


def test_unknown_preset_lists_the_presets() -> None:
    msg = _error("model=qwen3_06b")
    assert "unknown model preset 'qwen3_06b'" in msg
    assert "did you mean 'qwen3_0_6b'?" in msg
    for preset in _presets():
        assert preset in msg.split("available:", 1)[1]


def test_model_validation_runs_with_the_dotted_path() -> None:
    # tiny: 4 heads, 2 KV groups, hidden 128
    msg = _error("model.num_query_groups=3")
    assert msg == "model: num_attention_heads=4 is not a multiple of num_query_groups=3"
    msg = _error("model.hidden_size=130")
    assert msg == "model: hidden_size is not divisible by num_attention_heads; set head_dim"
    cfg, _ = _compose("model.hidden_size=130", "model.head_dim=32")
    assert cfg.model.kv_channels == 32


def test_learning_rates_are_checked_before_megatron_sees_them() -> None:
    # megatron's scheduler only asserts max_lr >= min_lr; the user gets the keys and a value that works
    msg = _error("train.lr=1e-4")  # the default min_lr is 3e-4
    assert msg.startswith("train.min_lr=0.0003 is above train.lr=0.0001")
    assert "train.min_lr=1e-05" in msg
    assert "must be >= 0" in _error("train.lr=-1")
    cfg, _ = _compose("train.lr=1e-4", "train.min_lr=1e-5")
    assert cfg.train.min_lr == 1e-5


def test_malformed_override_is_a_loong_error() -> None:
    assert _error("train.steps").startswith("cannot parse override")


# --- from_dict ----------------------------------------------------------------------------------


def test_from_dict_names_nested_unknown_keys() -> None:
    # (from_dict suggests the bare field name; compose_config suggests the dotted key)
    with pytest.raises(
        LoongError, match=r"unknown config key 'model\.hidden'; did you mean '(model\.)?hidden_size'\?"
    ):
        from_dict(LLMRunConfig, {"model": {"hidden": 3}})
    with pytest.raises(LoongError, match=r"unknown config key 'model\.rope_scaling\.facter'.*factor'\?"):
        from_dict(LLMRunConfig, {"model": {"rope_scaling": {"facter": 2.0}}})
    with pytest.raises(LoongError, match=r"^unknown config key 'trian'; did you mean 'train'\?$"):
        from_dict(LLMRunConfig, {"trian": {}})


def test_from_dict_checks_nested_types_and_mappings() -> None:
    with pytest.raises(LoongError, match=r"^parallel: expected a mapping, got 3$"):
        from_dict(LLMRunConfig, {"parallel": 3})
    with pytest.raises(LoongError, match=r"^model\.rope_scaling\.factor: expected a number, got 'x'$"):
        from_dict(LLMRunConfig, {"model": {"rope_scaling": {"factor": "x"}}})
    with pytest.raises(LoongError, match=r"^parallel\.vpp: expected an integer, got 1\.5$"):
        from_dict(LLMRunConfig, {"parallel": {"vpp": 1.5}})


def test_from_dict_round_trips_to_dict() -> None:
    cfg, plain = _compose("model=llama3_1_8b")
    again = from_dict(LLMRunConfig, to_dict(cfg))
    assert again == cfg
    assert isinstance(again.model.rope_scaling, RopeScaling)
    assert to_dict(again) == plain


# --- every packaged preset ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def presets() -> dict[str, DenseModelConfig]:
    out = {}
    for preset in _presets():
        cfg, _ = compose_config(MODULE, NAME, [f"model={preset}"], LLMRunConfig)
        out[preset] = cfg.model
    return out


def test_every_preset_composes_and_validates(presets: dict[str, DenseModelConfig]) -> None:
    for name, model in presets.items():
        assert model.preset == name, f"{name}.yaml says preset={model.preset}"
        model.validate(f"model[{name}]")
        assert model.hidden_size % model.num_attention_heads == 0 or model.head_dim is not None
        assert model.num_attention_heads % model.num_query_groups == 0
        # The preset must survive a round trip through the schema (what a checkpoint stores).
        assert from_dict(DenseModelConfig, dataclasses.asdict(model)) == model


def test_qwen_families_have_their_switches(presets: dict[str, DenseModelConfig]) -> None:
    for name, model in presets.items():
        if name.startswith("qwen3"):
            assert model.family == ("qwen3_moe" if model.num_experts else "qwen3")
            assert model.qk_norm and model.head_dim == 128 and not model.qkv_bias
        elif name.startswith("qwen2"):
            assert model.family == "qwen2" and model.qkv_bias and not model.qk_norm
        elif name.startswith("deepseek"):
            assert model.family == ("deepseek_v32" if name.startswith("deepseek_v3_2") else "deepseek_v3")
            assert model.is_mla and model.is_moe
        else:
            assert model.family == "llama" and not model.qkv_bias and not model.qk_norm
        if name.startswith("llama3_1") or name.startswith("llama3_2"):
            assert model.rope_scaling is not None and model.max_position_embeddings == 131072


@pytest.mark.parametrize("name", sorted(PUBLISHED_SIZES))
def test_preset_parameter_count_matches_the_published_size(
    presets: dict[str, DenseModelConfig], name: str
) -> None:
    got = presets[name].num_parameters()
    want = PUBLISHED_SIZES[name]
    assert abs(got - want) / want <= 0.10, f"{name}: {got / 1e9:.3f}B vs published {want / 1e9:.2f}B"


def test_moe_preset_active_parameters(presets: dict[str, DenseModelConfig]) -> None:
    active = presets["qwen3_30b_a3b"].num_parameters(active=True)
    assert abs(active - 3.3e9) / 3.3e9 <= 0.05, active  # Qwen3-30B-A3B: 3.3B activated


def test_tiny_preset_is_tiny(presets: dict[str, DenseModelConfig]) -> None:
    # tiny.yaml documents ~0.9M parameters; the packaged tokenizer's vocabulary is 512.
    assert 0.8e6 <= presets["tiny"].num_parameters() <= 1.0e6
    assert presets["tiny"].vocab_size == 512


def test_num_parameters_formula_on_a_hand_counted_model() -> None:
    # 1 layer, d=4, f=8, 2 heads of 2 channels, 1 KV group, vocab 10, untied, no biases.
    m = DenseModelConfig(
        num_layers=1,
        hidden_size=4,
        ffn_hidden_size=8,
        num_attention_heads=2,
        num_query_groups=1,
        vocab_size=10,
    )
    q, kv = 4, 2
    attn = 4 * q + 4 * kv * 2 + q * 4
    mlp = 3 * 4 * 8
    norms = 2 * 4
    assert m.num_parameters() == attn + mlp + norms + 2 * 10 * 4 + 4
    tied = dataclasses.replace(m, tie_word_embeddings=True)
    assert m.num_parameters() - tied.num_parameters() == 10 * 4
    biased = dataclasses.replace(m, qkv_bias=True, qk_norm=True)
    assert biased.num_parameters() - m.num_parameters() == (q + 2 * kv) + 2 * 2

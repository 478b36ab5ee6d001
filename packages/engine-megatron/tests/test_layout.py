"""Layout validation and model-family checks: pure functions, before any process group exists."""

from __future__ import annotations

import pytest
from polyrl_engine_megatron.convert import hf_param_shapes
from polyrl_engine_megatron.model import model_spec, validate_layout
from transformers import AutoConfig

from polyrl.errors import ConfigError

pytestmark = pytest.mark.smoke  # also run on the package installed alone (make test-packages)


def cfg(arch: str = "qwen2", **kw):
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
    return AutoConfig.for_model(arch, **{**base, **kw})


def test_valid_layouts_return_the_data_parallel_size():
    assert validate_layout(cfg(), tp=2, pp=2, world_size=8) == 2
    assert validate_layout(cfg(), tp=1, pp=1, world_size=2) == 2
    assert validate_layout(cfg("llama"), tp=2, pp=1, world_size=2, sequence_parallel=True) == 1


@pytest.mark.parametrize(("kw", "layout", "key", "words"), [
    ({"num_key_value_heads": 1}, (2, 1, 2), "actor.megatron.tensor_model_parallel_size", "num_key_value_heads (1)"),
    ({"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 63}, (2, 1, 2),
     "actor.megatron.tensor_model_parallel_size", "num_attention_heads (3)"),
    ({"vocab_size": 97}, (2, 1, 2), "actor.megatron.tensor_model_parallel_size", "vocab_size (97)"),
    ({"intermediate_size": 95}, (2, 1, 2), "actor.megatron.tensor_model_parallel_size", "intermediate_size (95)"),
    ({"num_hidden_layers": 3}, (1, 2, 2), "actor.megatron.pipeline_model_parallel_size", "num_hidden_layers (3)"),
    ({}, (2, 2, 6), "actor.megatron.pipeline_model_parallel_size", "world size (6"),
])
def test_bad_layouts_name_the_key(kw, layout, key, words):
    tp, pp, world = layout
    with pytest.raises(ConfigError) as e:
        validate_layout(cfg(**kw), tp=tp, pp=pp, world_size=world)
    assert key in str(e.value) and words in str(e.value)


def test_other_role_keys_sequence_parallel_and_lora():
    with pytest.raises(ConfigError, match=r"critic\.megatron\.tensor_model_parallel_size"):
        validate_layout(cfg(vocab_size=97), tp=2, pp=1, world_size=2, key="critic.megatron")
    with pytest.raises(ConfigError, match=r"actor\.megatron\.sequence_parallel"):
        validate_layout(cfg(), tp=1, pp=1, world_size=2, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"actor\.model\.lora"):
        validate_layout(cfg(), tp=1, pp=1, world_size=2, lora=True)
    with pytest.raises(ConfigError, match="positive integer"):
        validate_layout(cfg(), tp=0, pp=1, world_size=2)


@pytest.mark.parametrize(("config", "words"), [
    (AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4), "model_type 'gpt2'"),
    (cfg("llama", hidden_act="gelu"), "'hidden_act'"),
    (cfg("llama", attention_bias=True), "'attention_bias'"),
    (cfg("llama", mlp_bias=True), "'mlp_bias'"),
    (cfg("mistral", sliding_window=16), "'sliding_window'"),
    (cfg("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_scaling"),
])
def test_unsupported_models_name_the_config_key(config, words):
    with pytest.raises(ConfigError) as e:
        model_spec(config, source="/ckpt/m")
    assert words in str(e.value) and "/ckpt/m" in str(e.value) and "fsdp" in str(e.value)


def test_supported_variants():
    assert model_spec(cfg("mistral", sliding_window=None)).model_type == "mistral"
    assert model_spec(cfg("qwen2")).qkv_bias and model_spec(cfg("qwen3")).qk_norm
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    spec = model_spec(cfg("llama", rope_parameters=llama3))
    assert spec.rope_scaling_factor == 8.0 and spec.rope_theta == 5e5


def test_hf_param_shapes_follow_the_config():
    shapes = hf_param_shapes(cfg("qwen3", head_dim=24, tie_word_embeddings=False))
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (96, 64)
    assert shapes["model.layers.3.self_attn.k_proj.weight"] == (48, 64)
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (24,)
    assert shapes["lm_head.weight"] == (96, 64)
    tied = hf_param_shapes(cfg("qwen2", tie_word_embeddings=True), value_head=True)
    assert "lm_head.weight" not in tied and tied["score.weight"] == (1, 64) and tied["score.bias"] == (1,)
    assert "model.layers.0.self_attn.q_proj.bias" in tied


def test_a_vision_language_model_is_refused_with_the_engine_to_use(tmp_path):
    """Before any worker starts (the trainer asks the factory for the data-parallel size): a clear error naming
    the key, the model family and the engine that trains it."""
    from polyrl_engine_megatron.engine import MegatronEngine

    from polyrl.config.roles import EngineRoleConfig, ModelConfig
    from polyrl.models.tiny_vlm import build_vl_tokenizer, tiny_vlm_config

    tiny_vlm_dir = tmp_path / "vlm"
    tiny_vlm_config(tokenizer=build_vl_tokenizer()).save_pretrained(tiny_vlm_dir)  # the config is all it reads
    role = EngineRoleConfig(engine="megatron", model=ModelConfig(path=str(tiny_vlm_dir)))
    with pytest.raises(ConfigError) as e:
        MegatronEngine.data_parallel_size(role, 1, role="actor")
    assert f"actor.model.path={tiny_vlm_dir} is a vision-language model (qwen2_vl)" in str(e.value)
    assert "actor.engine=fsdp" in str(e.value)

import json

import pytest

from tinyformer.config import ModelConfig, llama_ffn_hidden
from tinyformer.errors import ConfigError
from tinyformer.presets import PRESETS, get_preset


def test_llama_ffn_rule():
    assert llama_ffn_hidden(4096, None, 256) == 11008
    assert llama_ffn_hidden(5120, None, 256) == 13824
    assert llama_ffn_hidden(8192, 1.3, 4096) == 28672


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(d_model=100, n_head=3), "d_model"),
        (dict(n_head=8, n_kv_head=3), "n_kv_head"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(n_layer=-1), "n_layer"),
        (dict(norm="batchnorm"), "norm"),
        (dict(pos="alibi"), "pos"),
        (dict(ffn="geglu"), "ffn"),
        (dict(attn_impl="flash3"), "attn_impl"),
        (dict(dropout=1.5), "dropout"),
        (dict(norm_eps=0), "norm_eps"),
        (dict(rope_scaling={"rope_type": "ntk"}), "rope_type"),
        (dict(rope_scaling={"rope_type": "linear"}), "factor"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2, "beta_fast": 3}), "beta_fast"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1,
                            "original_max_position_embeddings": 8192}), "low_freq_factor"),
        (dict(pos="learned", rope_scaling={"rope_type": "linear", "factor": 2}), "rope_scaling"),
        (dict(norm_placement="middle"), "norm_placement"),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(kwargs, field):
    base = dict(vocab_size=10, d_model=64, n_head=8)
    with pytest.raises(ValueError, match=field) as info:
        ModelConfig(**{**base, **kwargs})
    assert isinstance(info.value, ConfigError)


def test_config_round_trips_through_json():
    for name in PRESETS:
        cfg = get_preset(name)
        again = ModelConfig.from_json(cfg.to_json())
        assert again == cfg
        assert json.loads(cfg.to_json())["format_version"] == 1


def test_unknown_field_in_json_is_named():
    with pytest.raises(ConfigError, match="wings"):
        ModelConfig.from_dict({"vocab_size": 10, "wings": 2})


def test_replace_recomputes_derived_sizes():
    cfg = ModelConfig(vocab_size=10, d_model=64, n_head=8)
    wider = cfg.replace(d_model=128)
    assert wider.head_dim == 16 and wider.d_ff == llama_ffn_hidden(128, None, 256)

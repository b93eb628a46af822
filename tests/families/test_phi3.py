"""Phi-3: fused qkv / gate-up projections (tinyformer's own layout, copied as they are) and LongRoPE ("su")
scaling, checked against transformers' Phi3ForCausalLM (random weights built offline)."""

from __future__ import annotations

import pytest
import torch
from test_interop_common import (
    assert_import_matches_transformers,
    engine_greedy,
    hf_greedy,
    hf_logits,
    padded_batch,
    pytestmark,  # noqa: F401 - one intra-op thread for every test here
)

from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.run_folder import load_config

L0 = 32  # the original context of the LongRoPE cases
g = torch.Generator().manual_seed(5)
LONGROPE = dict(max_position_embeddings=128, original_max_position_embeddings=L0,
                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                 "short_factor": (1 + torch.rand(8, generator=g)).tolist(),
                                 "long_factor": (1 + 8 * torch.rand(8, generator=g)).tolist()})
CASES = {
    "plain": {},
    "window": dict(sliding_window=6),  # every layer slides, prompts of 24
    "longrope": LONGROPE,
}


@pytest.mark.parametrize("case", list(CASES))
def test_phi3_import_matches_transformers(case, tmp_path):
    hf, ours = assert_import_matches_transformers("phi3", tmp_path, length=24, **CASES[case])
    cfg = load_config(tmp_path / "run")
    assert cfg.rope_type == ("longrope" if case == "longrope" else "default")
    if case == "longrope":
        # beyond the original context the long factors (and the attention factor) apply to every position
        ids, mask = padded_batch(length=L0 + 8)
        with torch.no_grad():
            logits = ours(ids, attention_mask=mask)
        torch.testing.assert_close(logits[mask.bool()], hf_logits(hf, ids, mask)[mask.bool()], atol=1e-4, rtol=1e-4)
        # generation that crosses L0: transformers prefills again with the long factors, and so does the engine;
        # the log-probabilities of the generated tokens show it (the tokens alone may not)
        from tinyformer.generation.generator import Generator
        from tinyformer.generation.sampling import SamplingParams

        prompt, pmask = ids[:1, : L0 - 4], mask[:1, : L0 - 4]
        want = hf_greedy(hf, prompt, pmask, 12)
        assert torch.equal(engine_greedy(ours, prompt, pmask, 12), want)
        with torch.no_grad():
            out = hf.generate(input_ids=prompt, attention_mask=pmask, max_new_tokens=12, do_sample=False,
                              pad_token_id=2, output_logits=True, return_dict_in_generate=True)
        hf_logprobs = [float(torch.log_softmax(step[0].double(), -1)[t]) for step, t in zip(out.logits, want[0])]
        generator = Generator(ours)
        generator.eos_token_id = None
        result = generator.generate([prompt[0].tolist()], SamplingParams(temperature=0.0, max_new_tokens=12))[0]
        assert result.logprobs == pytest.approx(hf_logprobs, abs=1e-4)


def test_longrope_factors_are_validated():
    with pytest.raises(ConfigError, match="short_factor must be a list of head_dim/2 = 8"):
        ModelConfig(d_model=64, n_head=4, rope_scaling={"rope_type": "longrope", "short_factor": [1.0],
                                                        "long_factor": [1.0] * 8,
                                                        "original_max_position_embeddings": 16})

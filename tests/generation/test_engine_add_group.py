"""BatchEngine.add_group: n samples of one prompt prefill it once and copy its keys and values."""

from __future__ import annotations

import pytest
import torch

from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams
from tinyformer.models import build_model
from tinyformer.presets import get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


def test_samples_of_one_prompt_equal_each_sample_decoded_alone() -> None:
    torch.manual_seed(0)
    model = build_model(get_preset("tiny", d_model=32, n_layer=2, n_head=2, n_kv_head=1, d_ff=64, max_seq_len=48,
                                   vocab_size=50)).eval()
    gen = Generator(model)
    prompt, other = [3, 14, 15, 9, 2, 6], [7, 1]
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=10, seed=11)
    batch = gen.generate([prompt, prompt, prompt, other, other], params, sampled_logprobs=True)
    for b, result in enumerate(batch):
        alone = gen.generate([[prompt, prompt, prompt, other, other][b]],
                             SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=10, seed=11 + b),
                             sampled_logprobs=True)[0]
        assert result.token_ids == alone.token_ids
        assert torch.allclose(torch.tensor(result.logprobs), torch.tensor(alone.logprobs), atol=1e-5)
    assert len({tuple(r.token_ids) for r in batch[:3]}) > 1  # the samples differ: their own seeds, not copies

"""Speculative decoding of constrained rows: drafts are verified against the row's grammar, so that a
speculating row writes what the plain constrained path writes (greedy: token for token) and its output
stays in the language (sampled, with a draft model that knows nothing of the grammar)."""

from __future__ import annotations

import json
import string

import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.tokenizer import build_tokenizer  # noqa: E402
from tinyformer.generation import constraint as C  # noqa: E402
from tinyformer.generation.generator import Generator  # noqa: E402
from tinyformer.generation.sampling import SamplingParams  # noqa: E402
from tinyformer.generation.speculative import SpeculativeConfig  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402

ALPHABET = string.ascii_letters + string.digits + ' {}[]":,.-_\n'
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"],
    "additionalProperties": False,
}
# prompts that quote objects of the schema's shape, so that prompt lookup has something to propose
PROMPTS = ['{"name": "ab", "n": 12, "tags": ["ab"]} {"name": "ab", "n": 12, "tags": ["ab"]} ',
           '{"name":"cd","n":3,"tags":[]}\n{"name":"cd","n":3,"tags":[]}\n', "x"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models: a second intra-op thread only stalls on a busy machine."""


def model(tok, seed: int) -> DecoderLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2, d_ff=64, max_seq_len=320)
    return DecoderLM(cfg).eval()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("char", ALPHABET)


def test_speculative_greedy_constrained_output_equals_plain_constrained_output(tok):
    target = model(tok, 0)
    params = SamplingParams(temperature=0, max_new_tokens=120, constraint=C.json_schema(SCHEMA))
    plain = Generator(target, tok).generate(PROMPTS, params, logprobs=False)
    for spec in (SpeculativeConfig("ngram", draft_tokens=4), SpeculativeConfig("draft", draft_tokens=3)):
        gen = Generator(target, tok, speculative=spec,
                        draft_model=model(tok, 1) if spec.method == "draft" else None,
                        draft_tokenizer=tok if spec.method == "draft" else None)
        fast = gen.generate(PROMPTS, params, logprobs=False)
        assert [r.token_ids for r in fast] == [r.token_ids for r in plain], spec.method
        assert gen.timings.draft_proposed > 0, spec.method  # the drafts were verified, not skipped
    for r in plain:
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), SCHEMA)


def test_sampled_rows_with_a_grammar_blind_draft_model_stay_in_the_language(tok):
    """The draft model samples without the grammar, so many of its drafts leave the language: each must be
    rejected (its target probability is 0 under the mask), and every finished output must validate."""
    target, draft = model(tok, 0), model(tok, 2)
    gen = Generator(target, tok, speculative=SpeculativeConfig("draft", draft_tokens=4), draft_model=draft,
                    draft_tokenizer=tok)
    params = SamplingParams(temperature=1.0, max_new_tokens=160, seed=7, constraint=C.json_schema(SCHEMA))
    results = gen.generate(PROMPTS * 8, params, logprobs=False)
    assert gen.timings.draft_proposed > 0
    finished = [r for r in results if r.finish_reason == "stop"]
    assert len(finished) >= len(results) // 2, [r.text for r in results][:3]
    for r in finished:
        jsonschema.validate(json.loads(r.text), SCHEMA)

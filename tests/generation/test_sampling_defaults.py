"""Each entry point's default sampling parameters are the constants of generation/sampling.py that its
docstring table names for it."""

from __future__ import annotations

import inspect

import pytest

from tinyformer.cli.main import build_parser
from tinyformer.generation import sampling
from tinyformer.generation.sampling import SamplingParams


def test_the_library_default_is_the_plain_distribution():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (1.0, 0, 1.0, 0.0)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (
        sampling.DEFAULT_TEMPERATURE, sampling.DEFAULT_TOP_K, sampling.DEFAULT_TOP_P, sampling.DEFAULT_MIN_P)
    assert sampling.build_processors(p) == []  # nothing changes the model's distribution


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_generate_and_chat_default_to_the_human_setting(command):
    args = build_parser().parse_args([command, "--model", "RUN"] + (["--prompt", "x"] if command == "generate" else []))
    assert (args.temperature, args.top_k) == (0.8, 50)  # what the README promises
    assert (args.temperature, args.top_k) == (sampling.HUMAN_TEMPERATURE, sampling.HUMAN_TOP_K)
    assert (args.top_p, args.min_p) == (sampling.DEFAULT_TOP_P, sampling.DEFAULT_MIN_P)


def test_inspect_defaults_to_the_plain_distribution():
    args = build_parser().parse_args(["inspect", "--model", "RUN", "--prompt", "x"])
    assert (args.temperature, args.top_k, args.top_p) == (
        sampling.DEFAULT_TEMPERATURE, sampling.DEFAULT_TOP_K, sampling.DEFAULT_TOP_P)


def test_trainer_samples_default_to_the_human_setting():
    from tinyformer.training.sample import sample_text

    params = inspect.signature(sample_text).parameters
    assert (params["temperature"].default, params["top_k"].default) == (
        sampling.HUMAN_TEMPERATURE, sampling.HUMAN_TOP_K)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_server_defaults_are_the_openai_api_defaults(kind):
    pytest.importorskip("pydantic")
    from tinyformer.serve.protocol import ChatCompletionRequest, CompletionRequest

    cls = CompletionRequest if kind == "completion" else ChatCompletionRequest
    body = {"model": "m", "prompt": "x"} if kind == "completion" else {
        "model": "m", "messages": [{"role": "user", "content": "x"}]}
    req = cls.model_validate(body)
    assert (req.temperature, req.top_p) == (1.0, 1.0)  # the OpenAI API reference's defaults
    assert (req.temperature, req.top_p) == (sampling.OPENAI_TEMPERATURE, sampling.OPENAI_TOP_P)
    assert (req.top_k, req.min_p) == (sampling.DEFAULT_TOP_K, sampling.DEFAULT_MIN_P)

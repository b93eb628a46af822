"""The decoding engine against independent references: full recomputation without a cache, one prompt
at a time, Hugging Face ``generate()``, brute-force search, and ``bytes.decode`` for streamed text."""

from __future__ import annotations

import itertools

import pytest
import torch

from tinyformer.components import quant_kernels
from tinyformer.components.kv_cache import KVCache
from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.errors import GenerationError
from tinyformer.generation.engine import BatchEngine, EngineRow
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams
from tinyformer.generation.speculative import SpeculativeConfig
from tinyformer.generation.streaming import TextState
from tinyformer.generation.weight_layout import FewRowsLinear, prepare_for_decoding, store_input_major
from tinyformer.models.decoder import DecoderLM

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [20, 21, 22, 23, 24]]


def random_lm(vocab: int = 50, dtype: torch.dtype = torch.float64, seed: int = 0, **overrides) -> DecoderLM:
    """A small decoder with weights large enough that its next-token distributions are peaked and
    varied (the default 0.02 init gives near-uniform logits and repetitive argmaxes)."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=vocab, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=64)
    cfg = ModelConfig(**{**fields, **overrides})
    model = DecoderLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3)
    return model.to(dtype).eval()


def id_generator(model: DecoderLM, **kwargs) -> Generator:
    """A generator over token ids with no end-of-sequence token: every row runs max_new_tokens."""
    gen = Generator(model, **kwargs)
    gen.eos_token_id = None
    return gen


@torch.no_grad()
def greedy_by_recomputation(model: DecoderLM, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with no cache at all: a full forward pass over the whole sequence every step."""
    seq, logps = list(prompt), []
    for _ in range(n):
        logits = model(torch.tensor([seq]))[0, -1]
        tok = int(logits.argmax())
        logps.append(float(torch.log_softmax(logits.double(), -1)[tok]))
        seq.append(tok)
    return seq[len(prompt):], logps


# ------------------------------------------------------------------ cache and batching


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_cached_greedy_equals_full_recomputation(arch):
    extra = {} if arch == "llama" else dict(norm="layernorm", pos="learned", ffn="gelu", attn_bias=True,
                                           attn_out_bias=True, mlp_bias=True, n_kv_head=4)
    model = random_lm(**extra)
    gen = id_generator(model)
    for prompt in PROMPTS[:2]:
        want_ids, want_lps = greedy_by_recomputation(model, prompt, 24)
        got = gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=24))[0]
        assert got.token_ids == want_ids
        assert got.logprobs == pytest.approx(want_lps, abs=1e-6)  # returned as float32
        assert got.finish_reason == "length"


def test_batched_greedy_equals_one_prompt_at_a_time():
    gen = id_generator(random_lm())
    params = SamplingParams(temperature=0, max_new_tokens=40)
    batched = gen.generate(PROMPTS, params)
    for prompt, row in zip(PROMPTS, batched):
        alone = gen.generate([prompt], params)[0]
        assert row.token_ids == alone.token_ids
        assert row.logprobs == pytest.approx(alone.logprobs, abs=1e-6)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, max_new_tokens=40, seed=123),
    SamplingParams(temperature=1.3, top_k=10, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                   frequency_penalty=0.3, presence_penalty=0.2, max_new_tokens=40, seed=7),
])
def test_batched_sampling_row_b_equals_prompt_alone_with_seed_plus_b(params):
    gen = id_generator(random_lm())
    batched = gen.generate(PROMPTS, params)
    for b, (prompt, row) in enumerate(zip(PROMPTS, batched)):
        alone_params = SamplingParams(**{**params.__dict__, "seed": params.seed + b})
        alone = gen.generate([prompt], alone_params)[0]
        assert row.token_ids == alone.token_ids
    assert len({tuple(r.token_ids) for r in batched}) == len(PROMPTS)  # the rows really differ


def test_rows_of_different_settings_in_one_engine_each_decode_as_alone():
    """Greedy, penalised greedy, seeded and penalised seeded rows share every step's one sampler call (rows
    with equal sampler keys share their processors): each row's tokens are those it gets in an engine alone."""
    from tinyformer.generation.engine import BatchEngine, EngineRow
    from tinyformer.generation.streaming import TextState

    model = random_lm()
    settings = [SamplingParams(temperature=0, max_new_tokens=12),
                SamplingParams(temperature=0, repetition_penalty=1.5, max_new_tokens=12),
                SamplingParams(temperature=1.1, top_k=12, max_new_tokens=12, seed=5),
                SamplingParams(temperature=1.1, top_k=12, frequency_penalty=0.8, max_new_tokens=12, seed=6),
                SamplingParams(temperature=1.1, top_k=12, max_new_tokens=12, seed=7)]

    def run(pairs):
        engine = BatchEngine(model, max_batch=len(pairs), max_len=32)
        rows = [EngineRow(prompt, p, TextState(lambda t: b"", frozenset(), ())) for prompt, p in pairs]
        for r in rows:
            engine.add(r)
        with torch.inference_mode():
            while any(not r.finished for r in rows):
                engine.step()
        return [r.token_ids for r in rows]

    pairs = list(zip(itertools.cycle(PROMPTS), settings))
    together = run(pairs)
    assert together == [run([pair])[0] for pair in pairs]
    assert together[0] != together[1] and together[2] != together[4]  # the settings really differ


def test_same_seed_same_output_and_other_seed_differs():
    gen = id_generator(random_lm())
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=42)
    first = gen.generate(PROMPTS, params)
    again = gen.generate(PROMPTS, params)
    other = gen.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=40, seed=43))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    assert [r.token_ids for r in first] != [r.token_ids for r in other]


def test_temperature_near_zero_equals_greedy():
    gen = id_generator(random_lm())
    greedy = gen.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=30))
    cold = gen.generate(PROMPTS, SamplingParams(temperature=1e-4, max_new_tokens=30, seed=3))
    assert [r.token_ids for r in cold] == [r.token_ids for r in greedy]
    bare = gen.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=30), logprobs=False)
    assert [r.token_ids for r in bare] == [r.token_ids for r in greedy]
    assert all(r.logprobs == [] for r in bare)


@torch.no_grad()
def test_fixed_kv_len_per_row_decoding_equals_the_default():
    """The static-shape step (every row attends over the whole cache, masked per row) computes the same
    logits as attending only up to the furthest row."""
    model = random_lm()
    cache_a, cache_b = model.new_cache(3, 40), model.new_cache(3, 40)
    for b, prompt in enumerate(PROMPTS):
        for cache in (cache_a, cache_b):
            model(torch.tensor([prompt]), cache=cache.row_view(b))
    tokens = torch.tensor([[1], [2], [3]])
    positions = torch.tensor([len(p) for p in PROMPTS])
    for _ in range(5):
        a = model(tokens, cache=cache_a.at(positions))
        b = model(tokens, cache=cache_b.at(positions, 40))
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        tokens, positions = a[:, -1].argmax(-1, keepdim=True), positions + 1


@pytest.mark.slow
def test_compiled_decoding_equals_eager_decoding():
    model = random_lm(n_layer=1, dtype=torch.float32)
    eager, compiled = id_generator(model), id_generator(model, compile=True)
    for params in (SamplingParams(temperature=0, max_new_tokens=16),
                   SamplingParams(temperature=0.9, top_k=20, max_new_tokens=16, seed=3)):
        want = [r.token_ids for r in eager.generate(PROMPTS, params)]
        assert [r.token_ids for r in compiled.generate(PROMPTS, params)] == want
    # greedy without log-probabilities: the compiled step returns the argmax itself
    greedy = SamplingParams(temperature=0, max_new_tokens=16)
    want = [r.token_ids for r in eager.generate(PROMPTS, greedy, logprobs=False)]
    assert [r.token_ids for r in compiled.generate(PROMPTS, greedy, logprobs=False)] == want
    assert [r.token_ids for r in compiled.generate(PROMPTS[:1], greedy, logprobs=False)] == want[:1]


@pytest.mark.slow
def test_one_compiled_step_serves_requests_of_different_lengths_and_cache_sizes():
    """The packaged step (a CPU's compiled step) takes the attended span and the cache length as symbolic
    sizes: requests of 5 to 150 tokens, in caches of 128 and 256 slots, run one package."""
    from tinyformer.generation.compile_cache import PackagedStep

    model = random_lm(n_layer=1, dtype=torch.float32, seed=1, max_seq_len=300)
    compiled, eager = id_generator(model, compile=True), id_generator(model)
    for n in (5, 17, 40, 150):  # spans of 10 to 158 slots
        params = SamplingParams(temperature=0, max_new_tokens=n)
        want = [r.token_ids for r in eager.generate(PROMPTS, params, logprobs=False)]
        assert [r.token_ids for r in compiled.generate(PROMPTS, params, logprobs=False)] == want
    step = compiled._compiled
    assert isinstance(step, PackagedStep)
    assert [fn is not None for fn in step._packages.values()] == [True]


@pytest.mark.parametrize("tie", [False, True])
def test_layers_prepared_for_decoding_keep_weights_ties_outputs_tokens_and_gradients(tie):
    """With the CPU kernels, every float32 nn.Linear becomes a FewRowsLinear holding the same parameter
    objects (a tied head still is the token table); outputs, greedy tokens (batched prompts of different
    lengths) and, with autograd on, gradients are those of the untouched model; preparing twice changes
    nothing."""
    if not quant_kernels.available():
        pytest.skip("the CPU kernels are not built here (no C++ compiler)")
    model, ref = random_lm(tie_embeddings=tie, dtype=torch.float32), random_lm(tie_embeddings=tie, dtype=torch.float32)
    params_before = dict(model.named_parameters())
    prepare_for_decoding(model, min_bytes=0)
    prepare_for_decoding(model, min_bytes=0)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is FewRowsLinear for m in linears)
    assert dict(model.named_parameters()) == params_before  # the same objects, all contiguous still
    assert (model.lm_head.weight is model.tok_emb.weight) is tie
    x = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
    params = SamplingParams(temperature=0, max_new_tokens=12)
    assert ([r.token_ids for r in id_generator(model).generate(PROMPTS, params)]
            == [r.token_ids for r in id_generator(ref).generate(PROMPTS, params)])
    for m in (model, ref):
        m.zero_grad()
        m(x[:, :3]).float().square().mean().backward()  # 3 rows: the kernel's size, but autograd needs F.linear
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_without_the_cpu_kernels_layers_for_decoding_are_stored_input_major(monkeypatch):
    monkeypatch.setattr(quant_kernels, "available", lambda: False)
    model = random_lm(tie_embeddings=True, dtype=torch.float32)
    prepare_for_decoding(model, min_bytes=0)
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.lm_head.weight.stride() == (1, model.cfg.vocab_size)


def test_a_model_below_the_kernel_size_is_stored_input_major_without_building_the_kernels(monkeypatch):
    """Weights that stay in the caches gain little from the kernels, and a small model (the default run's)
    must not wait on their first build: it is laid out input-major, and the kernels are not asked for, by its
    products or by its attention, in plain or speculative decoding."""
    def must_not_build() -> bool:
        raise AssertionError("the CPU kernels were asked for")

    monkeypatch.setattr(quant_kernels, "available", must_not_build)
    model = random_lm(tie_embeddings=True, dtype=torch.float32)
    weights = {id(m.weight): m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)}
    prepare_for_decoding(model, min_bytes=sum(w.nbytes for w in weights.values()) + 1)
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert model.lm_head.weight.stride() == (1, model.cfg.vocab_size)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    plain = [r.token_ids for r in id_generator(model).generate(PROMPTS, params)]
    spec = id_generator(model, speculative=SpeculativeConfig("ngram", 3))
    assert [r.token_ids for r in spec.generate(PROMPTS, params)] == plain


@pytest.mark.parametrize("tie", [False, True])
def test_input_major_weights_keep_values_shapes_and_outputs(tie):
    model = random_lm(tie_embeddings=tie, dtype=torch.float32)
    x = torch.tensor([PROMPTS[0]])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    want = model(x)
    store_input_major(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        if p.dim() == 2 and name != "tok_emb.weight":
            assert p.stride() == (1, p.shape[0]), name  # W^T contiguous
    # the embedding keeps its rows, unless a head is tied to it: then the one table is the head's W^T
    assert model.tok_emb.weight.is_contiguous() is not tie
    if tie:
        assert model.lm_head.weight is model.tok_emb.weight
    torch.testing.assert_close(model(x), want)  # float32 tolerances: the products may sum in another order
    # only float32 weights move (bfloat16 products are slower input-major)
    half = random_lm(dtype=torch.bfloat16)
    store_input_major(half)
    assert all(p.is_contiguous() for p in half.parameters())
    # the generator's greedy tokens are those of the row-major copy
    ref = random_lm(tie_embeddings=tie, dtype=torch.float32)
    params = SamplingParams(temperature=0, max_new_tokens=12)
    assert ([r.token_ids for r in id_generator(model).generate(PROMPTS, params)]
            == [r.token_ids for r in id_generator(ref).generate(PROMPTS, params)])


def test_input_major_weights_keep_the_mode_they_were_made_in():
    """Moved inside inference mode (a decode step's first call), a model's weights stay normal tensors (for
    training and torch.export); a model made in inference mode keeps inference tensors and still decodes."""
    params = SamplingParams(temperature=0, max_new_tokens=5)
    want = [r.token_ids for r in id_generator(random_lm(tie_embeddings=True, dtype=torch.float32)).generate(
        PROMPTS, params)]
    model = random_lm(tie_embeddings=True, dtype=torch.float32)
    with torch.inference_mode():
        store_input_major(model)
    assert not any(p.is_inference() for p in model.parameters())
    assert model.lm_head.weight.stride() == (1, model.cfg.vocab_size)
    with torch.inference_mode():
        made = random_lm(tie_embeddings=True, dtype=torch.float32)
        store_input_major(made)
    assert all(p.is_inference() for p in made.parameters())
    for m in (model, made):
        assert [r.token_ids for r in id_generator(m).generate(PROMPTS, params)] == want


# ------------------------------------------------------------------ Hugging Face generate()


def hf_llama(model: DecoderLM):
    transformers = pytest.importorskip("transformers")
    from tinyformer.families import config_to_hf, tinyformer_to_hf

    hf_cfg = config_to_hf(model.cfg)
    config = transformers.LlamaConfig(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
    hf = transformers.LlamaForCausalLM(config).to(torch.float64)
    missing, unexpected = hf.load_state_dict(dict(tinyformer_to_hf(model.cfg, model.state_dict())), strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    return hf.eval()


def test_greedy_equals_transformers_generate_single_and_left_padded_batch():
    model = random_lm(tie_embeddings=False)
    hf = hf_llama(model)
    gen = id_generator(model)
    n = 32
    ours = gen.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=n))
    # one prompt alone
    prompt = PROMPTS[0]
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    alone = gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=n))[0]
    assert out[0, len(prompt):].tolist() == alone.token_ids
    # as one left-padded batch, the way transformers pads for generation
    P = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in PROMPTS])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert out[:, P:].tolist() == [r.token_ids for r in ours]


# ------------------------------------------------------------------ stopping


def test_eos_and_stop_token_end_a_row_and_are_not_text():
    tok = build_tokenizer("char", "abcdefghijklmnopqrstuvwxyz .,\n")
    model = random_lm(vocab=tok.vocab_size)
    gen = Generator(model, tok)
    gen.eos_token_id = None
    free = gen.generate(["hello there"], SamplingParams(temperature=0, max_new_tokens=30))[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    stopped = gen.generate(["hello there"], SamplingParams(temperature=0, max_new_tokens=30,
                                                           stop_token_ids=[stop_id]))[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.text == tok.decode(free.token_ids[:first], skip_special_tokens=True)
    assert stopped.finish_reason == "stop"
    gen.eos_token_id = stop_id  # the same id as end-of-sequence token
    assert gen.generate(["hello there"], SamplingParams(temperature=0, max_new_tokens=30))[0] == stopped


def test_stop_string_spread_over_tokens_stops_and_is_never_shown():
    tok = build_tokenizer("char", "abcdefghijklmnopqrstuvwxyz .,\n")
    gen = Generator(random_lm(vocab=tok.vocab_size, seed=1), tok)
    gen.eos_token_id = None
    free = gen.generate(["the cat"], SamplingParams(temperature=0, max_new_tokens=40))[0]
    text = free.text
    stop = text[6:9]  # three characters = three tokens of the char tokenizer
    cut = text.find(stop)
    params = SamplingParams(temperature=0, max_new_tokens=40, stop_strings=[stop, "never-appears"])
    result = gen.generate(["the cat"], params)[0]
    assert result.text == text[:cut]
    assert result.finish_reason == "stop"
    assert result.token_ids == free.token_ids[: cut + len(stop)]  # generation ended on the stop's last token
    stream = gen.stream("the cat", params)
    pieces = list(stream)
    assert "".join(pieces) == text[:cut]
    assert stream.result.text == text[:cut]


# ------------------------------------------------------------------ streaming UTF-8

CJK_TEXT = ("東京タワーは高い。今日は晴れです。絵文字も使います 😀👍🏽🎉 と 🍣🍜。"
            "日本語のテキストと emoji 🚀✨ を混ぜた文章です。中文也可以：你好，世界！") * 4


class ScriptedLM(DecoderLM):
    """A real decoder whose logits are overridden to spell out ``script`` after the prompt, so that a
    test knows which token sequence (here: characters split across byte-level tokens) comes out."""

    def __init__(self, cfg: ModelConfig, script: list[int], prompt_len: int) -> None:
        super().__init__(cfg)
        self.script, self.prompt_len = script, prompt_len

    def forward(self, input_ids, *, cache=None, **kwargs):
        logits = super().forward(input_ids, cache=cache, **kwargs)
        # positions filled after this call: per-row decoding (cache.at) gives them, a prefill advances cache.length
        filled = cache.length if isinstance(cache, KVCache) else int(cache.positions.max()) + 1
        i = filled - self.prompt_len  # index of the token to predict next
        forced = torch.full_like(logits[:, -1:], -30.0)
        forced[..., self.script[min(i, len(self.script) - 1)]] = 30.0
        return torch.cat([logits[:, :-1], forced], dim=1)


def test_stream_never_emits_a_broken_utf8_character():
    tok = build_tokenizer("bpe", CJK_TEXT, vocab_size=300)
    target = "今日は絵文字 😀👍🏽🎉 と 🍣 です。你好，世界！"
    script = tok.encode(target)
    splits = [t for t in script if not _is_complete_utf8(tok.token_bytes(t))]
    assert splits, "the tokenizer must split characters across tokens for this test to mean anything"
    prompt = tok.encode("東京")
    cfg = ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=4, max_seq_len=128)
    gen = Generator(ScriptedLM(cfg, script, len(prompt)).eval(), tok)
    gen.eos_token_id = None
    stream = gen.stream(prompt, SamplingParams(temperature=0, max_new_tokens=len(script)))
    pieces = list(stream)
    assert stream.result.token_ids == script
    assert "".join(pieces) == target
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) < len(script)  # some tokens completed no character and emitted nothing


def test_stream_of_random_bytes_concatenates_to_the_decoded_bytes():
    tok = build_tokenizer("bpe", CJK_TEXT, vocab_size=300)
    gen = Generator(random_lm(vocab=tok.vocab_size, seed=2, max_seq_len=128), tok)
    gen.eos_token_id = None
    for seed in range(2):
        stream = gen.stream("東京", SamplingParams(temperature=1.0, max_new_tokens=48, seed=seed))
        pieces = list(stream)
        special = {tok.bos_id, tok.eos_id, tok.pad_id}  # control tokens, shown as nothing
        raw = b"".join(tok.token_bytes(t) for t in stream.result.token_ids if t not in special)
        assert "".join(pieces) == raw.decode("utf-8", errors="replace") == stream.result.text


def _is_complete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ------------------------------------------------------------------ context policy


def test_error_policy_refuses_what_does_not_fit():
    gen = id_generator(random_lm(max_seq_len=16))
    with pytest.raises(GenerationError, match="context"):
        gen.generate([list(range(1, 17))], SamplingParams(max_new_tokens=1))
    with pytest.raises(GenerationError, match="at most 6 new tokens"):
        gen.generate([list(range(1, 11))], SamplingParams(max_new_tokens=7))
    assert len(gen.generate([list(range(1, 11))], SamplingParams(max_new_tokens=6))[0].token_ids) == 6


@torch.no_grad()
def test_slide_policy_equals_recomputation_over_the_same_windows():
    L, keep = 16, 10
    model = random_lm(max_seq_len=L)
    gen = id_generator(model, context_policy="slide", slide_keep=keep)
    prompt = list(range(3, 23))  # longer than the context: the last L tokens are kept
    got = gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=30))[0].token_ids
    # reference: no cache; the window is the last L tokens until it is full, then restarts from the last `keep`
    seq, start, want = prompt[-L:], 0, []
    for _ in range(30):
        tok = int(model(torch.tensor([seq[start:]]))[0, -1].argmax())
        want.append(tok)
        seq.append(tok)
        if len(seq) - start > L:
            start = len(seq) - keep
    assert got == want
    assert len(got) == 30


# ------------------------------------------------------------------ beam search


def test_one_beam_is_greedy():
    gen = id_generator(random_lm())
    for prompt in PROMPTS:
        greedy = gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=20))[0]
        beam = gen.beam_search(prompt, num_beams=1, max_new_tokens=20)[0]
        assert beam.token_ids == greedy.token_ids


@torch.no_grad()
def test_beam_search_finds_the_exhaustive_optimum_on_a_tiny_vocabulary():
    V, L, eos = 5, 4, 0
    model = random_lm(vocab=V, seed=3)
    prompt = [1, 2, 3]
    # brute force: every sequence of L tokens; a hypothesis ends at its first EOS or after L tokens
    seqs = torch.tensor(list(itertools.product(range(V), repeat=L)))
    x = torch.cat([torch.tensor(prompt).expand(len(seqs), -1), seqs], dim=1)
    logp = torch.log_softmax(model(x)[:, len(prompt) - 1 : -1], dim=-1).gather(-1, seqs[..., None])[..., 0]
    best: dict[tuple[int, ...], float] = {}
    for s, lp in zip(seqs.tolist(), logp.tolist()):
        n = s.index(eos) + 1 if eos in s else L
        best[tuple(s[:n])] = sum(lp[:n])
    want_ids, want_lp = max(best.items(), key=lambda kv: kv[1])

    gen = Generator(model)
    gen.eos_token_id = eos
    top = gen.beam_search(prompt, num_beams=V**L, max_new_tokens=L, length_penalty=0.0, num_return_sequences=10)
    assert tuple(top[0].token_ids) == want_ids
    assert sum(top[0].logprobs) == pytest.approx(want_lp, abs=1e-9)
    # the ranking below the top is exhaustive too
    ranked = sorted(best.values(), reverse=True)[:10]
    assert [sum(r.logprobs) for r in top[:10]] == pytest.approx(ranked, abs=1e-9)
    greedy = gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=L))[0]
    assert sum(top[0].logprobs) >= sum(greedy.logprobs) - 1e-12


def test_more_beams_score_at_least_greedy():
    gen = id_generator(random_lm(seed=4))
    for prompt in PROMPTS:
        greedy = gen.generate([prompt], SamplingParams(temperature=0, max_new_tokens=12))[0]
        beams = gen.beam_search(prompt, num_beams=4, max_new_tokens=12, length_penalty=0.0, num_return_sequences=4)
        assert len(beams) == 4
        assert sum(beams[0].logprobs) >= sum(greedy.logprobs) - 1e-12
        assert [sum(b.logprobs) for b in beams] == sorted((sum(b.logprobs) for b in beams), reverse=True)


@torch.no_grad()
def test_beam_logprobs_are_the_model_logprobs_of_the_sequence():
    model = random_lm(seed=5)
    gen = id_generator(model)
    prompt = PROMPTS[0]
    for beam in gen.beam_search(prompt, num_beams=3, max_new_tokens=8, num_return_sequences=3):
        x = torch.tensor([prompt + beam.token_ids])
        lp = torch.log_softmax(model(x)[0, len(prompt) - 1 : -1], -1)
        want = lp.gather(-1, torch.tensor(beam.token_ids)[:, None])[:, 0]
        assert beam.logprobs == pytest.approx(want.tolist(), abs=1e-9)


@torch.no_grad()
def test_a_search_picks_its_rows_tokens_and_moves_their_cache_rows():
    """BatchEngine._search: a scripted search's rows feed the tokens it picks after taking over the cache
    rows it names; at every step the logits it is given are each row's own sequence recomputed without a
    cache, and the engine steps until the search stops (its rows then end together)."""
    model = random_lm()
    prompt = [5, 6, 7]
    script = [([1, 2, 3], [0, 0, 0]), ([4, 5, 6], None), ([7, 8, 9], [2, 0, 1]), ([1, 1, 1], [1, 1, 2])]

    class Scripted:
        def __init__(self) -> None:
            self.seen: list[torch.Tensor] = []  # the logits of each step

        def advance(self, logits):
            self.seen.append(logits.clone())
            if len(self.seen) > len(script):
                return None
            tokens, index = script[len(self.seen) - 1]
            return torch.tensor(tokens), None if index is None else torch.tensor(index)

    search = Scripted()
    engine = BatchEngine(model, max_batch=3, max_len=12)
    params = SamplingParams(max_new_tokens=12)
    rows = [EngineRow(prompt, params, TextState(lambda t: b""), search=search) for _ in range(3)]
    engine.add_group(rows)
    steps = list(engine.run())
    assert len(steps) == len(script) + 1 and not engine.rows
    assert all(o.finish_reason == "stop" for o in steps[-1]) and len(steps[-1]) == 3
    # each row's sequence, by following the script's moves
    seqs = [[] for _ in range(3)]
    for logits, (tokens, index) in zip(search.seen, [([], None)] + script):
        if index is not None:
            seqs = [list(seqs[i]) for i in index]
        seqs = [s + [t] for s, t in zip(seqs, tokens)] if tokens else seqs
        for r in range(3):
            want = model(torch.tensor([prompt + seqs[r]]))[0, -1]
            assert torch.allclose(logits[r], want, atol=1e-9)
    assert [r.token_ids for r in rows] == seqs

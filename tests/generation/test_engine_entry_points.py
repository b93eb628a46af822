"""Every entry point that generates text goes through one engine, and each gives the greedy tokens of
Hugging Face ``LlamaForCausalLM.generate`` with the same weights: the library ``Generator`` (eager and
compiled, batch 1 and mixed batches), the engine's batched and chunked prefill, the server's scheduler
(eager and compiled), ``tinyformer chat``'s session, ``tinyformer generate`` and the trainer's samples."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import build_tokenizer
from tinyformer.families import config_to_hf, tinyformer_to_hf
from tinyformer.generation.chat import ChatSession
from tinyformer.generation.engine import BatchEngine, EngineRow
from tinyformer.generation.generator import Generator
from tinyformer.generation.sampling import SamplingParams
from tinyformer.generation.streaming import TextState
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import save_model
from tinyformer.serve.scheduler import GenerationRequest, Scheduler, StepEvent
from tinyformer.training.sample import sample_text

transformers = pytest.importorskip("transformers")

CORPUS = "User: Assistant: System: [the quick brown fox jumps over a lazy dog] 0123456789.,!?\n"
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [3, 4, 5], [20, 21, 22, 23, 24], [7]]
N = 12


def random_lm(vocab: int, dtype: torch.dtype, max_seq_len: int = 96) -> DecoderLM:
    """A small Llama-shaped decoder with peaked next-token distributions (no near-ties for argmax)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, d_model=32, n_layer=2, n_head=4, n_kv_head=2, d_ff=64,
                      max_seq_len=max_seq_len, tie_embeddings=False)
    model = DecoderLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.3)
    return model.to(dtype).eval()


def hf_twin(model: DecoderLM):
    hf_cfg = config_to_hf(model.cfg)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{k: v for k, v in hf_cfg.items() if k != "architectures"}))
    missing, unexpected = hf.load_state_dict(dict(tinyformer_to_hf(model.cfg, model.state_dict())), strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    return hf.to(next(model.parameters()).dtype).eval()


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], n: int = N) -> list[int]:
    """transformers' greedy continuation of one prompt alone (no end token)."""
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def model64() -> DecoderLM:
    return random_lm(50, torch.float64)


@pytest.fixture(scope="module")
def want64(model64) -> list[list[int]]:
    hf = hf_twin(model64)
    return [hf_greedy(hf, p) for p in PROMPTS]


def greedy(n: int = N) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n)


def engine_row(prompt: list[int], n: int = N) -> EngineRow:
    return EngineRow(prompt, greedy(n), TextState(lambda t: b""))


# ------------------------------------------------------------------ the library generator


def test_generator_batch_one_and_mixed_batch_equal_transformers(model64, want64):
    gen = Generator(model64)
    gen.eos_token_id = None
    assert [gen.generate([p], greedy())[0].token_ids for p in PROMPTS] == want64
    assert [r.token_ids for r in gen.generate(PROMPTS, greedy())] == want64
    assert [r.token_ids for r in gen.generate(PROMPTS, greedy(), logprobs=False)] == want64


def test_compiled_generator_equals_transformers():
    model = random_lm(50, torch.float32)
    want = [hf_greedy(hf_twin(model), p) for p in PROMPTS]
    gen = Generator(model, compile=True)
    gen.eos_token_id = None
    assert [r.token_ids for r in gen.generate(PROMPTS, greedy(), logprobs=False)] == want
    assert [r.token_ids for r in gen.generate(PROMPTS[:1], greedy())] == want[:1]


# ------------------------------------------------------------------ the engine: batched and chunked prefill


def test_new_prompts_are_prefilled_together_in_one_forward_call(model64, want64):
    engine = BatchEngine(model64, max_batch=4, max_len=64)
    calls: list[tuple[int, int]] = []
    hook = model64.tok_emb.register_forward_hook(lambda m, args, out: calls.append(tuple(args[0].shape)))
    try:
        rows = [engine_row(p) for p in PROMPTS]
        for r in rows:
            engine.add(r)
        first = engine.step()
    finally:
        hook.remove()
    # four prompts of lengths 17, 3, 5, 1: one right-padded (4, 17) forward call, one token for each
    assert calls == [(4, max(map(len, PROMPTS)))]
    assert sorted(o.row.slot for o in first) == [0, 1, 2, 3]
    while any(not r.finished for r in rows):
        engine.step()
    assert [r.token_ids for r in rows] == want64


def test_chunked_prefill_interleaves_with_decoding_and_keeps_tokens(model64, want64):
    engine = BatchEngine(model64, max_batch=3, max_len=64, prefill_chunk=4)
    short = engine_row(PROMPTS[1], n=20)
    engine.add(short)
    engine.step()  # prefilled (3 tokens <= one chunk): its first token
    long = engine_row(PROMPTS[0])
    engine.add(long)
    steps = 0
    while long.prefilling:
        produced = {id(o.row) for o in engine.step()}
        steps += 1
        assert id(short) in produced  # the running row gets a token every step of the long prefill
    assert steps == -(-len(PROMPTS[0]) // 4)  # 17 tokens in chunks of 4: 5 rounds
    late = engine_row(PROMPTS[2])
    engine.add(late)
    rows = [short, long, late]
    while any(not r.finished for r in rows):
        for o in engine.step():
            if o.finish_reason is not None:
                engine.remove(o.row)
    hf = hf_twin(model64)
    assert short.token_ids == hf_greedy(hf, PROMPTS[1], 20)
    assert [long.token_ids, late.token_ids] == [want64[0], want64[2]]


def test_the_prefill_budget_is_shared_first_come_first_served(model64):
    """8 tokens per step, first come first served; a prompt that cannot finish in what is left of the
    budget waits for the next step whole, so every prompt reaches its first token as early as it can:
    step 1 the first prompt (5 tokens; 3 would be left, too few for the second's 5), step 2 the second,
    step 3 the third; only the first in line is ever fed in part (the long one, in chunks of 8)."""
    prompts = [[20, 21, 22, 23, 24], [24, 23, 22, 21, 20], [1, 2, 3, 4, 5], list(range(3, 23)), [6, 7]]
    engine = BatchEngine(model64, max_batch=5, max_len=64, prefill_chunk=8)
    rows = [engine_row(p) for p in prompts]
    for r in rows:
        engine.add(r)
    assert [o.row for o in engine.step()] == rows[:1]
    assert [r.pos for r in rows] == [5, 0, 0, 0, 0]
    assert [o.row for o in engine.step()] == rows[:2]  # the first row's decode step, the second's prefill
    assert [r.pos for r in rows] == [6, 5, 0, 0, 0]
    engine.step()
    assert [r.pos for r in rows[2:]] == [5, 0, 0]
    engine.step()  # the long prompt is first in line: 8 of its 20 tokens
    assert [r.pos for r in rows[3:]] == [8, 0]
    while any(not r.finished for r in rows):
        engine.step()
    hf = hf_twin(model64)
    assert [r.token_ids for r in rows] == [hf_greedy(hf, p) for p in prompts]


def test_a_row_can_start_prefilling_after_positions_already_in_its_cache(model64, want64):
    """A prefix-cache hit: the first k positions are copied into the row, prefill starts at k."""
    prompt = PROMPTS[0]
    donor = BatchEngine(model64, max_batch=1, max_len=64)
    donor.add(engine_row(prompt))
    donor.step()
    engine = BatchEngine(model64, max_batch=2, max_len=64, prefill_chunk=5)
    engine.add(engine_row(PROMPTS[1]))  # slot 0: another request
    row = engine_row(prompt)
    k = 8
    engine.add(row, prefilled=k)
    for (dk, dv), (ek, ev) in zip(donor.cache.layers, engine.cache.layers):
        ek[row.slot, :, :k] = dk[0, :, :k]
        ev[row.slot, :, :k] = dv[0, :, :k]
    while not row.finished:
        engine.step()
    assert row.token_ids == want64[0]


# ------------------------------------------------------------------ the server's scheduler


def run_scheduler(sched: Scheduler, prompts: list[list[int]], n: int = N) -> list[list[int]]:
    """Submit every prompt at once and wait for all of them: each one's generated ids."""
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    done = threading.Semaphore(0)

    def sink(event: StepEvent) -> None:
        got[event.index] += [t.token_id for t in event.tokens]
        if event.finish_reason is not None:
            assert event.error is None, event.error
            done.release()

    sched.start()
    try:
        sched.submit([GenerationRequest(p, greedy(n), sink, index=i) for i, p in enumerate(prompts)])
        for _ in prompts:
            assert done.acquire(timeout=300)
    finally:
        sched.stop()
    return [got[i] for i in range(len(prompts))]


def test_scheduler_with_queueing_and_chunked_prefill_equals_transformers(model64, want64):
    # two slots for four requests: later ones are admitted mid-flight; prompts longer than a chunk
    sched = Scheduler(model64, lambda t: b"", max_batch=2, max_len=64, prefill_chunk=4)
    assert run_scheduler(sched, PROMPTS) == want64


def test_compiled_scheduler_equals_transformers():
    model = random_lm(50, torch.float32)
    want = [hf_greedy(hf_twin(model), p) for p in PROMPTS[:3]]
    sched = Scheduler(model, lambda t: b"", max_batch=2, max_len=64, compile=True, prefill_chunk=8)
    assert run_scheduler(sched, PROMPTS[:3]) == want


def test_a_one_shot_batch_pads_to_max_batch_and_a_server_to_powers_of_two(model64):
    """Generator's engine: one graph for one row and one for max_batch rows (a batch only shrinks);
    the scheduler's (buckets=True): the next power of two, so few rows are not padded to max_batch."""
    from tinyformer.generation.engine import CompiledStep

    step = CompiledStep(model64)  # nothing compiles until a step runs
    once = BatchEngine(model64, max_batch=8, max_len=64, compiled=step)
    served = BatchEngine(model64, max_batch=8, max_len=64, compiled=step, buckets=True)
    assert [once.bucket(n) for n in range(1, 9)] == [1, 8, 8, 8, 8, 8, 8, 8]
    assert once.buckets() == [1, 8]
    assert [served.bucket(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert served.buckets() == [1, 2, 4, 8]
    assert BatchEngine(model64, max_batch=6, max_len=64, compiled=step, buckets=True).buckets() == [1, 2, 4, 6]


def test_compiled_scheduler_compiles_every_bucket_at_start_and_never_while_serving():
    """``start()`` builds (or loads) the packaged step of each bucket (1, 2, 4 rows for max_batch 4; one row
    also greedy); then 1, 2, 3 and 4 requests at once decode in those packages (3 rows run the 4-row
    bucket, padded) with no further package, and give transformers' greedy tokens."""
    from tinyformer.generation.compile_cache import PackagedStep

    model = random_lm(50, torch.float32)
    hf = hf_twin(model)
    want = [hf_greedy(hf, p) for p in PROMPTS]
    sched = Scheduler(model, lambda t: b"", max_batch=4, max_len=64, compile=True, prefill_chunk=8)
    assert sched.engine.buckets() == [1, 2, 4]
    step = sched.engine.compiled
    assert isinstance(step, PackagedStep) and not step._packages
    sched.start()
    sched.stop()
    sched._thread = None
    warmed = dict(step._packages)
    assert sorted((ids_only, rows) for ids_only, rows, *_ in warmed) == [(False, 1), (False, 2), (False, 4),
                                                                         (True, 1)]
    assert all(fn is not None for fn in warmed.values())
    for k in (1, 2, 3, 4):
        assert run_scheduler(sched, PROMPTS[:k]) == want[:k]
    assert step._packages == warmed


# ------------------------------------------------------------------ chat, the CLI and training samples


@pytest.fixture(scope="module")
def char_run(tmp_path_factory) -> tuple[Path, DecoderLM]:
    folder = tmp_path_factory.mktemp("parity")
    tok = build_tokenizer("char", CORPUS)
    model = random_lm(tok.vocab_size, torch.float32, max_seq_len=160)
    save_model(folder, model)
    tok.save(folder)
    return folder, model


def test_chat_session_first_turn_equals_transformers(char_run):
    folder, model = char_run
    gen = Generator.from_run(folder)
    session = ChatSession(gen)
    ids = gen.encode(session.template.render([{"role": "user", "content": "the fox"}]))
    stream = gen.stream(ids, session.stop_params(greedy(24)), logprobs=False)
    list(stream)
    got = stream.result.token_ids
    assert got and got == hf_greedy(hf_twin(model), ids, len(got))


def test_generate_cli_equals_transformers(char_run, cli_env):
    folder, model = char_run
    out = subprocess.run([sys.executable, "-m", "tinyformer", "generate", "--model", str(folder), "--prompt",
                          "the fox", "--temperature", "0", "--max-new-tokens", str(N), "--ignore-eos", "--json"],
                         capture_output=True, text=True, env=cli_env, timeout=120)
    assert out.returncode == 0, out.stderr
    ids = Generator.from_run(folder).encode("the fox")
    assert json.loads(out.stdout.splitlines()[0])["token_ids"] == hf_greedy(hf_twin(model), ids)


def test_training_sample_equals_transformers(char_run):
    folder, model = char_run
    from tinyformer.run_folder import load_tokenizer

    tok = load_tokenizer(folder)
    ids = tok.encode("the fox")
    want = hf_greedy(hf_twin(model), ids)
    if tok.eos_id is not None and tok.eos_id in want:
        want = want[: want.index(tok.eos_id)]
    text = sample_text(model, tok, "the fox", N, "cpu", temperature=0)
    assert text == tok.decode(ids + want, skip_special_tokens=True)


# ------------------------------------------------------------------ prefix cache hits and misses


SYSTEM = [(7 * i + 3) % 50 for i in range(40)]  # a shared 40-token "system prompt"


def test_generator_prefix_hit_gives_the_logprobs_and_tokens_of_a_miss(model64):
    from tinyformer.generation.engine import new_prefix_cache

    cold = Generator(model64)
    warm = Generator(model64, prefix_cache=new_prefix_cache(model64, 1))
    for g in (cold, warm):
        g.eos_token_id = None
    first = warm.generate([SYSTEM + [1, 2]], greedy())[0]
    assert warm.prefix_cache.stats.hits == 0
    prompt = SYSTEM + [1, 2] + first.token_ids[:6] + [9]  # continues the first request: a chat's next turn
    hit = warm.generate([prompt], greedy())[0]
    # the first request stored prompt + completion; whole 16-token blocks of the 48 shared tokens are reused
    assert warm.prefix_cache.stats.hits == 1 and warm.prefix_cache.stats.tokens_reused == 48
    miss = cold.generate([prompt], greedy())[0]
    assert hit.token_ids == miss.token_ids == hf_greedy(hf_twin(model64), prompt)
    torch.testing.assert_close(torch.tensor(hit.logprobs), torch.tensor(miss.logprobs), rtol=0, atol=1e-10)


def test_scheduler_prefix_hits_small_budget_eviction_and_cancel_keep_tokens_and_free_blocks(model64):
    hf = hf_twin(model64)
    prompts = [SYSTEM + [i, i + 1, i + 2] for i in range(6)]
    want = [hf_greedy(hf, p) for p in prompts]
    # 3 blocks of 16 positions fit: requests evict each other's blocks while others still run
    block = 2 * model64.cfg.n_layer * model64.cfg.n_kv_head * 16 * model64.cfg.head_dim * 8
    sched = Scheduler(model64, lambda t: b"", max_batch=2, max_len=64, prefill_chunk=16,
                      prefix_cache_mb=3 * block / 2**20)
    assert run_scheduler(sched, prompts[:1]) == want[:1]
    assert run_scheduler(sched, prompts[1:]) == want[1:]
    pc = sched.engine.prefix_cache
    assert pc.stats.hits >= 1 and pc.stats.evictions >= 1
    assert all(b.refs == 0 for b in pc._blocks.values())  # every finished request released its hit
    # a request cancelled while it runs releases its blocks too
    started = threading.Event()
    sched.start()
    try:
        req = GenerationRequest(prompts[0], greedy(40), lambda e: started.set())
        sched.submit([req])
        assert started.wait(60)
        sched.cancel([req.id])
        while sched.stats()["active"]:
            threading.Event().wait(0.01)
    finally:
        sched.stop()
    assert all(b.refs == 0 for b in pc._blocks.values())


def test_chat_turns_reuse_the_history_and_answer_as_without_the_prefix_cache(char_run):
    from tinyformer.generation.engine import new_prefix_cache

    folder, _ = char_run
    replies = {}
    for mb in (0, 4):
        gen = Generator.from_run(folder)
        gen.prefix_cache = new_prefix_cache(gen.model, mb)
        session = ChatSession(gen)
        replies[mb] = ["".join(session.send(text, greedy(16))) for text in ("the fox", "a lazy dog", "the dog")]
    assert replies[4] == replies[0]
    assert gen.prefix_cache.stats.hits >= 2  # the second and third turns started from the history's blocks


def test_served_completion_equals_transformers(char_run):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from serve_helpers import BackgroundServer

    from tinyformer.run_folder import load_model, load_tokenizer
    from tinyformer.serve.app import create_app

    folder, model = char_run
    tok = load_tokenizer(folder)
    ids = tok.encode("the fox")
    want = tok.decode(hf_greedy(hf_twin(model), ids), skip_special_tokens=True)  # special tokens show no text
    for compile_ in (False, True):
        app = create_app(load_model(folder), tok, model_name="m", max_batch=2, compile=compile_, prefix_cache_mb=1)
        with BackgroundServer(app) as srv:
            for _ in range(2):  # the second request hits the prefix cache
                r = httpx.post(srv.url + "/v1/completions", timeout=300, json={
                    "model": "m", "prompt": "the fox", "max_tokens": N, "temperature": 0, "ignore_eos": True})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["text"] == want


def test_compile_without_a_cpp_compiler_is_a_clear_error(model64, monkeypatch):
    """Inductor writes C++ for the CPU: without a compiler, --compile is refused up front (generate, chat and
    serve), naming what is missing, instead of failing inside the first decode step."""
    from tinyformer.errors import GenerationError

    monkeypatch.setenv("CXX", "no-such-c++-compiler")  # the compiler inductor would call, not on PATH
    with pytest.raises(GenerationError, match="needs a C\\+\\+ compiler"):
        Generator(model64, compile=True)
    with pytest.raises(GenerationError, match="needs a C\\+\\+ compiler"):
        Scheduler(model64, lambda t: b"", max_batch=2, max_len=64, compile=True)
    Generator(model64)  # eager needs none

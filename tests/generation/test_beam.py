"""The one beam search (generation/beam.py) against transformers' generate(num_beams=...), brute force,
and the two beam searches it replaced (kept here, frozen, as float64 references)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_classic_seq2seq import BOS, EOS, _peaked_model  # noqa: E402
from test_engine import hf_llama, random_lm  # noqa: E402

from tinyformer.errors import GenerationError, NonFiniteOutputError
from tinyformer.generation.beam import new_search
from tinyformer.generation.generator import Generator
from tinyformer.generation.seq2seq import beam_search as seq2seq_beam_search

NEG_INF = float("-inf")


# ------------------------------------------------------------------ the searches before the merge (frozen)


def old_generic_beam_search(step, logits, cache, *, num_beams, max_new_tokens, eos_token_ids=(), length_penalty=1.0):
    """generation/generator.py's beam_search before the merge (decoder-only models), unchanged but for the
    result type: (token_ids, token_logprobs, logprob, score) tuples, best first."""
    K = num_beams
    ends = {int(t) for t in eos_token_ids}
    logp = torch.log_softmax(logits.double(), dim=-1)
    V = logp.shape[-1]
    scores = logp.new_zeros(1)
    seqs = torch.zeros(1, 0, dtype=torch.long)
    seq_logps = logp.new_zeros(1, 0)
    finished: list[tuple] = []

    def normalised(total, n):
        return total / (n**length_penalty)

    def best_possible(total, n):
        return total / (max_new_tokens**length_penalty) if length_penalty > 0 else normalised(total, n)

    for t in range(max_new_tokens):
        n = t + 1
        candidates = (scores[:, None] + logp).view(-1)
        top_scores, top_index = candidates.topk(min(2 * K, candidates.numel()))
        keep_rows, keep_tokens = [], []
        for rank, (s, flat) in enumerate(zip(top_scores.tolist(), top_index.tolist())):
            if s == NEG_INF:
                break
            row, token = divmod(flat, V)
            if token in ends:
                if rank < K:
                    finished.append((seqs[row].tolist() + [token], seq_logps[row].tolist() + [float(logp[row, token])],
                                     s, normalised(s, n)))
                continue
            keep_rows.append(row)
            keep_tokens.append(token)
            if len(keep_rows) == K:
                break
        finished.sort(key=lambda b: b[3], reverse=True)
        del finished[K:]
        if not keep_rows:
            break
        index, tokens = torch.tensor(keep_rows), torch.tensor(keep_tokens)
        new_lps = logp[index, tokens]
        scores = scores[index] + new_lps
        seqs = torch.cat([seqs[index], tokens[:, None]], dim=1)
        seq_logps = torch.cat([seq_logps[index], new_lps[:, None]], dim=1)
        if n == max_new_tokens:
            for ids, lps, total in zip(seqs.tolist(), seq_logps.tolist(), scores.tolist()):
                finished.append((ids, lps, total, normalised(total, n)))
            break
        if len(finished) == K and best_possible(float(scores.max()), n) <= finished[-1][3]:
            break
        cache.reorder(index)
        logp = torch.log_softmax(step(tokens, cache).double(), dim=-1)
    finished.sort(key=lambda b: b[3], reverse=True)
    return finished[:K]


@torch.no_grad()
def old_seq2seq_beam_search(model, src_ids, src_mask, *, bos_id, eos_id, max_new_tokens, beam_size, length_penalty):
    """generation/seq2seq.py's beam_search before the merge: (tokens without EOS, score) of each source's best
    hypothesis. It differs from the merged search in one rule: every live prefix closed by EOS became a
    finished candidate, not only those ranked among the first K candidates."""
    B, K = src_ids.shape[0], beam_size
    memory = model.encode(src_ids, src_mask)
    cross = [(k.repeat_interleave(K, 0), v.repeat_interleave(K, 0)) for k, v in model.cross_kv(memory)]
    mask = src_mask.repeat_interleave(K, 0) if src_mask is not None else None
    cache = model.new_cache(B * K, max_new_tokens)
    scores = torch.full((B, K), NEG_INF, dtype=torch.float64)
    scores[:, 0] = 0.0
    prefixes = [[[] for _ in range(K)] for _ in range(B)]
    finished: list[list[tuple]] = [[] for _ in range(B)]
    closed = [False] * B
    tok = torch.full((B * K, 1), bos_id, dtype=torch.long)

    def add(b, hyp):
        finished[b].append(hyp)
        finished[b].sort(key=lambda h: h[1], reverse=True)
        del finished[b][K:]

    for step in range(max_new_tokens):
        length = step + 1
        logits = model.lm_head(model.decode(tok, cross, mask, cache))[:, -1]
        logp = torch.log_softmax(logits.double(), -1).view(B, K, -1)
        V = logp.shape[-1]
        ended = (scores + logp[:, :, eos_id]).tolist()
        logp[:, :, eos_id] = NEG_INF
        top_scores, top_index = (scores[:, :, None] + logp).view(B, K * V).topk(K, dim=-1)
        new_scores = torch.full((B, K), NEG_INF, dtype=torch.float64)
        origin = torch.arange(B * K).view(B, K).clone()
        new_prefixes = [[[] for _ in range(K)] for _ in range(B)]
        for b in range(B):
            if closed[b]:
                continue
            for beam in range(K):
                if ended[b][beam] != NEG_INF:
                    add(b, (list(prefixes[b][beam]), ended[b][beam] / length**length_penalty))
            for rank, (s, idx) in enumerate(zip(top_scores[b].tolist(), top_index[b].tolist())):
                if s == NEG_INF:
                    break
                beam, token = divmod(idx, V)
                if length == max_new_tokens:
                    add(b, (prefixes[b][beam] + [token], s / length**length_penalty))
                    continue
                new_scores[b, rank] = s
                origin[b, rank] = b * K + beam
                new_prefixes[b][rank] = prefixes[b][beam] + [token]
            best_live = float(new_scores[b].max())
            if best_live == NEG_INF:
                closed[b] = True
            elif len(finished[b]) >= K:
                reach = length + 1 if length_penalty <= 0 else max_new_tokens
                closed[b] = best_live / reach**length_penalty <= finished[b][-1][1]
        if all(closed) or length == max_new_tokens:
            break
        for b in range(B):
            if closed[b]:
                new_scores[b] = NEG_INF
        scores, prefixes = new_scores, new_prefixes
        cache.reorder(origin.view(-1))
        tok = (top_index % V).view(B * K, 1)
    return [finished[b][0] for b in range(B)]


class OldDecoderState:
    """generation/seq2seq.py's decoder state before the engine ran the encoder-decoder: one source's
    self-attention cache and cross K/V, stepped one token at a time and reordered like a cache."""

    def __init__(self, model, src_ids, src_mask, max_new_tokens):
        self.model = model
        self.cross = model.cross_kv(model.encode(src_ids, src_mask))
        self.mask = src_mask
        self.cache = model.new_cache(src_ids.shape[0], max_new_tokens)

    def reorder(self, index):
        if index.numel() != self.cache.batch_size:
            self.cross = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.cross]
            self.mask = self.mask.index_select(0, index) if self.mask is not None else None
        self.cache.reorder(index)

    def step(self, tokens):
        return self.model.lm_head(self.model.decode(tokens[:, None], self.cross, self.mask, self.cache))[:, -1]


def search_over(step, logits, state, *, num_beams, max_new_tokens, num_return_sequences=1, **kwargs):
    """The search of generation/beam.py over a hand-made 'model' without a KV cache: the moves the engine
    makes (BatchEngine._search) on a ``state`` with ``reorder(index)``, from K copies of each source's row."""
    search = new_search(logits.shape[0], num_beams, max_new_tokens, **kwargs)
    state.reorder(torch.arange(logits.shape[0]).repeat_interleave(num_beams))
    logits = logits.repeat_interleave(num_beams, 0)
    while (picked := search.advance(logits)) is not None:
        tokens, index = picked
        if index is not None:
            state.reorder(index)
        logits = step(tokens, state)
    return search.results(num_return_sequences)


# ------------------------------------------------------------------ decoder-only: transformers' generate

EOS_LM = 34  # a token the model below often predicts: hypotheses end on it, before max_new_tokens


def eos_lm():
    """A random Llama-shaped model (float32, as transformers' beam search scores) whose EOS fires."""
    model = random_lm(vocab=64, dtype=torch.float32, seed=1, tie_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight[EOS_LM] *= 2.0
    return model


@pytest.fixture(scope="module")
def llama_pair():
    pytest.importorskip("transformers")
    model = eos_lm()
    hf = hf_llama(model).float()
    gen = Generator(model)
    gen.eos_token_id = EOS_LM
    return gen, hf


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 2.0, 0.0, -0.5])
@pytest.mark.parametrize("num_beams", [1, 2, 3, 4])
def test_decoder_beam_search_equals_transformers_generate(llama_pair, num_beams, length_penalty, early_stopping):
    gen, hf = llama_pair
    prompt, n = [5, 6, 7, 8], 12
    ours = gen.beam_search(prompt, num_beams, n, length_penalty, early_stopping=early_stopping,
                           num_return_sequences=num_beams)
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, num_beams=num_beams, do_sample=False, length_penalty=length_penalty,
                      early_stopping=early_stopping, num_return_sequences=num_beams, eos_token_id=EOS_LM,
                      pad_token_id=EOS_LM, output_scores=True, return_dict_in_generate=True)
    theirs = [row[: row.index(EOS_LM) + 1] if EOS_LM in row else row for row in out.sequences[:, len(prompt):].tolist()]
    assert [r.token_ids for r in ours] == theirs
    for r in ours:
        assert r.finish_reason == ("stop" if r.token_ids[-1] == EOS_LM else "length")
    if num_beams > 1:  # transformers' sequences_scores: logprob / length ** length_penalty
        got = [sum(r.logprobs) / len(r.token_ids) ** length_penalty for r in ours]
        assert got == pytest.approx(out.sequences_scores.tolist(), rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("early_stopping", [False, "never"])
def test_two_end_tokens_keep_three_k_candidates_as_transformers_does(llama_pair, early_stopping):
    gen, hf = llama_pair
    prompt, n, K, second = [5, 6, 7, 8], 12, 3, 14  # both end tokens end hypotheses here
    ours = gen.beam_search(prompt, K, n, 1.0, stop_token_ids=[second], early_stopping=early_stopping,
                           num_return_sequences=K)
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, num_beams=K, do_sample=False, early_stopping=early_stopping,
                      num_return_sequences=K, eos_token_id=[EOS_LM, second], pad_token_id=EOS_LM)
    theirs = []
    for row in out[:, len(prompt):].tolist():
        ends = [i for i, t in enumerate(row) if t in (EOS_LM, second)]
        theirs.append(row[: ends[0] + 1] if ends else row)
    assert [r.token_ids for r in ours] == theirs
    assert {r.token_ids[-1] for r in ours} == {EOS_LM, second}


def test_the_transformers_comparison_sees_eos_and_every_early_stopping_rule(llama_pair):
    """The model above is one where the comparison can fail: hypotheses end on EOS, and the three
    early_stopping rules give three different results."""
    gen, _ = llama_pair
    res = {es: [r.token_ids for r in gen.beam_search([5, 6, 7, 8], 4, 12, 1.0, early_stopping=es,
                                                     num_return_sequences=4)]
           for es in (False, True, "never")}
    assert all(ids[-1] == EOS_LM and len(ids) < 12 for ids in res[False])
    assert res[False] != res[True] and res[False] != res["never"] and res[True] != res["never"]


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
@pytest.mark.parametrize("num_beams", [2, 3, 5])
def test_decoder_beam_search_equals_the_search_before_the_merge_with_never(num_beams, length_penalty):
    """The decoder-only search before the merge used the exact stopping bound: early_stopping='never'."""
    model = eos_lm().double()
    gen = Generator(model)
    gen.eos_token_id = EOS_LM
    prompt, n = [5, 6, 7, 8], 12
    new = gen.beam_search(prompt, num_beams, n, length_penalty, early_stopping="never",
                          num_return_sequences=num_beams)
    with torch.no_grad():
        cache = model.new_cache(1, len(prompt) + n)
        logits = model(torch.tensor([prompt]), cache=cache)[:, -1]
        old = old_generic_beam_search(lambda tok, c: model(tok[:, None], cache=c)[:, -1], logits, cache,
                                      num_beams=num_beams, max_new_tokens=n, eos_token_ids=[EOS_LM],
                                      length_penalty=length_penalty)
    assert [r.token_ids for r in new] == [o[0] for o in old]
    for r, o in zip(new, old):
        assert r.logprobs == pytest.approx(o[1], abs=1e-12)


def test_generator_beam_search_options():
    model = eos_lm()
    gen = Generator(model)
    gen.eos_token_id = None
    # a stop token ends a hypothesis like EOS
    stopped = gen.beam_search([5, 6, 7, 8], 3, 12, 1.0, stop_token_ids=[EOS_LM], num_return_sequences=3)
    assert any(r.finish_reason == "stop" and r.token_ids[-1] == EOS_LM for r in stopped)
    # num_return_sequences defaults to 1, as in transformers
    assert len(gen.beam_search([5, 6, 7, 8], 3, 4)) == 1
    for bad in (dict(num_beams=0), dict(num_return_sequences=4), dict(early_stopping="always"),
                dict(length_penalty=math.nan)):
        kwargs = dict(num_beams=3, max_new_tokens=4) | bad
        with pytest.raises(GenerationError):
            gen.beam_search([5, 6, 7, 8], **kwargs)


def test_non_finite_logits_after_the_prompt_end_beam_search_with_the_engine_error():
    model = eos_lm()
    with torch.no_grad():
        model.lm_head.weight[3] = float("nan")
    for K in (1, 3):
        with pytest.raises(NonFiniteOutputError, match=r"non-finite logits \(NaN or inf\) for generated token 1"):
            Generator(model).beam_search([5, 6, 7, 8], K, 4)


# ------------------------------------------------------------------ exhaustive search (a property)


class PrefixModel:
    """A 'model' whose next-token log-probabilities are a fixed random function of the whole prefix
    (float64), and the state beam search carries: each row's prefix, reordered like a cache."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed = vocab, seed

    def logits(self, source: int, prefix: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, source, prefix)) % 2**63)
        return 2.0 * torch.randn(self.vocab, generator=g, dtype=torch.float64)

    def logp(self, source: int, seq: tuple[int, ...]) -> float:
        return sum(float(torch.log_softmax(self.logits(source, seq[:i]), -1)[y]) for i, y in enumerate(seq))


class PrefixState:
    def __init__(self, sources: list[int]) -> None:
        self.rows = [(s, ()) for s in sources]

    def reorder(self, index: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in index.tolist()]


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0, -0.5])
def test_beam_search_keeping_every_prefix_ranks_every_sequence_like_brute_force(length_penalty, early_stopping):
    V, L, eos = 4, 3, 0
    model = PrefixModel(V, seed=7)

    def step(tokens: torch.Tensor, state: PrefixState) -> torch.Tensor:
        state.rows = [(s, p + (t,)) for (s, p), t in zip(state.rows, tokens.tolist())]
        return torch.stack([model.logits(s, p) for s, p in state.rows])

    sources = [0, 1]
    K = V**L  # every candidate of every step ranks among the first K: nothing is ever dropped
    got = search_over(step, torch.stack([model.logits(s, ()) for s in sources]), PrefixState(sources),
                      num_beams=K, max_new_tokens=L, eos_token_ids=[eos], length_penalty=length_penalty,
                      early_stopping=early_stopping, num_return_sequences=K)
    for b, s in enumerate(sources):
        # every complete sequence: ended by EOS before L tokens, or L tokens long
        complete = {seq[: seq.index(eos) + 1] if eos in seq else seq for seq in itertools.product(range(V), repeat=L)}
        want = sorted(((model.logp(s, seq) / len(seq) ** length_penalty, seq) for seq in complete), reverse=True)
        assert [tuple(h.token_ids) for h in got[b]] == [seq for _, seq in want]
        assert [h.score for h in got[b]] == pytest.approx([score for score, _ in want], abs=1e-12)
        for h in got[b]:
            assert h.logprob == pytest.approx(model.logp(s, tuple(h.token_ids)), abs=1e-12)
            assert sum(h.token_logprobs) == pytest.approx(h.logprob, abs=1e-12)


def test_beam_search_takes_no_candidate_from_a_beam_that_does_not_exist():
    """A vocabulary smaller than the beam: the missing beams score -inf and are never returned."""
    model = PrefixModel(3, seed=1)

    def step(tokens, state):
        state.rows = [(s, p + (t,)) for (s, p), t in zip(state.rows, tokens.tolist())]
        return torch.stack([model.logits(s, p) for s, p in state.rows])

    got = search_over(step, model.logits(0, ())[None], PrefixState([0]), num_beams=20, max_new_tokens=2,
                      num_return_sequences=20)[0]
    assert sorted(tuple(h.token_ids) for h in got) == sorted(itertools.product(range(3), repeat=2))
    assert all(math.isfinite(h.score) for h in got)


def prefix_step(model: PrefixModel):
    def step(tokens: torch.Tensor, state: PrefixState) -> torch.Tensor:
        state.rows = [(s, p + (t,)) for (s, p), t in zip(state.rows, tokens.tolist())]
        return torch.stack([model.logits(s, p) for s, p in state.rows])

    return step


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_one_beam_is_the_stepwise_argmax_of_every_source_until_its_end_token(length_penalty):
    """num_beams=1 (greedy search, through the sampler's greedy case) against the
    argmax of each source's prefix recomputed by hand: tokens, log-probabilities, score, finish reason."""
    V, L, eos = 6, 7, 0
    model = PrefixModel(V, seed=3)
    sources = list(range(12))  # some end on EOS early, some run to max_new_tokens
    got = search_over(prefix_step(model), torch.stack([model.logits(s, ()) for s in sources]), PrefixState(sources),
                      num_beams=1, max_new_tokens=L, eos_token_ids=[eos], length_penalty=length_penalty)
    reasons = set()
    for b, s in enumerate(sources):
        seq: tuple[int, ...] = ()
        while len(seq) < L and (not seq or seq[-1] != eos):
            seq += (int(model.logits(s, seq).argmax()),)
        (hyp,) = got[b]
        assert tuple(hyp.token_ids) == seq
        assert hyp.finish_reason == ("stop" if seq[-1] == eos else "length")
        assert hyp.logprob == pytest.approx(model.logp(s, seq), abs=1e-12)
        assert hyp.score == pytest.approx(model.logp(s, seq) / len(seq) ** length_penalty, abs=1e-12)
        reasons.add(hyp.finish_reason)
    assert reasons == {"stop", "length"}  # both ways of ending were seen


# ------------------------------------------------------------------ encoder-decoder


def test_encoder_decoder_beam_search_equals_the_generic_search_before_the_merge():
    """The generic search before the merge, over the encoder-decoder's decoder step, one source at a time,
    gives the merged search's hypotheses for the whole batch (early_stopping='never', its stopping rule)."""
    torch.manual_seed(6)
    model = _peaked_model(vocab=20)
    src = torch.randint(2, 20, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0
    for K, lp in [(1, 0.0), (2, 1.0), (4, 0.0), (4, 1.0)]:
        new = seq2seq_beam_search(model, src, mask, bos_id=BOS, eos_id=EOS, max_new_tokens=8, num_beams=K,
                                  length_penalty=lp, early_stopping="never", num_return_sequences=K)
        for b in range(3):
            state = OldDecoderState(model, src[b : b + 1], mask[b : b + 1], 8)
            with torch.no_grad():
                first = state.step(torch.tensor([BOS]))
                old = old_generic_beam_search(lambda tok, st: st.step(tok), first, state, num_beams=K,
                                              max_new_tokens=8, eos_token_ids=[EOS], length_penalty=lp)
            assert [h.token_ids for h in new[b]] == [o[0] for o in old]
            assert [h.score for h in new[b]] == pytest.approx([o[3] for o in old], abs=1e-9)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_encoder_decoder_beam_search_equals_the_seq2seq_search_before_the_merge_when_exhaustive(length_penalty):
    """The seq2seq search before the merge also took EOS extensions ranked below the first K; with a beam
    wide enough to keep every candidate that rule cannot matter, and both return the same best sequence."""
    torch.manual_seed(3)
    model = _peaked_model(vocab=5)
    src = torch.randint(2, 5, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0
    old = old_seq2seq_beam_search(model, src, mask, bos_id=BOS, eos_id=EOS, max_new_tokens=3, beam_size=125,
                                  length_penalty=length_penalty)
    for early_stopping in (False, True, "never"):
        new = seq2seq_beam_search(model, src, mask, bos_id=BOS, eos_id=EOS, max_new_tokens=3, num_beams=125,
                                  length_penalty=length_penalty, early_stopping=early_stopping)
        assert [h[0].output_ids for h in new] == [o[0] for o in old]
        assert [h[0].score for h in new] == pytest.approx([o[1] for o in old], abs=1e-9)

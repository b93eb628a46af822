"""Encoder-decoder decoding (greedy, beam search against brute force), the synthetic tasks, and learning."""

from __future__ import annotations

import itertools

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.data.synthetic_tasks import TASKS, Reverse, TaskData, task_tokenizer
from tinyformer.generation.seq2seq import beam_search, greedy_decode
from tinyformer.models.seq2seq import Seq2SeqModel
from tinyformer.training.objectives.seq2seq import exact_match, make_batch

BOS, EOS = 0, 1


def _peaked_model(vocab: int = 5, placement: str = "post") -> Seq2SeqModel:
    """Random weights with a large init, so next-token distributions are far from uniform and differ by prefix."""
    cfg = ModelConfig(arch="encoder_decoder", vocab_size=vocab, d_model=32, n_layer=2, n_head=4, d_ff=64,
                      max_seq_len=16, norm="layernorm", norm_placement=placement, final_norm=placement == "pre",
                      pos="sinusoidal", embed_scale=True, ffn="relu", init_std=0.3)
    return Seq2SeqModel(cfg).double().eval()


def _brute_force_best(model, src, mask, max_new: int, length_penalty: float) -> tuple[list[int], float]:
    """Score every possible output (each prefix of non-EOS tokens ended by EOS, or cut at max_new) by one
    batched teacher-forced forward pass, and return the best: no cache, no search."""
    other = [t for t in range(model.cfg.vocab_size) if t != EOS]  # BOS may be generated too
    candidates = [(list(p), n < max_new) for n in range(max_new + 1) for p in itertools.product(other, repeat=n)]
    targets = [tokens + ([EOS] if ended else []) for tokens, ended in candidates]
    T = max(map(len, targets))
    tgt_in = torch.tensor([[BOS, *t[:-1]] + [BOS] * (T - len(t)) for t in targets])
    n = len(targets)
    with torch.no_grad():
        logp = torch.log_softmax(model(src.expand(n, -1), tgt_in, src_mask=mask.expand(n, -1)), dim=-1)
    best: tuple[list[int], float] = ([], float("-inf"))
    for i, t in enumerate(targets):
        score = float(sum(logp[i, j, y] for j, y in enumerate(t))) / len(t) ** length_penalty
        if score > best[1]:
            best = (candidates[i][0], score)
    return best


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_search_wide_enough_finds_the_brute_force_optimum(length_penalty):
    torch.manual_seed(3)
    model = _peaked_model()
    src = torch.randint(2, 5, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0
    # 5^3 beams: every candidate of every step ranks among the first K, so nothing is dropped
    hyps = beam_search(model, src, mask, bos_id=BOS, eos_id=EOS, max_new_tokens=3, num_beams=125,
                       length_penalty=length_penalty)
    for b in range(3):
        tokens, score = _brute_force_best(model, src[b : b + 1], mask[b : b + 1], 3, length_penalty)
        assert hyps[b][0].output_ids == tokens
        assert hyps[b][0].score == pytest.approx(score, abs=1e-9)


def test_narrow_beam_never_beats_the_optimum_and_greedy_equals_stepwise_argmax():
    torch.manual_seed(4)
    model = _peaked_model(vocab=7, placement="pre")
    src = torch.randint(2, 7, (4, 5))
    # 7^2 beams keep every candidate of two steps, so `wide` is the exact optimum
    wide = beam_search(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=2, num_beams=49)
    narrow = beam_search(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=2, num_beams=2)
    assert all(n[0].score <= w[0].score + 1e-9 for n, w in zip(narrow, wide))
    greedy = greedy_decode(model, src, bos_id=BOS, eos_id=EOS, max_new_tokens=6)
    for b in range(4):  # recompute every step from scratch, without the KV cache
        out: list[int] = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(src[b : b + 1], torch.tensor([[BOS, *out]]))[0, -1].argmax())
                if nxt == EOS:
                    break
                out.append(nxt)
        assert greedy[b] == out


def test_tasks_produce_correct_targets_and_keep_heldout_sources_out_of_training():
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        src, tgt = TASKS["add"].example(g)
        a, b = src.split("+")
        assert int(tgt) == int(a) + int(b) and not (a.startswith("0") and a != "0")
        src, tgt = TASKS["sort"].example(g)
        assert tgt == "".join(sorted(src)) and 1 <= len(src) <= 12
        src, tgt = TASKS["reverse"].example(g)
        assert tgt == src[::-1]
    data = TaskData(Reverse("reverse", "", 3, 4), n_heldout=200)  # 11,000 sources: collisions are certain
    held = {s for s, _ in data.heldout if len(s) == 4}
    trained = {s for s, _ in data.train_examples(3000, g)}
    assert not held & trained  # long held-out sources never reach training
    assert {s for s, _ in data.heldout if len(s) == 3} & trained  # the 1000 short ones are all fair game
    batch = make_batch([("12", "21"), ("3", "3")], task_tokenizer())
    tok = task_tokenizer()
    assert batch["src_mask"].tolist() == [[1, 1], [1, 0]]
    assert batch["tgt_in"][1].tolist() == [tok.bos_id, tok.encode("3")[0], tok.pad_id]
    assert batch["tgt_out"][1].tolist() == [tok.encode("3")[0], tok.eos_id, -100]



def test_encoder_decoder_learns_to_reverse_short_digit_strings(one_thread):
    """A short run (150 steps) takes held-out exact match from 0 to well above chance (~1e-5)."""
    torch.manual_seed(0)
    tok = task_tokenizer()
    data = TaskData(Reverse("reverse", "", 1, 5), n_heldout=200)
    cfg = ModelConfig(arch="encoder_decoder", vocab_size=tok.vocab_size, d_model=64, n_layer=2, n_head=4, d_ff=128,
                      max_seq_len=16, norm="layernorm", norm_placement="pre", pos="sinusoidal", embed_scale=True,
                      ffn="relu", attn_bias=True, attn_out_bias=True, mlp_bias=True)
    model = Seq2SeqModel(cfg)
    before = exact_match(model, tok, data.heldout)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.98), weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for step in range(1, 151):
        for group in opt.param_groups:
            group["lr"] = 2e-3 * min(1.0, step / 20)
        b = make_batch(data.train_examples(32, g), tok)
        loss = model.loss(b["src_ids"], b["tgt_in"], b["tgt_out"], b["src_mask"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = exact_match(model, tok, data.heldout)
    assert before < 0.05 and after > 0.3, (before, after)

import pytest
import torch

from tinyformer.config import ModelConfig
from tinyformer.models.decoder import DecoderLM


@pytest.mark.parametrize("n_kv", [4, 2], ids=["mha", "gqa"])
def test_kv_cached_decoding_equals_full_forward(n_kv):
    cfg = ModelConfig(vocab_size=97, d_model=64, n_layer=3, n_head=4, n_kv_head=n_kv, max_seq_len=40)
    model = DecoderLM(cfg).eval()
    x = torch.randint(0, 97, (3, 17))
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(3)
        # a prefill of 5 tokens, then one token at a time
        steps = [model(x[:, :5], cache=cache)]
        steps += [model(x[:, t : t + 1], cache=cache) for t in range(5, 17)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 17


def test_left_padded_batch_equals_unpadded_rows():
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=32)
    model = DecoderLM(cfg).eval()
    rows = [torch.randint(0, 50, (n,)) for n in (10, 6, 3)]
    T = 10
    ids = torch.zeros(3, T, dtype=torch.long)
    am = torch.zeros(3, T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = r
        am[i, T - len(r) :] = 1
    with torch.no_grad():
        batched = model(ids, attention_mask=am)
        for i, r in enumerate(rows):
            alone = model(r[None])
            torch.testing.assert_close(batched[i, T - len(r) :], alone[0], atol=1e-5, rtol=1e-5)


def test_context_overflow_is_an_error_not_silent():
    from tinyformer.errors import GenerationError

    cfg = ModelConfig(vocab_size=20, d_model=16, n_layer=1, n_head=2, max_seq_len=8)
    model = DecoderLM(cfg)
    with pytest.raises(GenerationError, match="max_seq_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_tied_head_shares_the_embedding_tensor():
    cfg = ModelConfig(vocab_size=20, d_model=16, n_layer=1, n_head=2, max_seq_len=8, tie_embeddings=True)
    model = DecoderLM(cfg)
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    untied = DecoderLM(cfg.replace(tie_embeddings=False))
    assert untied.num_params() == model.num_params() + 20 * 16


def test_residual_projection_init_is_scaled_by_depth():
    cfg = ModelConfig(vocab_size=64, d_model=256, n_layer=8, n_head=4, max_seq_len=8, init_std=0.02)
    model = DecoderLM(cfg)
    out_std = float(model.blocks[0].attn.out.weight.detach().std())
    qkv_std = float(model.blocks[0].attn.qkv.weight.detach().std())
    assert abs(qkv_std - 0.02) < 0.002
    assert abs(out_std - 0.02 / (2 * 8) ** 0.5) < 0.001


def test_tiny_model_overfits_a_fixed_batch():
    # 4 sequences of 32 random tokens over a vocab of 32: an untrained model scores ln(32) = 3.47 nats.
    # Memorising them is possible (the model has far more parameters than the 128 targets), so a
    # model that learns must drive the loss towards 0; 0.1 nats is 35x below chance.
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=32, d_model=64, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=33)
    model = DecoderLM(cfg)
    data = torch.randint(0, 32, (4, 33))
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = float(model.loss(x, y))
    assert abs(first - torch.log(torch.tensor(32.0)).item()) < 0.3
    for _ in range(150):
        opt.zero_grad()
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
    assert float(loss) < 0.1


def test_forward_is_compilable_without_graph_breaks():
    cfg = ModelConfig(vocab_size=32, d_model=32, n_layer=1, n_head=4, n_kv_head=2, max_seq_len=16)
    model = DecoderLM(cfg)
    explanation = torch._dynamo.explain(model)(torch.randint(0, 32, (2, 8)))
    assert explanation.graph_break_count == 0, explanation.break_reasons


def test_per_row_cache_positions_equal_separate_decoding():
    """Continuous batching: rows at different positions decode together like each alone."""
    cfg = ModelConfig(vocab_size=60, d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=32)
    model = DecoderLM(cfg).eval()
    prompts = [torch.randint(0, 60, (n,)) for n in (9, 4, 6)]
    nxt = torch.randint(0, 60, (3,))
    with torch.no_grad():
        cache = model.new_cache(3)
        for i, p in enumerate(prompts):  # prefill each request into its own slot
            model(p[None], cache=cache.row_view(i))
        pos = torch.tensor([len(p) for p in prompts])
        step = model(nxt[:, None], cache=cache.at(pos))
        for i, p in enumerate(prompts):
            alone = model(torch.cat([p, nxt[i : i + 1]])[None])[0, -1]
            torch.testing.assert_close(step[i, 0], alone, atol=1e-5, rtol=1e-5)

"""The classic family's building blocks against their formulas, and who attends to whom in each stack."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tinyformer.components.block import Block
from tinyformer.components.cross_attention import CrossAttention, source_padding_mask
from tinyformer.components.positions import sinusoidal_table
from tinyformer.config import ModelConfig
from tinyformer.errors import ConfigError
from tinyformer.models import build_model
from tinyformer.models.decoder import DecoderLM
from tinyformer.models.encoder import EncoderModel, pool
from tinyformer.models.seq2seq import Seq2SeqModel
from tinyformer.sizing import count_params

SMALL = dict(vocab_size=40, d_model=32, n_layer=2, n_head=4, d_ff=64, max_seq_len=32)


def test_sinusoidal_table_equals_the_papers_formula():
    length, d = 50, 16
    table = sinusoidal_table(length, d)
    for pos in range(length):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def _layer_norm(x, ln):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def _attention(x, attn, causal):
    """softmax(Q K^T / sqrt(d_h) + M) V W_o + b_o, written out head by head."""
    B, T, d = x.shape
    q, k, v = (x @ attn.qkv.weight.T + attn.qkv.bias).split(d, dim=-1)
    heads = []
    for h in range(attn.n_head):
        sl = slice(h * attn.head_dim, (h + 1) * attn.head_dim)
        scores = q[..., sl] @ k[..., sl].transpose(1, 2) / math.sqrt(attn.head_dim)
        if causal:
            scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(torch.softmax(scores, dim=-1) @ v[..., sl])
    return torch.cat(heads, dim=-1) @ attn.out.weight.T + attn.out.bias


def _mlp(x, ffn):
    return F.gelu(x @ ffn.up.weight.T + ffn.up.bias) @ ffn.down.weight.T + ffn.down.bias


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_block_equals_its_norm_placement_formula(placement):
    cfg = ModelConfig(**SMALL, norm="layernorm", norm_placement=placement, pos="learned", ffn="gelu",
                      attn_bias=True, attn_out_bias=True, mlp_bias=True)
    block = Block(cfg, causal=True).double()
    with torch.no_grad():
        for p in block.parameters():  # non-trivial gains and biases, so a swapped norm cannot hide
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        got = block(x)
        if placement == "post":  # Norm(x + F(x)) per sublayer
            h = _layer_norm(x + _attention(x, block.attn, True), block.attn_norm)
            want = _layer_norm(h + _mlp(h, block.ffn), block.ffn_norm)
        else:  # x + F(Norm(x))
            h = x + _attention(_layer_norm(x, block.attn_norm), block.attn, True)
            want = h + _mlp(_layer_norm(h, block.ffn_norm), block.ffn)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


# ----------------------------------------------------------------------------------------- who sees whom


def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per position (B, T): did the output move?"""
    return (a - b).abs().amax(dim=-1) > 1e-9


def test_encoder_attends_both_ways_and_never_to_padding():
    cfg = ModelConfig(arch="encoder", **SMALL, norm="layernorm", norm_placement="post", pos="learned", ffn="gelu",
                      type_vocab_size=2, embed_norm=True, final_norm=False)
    model = EncoderModel(cfg).double().eval()
    x = torch.randint(0, 40, (1, 10))
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[0, 7:] = 0  # three padding positions at the end
    with torch.no_grad():
        base = model(x, attention_mask=mask)
        for j in range(7):  # a real token changes every real position, before and after it
            y = x.clone()
            y[0, j] = (y[0, j] + 1) % 40
            assert _changed(model(y, attention_mask=mask), base)[0, :7].all(), f"token {j} not seen by all"
        for j in range(7, 10):  # a padding token changes no real position
            y = x.clone()
            y[0, j] = (y[0, j] + 1) % 40
            assert not _changed(model(y, attention_mask=mask), base)[0, :7].any()


def test_decoder_attends_only_to_the_past():
    cfg = ModelConfig(**SMALL, norm="layernorm", pos="learned", ffn="gelu")
    model = DecoderLM(cfg).double().eval()
    x = torch.randint(0, 40, (1, 9))
    with torch.no_grad():
        base = model(x)
        for j in range(9):
            y = x.clone()
            y[0, j] = (y[0, j] + 1) % 40
            changed = _changed(model(y), base)[0]
            assert not changed[:j].any() and changed[j:].all(), f"perturbing {j}: {changed.tolist()}"


def _seq2seq(placement: str = "post") -> Seq2SeqModel:
    cfg = ModelConfig(arch="encoder_decoder", **SMALL, norm="layernorm", norm_placement=placement,
                      final_norm=placement == "pre", pos="sinusoidal", embed_scale=True, ffn="relu",
                      attn_bias=True, attn_out_bias=True, mlp_bias=True)
    return Seq2SeqModel(cfg).double().eval()


def test_cross_attention_sees_every_non_padding_source_token_and_decoder_only_the_past():
    model = _seq2seq()
    src = torch.randint(0, 40, (1, 8))
    src_mask = torch.ones(1, 8, dtype=torch.long)
    src_mask[0, 6:] = 0
    tgt = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        base = model(src, tgt, src_mask=src_mask)
        for j in range(8):
            s = src.clone()
            s[0, j] = (s[0, j] + 1) % 40
            changed = _changed(model(s, tgt, src_mask=src_mask), base)[0]
            if j < 6:  # every target position reads every real source token
                assert changed.all(), f"source token {j} not seen by every target position"
            else:  # source padding is invisible
                assert not changed.any(), f"padding source token {j} leaked"
        for j in range(6):
            t = tgt.clone()
            t[0, j] = (t[0, j] + 1) % 40
            changed = _changed(model(src, t, src_mask=src_mask), base)[0]
            assert not changed[:j].any() and changed[j:].all()


def _cross_case(n_kv_head: int, impl: str):
    """A CrossAttention with random biases, decoder stream x (2, 5, d), memory m (2, 7, d), and a source
    mask whose second row ends in 3 padding positions."""
    cfg = ModelConfig(**SMALL, n_kv_head=n_kv_head, attn_bias=True, attn_out_bias=True, attn_impl=impl)
    attn = CrossAttention(cfg).double().eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x, m = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 7, 32, dtype=torch.float64)
    src_mask = torch.ones(2, 7, dtype=torch.long)
    src_mask[1, 4:] = 0
    return attn, x, m, src_mask


@pytest.mark.parametrize("impl", ["reference", "sdpa"])
@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_cross_attention_equals_its_formula_in_float64(n_kv_head, impl, one_thread):
    """softmax((x W_q)(m W_k)^T / sqrt(d_h) + M_src)(m W_v) W_o, written out head by head: queries from the
    decoder stream, keys and values from the memory, no causal mask, -inf on source padding only."""
    attn, x, m, src_mask = _cross_case(n_kv_head, impl)
    d_h, kv_size = attn.head_dim, attn.kv_size
    q = x @ attn.q.weight.T + attn.q.bias
    w_k, w_v = attn.kv.weight.split(kv_size)
    b_k, b_v = attn.kv.bias.split(kv_size)
    k, v = m @ w_k.T + b_k, m @ w_v.T + b_v
    want = torch.zeros(2, 5, attn.q_size, dtype=torch.float64)
    for b in range(2):
        for h in range(attn.n_head):
            g = h // (attn.n_head // n_kv_head)
            qs, ks, vs = (slice(h * d_h, (h + 1) * d_h), slice(g * d_h, (g + 1) * d_h), slice(g * d_h, (g + 1) * d_h))
            s = q[b, :, qs] @ k[b, :, ks].T / math.sqrt(d_h)  # (T, S): every target row sees the whole source
            s = s.masked_fill(src_mask[b] == 0, float("-inf"))
            want[b, :, qs] = torch.softmax(s, dim=-1) @ v[b, :, vs]
    want = want @ attn.out.weight.T + attn.out.bias
    with torch.no_grad():
        got = attn(x, attn.project_memory(m), source_padding_mask(src_mask))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_cross_attention_equals_transformers_bart_cross_attention(one_thread):
    """The same weights in Hugging Face's BartAttention (is_decoder, key_value_states = encoder output)."""
    modeling_bart = pytest.importorskip("transformers.models.bart.modeling_bart")
    from transformers import BartConfig

    attn, x, m, src_mask = _cross_case(4, "sdpa")
    config = BartConfig(d_model=32, decoder_attention_heads=4, encoder_attention_heads=4, attention_dropout=0.0)
    config._attn_implementation = "eager"
    hf = modeling_bart.BartAttention(32, 4, is_decoder=True, bias=True, config=config).double().eval()
    w_k, w_v = attn.kv.weight.split(attn.kv_size)
    b_k, b_v = attn.kv.bias.split(attn.kv_size)
    with torch.no_grad():
        for proj, w, b in ((hf.q_proj, attn.q.weight, attn.q.bias), (hf.k_proj, w_k, b_k), (hf.v_proj, w_v, b_v),
                           (hf.out_proj, attn.out.weight, attn.out.bias)):
            proj.weight.copy_(w)
            proj.bias.copy_(b)
        additive = torch.zeros(2, 1, 5, 7, dtype=torch.float64).masked_fill(
            src_mask[:, None, None, :] == 0, torch.finfo(torch.float64).min)
        want = hf(x, key_value_states=m, attention_mask=additive)[0]
        got = attn(x, attn.project_memory(m), source_padding_mask(src_mask))
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def _jacobian(f, x: torch.Tensor) -> torch.Tensor:
    """d f(x) / d x flattened to (n, n), n = x.numel()."""
    return torch.autograd.functional.jacobian(f, x).reshape(x.numel(), x.numel())


def test_residual_block_jacobian_is_identity_plus_the_branch_jacobians(one_thread):
    """Pre-Norm y = h + FFN(Norm(h)), h = x + Attn(Norm(x)): dy/dx = (I + dFFN/dh)(I + dAttn/dx). With the
    output projections zero the branches add nothing and dy/dx = I exactly: the identity path. Post-Norm
    with the same zero projections is LayerNorm(x), whose Jacobian is not I (it removes each token's mean)."""
    cfg = ModelConfig(**SMALL, norm="layernorm", pos="learned", ffn="gelu", attn_bias=True, attn_out_bias=True,
                      mlp_bias=True)
    block = Block(cfg, causal=True).double()
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(1, 2, 32, dtype=torch.float64)
    eye = torch.eye(x.numel(), dtype=torch.float64)

    def attn_branch(x):
        return block.attn(block.attn_norm(x))

    def ffn_branch(h):
        return block.ffn(block.ffn_norm(h))

    h = (x + attn_branch(x)).detach()
    chain = (eye + _jacobian(ffn_branch, h)) @ (eye + _jacobian(attn_branch, x))
    torch.testing.assert_close(_jacobian(block, x), chain, atol=1e-10, rtol=1e-8)
    assert (chain - eye).abs().max() > 1e-2  # the branches do contribute

    post = Block(cfg.replace(norm_placement="post"), causal=True).double()
    post.load_state_dict(block.state_dict())
    for b in (block, post):
        with torch.no_grad():
            for lin in (b.attn.out, b.ffn.down):
                lin.weight.zero_()
                lin.bias.zero_()
    assert torch.equal(_jacobian(block, x), eye)
    post_jac = _jacobian(post, x)
    shift = torch.ones(2, 32, dtype=torch.float64).flatten()  # add the same constant to every feature
    assert post_jac.matmul(shift).abs().max() < 1e-10 and not torch.allclose(post_jac, eye, atol=1e-2)


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_incremental_decoding_with_kv_cache_equals_teacher_forcing(placement):
    model = _seq2seq(placement)
    src = torch.randint(0, 40, (3, 9))
    src_mask = torch.ones(3, 9, dtype=torch.long)
    src_mask[1, 5:] = 0
    tgt = torch.randint(0, 40, (3, 7))
    with torch.no_grad():
        full = model(src, tgt, src_mask=src_mask)
        cross = model.cross_kv(model.encode(src, src_mask))  # once per source
        cache = model.new_cache(3, 7)
        prefix = model.lm_head(model.decode(tgt[:, :3], cross, src_mask, cache))  # a 3-token prefill ...
        steps = [model.lm_head(model.decode(tgt[:, i : i + 1], cross, src_mask, cache)) for i in range(3, 7)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, atol=1e-10, rtol=1e-10)
    assert cache.length == 7


# ----------------------------------------------------------------------------------------- options


OPTIONS = {
    "rmsnorm-rope-swiglu-gqa": dict(norm="rmsnorm", pos="rope", ffn="swiglu", n_kv_head=2),
    "layernorm-nobias-learned-gelu": dict(norm="layernorm", norm_bias=False, pos="learned", ffn="gelu"),
    "post-sinusoidal-relu-scaled": dict(norm="layernorm", norm_placement="post", final_norm=False, pos="sinusoidal",
                                        ffn="relu", embed_scale=True, attn_bias=True, attn_out_bias=True,
                                        mlp_bias=True),
    "nopos-gelu-tanh-untied-dropout": dict(pos="none", ffn="gelu_tanh", tie_embeddings=False, dropout=0.1,
                                           attn_dropout=0.1, embd_dropout=0.1, mlp_bias=True),
}
ARCH_OPTIONS = {
    "decoder": {},
    "encoder": dict(type_vocab_size=3, embed_norm=True, pooler=True, mlm_head=True),
    "encoder_decoder": dict(n_encoder_layer=3, embed_norm=True, share_src_tgt_embeddings=False),
}


def _forward(model, x):
    if isinstance(model, Seq2SeqModel):
        return model(x, x[:, :5])
    if isinstance(model, EncoderModel):  # MLM logits and the pooler output, so every parameter is used
        types = torch.arange(x.numel()).view(x.shape) % 3
        h = model(x, token_type_ids=types)
        return torch.cat([model.lm_head(model.mlm_head(h)).flatten(), model.pooled(h).flatten()])
    return model(x)


@pytest.mark.parametrize("arch", list(ARCH_OPTIONS))
@pytest.mark.parametrize("option", list(OPTIONS))
def test_every_option_works_in_every_stack(arch, option):
    """Each option builds, runs forward and backward, counts exactly, and the fused attention kernel
    agrees with the explicit formula."""
    cfg = ModelConfig(arch=arch, **{**SMALL, **OPTIONS[option], **ARCH_OPTIONS[arch]})
    model = build_model(cfg)
    with torch.device("meta"):
        meta = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == sum(p.numel() for p in meta.parameters()) == count_params(cfg).total
    x = torch.randint(0, 40, (2, 9))
    model.train()
    out = _forward(model, x)
    assert torch.isfinite(out).all()
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    reference = build_model(cfg.replace(attn_impl="reference"))
    reference.load_state_dict(model.state_dict())
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(_forward(model, x), _forward(reference, x), atol=1e-5, rtol=1e-5)


def test_pooling_modes_follow_their_definitions():
    h = torch.randn(2, 4, 3)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    torch.testing.assert_close(pool(h, mask, "mean")[0], h[0, :2].mean(0))
    torch.testing.assert_close(pool(h, mask, "max")[0], h[0, :2].amax(0))
    torch.testing.assert_close(pool(h, mask, "cls"), h[:, 0])


@pytest.mark.parametrize("fields, field", [
    (dict(arch="decoder", type_vocab_size=2), "type_vocab_size"),
    (dict(arch="decoder", embed_norm=True), "embed_norm"),
    (dict(arch="encoder_decoder", pooler=True), "pooler"),
    (dict(arch="decoder", mlm_head=True), "mlm_head"),
    (dict(arch="encoder", share_src_tgt_embeddings=False), "share_src_tgt_embeddings"),
    (dict(arch="encoder", embed_norm="yes"), "embed_norm"),
])
def test_classic_config_fields_are_validated(fields, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**SMALL, **fields})


def test_encoder_config_round_trips_through_json():
    from tinyformer.presets import get_preset

    cfg = get_preset("bert-base")
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert cfg.embed_norm and cfg.pooler and not cfg.mlm_head


def test_sinusoidal_reset_buffers_after_a_meta_build_recomputes_the_table():
    from tinyformer.components.positions import SinusoidalPositions

    with torch.device("meta"):
        pe = SinusoidalPositions(50, 16)
    pe.reset_buffers("cpu")
    assert pe.table.device.type == "cpu"
    assert float(pe.table[7, 2]) == pytest.approx(math.sin(7 / 10000 ** (2 / 16)), abs=1e-6)
    assert float(pe.table[7, 3]) == pytest.approx(math.cos(7 / 10000 ** (2 / 16)), abs=1e-6)

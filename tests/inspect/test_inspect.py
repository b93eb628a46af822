"""`tinyformer inspect` and tinyformer.inspect: the tensors behind the pictures, then the pictures themselves."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.components.attention import SelfAttention
from tinyformer.components.rope import RotaryEmbedding
from tinyformer.config import ModelConfig
from tinyformer.data.tokenizer import Tokenizer
from tinyformer.generation.sampling import SamplingParams
from tinyformer.inspect.attention_maps import CELL_INCHES, attention_maps, grid_size_inches
from tinyformer.inspect.next_token import distribution_from_logits
from tinyformer.inspect.plotting import DPI
from tinyformer.inspect.rope_plot import relative_dot_curve, rotate_over_positions
from tinyformer.inspect.token_loss import per_token_loss
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_model, save_model

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"
SMALL = dict(d_model=32, n_layer=2, n_head=4, n_kv_head=2, max_seq_len=96)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with a random tiny decoder and a char tokenizer."""
    folder = tmp_path_factory.mktemp("inspect") / "run"
    tok = Tokenizer.train_char(TEXT)
    torch.manual_seed(0)
    save_model(folder, DecoderLM(ModelConfig(vocab_size=tok.vocab_size, **SMALL)))
    tok.save(folder)
    return folder


CONFIGS = {
    "rope-gqa-sdpa": dict(SMALL, vocab_size=40),
    "rope-mqa-reference": dict(SMALL, vocab_size=40, n_kv_head=1, attn_impl="reference"),
    "learned-postnorm-mha": dict(SMALL, vocab_size=40, n_kv_head=4, pos="learned", norm="layernorm",
                                 norm_placement="post", ffn="gelu", attn_bias=True),
    "qknorm-scale-softcap-sandwich": dict(SMALL, vocab_size=40, qk_norm=True, attn_scale=0.2, attn_logit_softcap=0.5,
                                          norm_placement="sandwich", norm_gain_offset=1.0, sliding_window=16),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_attention_rows_sum_to_one_and_nothing_is_above_the_diagonal(name):
    cfg = ModelConfig(**CONFIGS[name])
    model = DecoderLM(cfg).eval()
    x = torch.randint(0, 40, (2, 11))
    maps = attention_maps(model, x)
    assert len(maps) == cfg.n_layer
    future = torch.ones(11, 11, dtype=torch.bool).triu(diagonal=1)
    for probs in maps:
        assert probs.shape == (2, cfg.n_head, 11, 11)
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, cfg.n_head, 11), atol=1e-6, rtol=0)
        assert (probs >= 0).all()
        assert torch.equal(probs[..., future], torch.zeros_like(probs[..., future]))
        assert (probs[..., ~future] > 0).all()  # a softmax never gives exactly 0 to a visible key
    for module in model.modules():  # the hooks are gone again
        assert not module._forward_pre_hooks


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_recomputed_probabilities_times_v_give_the_modules_own_output(name):
    """P @ V, heads merged, through W_o must equal what each attention module returned to its block."""
    cfg = ModelConfig(**CONFIGS[name])
    model = DecoderLM(cfg).eval()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def grab(module, args, output):
        seen.append((args[0], output))

    handles = [m.register_forward_hook(grab) for m in model.modules() if isinstance(m, SelfAttention)]
    x = torch.randint(0, 40, (2, 9))
    maps = attention_maps(model, x)
    for h in handles:
        h.remove()
    attns = [m for m in model.modules() if isinstance(m, SelfAttention)]
    for attn, probs, (inp, out) in zip(attns, maps, seen):
        B, T, _ = inp.shape
        v = attn.qkv(inp)[..., attn.q_size + attn.kv_size :]
        v = v.view(B, T, attn.n_kv_head, attn.head_dim).transpose(1, 2)
        v = v.repeat_interleave(attn.n_head // attn.n_kv_head, dim=1)
        y = (probs @ v).transpose(1, 2).reshape(B, T, attn.q_size)
        torch.testing.assert_close(attn.out(y), out, atol=2e-6, rtol=1e-5)


def test_padding_keys_get_zero_attention_from_real_tokens():
    model = DecoderLM(ModelConfig(**CONFIGS["rope-gqa-sdpa"])).eval()
    x = torch.randint(0, 40, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding of row 1
    for probs in attention_maps(model, x, attention_mask=mask):
        assert torch.equal(probs[1, :, 3:, :3], torch.zeros_like(probs[1, :, 3:, :3]))
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 8), atol=1e-6, rtol=0)


def _nucleus_bruteforce(logits: torch.Tensor, temperature: float, k: int, p: float) -> set[int]:
    """Top-k then top-p as the definitions say, one token at a time in float64."""
    probs = torch.softmax(logits.double() / temperature, -1).tolist()
    ranked = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    if k > 0:
        ranked = ranked[:k]
    mass = sum(probs[i] for i in ranked)
    kept, total = [], 0.0
    for i in ranked:
        kept.append(i)
        total += probs[i] / mass
        if total >= p:
            break
    return set(kept)


@pytest.mark.parametrize("temperature,k,p", [(1.0, 0, 0.9), (0.7, 10, 0.8), (1.5, 5, 1.0), (1.0, 0, 0.3)])
def test_next_token_kept_set_is_the_top_k_top_p_set(temperature, k, p):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, generator=gen) * 2
    dist = distribution_from_logits(logits, SamplingParams(temperature=temperature, top_k=k, top_p=p))
    assert set(torch.nonzero(dist.kept).flatten().tolist()) == _nucleus_bruteforce(logits, temperature, k, p)
    torch.testing.assert_close(dist.probs, torch.softmax(logits / temperature, -1))
    want = torch.where(dist.kept, dist.probs, torch.zeros(50))
    torch.testing.assert_close(dist.sampled, want / want.sum())


def test_greedy_keeps_only_the_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    for params in (SamplingParams(temperature=0.0), SamplingParams(top_k=1)):
        dist = distribution_from_logits(logits, params)
        assert dist.kept.tolist() == [False, True, False, False]


def test_per_token_loss_is_the_cross_entropy_the_model_trains_on():
    model = DecoderLM(ModelConfig(**CONFIGS["rope-gqa-sdpa"])).eval()
    x = torch.randint(0, 40, (1, 12))
    losses = per_token_loss(model, x)
    assert losses.shape == (11,)
    with torch.no_grad():  # the model's fused head + cross-entropy (components/loss.py) is the reference
        mean = model.loss(x[:, :-1], x[:, 1:])
        first = -torch.log_softmax(model(x[:, :1])[0, 0].double(), -1)[x[0, 1]]
    assert float(losses.mean()) == pytest.approx(float(mean), rel=1e-5)
    assert float(losses[0]) == pytest.approx(float(first), rel=1e-5)


def test_rope_curve_is_the_sum_of_cosines_and_pairs_keep_their_length():
    cfg = ModelConfig(vocab_size=10, d_model=64, n_head=4, max_seq_len=300, rope_theta=10000.0)  # d_head 16
    rope = RotaryEmbedding(cfg)
    ones = torch.ones(16, dtype=torch.float64)
    curve = relative_dot_curve(rope, ones, ones, 300)
    theta = torch.tensor([10000.0 ** (-2 * i / 16) for i in range(8)], dtype=torch.float64)
    want = torch.stack([2 * torch.cos(m * theta).sum() for m in range(300)])
    torch.testing.assert_close(curve, want, atol=1e-4, rtol=1e-4)
    rotated = rotate_over_positions(rope, torch.randn(16, dtype=torch.float64), 50)
    pair_len = rotated[:, :8] ** 2 + rotated[:, 8:] ** 2  # half split: dimension i pairs with i + 8
    torch.testing.assert_close(pair_len, pair_len[:1].expand(50, -1), atol=1e-5, rtol=1e-5)


def _image(path: Path):
    import matplotlib.image as mpimg

    img = mpimg.imread(str(path))
    gray = img[..., :3].mean(-1)
    return img, gray


def test_every_picture_is_written_with_its_size_and_is_not_blank(run, tmp_path, capsys):
    from tinyformer.inspect import next_token, rope_plot, token_loss

    out = tmp_path / "pictures"
    prompt = "To be, or not to be"
    assert main(["inspect", "--model", str(run), "--prompt", prompt, "--out", str(out), "--top-k", "8",
                 "--top-p", "0.9"]) == 0
    printed = capsys.readouterr().out
    n = len(prompt)  # char tokenizer: one token per character
    expected_inches = {
        "attention.png": grid_size_inches(SMALL["n_layer"], SMALL["n_head"]),
        "next_token.png": next_token.FIGSIZE,
        "token_loss.png": (token_loss.figure_width_inches(n - 1), token_loss.HEIGHT_INCHES),
        "rope.png": rope_plot.FIGSIZE,
    }
    for name, (w, h) in expected_inches.items():
        assert f"wrote {out / name}" in printed
        img, gray = _image(out / name)
        assert abs(img.shape[1] - w * DPI) <= 1 and abs(img.shape[0] - h * DPI) <= 1, (name, img.shape)
        assert gray.std() > 0.05, name  # not one flat colour
        assert (gray < 0.9).mean() > 0.02, name  # a real share of the pixels is drawn on
    # the grid has one cell per head (columns) and per layer (rows)
    assert grid_size_inches(2, 8)[0] - grid_size_inches(2, 4)[0] == pytest.approx(4 * CELL_INCHES)
    assert grid_size_inches(3, 4)[1] - grid_size_inches(2, 4)[1] == pytest.approx(CELL_INCHES)


def test_table_shows_the_models_softmax_probabilities(run, capsys):
    assert main(["inspect", "--model", str(run), "--prompt", "not to", "--no-plots", "--rows", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [ln for ln in lines if re.match(r"^\s+\d+\s+\d+\s", ln)]
    assert len(rows) == 5
    model = load_model(run)
    tok = Tokenizer.load(run / "tokenizer.json")
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([tok.encode("not to")]))[0, -1].double(), -1)
    top = torch.sort(probs, descending=True, stable=True).indices[:5].tolist()
    for row, tid in zip(rows, top):
        fields = row.split()
        assert int(fields[1]) == tid
        assert float(fields[3]) == pytest.approx(float(probs[tid]), abs=1e-4)
    assert math.isclose(sum(float(r.split()[3]) for r in rows), float(probs[top].sum()), abs_tol=5e-4)


@pytest.mark.parametrize(
    "args, message",
    [(["--model", "{tmp}/missing", "--prompt", "a"], "does not exist"),
     (["--model", "{run}", "--prompt", "a", "--top-p", "0"], "top_p"),
     (["--model", "{run}", "--prompt", ""], "empty"),
     (["--model", "{run}", "--prompt", "Zebra"], "not in the char tokenizer"),
     (["--model", "{run}", "--prompt", "a", "--rows", "0"], "--rows")],
)
def test_bad_input_is_one_line_and_exit_2(args, message, run, tmp_path, capsys):
    argv = ["inspect"] + [a.format(tmp=tmp_path, run=run) for a in args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_without_matplotlib_the_error_names_it_and_no_plots_still_works(run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main(["inspect", "--model", str(run), "--prompt", "to be", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "pip install" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    assert main(["inspect", "--model", str(run), "--prompt", "to be", "--no-plots"]) == 0
    assert "kept" in capsys.readouterr().out

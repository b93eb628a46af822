"""GPT-2 and BERT checkpoints (and sentence-transformers folders) against transformers / sentence-transformers.

Every model is built offline from a config with random weights (perturbed so that biases and norm gains
are not their trivial initial values), saved with the library's own save functions, imported, and compared.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tinyformer.cli.main import main
from tinyformer.config import ModelConfig
from tinyformer.interop.hf_folder import export_hf, import_hf
from tinyformer.models.decoder import DecoderLM
from tinyformer.run_folder import load_model, load_tokenizer, save_model

transformers = pytest.importorskip("transformers")


def _perturb(model: torch.nn.Module, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def _padded(vocab: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    if left:
        mask[1, :5] = 0
    else:
        mask[1, 8:] = 0
        mask[2, 11:] = 0
    return ids, mask


# ----------------------------------------------------------------------------------------- GPT-2

GPT2_CASES = {
    "gpt2": {},  # gelu_new (tanh GELU), tied head, n_inner = 4d
    "relu-untied-ninner": dict(activation_function="relu", tie_word_embeddings=False, n_inner=48,
                               layer_norm_epsilon=1e-6),
}


@pytest.mark.parametrize("case", list(GPT2_CASES))
def test_gpt2_import_gives_transformers_logits(case, tmp_path):
    config = transformers.GPT2Config(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, **GPT2_CASES[case])
    hf = transformers.GPT2LMHeadModel(config).eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    ours = load_model(tmp_path / "run")
    assert ours.cfg.ffn == ("gelu_tanh" if case == "gpt2" else "relu")
    ids, mask = _padded(96, left=True)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = ours(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4)


def test_gpt2_model_checkpoint_without_head_prefix_imports(tmp_path):
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2Model(config).eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path / "hf")  # names without "transformer.", architectures [GPT2Model]
    import_hf(tmp_path / "hf", tmp_path / "run")
    ours = load_model(tmp_path / "run")
    ids = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        want = hf(ids).last_hidden_state @ hf.wte.weight.T  # GPT-2's tied head on the final hidden states
        torch.testing.assert_close(ours(ids), want, atol=1e-4, rtol=1e-4)


def _label(folder, architecture):
    """Rewrite config.json's ``architectures`` as a Hub upload may state it, whatever class saved the tensors."""
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "architectures": [architecture]}))


def test_gpt2_checkpoint_saved_as_lm_head_model_without_the_prefix_imports_with_its_tied_head(tmp_path):
    # the Hub's gpt2 layout: config.json says GPT2LMHeadModel, the tensors are named without "transformer."
    config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, architectures=["GPT2LMHeadModel"])
    hf = transformers.GPT2LMHeadModel(config).eval()
    _perturb(hf)
    hf.transformer.save_pretrained(tmp_path / "hf")
    _label(tmp_path / "hf", "GPT2LMHeadModel")
    import_hf(tmp_path / "hf", tmp_path / "run")
    ids = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "run")(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_gpt2_style_model_exports_to_transformers(tmp_path):
    cfg = ModelConfig(vocab_size=96, d_model=64, n_layer=2, n_head=4, max_seq_len=32, norm="layernorm",
                      pos="learned", ffn="gelu_tanh", attn_bias=True, attn_out_bias=True, mlp_bias=True)
    model = DecoderLM(cfg).eval()
    _perturb(model)
    save_model(tmp_path / "run", model)
    export_hf(tmp_path / "run", tmp_path / "hf")
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == "gpt2" and hf_config["architectures"] == ["GPT2LMHeadModel"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------- BERT

BERT_CLASSES = ["BertModel", "BertForMaskedLM", "BertForPreTraining"]


def _bert_config(**overrides):
    fields = dict(vocab_size=80, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                  max_position_embeddings=40, type_vocab_size=2)
    return transformers.BertConfig(**{**fields, **overrides})


@pytest.mark.parametrize("name", BERT_CLASSES)
def test_bert_import_gives_transformers_hidden_states_and_heads(name, tmp_path):
    hf = getattr(transformers, name)(_bert_config()).eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "run")
    ours = load_model(tmp_path / "run")
    ids, mask = _padded(80, left=False)
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    with torch.no_grad():
        out = hf(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
        hidden = ours(ids, attention_mask=mask, token_type_ids=types)
    real = mask.bool()
    torch.testing.assert_close(hidden[real], out.hidden_states[-1][real], atol=1e-4, rtol=1e-4)
    if name == "BertModel":
        torch.testing.assert_close(ours.pooled(hidden), out.pooler_output, atol=1e-4, rtol=1e-4)
    else:
        logits = out.logits if name == "BertForMaskedLM" else out.prediction_logits
        with torch.no_grad():
            mlm = ours.mlm_logits(ids, attention_mask=mask, token_type_ids=types)
        torch.testing.assert_close(mlm[real], logits[real], atol=1e-4, rtol=1e-4)
    # and back: the exported folder loads in transformers with the same weights
    export_hf(tmp_path / "run", tmp_path / "back")
    again = getattr(transformers, name).from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        back = again(input_ids=ids, attention_mask=mask, token_type_ids=types, output_hidden_states=True)
    torch.testing.assert_close(back.hidden_states[-1][real], out.hidden_states[-1][real], atol=1e-5, rtol=1e-5)


def test_bert_pretraining_checkpoint_labelled_masked_lm_keeps_its_pooler(tmp_path):
    # bert-base-uncased's layout: config.json says BertForMaskedLM, the file holds the pre-training model's tensors
    hf = transformers.BertForPreTraining(_bert_config()).eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path / "hf")
    _label(tmp_path / "hf", "BertForMaskedLM")
    import_hf(tmp_path / "hf", tmp_path / "run")
    ours = load_model(tmp_path / "run")
    ids = torch.randint(0, 80, (2, 9))
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
        hidden = ours(ids)
        torch.testing.assert_close(hidden, out.hidden_states[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.mlm_logits(ids), out.prediction_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.pooled(hidden), hf.bert.pooler(hidden), atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------------------- sentence-transformers

WORDS = "the a cat dog sat on mat runs fast slow big small red blue bird sings loud quiet house".split()
TEXTS = ["the cat sat on the mat", "a big red dog runs fast", "blue", "the bird sings loud in the quiet house"]


def _wordpiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + WORDS + ["##s", "##ed", "in"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.decoder = decoders.WordPiece()
    fast = transformers.BertTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                          cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    return fast, len(vocab)


def _st_modules():
    """(Transformer, Pooling) module classes of sentence-transformers, new location first."""
    try:
        from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers.models import Pooling, Transformer
    return Transformer, Pooling


@pytest.fixture(scope="module")
def sentence_transformer(tmp_path_factory):
    """A SentenceTransformer (random BERT + WordPiece tokenizer + mean pooling) saved with its own save()."""
    st = pytest.importorskip("sentence_transformers")
    root = tmp_path_factory.mktemp("st")
    fast, vocab = _wordpiece_tokenizer()
    torch.manual_seed(0)
    bert = transformers.BertModel(_bert_config(vocab_size=vocab)).eval()
    _perturb(bert)
    bert.save_pretrained(root / "bert")
    fast.save_pretrained(root / "bert")
    transformer_cls, pooling_cls = _st_modules()
    transformer = transformer_cls(str(root / "bert"), max_seq_length=32)
    model = st.SentenceTransformer(modules=[transformer, pooling_cls(64, pooling_mode="mean")], device="cpu")
    model.save(str(root / "saved"))
    return model, root


def _cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


def test_sentence_transformers_folder_converts_on_the_command_line_and_reproduces_encode(
        sentence_transformer, tmp_path, capsys):
    from tinyformer.cli.embed import embed

    st_model, root = sentence_transformer
    want = st_model.encode(TEXTS, convert_to_tensor=True)
    # `convert --from-hf` recognises the folder by its modules.json and keeps the pooling
    assert main(["convert", "--from-hf", str(root / "saved"), "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    ours = load_model(tmp_path / "run")
    assert ours.cfg.extra["sentence_transformers"]["pooling"] == "mean"
    got = embed(ours, load_tokenizer(tmp_path / "run"), TEXTS)
    assert _cosine_rows(got, want).min() >= 0.9999
    # the command line prints the cosine-similarity matrix of the same vectors
    texts = [arg for t in TEXTS for arg in ("--text", t)]
    assert main(["embed", "--model", str(tmp_path / "run"), "--similarity", *texts]) == 0
    sim = torch.tensor(json.loads(capsys.readouterr().out)["similarity"], dtype=torch.float64)
    w = torch.nn.functional.normalize(want.double(), dim=-1)
    torch.testing.assert_close(sim, w @ w.T, atol=1e-4, rtol=0)


def test_legacy_sentence_transformers_layout_with_cls_pooling(sentence_transformer, tmp_path):
    """Older folders: the BERT under 0_Transformer/, pooling as pooling_mode_*_tokens flags."""
    st = pytest.importorskip("sentence_transformers")
    from tinyformer.cli.embed import embed
    from tinyformer.interop.hf_folder import import_sentence_transformers

    st_model, root = sentence_transformer
    legacy = tmp_path / "legacy"
    shutil.copytree(root / "bert", legacy / "0_Transformer")
    (legacy / "0_Transformer" / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 32}))
    (legacy / "1_Pooling").mkdir()
    (legacy / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}))
    (legacy / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    cls_model = st.SentenceTransformer(modules=[st_model[0], _st_modules()[1](64, pooling_mode="cls")], device="cpu")
    want = cls_model.encode(TEXTS, convert_to_tensor=True)
    import_sentence_transformers(legacy, tmp_path / "run")
    ours = load_model(tmp_path / "run")
    assert ours.cfg.extra["sentence_transformers"] == {"pooling": "cls", "normalize": False, "max_seq_length": 32}
    got = embed(ours, load_tokenizer(tmp_path / "run"), TEXTS)
    assert _cosine_rows(got, want).min() >= 0.9999


def test_saved_fixed_padding_in_a_sentence_transformers_folder_does_not_change_embeddings(
        sentence_transformer, tmp_path):
    """sentence-transformers folders ship tokenizer.json with `padding: Fixed 128`; embeddings must still
    equal SentenceTransformer.encode (which, through transformers, ignores the saved padding)."""
    from tinyformer.cli.embed import embed

    st_model, root = sentence_transformer
    folder = tmp_path / "padded"
    shutil.copytree(root / "saved", folder)
    files = sorted(folder.rglob("tokenizer.json"))
    assert files
    for file in files:
        spec = json.loads(file.read_text())
        spec["padding"] = {"strategy": {"Fixed": 128}, "direction": "Right", "pad_to_multiple_of": None,
                           "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"}
        spec["truncation"] = {"direction": "Right", "max_length": 128, "strategy": "LongestFirst", "stride": 0}
        file.write_text(json.dumps(spec))
    want = st_model.encode(TEXTS, convert_to_tensor=True)
    import_hf(folder, tmp_path / "run")
    got = embed(load_model(tmp_path / "run"), load_tokenizer(tmp_path / "run"), TEXTS)
    assert _cosine_rows(got, want).min() >= 0.9999


def test_embed_max_length_keeps_the_final_sep_like_sentence_transformers(sentence_transformer, tmp_path):
    from tinyformer.cli.embed import embed

    st_model, root = sentence_transformer
    import_hf(root / "saved", tmp_path / "run")
    old = st_model.max_seq_length
    st_model.max_seq_length = 5  # [CLS] + 3 words + [SEP]: every text but "blue" is cut
    try:
        want = st_model.encode(TEXTS, convert_to_tensor=True)
    finally:
        st_model.max_seq_length = old
    got = embed(load_model(tmp_path / "run"), load_tokenizer(tmp_path / "run"), TEXTS, max_length=5)
    assert _cosine_rows(got, want).min() >= 0.9999

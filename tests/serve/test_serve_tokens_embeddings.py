"""POST /tokenize, /detokenize and /v1/embeddings, and /v1/models' context length, over real HTTP.

Tokens are compared with the tokenizer itself; embeddings with what ``tinyformer embed`` prints for the same
texts and, for a run imported from a sentence-transformers folder, with ``SentenceTransformer.encode``. The
embeddings are requested with the official ``openai`` client (which asks for base64 by default) and with
httpx (both encodings).
"""

from __future__ import annotations

import base64
import codecs
import json
import string
import struct

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from serve_helpers import BackgroundServer  # noqa: E402

from tinyformer.cli.main import main  # noqa: E402
from tinyformer.config import ModelConfig  # noqa: E402
from tinyformer.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402
from tinyformer.models.decoder import DecoderLM  # noqa: E402
from tinyformer.models.encoder import EncoderModel  # noqa: E402
from tinyformer.run_folder import load_model, load_tokenizer, save_model  # noqa: E402
from tinyformer.serve.app import create_app  # noqa: E402

TEXTS = ["the cat sat on the mat", "a big red dog runs fast", "blue"]


@pytest.fixture(scope="module")
def decoder_server(tmp_path_factory):
    """A tiny decoder with a byte-level BPE (whose pieces can be parts of characters), served."""
    run = tmp_path_factory.mktemp("decoder")
    tok = Tokenizer.train_bpe(("tokens and pieces of text, " + string.ascii_letters) * 30, 300)
    torch.manual_seed(0)
    save_model(run, DecoderLM(ModelConfig(vocab_size=tok.vocab_size, d_model=32, n_layer=1, n_head=2,
                                          max_seq_len=48)))
    tok.save(run)
    with BackgroundServer(create_app(load_model(run), load_tokenizer(run), model_name="dec")) as srv:
        yield srv, load_tokenizer(run)


@pytest.fixture(scope="module")
def encoder_run(tmp_path_factory):
    """A tiny random encoder (the BERT recipe) with a char tokenizer, saved as a run folder."""
    run = tmp_path_factory.mktemp("encoder")
    tok = build_tokenizer("char", string.ascii_lowercase + " ")
    from tinyformer.presets import get_preset

    cfg = get_preset("bert-base", vocab_size=tok.vocab_size, d_model=32, n_layer=2, n_head=2, d_ff=64,
                     max_seq_len=24)
    torch.manual_seed(0)
    save_model(run, EncoderModel(cfg))
    tok.save(run)
    return run


@pytest.fixture(scope="module")
def encoder_server(encoder_run):
    app = create_app(load_model(encoder_run), load_tokenizer(encoder_run), model_name="enc")
    with BackgroundServer(app) as srv:
        yield srv


def _embed_cli(capsys, run, texts) -> torch.Tensor:
    """The vectors `tinyformer embed` prints (8 decimals)."""
    assert main(["embed", "--model", str(run), "--precision", "8", *[a for t in texts for a in ("--text", t)]]) == 0
    return torch.tensor([e["vector"] for e in json.loads(capsys.readouterr().out)["embeddings"]])


def _floats(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))  # little-endian float32, decoded independently


# ---------------------------------------------------------------------------------------------- tokens
def test_tokenize_gives_the_tokenizers_ids_and_their_pieces(decoder_server):
    srv, tok = decoder_server
    content = "tokens 注意 text"
    r = httpx.post(srv.url + "/tokenize", json={"content": content})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tok.encode(content)
    assert len(body["pieces"]) == len(body["tokens"])
    # the pieces, their \xNN escapes read back, are the content's bytes in order
    assert b"".join(codecs.escape_decode(p.encode("utf-8"))[0] for p in body["pieces"]) == content.encode("utf-8")
    # 注 is 3 bytes the corpus never had: its first byte is a piece of its own, written \xe6
    assert "\\xe6" in body["pieces"]


def test_detokenize_inverts_tokenize_special_tokens_included(decoder_server):
    srv, tok = decoder_server
    content = "<|bos|>pieces of 注意 text"
    ids = httpx.post(srv.url + "/tokenize", json={"content": content}).json()["tokens"]
    assert ids[0] == tok.bos_id
    r = httpx.post(srv.url + "/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"content": content}


def test_tokenize_add_special_applies_the_post_processor(encoder_server, encoder_run):
    tok = load_tokenizer(encoder_run)
    plain = httpx.post(encoder_server.url + "/tokenize", json={"content": "cat"}).json()
    special = httpx.post(encoder_server.url + "/tokenize", json={"content": "cat", "add_special": True}).json()
    assert plain["tokens"] == tok.encode("cat")
    assert special["tokens"] == tok.encode("cat", add_special_tokens=True)


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {}, "content"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_token_requests_are_400_naming_the_field(decoder_server, path, body, param):
    r = httpx.post(decoder_server[0].url + path, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param


def test_models_gives_the_context_length(decoder_server, encoder_server):
    client = openai.OpenAI(base_url=decoder_server[0].url + "/v1", api_key="-")
    assert client.models.list().data[0].model_extra["context_length"] == 48
    card = httpx.get(encoder_server.url + "/v1/models/enc").json()
    assert card["id"] == "enc" and card["context_length"] == 24


# ---------------------------------------------------------------------------------------------- embeddings
def test_embeddings_equal_tinyformer_embeds_for_the_openai_client_and_both_encodings(
        encoder_server, encoder_run, capsys):
    want = _embed_cli(capsys, encoder_run, TEXTS)
    client = openai.OpenAI(base_url=encoder_server.url + "/v1", api_key="-")
    got = client.embeddings.create(model="enc", input=TEXTS)  # the client asks for base64 and decodes it
    assert [d.index for d in got.data] == [0, 1, 2]
    torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), want, atol=1e-6, rtol=0)
    tok = load_tokenizer(encoder_run)
    assert got.usage.prompt_tokens == sum(len(tok.encode(t, add_special_tokens=True)) for t in TEXTS)
    for fmt in ("float", "base64"):
        r = httpx.post(encoder_server.url + "/v1/embeddings",
                       json={"model": "enc", "input": TEXTS[2], "encoding_format": fmt})
        assert r.status_code == 200
        body = r.json()
        assert body["object"] == "list" and body["model"] == "enc" and body["data"][0]["object"] == "embedding"
        vector = body["data"][0]["embedding"]
        vector = _floats(vector) if fmt == "base64" else vector
        torch.testing.assert_close(torch.tensor(vector), want[2], atol=1e-6, rtol=0)
        assert abs(sum(v * v for v in vector) - 1) < 1e-5  # unit length


def test_embeddings_of_token_ids_equal_those_of_the_text(encoder_server, encoder_run):
    tok = load_tokenizer(encoder_run)
    client = openai.OpenAI(base_url=encoder_server.url + "/v1", api_key="-")
    by_text = client.embeddings.create(model="enc", input=TEXTS[:2], encoding_format="float").data
    ids = [tok.encode(t, add_special_tokens=True) for t in TEXTS[:2]]
    by_ids = client.embeddings.create(model="enc", input=ids, encoding_format="float").data
    one = client.embeddings.create(model="enc", input=ids[0], encoding_format="float").data
    for a, b in zip(by_text, by_ids):
        torch.testing.assert_close(torch.tensor(a.embedding), torch.tensor(b.embedding), atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(one[0].embedding), torch.tensor(by_text[0].embedding), atol=1e-6, rtol=0)


@pytest.mark.parametrize("body,param", [
    ({"model": "enc", "input": ""}, "input"),
    ({"model": "enc", "input": []}, "input"),
    ({"model": "enc", "input": ["a", ""]}, "input"),
    ({"model": "enc", "input": [[1, 2], []]}, "input"),
    ({"model": "enc", "input": [99999]}, "input"),
    ({"model": "enc", "input": {"text": "a"}}, "input"),
    ({"model": "enc", "input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "enc", "input": "a", "dimensions": 7}, "dimensions"),
    ({"model": "enc", "input": "A"}, "input"),  # not in the char vocabulary
])
def test_bad_embedding_requests_are_400_naming_the_field(encoder_server, body, param):
    r = httpx.post(encoder_server.url + "/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_embeddings_of_a_decoder_and_generation_on_an_encoder_are_clear_400s(decoder_server, encoder_server):
    dec = openai.OpenAI(base_url=decoder_server[0].url + "/v1", api_key="-")
    with pytest.raises(openai.BadRequestError, match="needs an encoder run"):
        dec.embeddings.create(model="dec", input="text")
    enc = openai.OpenAI(base_url=encoder_server.url + "/v1", api_key="-")
    with pytest.raises(openai.BadRequestError, match="is an encoder"):
        enc.completions.create(model="enc", prompt="a", max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        enc.embeddings.create(model="other", input="a")


def test_an_api_key_guards_the_new_routes(encoder_run):
    app = create_app(load_model(encoder_run), load_tokenizer(encoder_run), model_name="enc", api_key="k")
    with BackgroundServer(app) as srv:
        for path, body in (("/tokenize", {"content": "a"}), ("/detokenize", {"tokens": [3]}),
                           ("/v1/embeddings", {"model": "enc", "input": "a"})):
            assert httpx.post(srv.url + path, json=body).status_code == 401
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="k").embeddings.create(model="enc", input="a")
        assert len(ok.data[0].embedding) == 32


def test_a_long_text_is_cut_to_the_context_as_tinyformer_embed_cuts_it(encoder_server, encoder_run, capsys):
    text = "abcdefghij " * 5  # 55 characters, over the 24 positions
    want = _embed_cli(capsys, encoder_run, [text])
    got = httpx.post(encoder_server.url + "/v1/embeddings",
                     json={"model": "enc", "input": text, "encoding_format": "float"}).json()
    torch.testing.assert_close(torch.tensor(got["data"][0]["embedding"]), want[0], atol=1e-6, rtol=0)
    assert got["usage"]["prompt_tokens"] == 24


# ---------------------------------------------------------------------------------------------- sentence-transformers
from test_classic_interop import TEXTS as ST_TEXTS  # noqa: E402
from test_classic_interop import sentence_transformer  # noqa: E402, F401  (the fixture)


def test_embeddings_of_a_sentence_transformers_import_equal_its_encode(sentence_transformer, tmp_path):  # noqa: F811
    from tinyformer.interop.hf_folder import import_hf

    st_model, root = sentence_transformer
    import_hf(root / "saved", tmp_path / "run")
    want = st_model.encode(ST_TEXTS, convert_to_tensor=True, normalize_embeddings=True)
    app = create_app(load_model(tmp_path / "run"), load_tokenizer(tmp_path / "run"), model_name="st")
    with BackgroundServer(app) as srv:
        got = openai.OpenAI(base_url=srv.url + "/v1", api_key="-").embeddings.create(model="st", input=ST_TEXTS)
    torch.testing.assert_close(torch.tensor([d.embedding for d in got.data]), want.float(), atol=1e-5, rtol=0)


def test_serve_refuses_compile_for_an_encoder_run_in_one_line(encoder_run, capsys):
    assert main(["serve", "--model", str(encoder_run), "--compile", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "an encoder run does not decode" in err


def test_an_encoder_app_keeps_the_body_timeout_it_is_given(encoder_run):
    """``serve --header-timeout`` limits each part of a request body on an encoder run too."""
    from tinyformer.serve.guard import RequestGuard

    app = create_app(load_model(encoder_run), load_tokenizer(encoder_run), model_name="enc", body_timeout=0.5)
    guard = next(m for m in app.user_middleware if m.cls is RequestGuard)
    assert guard.kwargs["body_timeout"] == 0.5

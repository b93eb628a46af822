"""Tokenizers: character-level, byte-level BPE, or any Hugging Face ``tokenizer.json``.

Every kind is one :class:`Tokenizer` wrapping a ``tokenizers.Tokenizer``, so every kind saves as a
real ``tokenizer.json`` that ``tokenizers.Tokenizer.from_file`` (and ``transformers``) can load.

* ``char``: a ``WordLevel`` model over single characters, with a ``Split`` pre-tokenizer that
  isolates every character (regex ``[\\s\\S]``) and a ``Fuse`` decoder that joins them back.
* ``bpe``: byte-level BPE (GPT-2 style) trained with ``tokenizers``' ``BpeTrainer``.
* ``hf``: any other ``tokenizer.json``, e.g. downloaded with a Hugging Face model.

Special tokens of the trained kinds are ``<|bos|>``, ``<|eos|>``, ``<|pad|>`` with ids 0, 1, 2
(``BpeTrainer`` puts them first; the char kind does the same so that both agree). Character ids
are therefore the classic nanoGPT ids (index in ``sorted(set(text))``) plus 3. As in Hugging Face
tokenizers, a special token's text appearing in the input is encoded as that special token.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

from tinyformer.errors import DataError
from tinyformer.utils.io import atomic_write_text

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)
KINDS = ("char", "bpe")
DEFAULT_BPE_VOCAB_SIZE = 4096
#: The smallest byte-level BPE: every byte is a token, plus the special tokens (no merges yet).
BPE_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
_CHAR_PATTERN = r"[\s\S]"  # one Unicode scalar value, newlines included (Oniguruma has no (?s))

# Names under which tokenizers in the wild spell their special tokens, most specific first.
_BOS_NAMES = ("<|bos|>", "<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|eos|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode``: the printable character that stands for each byte.

    Bytes that are printable Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for
    themselves; the other 68 bytes ``b`` are mapped, in increasing order, to ``chr(256 + k)``.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = (b for b in range(256) if b not in set(printable))
    table.update({chr(256 + k): b for k, b in enumerate(extra)})
    return table


def _types(component: dict[str, Any] | None) -> set[str]:
    """All ``type`` names in a (possibly ``Sequence``-nested) tokenizer.json component."""
    if not component:
        return set()
    found = {component.get("type", "")}
    for key in ("pretokenizers", "decoders", "normalizers", "processors"):
        for child in component.get(key) or []:
            found |= _types(child)
    return found


class Tokenizer:
    """Text <-> token ids, backed by a Hugging Face ``tokenizers.Tokenizer``.

    ``bos_token``/``eos_token``/``pad_token`` name the special tokens; those left ``None`` are
    looked up among common spellings (``<|bos|>``, ``<s>``, ``</s>``, ``<|endoftext|>``, ...).
    ``chat_template`` is a Jinja template as found in ``tokenizer_config.json``, or None.

    ``kind`` is "char", "bpe" (any byte-level BPE, trained here or loaded, e.g. GPT-2's) or "hf"
    (anything else). ``vocab_size`` is the largest id + 1, the rows an embedding table needs.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None, chat_template: str | None = None) -> None:
        # A tokenizer.json may carry padding and truncation settings (sentence-transformers folders ship
        # `padding: Fixed 128`) that the backend would apply to every text: each prompt padded to 128 ids
        # that a model then reads as real tokens. As transformers does, they are switched off here and
        # done explicitly where needed (batching pads with a mask; `encode(max_length=...)` truncates).
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.chat_template = chat_template
        spec = json.loads(backend.to_str())
        vocab = backend.get_vocab(with_added_tokens=True)
        self._vocab = vocab
        # Ids need not be contiguous in foreign tokenizers; an embedding table needs max id + 1 rows.
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        self._id_to_token = {i: t for t, i in vocab.items()}
        self._added = {t.content for t in backend.get_added_tokens_decoder().values()}
        model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
        self._byte_level = "ByteLevel" in _types(spec.get("decoder"))
        self._metaspace = "Metaspace" in _types(spec.get("decoder")) or "▁" in json.dumps(spec.get("decoder"),
                                                                                           ensure_ascii=False)
        if model.get("type") == "WordLevel" and pre.get("type") == "Split" and \
                pre.get("pattern") == {"Regex": _CHAR_PATTERN}:
            self.kind = "char"
        elif model.get("type") == "BPE" and self._byte_level:
            self.kind = "bpe"
        else:
            self.kind = "hf"
        self.bos_token = self._pick("bos_token", bos_token, _BOS_NAMES)
        self.eos_token = self._pick("eos_token", eos_token, _EOS_NAMES)
        self.pad_token = self._pick("pad_token", pad_token, _PAD_NAMES)
        if self.kind == "char":
            # Encoding characters by dict lookup is ~30x faster than the regex pre-tokenizer and
            # gives the exact position of an unknown character. Special tokens are matched first,
            # longest first, exactly as tokenizers' added-vocabulary does.
            specials = sorted(self._added, key=len, reverse=True)
            self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    # ---------------------------------------------------------------- construction

    def _pick(self, field: str, explicit: str | None, names: Sequence[str]) -> str | None:
        if explicit is not None:
            if explicit not in self._vocab:
                raise DataError(f"{field} {explicit!r} is not in the tokenizer vocabulary")
            return explicit
        return next((name for name in names if name in self._vocab), None)

    @classmethod
    def train_char(cls, text: str) -> Tokenizer:
        """A character tokenizer over ``sorted(set(text))`` plus the three special tokens (ids 0-2)."""
        chars = sorted(set(text))
        if not chars:
            raise DataError("cannot build a char tokenizer from an empty corpus")
        vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
        backend = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # no <unk>: unknown errors
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(_CHAR_PATTERN), behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens(list(SPECIAL_TOKENS))
        return cls(backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)

    @classmethod
    def train_bpe(cls, text: str | Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB_SIZE) -> Tokenizer:
        """Train a byte-level BPE with ``vocab_size`` tokens (256 bytes + 3 specials + merges).

        Raises :class:`DataError` when ``vocab_size`` is below 259 or above what the corpus can
        support (training stops when no pair of tokens occurs twice).
        """
        if vocab_size < BPE_MIN_VOCAB:
            raise DataError(f"bpe vocab_size {vocab_size} is too small: it must be >= {BPE_MIN_VOCAB} "
                            "(256 bytes + specials)")
        backend = tokenizers.Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        # chunks of 64K characters let tokenizers count words in parallel; a split word is rare enough not to matter
        chunks = (text[i : i + 65536] for i in range(0, len(text), 65536)) if isinstance(text, str) else iter(text)
        backend.train_from_iterator(chunks, trainer=trainer)
        got = backend.get_vocab_size()
        if got < vocab_size:
            raise DataError(f"bpe vocab_size {vocab_size} is larger than this corpus supports: training stopped at "
                            f"{got} tokens; use vocab_size <= {got} or a larger corpus")
        return cls(backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, bos_token: str | None = None, eos_token: str | None = None,
             pad_token: str | None = None) -> Tokenizer:
        """Load a ``tokenizer.json`` (or a folder holding one) and its optional ``tokenizer_config.json``.

        Special tokens come from the arguments, else from ``tokenizer_config.json``, else from
        common names in the vocabulary. ``chat_template`` comes from the config (or from a
        ``chat_template.jinja`` file next to it).
        """
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise DataError(f"tokenizer file {file} does not exist; train one or give a tokenizer.json path")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise DataError(f"cannot load tokenizer {file}: {e}") from e
        config = _read_config(file.parent / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja = file.parent / "chat_template.jinja"
        if template is None and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")

        def configured(field: str, explicit: str | None) -> str | None:
            # A config naming a token the vocabulary lacks is ignored (name lookup applies instead);
            # only an explicit argument that is missing is an error.
            if explicit is not None:
                return explicit
            name = config.get(field)  # a string or an AddedToken dict {"content": ...}
            name = name.get("content") if isinstance(name, dict) else name
            return name if isinstance(name, str) and backend.token_to_id(name) is not None else None

        return cls(backend, bos_token=configured("bos_token", bos_token), eos_token=configured("eos_token", eos_token),
                   pad_token=configured("pad_token", pad_token),
                   chat_template=template if isinstance(template, str) else None)

    # ---------------------------------------------------------------- ids

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self._vocab[self.bos_token]

    @property
    def eos_id(self) -> int | None:
        return None if self.eos_token is None else self._vocab[self.eos_token]

    @property
    def pad_id(self) -> int | None:
        return None if self.pad_token is None else self._vocab[self.pad_token]

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (in the model's own spelling, e.g. ``Ġthe`` for byte-level BPE)."""
        return self._vocab.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        """Token string of an id, or None if the id is not in the vocabulary."""
        return self._id_to_token.get(token_id)

    # ---------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = False, max_length: int | None = None) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` applies the tokenizer's post-processor
        (e.g. a BOS prefix in Llama tokenizers, [CLS] .. [SEP] in BERT's); the trained kinds have none.

        ``max_length`` truncates the *content* to ``max_length - s`` ids, s = the special tokens the
        post-processor adds, and then adds them: [CLS] a b [SEP] stays [CLS] a [SEP] at max_length 3
        (what transformers' ``truncation=True`` and so sentence-transformers do), never [CLS] a b."""
        if max_length is not None and max_length < 1:
            raise DataError(f"max_length must be positive, got {max_length}")
        if self.kind == "char" and not add_special_tokens:
            return self._encode_chars(text)[:max_length]
        if max_length is None:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        n_special = self.backend.num_special_tokens_to_add(False) if add_special_tokens else 0
        if max_length <= n_special:
            raise DataError(f"max_length {max_length} leaves no room for text beside the {n_special} special "
                            "tokens the tokenizer adds")
        encoding = self.backend.encode(text, add_special_tokens=False)
        encoding.truncate(max_length - n_special)
        if add_special_tokens:
            encoding = self.backend.post_process(encoding, add_special_tokens=True)
        return encoding.ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode several texts (in parallel threads for the non-char kinds)."""
        if self.kind == "char":
            return [self._encode_chars(t) for t in texts]
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def _encode_chars(self, text: str) -> list[int]:
        vocab = self._vocab
        pieces = self._special_re.split(text) if self._special_re else [text]
        specials = self._special_re.findall(text) if self._special_re else []
        ids: list[int] = []
        offset = 0
        for i, piece in enumerate(pieces):
            try:
                ids.extend([vocab[c] for c in piece])
            except KeyError:
                pos = next(j for j, c in enumerate(piece) if c not in vocab)
                raise DataError(f"character {piece[pos]!r} (U+{ord(piece[pos]):04X}) at position {offset + pos} is "
                                "not in the char tokenizer's vocabulary; retrain the tokenizer on a corpus that "
                                "contains it") from None
            offset += len(piece)
            if i < len(specials):
                ids.append(vocab[specials[i]])
                offset += len(specials[i])
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; special tokens are kept by default so ``decode(encode(t)) == t``."""
        ids = list(ids)
        if self.kind == "char":
            try:
                return "".join(self._id_to_token[i] for i in ids
                               if not (skip_special_tokens and self._id_to_token[i] in self._added))
            except KeyError as e:
                raise DataError(f"token id {e.args[0]} is out of range for a vocabulary of {self.vocab_size}") from None
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for, so a streaming decoder can emit whole UTF-8 only.

        A byte-level BPE token may hold part of a multi-byte character (e.g. half an emoji); the
        concatenation of ``token_bytes`` over a sequence is the UTF-8 of its decoded text.
        """
        token = self._id_to_token.get(token_id)
        if token is None:
            raise DataError(f"token id {token_id} is out of range for a vocabulary of {self.vocab_size}")
        if token in self._added or self.kind == "char":
            return token.encode("utf-8")
        if self._byte_level:
            table = byte_level_decoder()
            return bytes(table[c] for c in token) if all(c in table for c in token) else token.encode("utf-8")
        match = _BYTE_FALLBACK.fullmatch(token)
        if match:
            return bytes([int(match.group(1), 16)])
        if self._metaspace:
            return token.replace("▁", " ").encode("utf-8")
        return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    # ---------------------------------------------------------------- saving

    def to_json(self) -> str:
        """The ``tokenizer.json`` text (deterministic for a given tokenizer)."""
        return self.backend.to_str()

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json``; returns its path.

        A path ending in ``.json`` is the file itself; any other path is a folder that receives
        ``tokenizer.json`` plus a ``tokenizer_config.json`` naming the special tokens (and the
        chat template), which is what ``transformers.AutoTokenizer`` reads.
        """
        p = Path(path)
        if p.suffix == ".json":
            atomic_write_text(p, self.to_json())
            return p
        p.mkdir(parents=True, exist_ok=True)
        fields = ("bos_token", "eos_token", "pad_token", "chat_template")
        config = {"tokenizer_class": "PreTrainedTokenizerFast",
                  **{field: getattr(self, field) for field in fields if getattr(self, field) is not None}}
        atomic_write_text(p / "tokenizer.json", self.to_json())
        atomic_write_text(p / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        return p / "tokenizer.json"

    def __repr__(self) -> str:
        return (f"Tokenizer(kind={self.kind!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id}, "
                f"pad={self.pad_id})")


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from e
    return config if isinstance(config, dict) else {}


def build_tokenizer(kind: str, text: str, vocab_size: int | None = None) -> Tokenizer:
    """Train a tokenizer of ``kind`` ("char" or "bpe") on ``text``.

    ``vocab_size`` is used by "bpe" only (default :data:`DEFAULT_BPE_VOCAB_SIZE`); the char
    vocabulary is fixed by the corpus.
    """
    if kind == "char":
        return Tokenizer.train_char(text)
    if kind == "bpe":
        return Tokenizer.train_bpe(text, DEFAULT_BPE_VOCAB_SIZE if vocab_size is None else vocab_size)
    raise DataError(f"tokenizer kind {kind!r} is not known; use one of {', '.join(KINDS)}")

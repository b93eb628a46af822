"""`tinyformer embed`: sentence embeddings from an encoder run folder.

    tinyformer embed --model RUN --text "a cat" --text "a dog"                 JSON vectors
    tinyformer embed --model RUN --text "a cat" --text "a dog" --similarity    JSON cosine-similarity matrix

Each text is tokenized (with the tokenizer's special tokens, e.g. [CLS] ... [SEP] for BERT), the encoder's
hidden states are pooled over the real tokens (mean by default, or the pooling a sentence-transformers
import recorded) and L2-normalised, so that the similarity matrix is E E^T.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tinyformer.cli.common import add_no_verify_flag
from tinyformer.errors import ConfigError, DataError
from tinyformer.models.sentence_embeddings import embed
from tinyformer.utils.io import read_utf8


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("embed", help="sentence embeddings (and their similarities) from an encoder model",
                       description="Embed texts with an encoder run folder (BERT-style, e.g. imported from "
                                   "sentence-transformers or trained with --objective mlm): mean pooling over "
                                   "non-padding tokens, L2-normalised. Prints JSON.")
    p.add_argument("--model", required=True, metavar="RUN", help="encoder run folder")
    p.add_argument("--text", action="append", default=[], help="a text to embed (repeatable)")
    p.add_argument("--file", help="a file with one text per line (may be - for stdin)")
    p.add_argument("--similarity", action="store_true", help="print the cosine-similarity matrix instead of vectors")
    p.add_argument("--pooling", choices=("mean", "cls", "max"), default=None,
                   help="pooling over tokens (default: the model's recorded pooling, else mean)")
    p.add_argument("--max-length", type=int, default=None, help="truncate texts to this many tokens")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--precision", type=int, default=6, help="decimals printed (default 6)")
    add_no_verify_flag(p)
    p.set_defaults(func=run)


def read_texts(args: argparse.Namespace) -> list[str]:
    texts = list(args.text)
    if args.file:
        if args.file == "-":
            texts += [line.rstrip("\n") for line in sys.stdin if line.strip()]
        else:
            path = Path(args.file)
            if not path.is_file():
                raise DataError(f"--file {path} does not exist")
            texts += [line for line in read_utf8(path, DataError, "--file").splitlines() if line.strip()]
    if not texts:
        raise ConfigError("give at least one --text or a --file of texts")
    return texts


def run(args: argparse.Namespace) -> int:
    from tinyformer.run_folder import load_config, load_model, load_tokenizer

    if args.max_length is not None and args.max_length < 1:
        raise ConfigError("--max-length must be positive")
    if args.batch_size < 1:
        raise ConfigError("--batch-size must be positive")
    cfg = load_config(args.model)
    if cfg.arch != "encoder":
        raise ConfigError(f"{args.model} is a {cfg.arch} model; embed needs an encoder (arch 'encoder', e.g. BERT)")
    texts = read_texts(args)
    model = load_model(args.model, cfg=cfg, verify=not args.no_verify)
    tokenizer = load_tokenizer(args.model)
    e = embed(model, tokenizer, texts, args.pooling, args.max_length, args.batch_size)
    if args.similarity:
        sim = (e @ e.T).clamp(-1.0, 1.0)
        out = {"texts": texts, "similarity": [[round(v, args.precision) for v in row] for row in sim.tolist()]}
    else:
        out = {"dim": e.shape[1], "embeddings": [{"text": t, "vector": [round(v, args.precision) for v in row]}
                                                  for t, row in zip(texts, e.tolist())]}
    print(json.dumps(out))
    return 0

"""Loss, perplexity and bits per byte of a run's model on any text (``tinyformer eval --data``).

The text is encoded with the run's tokenizer (cached like training data) and cut into
non-overlapping windows of ``block_size`` tokens; every token after the first of its window is
predicted from the tokens before it in that window:

    loss = -1/N sum_i log p(x_i | window prefix),   perplexity = exp(loss),
    bits per byte = N * loss / (ln 2 * bytes of the predicted tokens)

Bits per byte does not depend on the tokenizer, so it compares models with different vocabularies.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from tinyformer.errors import ConfigError
from tinyformer.training.train_config import read_run_file


def _training_block_size(run: Path) -> int | None:
    if not (run / "train.yaml").is_file():
        return None
    try:
        value = read_run_file(run / "train.yaml")["train"].get("block_size")
    except ConfigError:
        return None
    return value if isinstance(value, int) and value > 0 else None


def evaluate_text(run: Path, data: str, *, text_field: str = "text", block_size: int | None = None,
                  batch_size: int = 8, max_batches: int | None = None, device: str = "auto", dtype: str = "auto",
                  cache_dir: str | None = None, progress: bool = True, per_token: bool = False,
                  verify: bool = True) -> dict:
    """Loss, perplexity and bits per byte of the model in ``run`` on the corpus ``data`` (the flags of ``tinyformer
    eval --data``): ``text_field`` of each JSONL record, windows of ``block_size`` tokens (None: the run's training
    block size, else max_seq_len), ``batch_size`` windows per forward pass, at most ``max_batches`` batches,
    ``dtype`` the autocast dtype, tokens cached under ``cache_dir`` (None: ~/.cache/tinyformer), the weight files
    checked against the run's manifest when ``verify``; with ``per_token``, ``token_losses`` lists {id, text,
    bytes, loss} of every predicted token in text order."""
    from tqdm.auto import tqdm

    from tinyformer.data.dataset import TokenDataset, encode_to_memmap
    from tinyformer.data.named import default_cache_dir
    from tinyformer.devices import autocast_dtype, resolve_device
    from tinyformer.run_folder import load_config, load_model, load_tokenizer

    cfg = load_config(run)
    T = block_size or _training_block_size(run) or cfg.max_seq_len
    if T < 1 or T > cfg.max_seq_len:
        raise ConfigError(f"--block-size {T} must be in [1, max_seq_len={cfg.max_seq_len}]")
    dev = resolve_device(device)
    amp = autocast_dtype(dtype, dev)
    tokenizer = load_tokenizer(run)
    model = load_model(run, device=dev, verify=verify)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    path = encode_to_memmap(Path(data), tokenizer, cache / "tokens", text_field=text_field)
    dataset = TokenDataset(path, val_fraction=0.0)
    n = len(dataset)
    windows = (n - 1) // T if n > T else 0
    if windows == 0:
        raise ConfigError(f"{data} has {n} tokens, too few for one window of --block-size {T} (needs {T + 1})")
    # bytes each id stands for, to turn nats/token into bits/byte
    token_bytes = np.array([len(tokenizer.token_bytes(i)) if tokenizer.id_to_token(i) is not None else 0
                            for i in range(tokenizer.vocab_size)], dtype=np.int64)
    n_batches = math.ceil(windows / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    nll, count, n_bytes = 0.0, 0, 0
    token_losses: list[dict] = []
    with torch.no_grad(), torch.autocast(dev.type, dtype=amp, enabled=amp is not None):
        batches = dataset.iter_eval_batches("train", batch_size, T, max_batches=max_batches)
        for x, y in tqdm(batches, total=n_batches, desc="eval", unit="batch", disable=not progress):
            logits = model(x.to(dev))
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.to(dev).flatten(),
                                                       reduction="none")
            nll += float(losses.sum())
            if not math.isfinite(nll):  # a NaN loss would be reported as a result, exit 0
                from tinyformer.errors import NonFiniteOutputError, non_finite_message

                raise NonFiniteOutputError(non_finite_message(f"on {data}"))
            if per_token:
                # a token may hold part of a character: its text is then lossy, its byte count exact
                token_losses.extend({"id": t, "text": tokenizer.token_bytes(t).decode("utf-8", errors="replace"),
                                     "bytes": int(token_bytes[t]), "loss": v}
                                    for t, v in zip(y.flatten().tolist(), losses.tolist()))
            count += y.numel()
            n_bytes += int(token_bytes[y.numpy()].sum())
    mean = nll / count
    extra = {"token_losses": token_losses} if per_token else {}
    return {
        "model": str(run),
        "data": str(data),
        "tokens": count,
        "block_size": T,
        "loss": mean,
        "perplexity": math.exp(min(mean, 700.0)),
        "bits_per_byte": nll / math.log(2) / n_bytes if n_bytes else None,
        "bytes": n_bytes,
        **extra,
    }



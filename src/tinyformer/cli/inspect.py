"""`tinyformer inspect`: pictures of what a trained model does with a prompt.

    tinyformer inspect --model RUN --prompt "To be, or not to be" --top-k 20 --top-p 0.9

prints a table of the most probable next tokens and writes into ``--out`` (default RUN/inspect):

    attention.png    attention probabilities of every layer (rows) and head (columns)
    next_token.png   the next-token distribution with the top-k / top-p cut marked
    token_loss.png   -log p(token | prefix) for every token of the prompt
    rope.png         RoPE's rotation of the pairs of dimensions and the dot product against distance

The computations live in ``tinyformer.inspect``; this module parses flags and prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from tinyformer.cli.common import add_no_verify_flag, read_prompt
from tinyformer.errors import ConfigError, GenerationError
from tinyformer.generation.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="attention maps, next-token distribution, per-token loss, RoPE pictures",
                       description="Look inside a run's model: writes attention heat-maps, the next-token "
                                   "distribution with the top-k/top-p cut, the per-token loss of the prompt and "
                                   "RoPE's rotations as PNGs, and prints the most probable next tokens.")
    p.add_argument("--model", required=True, metavar="RUN", help="run folder (config.json, weights, tokenizer.json)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the text to look at")
    src.add_argument("--prompt-file", metavar="PATH", help="read the text from a UTF-8 file")
    p.add_argument("--out", metavar="DIR", default=None, help="folder for the pictures (default: RUN/inspect)")
    # the plain distribution (generation/sampling.py's DEFAULT_*): inspect shows the model as it is
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"softmax temperature (default {DEFAULT_TEMPERATURE:g}; 0 = greedy)")
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K,
                   help="keep the k most probable tokens; 0 = off (default)")
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P,
                   help="nucleus: smallest set with mass >= p; 1 = off (default)")
    p.add_argument("--rows", type=int, default=10, metavar="N", help="next tokens in the table (default 10)")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N",
                   help="last N tokens shown in the attention maps (default 32)")
    p.add_argument("--no-plots", action="store_true", help="print the table only (no matplotlib needed)")
    add_no_verify_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tinyformer.generation.sampling import SamplingParams
    from tinyformer.inspect.next_token import format_table, next_token_distribution
    from tinyformer.run_folder import load_config, load_model, load_tokenizer

    for flag, value in (("--rows", args.rows), ("--max-tokens", args.max_tokens)):
        if value < 1:
            raise GenerationError(f"{flag} must be >= 1, got {value}")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p).validate()
    text = read_prompt(args)
    out = Path(args.out) if args.out else Path(args.model) / "inspect"
    if not args.no_plots and out.exists() and not out.is_dir():  # checked before the (slow) model load
        raise ConfigError(f"--out {out} is a file; give a folder for the pictures")
    if not args.no_plots:
        from tinyformer.inspect.plotting import pyplot

        pyplot()  # a missing matplotlib is reported before the model is loaded
    cfg = load_config(args.model)
    if cfg.arch != "decoder":
        raise ConfigError(f"inspect works on decoder language models; {args.model} has arch {cfg.arch!r}")
    tok = load_tokenizer(args.model)
    ids = tok.encode(text)
    if not ids:
        raise GenerationError("the prompt encodes to no tokens")
    if len(ids) > cfg.max_seq_len:
        print(f"note: the prompt has {len(ids)} tokens; the last {cfg.max_seq_len} (max_seq_len) are used",
              file=sys.stderr)
        ids = ids[-cfg.max_seq_len :]
    model = load_model(args.model, verify=not args.no_verify)
    x = torch.tensor([ids])

    def token_text(i: int) -> str:
        return tok.decode([i])

    dist = next_token_distribution(model, x, params)
    print(f"prompt: {len(ids)} tokens; next token after {token_text(ids[-1])!r}:")
    print(format_table(dist, token_text, args.rows))
    if args.no_plots:
        return 0
    for path in draw_all(model, x, dist, token_text, out, args.max_tokens):
        print(f"wrote {path}")
    return 0


def draw_all(model: torch.nn.Module, x: torch.Tensor, dist, token_text, out: Path, max_tokens: int) -> list[Path]:
    """Every picture for the prompt ``x`` (1, T); returns the paths written (a 1-token prompt has no loss
    picture, a model without RoPE no RoPE picture)."""
    from tinyformer.inspect.attention_maps import attention_maps, plot_attention_grid
    from tinyformer.inspect.next_token import plot_next_token
    from tinyformer.inspect.rope_plot import plot_rope
    from tinyformer.inspect.token_loss import per_token_loss, plot_token_loss

    ids = x[0].tolist()
    labels = [token_text(i) for i in ids]
    written = [plot_attention_grid(attention_maps(model, x), labels, out / "attention.png", max_tokens=max_tokens),
               plot_next_token(dist, token_text, out / "next_token.png")]
    if len(ids) >= 2:
        written.append(plot_token_loss(per_token_loss(model, x), labels[1:], out / "token_loss.png"))
    else:
        print("note: token_loss.png skipped: a one-token prompt predicts nothing", file=sys.stderr)
    rope = getattr(model, "rope", None)
    if rope is not None:
        written.append(plot_rope(rope, out / "rope.png", n_distances=min(512, model.cfg.max_seq_len)))
    else:
        print(f"note: rope.png skipped: the model uses pos={model.cfg.pos!r}", file=sys.stderr)
    return written

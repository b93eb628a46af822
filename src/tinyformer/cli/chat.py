"""`tinyformer chat`: an interactive conversation that keeps every turn in the model's context.

    tinyformer chat --model RUN --temperature 0.7
    printf 'Hello\\nHow are you?\\n' | tinyformer chat --model RUN --seed 0

Each input line is one user turn; ``/reset`` starts a new conversation, ``/quit`` (or end of input,
Ctrl-D) leaves. With piped input nothing but the replies is printed, each followed by a line
``---`` (``--separator``), since a reply may span several lines. A turn that
cannot be answered (the conversation no longer fits the context, a character the tokenizer lacks)
prints an error and the conversation continues without it.
"""

from __future__ import annotations

import argparse
import sys

from tinyformer.cli.common import template_timeout
from tinyformer.cli.generate import (
    add_model_args,
    add_sampling_args,
    load_generator,
    sampling_params,
    use_replacement_on_output,
)
from tinyformer.data.chat_template import ChatTemplate
from tinyformer.errors import ConfigError, TinyformerError
from tinyformer.generation.chat import ChatSession
from tinyformer.generation.engine import new_prefix_cache

HELP = "/reset starts a new conversation, /quit or Ctrl-D leaves"
PIPED_SEPARATOR = "---"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="talk to a trained model, turn by turn",
                       description="Interactive chat with a run folder's model. " + HELP + ".")
    add_model_args(p)
    p.add_argument("--system", default=None, help="a system message placed before the conversation")
    p.add_argument("--separator", default=PIPED_SEPARATOR, metavar="TEXT",
                   help=f"with piped input, a line printed after each reply, so that replies of several lines "
                        f"stay apart (default {PIPED_SEPARATOR!r}; '' for none)")
    p.add_argument("--prefix-cache-mb", type=float, default=64, metavar="MB",
                   help="keep the conversation's keys/values between turns in a prefix cache of this size, so each "
                        "turn prefills only what is new (default 64; 0: off)")
    add_sampling_args(p)
    p.set_defaults(func=run)


def read_line(interactive: bool) -> str | None:
    """One line of input without its newline, or None at end of input."""
    if interactive:
        try:
            return input("you> ")
        except EOFError:
            print()
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\r\n")


def run(args: argparse.Namespace) -> int:
    use_replacement_on_output()
    sampling_params(args, 0 if args.max_new_tokens is None else args.max_new_tokens)  # bad values: exit 2 now
    if args.prefix_cache_mb < 0:
        raise ConfigError(f"--prefix-cache-mb must be >= 0, got {args.prefix_cache_mb}")
    timeout_s = template_timeout(args)
    gen = load_generator(args)
    gen.prefix_cache = new_prefix_cache(gen.model, args.prefix_cache_mb)  # each turn reuses the history's K/V
    session = ChatSession(gen, system=args.system, template=ChatTemplate(gen.tokenizer, timeout_s=timeout_s))
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"chatting with {args.model} ({HELP})", file=sys.stderr)
    turn = 0
    while True:
        line = read_line(interactive)
        if line is None or line.strip() == "/quit":
            return 0
        if line.strip() == "/reset":
            session.reset()
            if interactive:
                print("(new conversation)", file=sys.stderr)
            continue
        if not line.strip():
            continue
        seed = None if args.seed is None else (args.seed + turn) % 2**64
        turn += 1
        try:
            pieces = session.send(line, sampling_params(args, 0, seed=seed), args.max_new_tokens)
        except TinyformerError as exc:
            hint = " (/reset starts a new conversation)" if "context" in str(exc) else ""
            print(f"error: {exc}{hint}", file=sys.stderr, flush=True)
            continue
        if interactive:
            sys.stdout.write("assistant> ")
        started = False  # the reply is shown without the space that follows "Assistant:"
        try:
            for piece in pieces:
                if not started:
                    piece = piece.lstrip()
                    started = bool(piece)
                sys.stdout.write(piece)
                sys.stdout.flush()
        except KeyboardInterrupt:  # Ctrl-C stops this reply (it is not kept), not the chat
            print("\n(interrupted)", file=sys.stderr)
        sys.stdout.write("\n")
        if not interactive and args.separator:
            sys.stdout.write(args.separator + "\n")
        sys.stdout.flush()

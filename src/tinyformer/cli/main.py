"""The `tinyformer` command line: one module per subcommand, wired here.

Each subcommand module exposes ``add_parser(subparsers)`` (which sets ``func`` on its parser)
and the function it points to returns an exit code. A ``TinyformerError`` (a user mistake) is
printed on one line to stderr with exit code 2, without a traceback; anything else is a bug
and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tinyformer.errors import TinyformerError

# subcommand modules under tinyformer.cli, in the order `--help` lists them
COMMANDS = [
    "count",
    "train",
    "eval",
    "generate",
    "chat",
    "serve",
    "convert",
    "quantize",
    "embed",
    "inspect",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinyformer",
        description="A from-scratch Transformer and mini-LLM toolkit: count, train, generate, convert.",
    )
    from tinyformer import __version__

    parser.add_argument("--version", action="version", version=f"tinyformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"tinyformer.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except TinyformerError as exc:
        print(f"tinyformer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tinyformer generate ... | head`
        return 0


if __name__ == "__main__":
    raise SystemExit(main())

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
from typing import NoReturn

from tinyformer.errors import TinyformerError, environment_error_message
from tinyformer.utils.io import check_utf8_arguments
from tinyformer.utils.threads import configure_threads, set_wait_policy

set_wait_policy()  # before torch (and its OpenMP runtime) loads with a subcommand: idle threads sleep

#: Commands that compute with torch: their thread count follows the machine's load (utils/threads.py).
COMPUTE_COMMANDS = frozenset({"train", "eval", "generate", "chat", "serve", "embed", "inspect"})
#: cores a command leaves to its own threads besides torch's (serve: the HTTP event loop)
RESERVED_CORES = {"serve": 1}

# subcommand modules under tinyformer.cli, in the order `--help` lists them
COMMANDS = ["count", "train", "eval", "generate", "chat", "serve", "convert", "quantize", "embed", "tokenize",
            "inspect"]


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (argparse prints the whole multi-line usage first), exit 2;
    subcommand parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tinyformer",
                     description="A from-scratch Transformer and mini-LLM toolkit: count, train, generate, convert.")
    from tinyformer import __version__

    parser.add_argument("--version", action="version", version=f"tinyformer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"tinyformer.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):  # bare `tinyformer`: the help is what was asked for
        parser.print_help()
        return 0
    try:
        check_utf8_arguments(sys.argv[1:] if argv is None else argv)
        if args.command in COMPUTE_COMMANDS:
            configure_threads(getattr(args, "threads", None), reserve=RESERVED_CORES.get(args.command, 0))
            from tinyformer.generation.compile_cache import default_inductor_cache

            default_inductor_cache()  # compiled kernels kept per torch version and CPU, across invocations
        return int(args.func(args) or 0)
    except TinyformerError as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message's source put in it
        print(f"tinyformer {args.command}: error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `tinyformer generate ... | head`
        return 0
    except OSError as exc:  # a full or read-only disk, a file where a folder should be: one line, not a bug
        message = environment_error_message(exc)
        if message is None:
            raise
        print(f"tinyformer {args.command}: error: {message}", file=sys.stderr)
        return 2
    except RecursionError:  # json/yaml parsers recurse once per level: a file nested 10^5 deep
        print(f"tinyformer {args.command}: error: an input file is nested too deeply to read (thousands of "
              "levels of brackets: it is corrupt or hostile)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

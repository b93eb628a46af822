"""`python -m tinyformer ...` (and `torchrun -m tinyformer ...`) runs the command line."""

from tinyformer.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())

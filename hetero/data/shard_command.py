"""The command line every shard writer shares: ``hetero data NAME`` and ``python -m hetero.data.NAME``."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from hetero.errors import ConfigError

AddArguments = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], None]


def register(subparsers: argparse._SubParsersAction, name: str, help_text: str, add_arguments: AddArguments,
             run: Run) -> argparse.ArgumentParser:
    """Register ``name`` under ``subparsers`` (e.g. of ``hetero data``); it runs via ``args.run(args)``."""
    parser = subparsers.add_parser(name, help=help_text, description=help_text)
    add_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def main(prog: str, help_text: str, add_arguments: AddArguments, run: Run, argv: list[str] | None) -> int:
    """Parse ``argv`` and run; a ``ConfigError`` is printed as the error and exits with 2."""
    parser = argparse.ArgumentParser(prog=prog, description=help_text)
    add_arguments(parser)
    try:
        run(parser.parse_args(argv))
    except ConfigError as err:
        print(f"hetero: error: {err}", file=sys.stderr)
        return 2
    return 0

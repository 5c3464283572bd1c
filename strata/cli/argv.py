"""Command-line parsing shared by `strata` and `stratactl`: an unknown flag is reported with its subcommand's usage line."""
from __future__ import annotations

import argparse


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """parser.parse_args(argv), except that arguments nobody takes are an error of the subcommand's parser (its
    usage line and `prog sub: error: unrecognized arguments: ...`, exit 2) rather than of the top-level one, which
    is what argparse reports them with. `parser.subcommands` is the action add_subparsers returned."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = parser.subcommands
        parser_of = sub.choices.get(getattr(args, sub.dest, None), parser)
        parser_of.error(f"unrecognized arguments: {' '.join(extra)}")
    return args

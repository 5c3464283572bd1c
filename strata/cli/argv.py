"""Command-line parsing shared by `strata` and `stratactl`: a bad or unknown flag is reported in two lines, a short
usage line naming the subcommand and the error (the full list is its --help)."""
from __future__ import annotations

import argparse
import math


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors print `usage: PROG [options] ...` and `PROG: error: ...` (exit 2) instead of
    the whole usage text; its subcommands' parsers are Parsers too."""

    def error(self, message: str):
        self.exit(2, f"usage: {self.prog} [options] ('{self.prog} --help' lists them)\n{self.prog}: error: {message}\n")


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


def int_at_least(lo: int, name: str):
    """An argparse type: an integer >= lo; argparse names it `name` in its "invalid ... value" error."""
    def conv(s: str) -> int:
        v = int(s)
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    conv.__name__ = name
    return conv


def number_above(lo: float, name: str, *, inclusive: bool = False):
    """An argparse type: a finite number > lo (>= lo when inclusive)."""
    def conv(s: str) -> float:
        v = float(s)
        if not math.isfinite(v):
            raise ValueError(s)
        if v < lo or (v == lo and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {lo:g}, got {v:g}")
        return v
    conv.__name__ = name
    return conv

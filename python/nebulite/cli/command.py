"""How a subcommand registers itself: the one place that makes every ``--help`` show the
command's description and at least one example."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

#: Help of the PATH argument of the commands that read a store.
STORE = "the store (persistent_storage_path)"


def subcommand(sub: Any, name: str, *, help: str, examples: Sequence[str],
               doc: str | None = None, run: Callable[[argparse.Namespace], int] | None = None,
               path: str | None = STORE) -> argparse.ArgumentParser:
    """Adds command `name` to the subparsers `sub`: `doc` as its description, `examples`
    (command lines, at least one) after its options, a PATH argument described by `path`
    (None: none) and `run(args) -> int` as what it does (None: set by its own subcommands)."""
    if not examples:
        raise ValueError(f"command {name!r} needs an example for its --help")
    heading = "example:" if len(examples) == 1 else "examples:"
    p = sub.add_parser(name, help=help, description=doc,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=heading + "".join(f"\n  {e}" for e in examples))
    if path is not None:
        p.add_argument("path", metavar="PATH", help=path)
    if run is not None:
        p.set_defaults(run=run)
    return p

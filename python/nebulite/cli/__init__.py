"""The ``nebulite`` command: look into checkpoint stores, verify, export and import
checkpoints, plot their history, clean up dead runs' leftovers, and control this node's
agents, without writing Python.

Each subcommand is one module here with ``add_parser(subparsers)``, which registers it
and its ``run(args) -> int``. Errors are one line on stderr and a non-zero exit status:
1 for "damaged" (``verify``), 2 for everything else.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Any

from ..errors import NebuliteError

#: Exit status of a command that failed (verify's "damaged" is 1).
FAILED = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nebulite", description=__doc__.split("\n\n")[0],
        epilog="Run 'nebulite COMMAND --help' for each command's options and an example.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Imported here, not with the package: `nebulite agent --root ...` runs an agent, which
    # must not load what the subcommands need (torch among them).
    from . import agent, export, gc, history, importer, listing, ls, show, verify

    for m in (ls, show, verify, history, gc, export, importer, agent, listing):
        m.add_parser(sub)
    return parser


def _one_line_warning(message: Any, category: Any, filename: str, lineno: int,
                      file: Any = None, line: str | None = None) -> None:
    text = str(message)
    print(text if text.startswith("nebulite") else f"nebulite: {text}",
          file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["agent"] and not (set(argv[1:2]) & {"status", "stop", "-h", "--help"}):
        from ..agent.server import main as agent_main  # `nebulite agent [--root ...]`: run one

        return agent_main(argv[1:])
    args = build_parser().parse_args(argv)
    warnings.showwarning = _one_line_warning
    try:
        return int(args.run(args))
    except BrokenPipeError:  # `nebulite ls | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (NebuliteError, OSError, ValueError) as e:
        print(f"nebulite {args.command}: {e}", file=sys.stderr)
        return FAILED
    except KeyboardInterrupt:
        print(f"nebulite {args.command}: interrupted", file=sys.stderr)
        return 130

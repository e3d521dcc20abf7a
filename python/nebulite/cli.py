"""Command line: ``nebulite list PATH`` shows the committed checkpoints in a store;
``nebulite agent --socket PATH [...]`` runs a node agent by hand."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nebulite", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="list committed checkpoints in a store")
    ls.add_argument("path")
    sub.add_parser("agent", help="run the node agent in the foreground (python -m nebulite.agent)",
                   add_help=False)
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "agent":
        from .agent.server import main as agent_main

        return agent_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "list":
        from . import list_checkpoints

        json.dump(list_checkpoints(args.path), sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

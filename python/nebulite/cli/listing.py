"""``nebulite list PATH``: ``list_checkpoints(PATH)`` as JSON (see ``nebulite ls``)."""

from __future__ import annotations

import argparse
from typing import Any

from .output import print_json


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "list", help="the committed checkpoints as list_checkpoints() returns them (JSON)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__, epilog="example:\n  nebulite list /mnt/ckpt/run1")
    p.add_argument("path", metavar="PATH")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from .. import list_checkpoints

    print_json(list_checkpoints(args.path))
    return 0

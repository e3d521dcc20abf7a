"""``nebulite list PATH``: ``list_checkpoints(PATH)`` as JSON (see ``nebulite ls``)."""

from __future__ import annotations

import argparse
from typing import Any

from .output import print_json
from .command import subcommand


def add_parser(sub: Any) -> None:
    subcommand(sub, "list", help="the committed checkpoints as list_checkpoints() returns them (JSON)",
               doc=__doc__, run=run, examples=["nebulite list /mnt/ckpt/run1"])


def run(args: argparse.Namespace) -> int:
    from .. import list_checkpoints

    print_json(list_checkpoints(args.path))
    return 0

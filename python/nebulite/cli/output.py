"""Text output of the command: sizes, times, tables."""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any, Sequence


def size(n: int | None) -> str:
    """Bytes in SI units: 512 B, 41.8 kB, 1.2 GB."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"  # pragma: no cover


def duration(seconds: float | None) -> str:
    """12 ms, 3.4 s, 5 min, 2 h, 3 d."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} d"


def utc(unix_ns: int | None) -> str:
    if not unix_ns:
        return "-"
    t = datetime.datetime.fromtimestamp(unix_ns / 1e9, tz=datetime.timezone.utc)
    return t.strftime("%Y-%m-%d %H:%M:%S")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], file: Any = None) -> None:
    """Columns padded to their widest cell; numbers and sizes right-aligned."""
    out = file or sys.stdout
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = [all(_numeric(r[i]) for r in cells[1:]) and len(cells) > 1 for i in range(len(headers))]
    for r in cells:
        line = "  ".join(c.rjust(w) if right[i] else c.ljust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))
        print(line.rstrip(), file=out)


def _numeric(text: str) -> bool:
    head = text.split(" ")[0]
    try:
        float(head)
        return True
    except ValueError:
        return text == "-"


def print_json(value: Any) -> None:
    json.dump(value, sys.stdout, indent=2)
    print()

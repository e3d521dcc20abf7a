"""Foreseeing whether objects still to be staged will fit in the memory tier.

Coordinated ranks agree at the commit whether a checkpoint stays in memory only. With
asynchronous staging, a rank's staging thread may not have reserved memory for the
checkpoint's objects yet; an object that then does not fit is streamed to the store, and
the checkpoint must be persisted after all, which the ranks agreed not to. So each rank
asks, at the commit, whether what it still has to stage (estimated from above) exceeds
what reservations can take now: the arena's free bytes and the memory that versions hold
and that may go (``Engine.memory_reclaimable``: not the newest version while it is held in
memory only). If any rank's answer is yes, every rank persists the checkpoint.
"""

from __future__ import annotations

from typing import Any, Iterable


def will_not_fit(unstaged_bytes: int, engines: Iterable[Any]) -> bool:
    """True if `unstaged_bytes` exceed what reservations can take now in the arena that
    `engines` share (each staging its part of those bytes, evicting its own versions)."""
    if unstaged_bytes <= 0:
        return False
    room, capacity, used = 0, 0, 0
    for e in engines:
        room += e.memory_reclaimable
        capacity, used = e.memory_capacity, e.memory_used
    return unstaged_bytes > max(0, capacity - used) + room

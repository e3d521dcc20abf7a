"""The versions a trainer committed, remembered for as long as they can matter.

The session waits for them on their way to the store (``_Session.flush_committed``); the
node agent, once a trainer left, stops awaiting rank 0's commit of them
(``Agent._stop_awaiting_commits``). Both only look at versions the engine still holds, so
a version the engine let go (retention) is forgotten: once the set doubled since it was
last pruned, it keeps only the versions the engine holds, and a job that checkpoints
every step for weeks does not grow it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

#: The fewest versions remembered before the first pruning.
FORGET_AT = 64


class CommittedVersions(set[tuple[str, str]]):
    """A set of (tag, version) that forgets what its engine no longer holds."""

    def __init__(self) -> None:
        super().__init__()
        self._forget_at = FORGET_AT

    def remember(self, tag: str, version: str,
                 held: Callable[[], Iterable[dict[str, Any]]]) -> None:
        """Adds (tag, version); once the set doubled, keeps only the versions `held()`
        (the engine's ``versions()``) lists. What `held()` raises leaves the set as it is
        (the version added), to be pruned at a later commit."""
        self.add((tag, version))
        if len(self) >= self._forget_at:
            self &= {(v["tag"], v["version"]) for v in held()}
            self._forget_at = max(FORGET_AT, 2 * len(self))

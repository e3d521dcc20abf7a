"""The memory tier as pinned memory for CUDA: the arena registered with the driver.

Copies between a GPU and pageable host memory go through a driver bounce buffer, one
chunk at a time; from and into page-locked memory they run at the link's speed and may be
asynchronous. The arena (the embedded engine's, or the node agent's shared memory as this
process maps it) is registered with ``cudaHostRegister`` (through ``torch.cuda.cudart()``)
once per process that maps it, in pieces of `PIECE_BYTES` (a single registration of a
very large range can fail where pieces succeed), and unregistered before it is unmapped.

Registering locks the arena's pages in memory (they become resident), so it is done only
in a process that uses CUDA: when the session opens with CUDA initialised, or at the first
save or load that involves a CUDA tensor. Without CUDA, nothing here runs. A registration
the driver refuses is logged and leaves the arena pageable: copies still work, slower.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("nebulite")

#: The size of each registered piece.
PIECE_BYTES = 1 << 30
_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def pieces(address: int, nbytes: int, piece: int | None = None) -> list[tuple[int, int]]:
    """[(address, size)] covering [address, address + nbytes) in order, each at most `piece`
    (default `PIECE_BYTES`)."""
    piece = PIECE_BYTES if piece is None else piece
    if piece <= 0:
        raise ValueError("piece must be positive")
    return [(address + off, min(piece, nbytes - off)) for off in range(0, nbytes, piece)]


class PinnedRange:
    """A host range registered with the CUDA driver while `pinned`.

    Lifecycle: ``ensure()`` (any number of times; registers once, when CUDA is available),
    then ``release()`` before the memory is unmapped. Thread-safe.
    `register` and `unregister` stand in for the driver in tests."""

    def __init__(self, address: int, nbytes: int,
                 register: Callable[[int, int], int] | None = None,
                 unregister: Callable[[int], int] | None = None) -> None:
        self.address = address
        self.nbytes = nbytes
        self._register = register
        self._unregister = unregister
        self._lock = threading.Lock()
        self._done: list[tuple[int, int]] = []
        self._tried = False

    @property
    def pinned(self) -> bool:
        return bool(self._done)

    def _driver(self) -> tuple[Callable[[int, int], int], Callable[[int], int]] | None:
        if self._register is not None and self._unregister is not None:
            return self._register, self._unregister
        import torch

        if not torch.cuda.is_available():
            return None
        cudart = torch.cuda.cudart()
        return (lambda a, n: int(cudart.cudaHostRegister(a, n, _PORTABLE)),
                lambda a: int(cudart.cudaHostUnregister(a)))

    def ensure(self) -> bool:
        """Registers the range (once); True if it is pinned."""
        with self._lock:
            if self._tried:
                return self.pinned
            self._tried = True
            driver = self._driver()
            if driver is None or self.nbytes == 0:
                return False
            register, unregister = driver
            for address, size in pieces(self.address, self.nbytes):
                err = register(address, size)
                if err != 0:
                    log.warning("nebulite: cudaHostRegister of %d bytes of the memory tier failed "
                                "(cudaError %d); it stays pageable", size, err)
                    for a, _ in reversed(self._done):
                        unregister(a)
                    self._done.clear()
                    return False
                self._done.append((address, size))
            return True

    def release(self) -> None:
        """Unregisters what was registered (before the memory is unmapped)."""
        with self._lock:
            if not self._done:
                return
            driver = self._driver()
            assert driver is not None
            for address, _ in reversed(self._done):
                err = driver[1](address)
                if err != 0:
                    log.warning("nebulite: cudaHostUnregister failed (cudaError %d)", err)
            self._done.clear()


def cuda_in_use() -> bool:
    """True if this process has initialised CUDA (registering never initialises it)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()

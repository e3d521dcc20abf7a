"""The memory tier as pinned memory for CUDA: the arena registered with the driver.

Copies between a GPU and pageable host memory go through a driver bounce buffer, one
chunk at a time; from and into page-locked memory they run at the link's speed and may be
asynchronous. The arena (the embedded engine's, or the node agent's shared memory as this
process maps it) is registered with ``cudaHostRegister`` (through ``torch.cuda.cudart()``)
once per process that maps it, as one range, and unregistered before it is unmapped. One
range, not pieces: a copy whose host bytes span two registrations is refused by CUDA
(``cudaErrorInvalidValue``), and a tensor's place in the arena may span any boundary.

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

_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


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
        self._registered = False
        self._tried = False

    @property
    def pinned(self) -> bool:
        return self._registered

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
            err = driver[0](self.address, self.nbytes)
            if err != 0:
                log.warning("nebulite: cudaHostRegister of the memory tier (%d bytes) failed "
                            "(cudaError %d); it stays pageable", self.nbytes, err)
                return False
            self._registered = True
            return True

    def release(self) -> None:
        """Unregisters the range if it was registered (before the memory is unmapped)."""
        with self._lock:
            if not self._registered:
                return
            driver = self._driver()
            assert driver is not None
            err = driver[1](self.address)
            if err != 0:
                log.warning("nebulite: cudaHostUnregister failed (cudaError %d)", err)
            self._registered = False


def cuda_in_use() -> bool:
    """True if this process has initialised CUDA (registering never initialises it)."""
    import torch

    return torch.cuda.is_initialized()  # (only where CUDA is available)

"""Reading a checkpoint's object without importing or running anything it names.

A data file is a ``torch.save`` archive: ``data.pkl`` (the object's pickled skeleton,
tensors as references to storage records) and one record per storage. `Skeleton`
unpickles ``data.pkl`` allowing only plain containers, torch's dtypes, sizes and tensor
rebuilders: any other class becomes an `Opaque` (its name and state), so that DeepSpeed's
or Lightning's objects are shown without their packages, and nothing in the file runs.
With a `read_storage` function, tensors are real (their records read); without, each is
a `TensorInfo` (dtype, shape, bytes) and no payload is read.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch


@dataclass
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class _StorageRef:
    key: str
    dtype: torch.dtype


class Opaque:
    """An object of a class that is not imported: ``cls`` (module.name), and what its
    pickle gave it (constructor arguments, state, items)."""

    cls = "?"

    def __new__(cls, *args: Any, **kwargs: Any) -> "Opaque":
        obj = super().__new__(cls)
        obj.args, obj.state, obj.items = args, None, {}
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value

    def append(self, value: Any) -> None:
        self.items[len(self.items)] = value

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)

    def __repr__(self) -> str:
        return f"<{self.cls}>"

    def parts(self) -> dict[str, Any]:
        """Its contents by name, for walking: arguments, state and items."""
        out: dict[str, Any] = {f"arg{i}": a for i, a in enumerate(self.args)}
        if isinstance(self.state, dict):
            out.update({str(k): v for k, v in self.state.items()})
        elif self.state is not None:
            out["state"] = self.state
        out.update({str(k): v for k, v in self.items.items()})
        return out


_opaque_classes: dict[str, type] = {}


def _opaque(module: str, name: str) -> type:
    full = f"{module}.{name}"
    if full not in _opaque_classes:
        _opaque_classes[full] = type(name, (Opaque,), {"cls": full})
    return _opaque_classes[full]


_SAFE = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice, ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray, ("builtins", "object"): object,
    ("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
}


class Skeleton(pickle.Unpickler):
    def __init__(self, data: bytes, read_storage: Callable[[str, torch.dtype], Any] | None) -> None:
        super().__init__(io.BytesIO(data))
        self._read = read_storage
        self._storages: dict[str, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE:
            return _SAFE[module, name]
        if module == "copyreg" and name == "_reconstructor":
            return _reconstruct
        if module == "torch._utils" and name in _REBUILDERS:
            return _REBUILDERS[name] if self._read is None else getattr(torch._utils, name)
        if module == "torch._tensor" and name == "_rebuild_from_type_v2":
            return _rebuild_from_type_v2
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype) or (
                    isinstance(value, type) and name.endswith("Storage")):
                return value
        return _opaque(module, name)

    def persistent_load(self, pid: Any) -> Any:
        kind, storage_type, key, _location, _numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unknown reference {kind!r}")
        with warnings.catch_warnings():  # typed storages are what torch.load hands out too
            warnings.simplefilter("ignore", UserWarning)
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            if self._read is None:
                return _StorageRef(str(key), dtype)
            if key not in self._storages:
                untyped = self._read(str(key), dtype)
                self._storages[key] = torch.storage.TypedStorage(
                    wrap_storage=untyped, dtype=dtype, _internal=True)
        return self._storages[key]


def _reconstruct(cls: Any, base: Any, state: Any) -> Any:
    return cls.__new__(cls) if isinstance(cls, type) and issubclass(cls, Opaque) else base(state)


def _info_v2(storage: Any, offset: int, size: Any, stride: Any, *rest: Any) -> TensorInfo:
    return TensorInfo(storage.dtype, tuple(size))


def _info_parameter(data: Any, *rest: Any) -> Any:
    return data


_REBUILDERS: dict[str, Callable[..., Any]] = {
    "_rebuild_tensor_v2": _info_v2,
    "_rebuild_tensor": _info_v2,
    "_rebuild_parameter": _info_parameter,
    "_rebuild_parameter_with_state": _info_parameter,
}


def _rebuild_from_type_v2(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    return func(*args)  # the plain tensor: subclasses are not imported


def load(data_pkl: bytes, read_storage: Callable[[str, torch.dtype], Any] | None = None) -> Any:
    return Skeleton(data_pkl, read_storage).load()


def walk(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(key path, leaf) for each tensor and plain value in `obj`, depth first; key paths
    join dict keys and sequence indices with '.'."""
    def join(k: Any) -> str:
        return f"{path}.{k}" if path else str(k)

    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from walk(v, join(k))
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        for i, v in enumerate(obj):
            yield from walk(v, join(i))
    elif isinstance(obj, Opaque):
        yield path, obj  # its class, then what it holds
        for k, v in obj.parts().items():
            yield from walk(v, join(k))
    else:
        yield path, obj


def plain(value: Any) -> Any:
    """A JSON-serialisable form of a plain value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return str(value)
    if isinstance(value, Opaque):
        return repr(value)
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    return repr(value)

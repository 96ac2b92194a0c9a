"""A 1-d .npy file written piece by piece (token, mask and pixel arrays of the data cache)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np


class NpyStream:
    """A 1-d array of ``dtype`` streamed into a .npy file without holding it in memory.

    The header goes in last, when the count is known: numpy pads a .npy header so that its
    length does not depend on the array's length, so a header for zero items reserves
    exactly the space of the final one."""

    def __init__(self, path: Path, dtype):
        self._dtype = np.dtype(dtype).newbyteorder("<")
        self._handle = open(path, "wb")
        self._header_size = len(self._header(0))
        self._handle.write(b"\0" * self._header_size)
        self._count = 0

    def _header(self, count: int) -> bytes:
        buffer = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            buffer, {"descr": np.lib.format.dtype_to_descr(self._dtype),
                     "fortran_order": False, "shape": (count,)})
        return buffer.getvalue()

    def write(self, values: np.ndarray) -> None:
        self._handle.write(np.ascontiguousarray(values, dtype=self._dtype).tobytes())
        self._count += len(values)

    def __enter__(self) -> NpyStream:
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            header = self._header(self._count)
            if len(header) != self._header_size:
                raise RuntimeError("the .npy header changed size; cannot stream an array")
            self._handle.seek(0)
            self._handle.write(header)
        finally:
            self._handle.close()

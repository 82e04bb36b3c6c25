"""PostgreSQL's binary COPY format built from Arrow columns, with no Python loop over rows.

Pure: Arrow arrays in, one buffer out. A row is a 16-bit field count, then per field a 32-bit
length (-1 for NULL) and the value's bytes. Text, ``json`` and ``bytea`` values travel as their
bytes, so every field here is a binary column or a constant. pyarrow's element-wise binary
join concatenates the pieces of all rows at once (C++), and its data buffer is the COPY data.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

#: The header of a binary COPY stream: signature, flags, header extension length.
SIGNATURE = b"PGCOPY\n\xff\r\n\x00" + bytes(8)
_BIG_ENDIAN = sys.byteorder == "big"
_NULL = (-1).to_bytes(4, "big", signed=True)


class Const(bytes):
    """A field with the same value in every row, already encoded (length and bytes)."""

    @classmethod
    def of(cls, value: str | bytes | bool | None) -> Const:
        if value is None:
            return cls(_NULL)
        if isinstance(value, bool):
            return cls(b"\x00\x00\x00\x01" + (b"\x01" if value else b"\x00"))
        data = value.encode() if isinstance(value, str) else value
        return cls(len(data).to_bytes(4, "big") + data)


Field = Any  # a pyarrow string/binary array (nullable), or a ``Const``


def encode(fields: Sequence[Field]) -> pa.Buffer:
    """The COPY rows of ``fields`` (arrays of one length, at least one), without the header."""
    pieces: list[Any] = [len(fields).to_bytes(2, "big")]
    for f in fields:
        if isinstance(f, Const):
            _append_const(pieces, bytes(f))
            continue
        values = f.cast(pa.large_binary())
        pieces += [_lengths(values), pc.fill_null(values, b"")]
    args = [p if isinstance(p, pa.Array) else pa.scalar(p, pa.large_binary()) for p in pieces]
    joined = pc.binary_join_element_wise(*args, pa.scalar(b"", pa.large_binary()))
    return _data(joined)


def _append_const(pieces: list[Any], data: bytes) -> None:
    if isinstance(pieces[-1], bytes):
        pieces[-1] = pieces[-1] + data
    else:
        pieces.append(data)


def _lengths(values: pa.Array) -> pa.Array:
    """Each value's 32-bit big-endian length, -1 for a null, as 4-byte binaries."""
    lengths = pc.fill_null(pc.binary_length(values).cast(pa.int32()), -1)
    raw = array.array("i")
    raw.frombytes(_fixed_bytes(lengths, 4))
    if not _BIG_ENDIAN:
        raw.byteswap()
    fixed = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(4), len(lengths), [None, pa.py_buffer(raw)]
    )
    return fixed.cast(pa.large_binary())


def _fixed_bytes(values: pa.Array, width: int) -> bytes:
    buffer = values.buffers()[1]
    start = values.offset * width
    data: bytes = buffer[start : start + len(values) * width].to_pybytes()
    return data


def _data(joined: pa.Array) -> pa.Buffer:
    """The bytes of every value of a ``large_binary`` array, in order, as one buffer."""
    offsets = joined.buffers()[1]

    def offset(i: int) -> int:
        at = (joined.offset + i) * 8
        return int.from_bytes(offsets[at : at + 8].to_pybytes(), sys.byteorder, signed=True)

    return joined.buffers()[2][offset(0) : offset(len(joined))]

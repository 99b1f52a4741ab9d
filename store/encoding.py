"""How a store keeps blob bytes: plain, or zstd-compressed.

The digest is always of the plain bytes. A zstd blob is one standard zstd frame whose header
records the plain size; decoding refuses frames without it and stops at it, so a forged frame
cannot expand past the size its writer recorded (nor past the size a caller expects).
"""

from __future__ import annotations

import io
from enum import StrEnum
from typing import BinaryIO

import zstandard

from flare.errors import IntegrityError, InvalidInputError

ZSTD_HEADER_MAX = 18
VERIFY_HINT = "run `flare store verify` to quarantine it"
MULTITHREAD_FROM = 8 << 20
"""Blobs at least this large are compressed on all cores."""


class Encoding(StrEnum):
    """The stored form of a blob; the suffix of its file name says which."""

    PLAIN = "plain"
    ZSTD = "zstd"

    @property
    def suffix(self) -> str:
        return "" if self is Encoding.PLAIN else ".zst"

    @classmethod
    def from_name(cls, name: str) -> Encoding:
        """Parse an encoding name from a setting or an option."""
        try:
            return cls(str(name).strip().lower())
        except ValueError:
            raise InvalidInputError(
                f"unknown blob encoding {name!r}", "use one of: plain, zstd"
            ) from None


def check_zstd_level(level: int) -> int:
    """Refuse levels zstd does not have, before any byte is written."""
    if not 1 <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise InvalidInputError(
            f"zstd level {level} is out of range",
            f"use 1..{zstandard.MAX_COMPRESSION_LEVEL} (3 is a good default)",
        )
    return level


def zstd_writer(raw: BinaryIO, size: int, level: int) -> BinaryIO:
    """A writer that compresses exactly `size` plain bytes into `raw` as one frame."""
    compressor = zstandard.ZstdCompressor(
        level=level, write_content_size=True, threads=-1 if size >= MULTITHREAD_FROM else 0
    )
    return compressor.stream_writer(raw, size=size, closefd=False)  # type: ignore[return-value]


def zstd_plain_size(raw: BinaryIO, where: str) -> int:
    """Read the plain size a zstd frame records in its header; the reader is left at 0."""
    header = raw.read(ZSTD_HEADER_MAX)
    raw.seek(0)
    try:
        size = zstandard.get_frame_parameters(header).content_size
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"{where} is not a zstd frame: {exc}", VERIFY_HINT) from exc
    if size == zstandard.CONTENTSIZE_UNKNOWN:
        raise IntegrityError(f"{where} does not record its plain size", VERIFY_HINT)
    return size


class BoundedZstdReader(io.RawIOBase):
    """Decodes one zstd frame and refuses to produce more bytes than its recorded size."""

    def __init__(self, raw: BinaryIO, where: str, expected_size: int | None = None) -> None:
        super().__init__()
        self.where = where
        self.size = zstd_plain_size(raw, where)
        if expected_size is not None and self.size != expected_size:
            raise IntegrityError(
                f"{where} records {self.size} plain bytes, expected {expected_size}",
                VERIFY_HINT,
            )
        self._raw = raw
        self._reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=False)
        self._remaining = self.size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        if self._remaining == 0:
            self._check_end()
            return 0
        want = min(len(buffer), self._remaining)
        data = self._decode(want)
        if not data:
            raise IntegrityError(f"{self.where} ends before its recorded size", VERIFY_HINT)
        buffer[: len(data)] = data
        self._remaining -= len(data)
        return len(data)

    def _decode(self, size: int) -> bytes:
        try:
            return self._reader.read(size)
        except zstandard.ZstdError as exc:
            raise IntegrityError(f"{self.where} does not decode: {exc}", VERIFY_HINT) from exc

    def _check_end(self) -> None:
        if self._decode(1):
            raise IntegrityError(
                f"{self.where} decodes past its recorded size {self.size}",
                VERIFY_HINT,
            )

    def close(self) -> None:
        if not self.closed:
            self._reader.close()
            self._raw.close()
        super().close()

"""Bounded request-body reading and Content-Encoding decoding.

Both the encoded and the decoded body are capped at max_bytes: reading stops at the first
chunk past the cap, and decoders emit bounded pieces so a compression bomb is refused after
about max_bytes of output, never materialised.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import zlib
from collections.abc import AsyncIterator, Iterator, Sequence

import brotli
import zstandard

SUPPORTED = ("identity", "gzip", "deflate", "br", "zstd")
_ALIASES = {"x-gzip": "gzip"}
_MAX_CODINGS = 3  # stacked codings each cost up to max_bytes of work; more is abuse
_IN_SLICE = 1 << 16  # encoded bytes handed to a decoder at once
_OUT_CHUNK = 1 << 20  # most decoded bytes one decoder call may return
_ZSTD_WINDOW = 1 << 23  # RFC 8878 §3.1.1.1.2: HTTP zstd windows are at most 8 MiB
_ZSTD_RATIO = 1 << 15  # worst zstd expansion per input byte (4-byte RLE block -> 128 KiB)
_ZSTD_STEP = _OUT_CHUNK // _ZSTD_RATIO  # 32 bytes: cheap, the C decoder takes ~0.4 us a call
_CORRUPT = (zlib.error, brotli.error, zstandard.ZstdError)


class BodyError(Exception):
    """A body refused before parsing: 413 too large, 415 unknown coding, 400 corrupt."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_encodings(content_encoding: str | None) -> list[str]:
    """Codings in the order they were applied, identity dropped; 415 for unknown ones."""
    codings = []
    for token in (content_encoding or "").split(","):
        name = _ALIASES.get(token.strip().lower(), token.strip().lower())
        if name in ("", "identity"):
            continue
        if name not in SUPPORTED:
            raise BodyError(415, f"Unsupported Content-Encoding {token.strip()!r}; supported: {', '.join(SUPPORTED)}")
        codings.append(name)
    if len(codings) > _MAX_CODINGS:
        raise BodyError(415, f"At most {_MAX_CODINGS} stacked content codings are supported")
    return codings


async def read_body(
    chunks: AsyncIterator[bytes],
    content_encoding: str | None,
    max_bytes: int,
    pool: concurrent.futures.Executor | None = None,
    timeout: float | None = None,
) -> bytes:
    """Read and decode a request body; raises BodyError. Decoding runs in `pool` when given.

    `timeout` bounds the whole read (a client dripping bytes holds a connection and memory).
    """
    codings = parse_encodings(content_encoding)  # refuse before reading anything
    encoded = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for chunk in chunks:
                if len(encoded) + len(chunk) > max_bytes:
                    aclose = getattr(chunks, "aclose", None)
                    if aclose is not None:
                        await aclose()
                    raise BodyError(413, f"Request body exceeds max_body_bytes ({max_bytes} bytes)")
                encoded += chunk
    except TimeoutError:
        raise BodyError(408, f"the request body did not arrive within {timeout:g} s (body_timeout_seconds)") from None
    if not codings or not encoded:
        return bytes(encoded)
    if pool is None:
        return decode(encoded, codings, max_bytes)
    return await asyncio.get_running_loop().run_in_executor(pool, decode, encoded, codings, max_bytes)


def decode(data: bytes | bytearray, codings: Sequence[str], max_bytes: int) -> bytes:
    """Undo `codings` (in application order) with every stage's output capped at max_bytes."""
    out: bytes | bytearray = data
    for name in reversed(codings):
        out = _decode_one(out, name, max_bytes)
    return bytes(out)


def _decode_one(data: bytes | bytearray, name: str, max_bytes: int) -> bytearray:
    decoder = _make_decoder(name, data)
    view = memoryview(data)
    out = bytearray()
    try:
        for start in range(0, len(view), _IN_SLICE):
            for piece in decoder.feed(view[start : start + _IN_SLICE]):
                _append(out, piece, max_bytes)
        for piece in decoder.finish():
            _append(out, piece, max_bytes)
    except _CORRUPT as exc:
        raise BodyError(400, f"Invalid {name}-encoded request body: {exc}") from None
    return out


def _append(out: bytearray, piece: bytes, max_bytes: int) -> None:
    if len(out) + len(piece) > max_bytes:
        raise BodyError(413, f"Decoded request body exceeds max_body_bytes ({max_bytes} bytes)")
    out += piece


class _Zlib:
    """gzip (concatenated members allowed), zlib-wrapped deflate, or raw deflate."""

    def __init__(self, wbits: int, members: bool) -> None:
        self._wbits, self._members = wbits, members
        self._d = zlib.decompressobj(wbits)

    def feed(self, data: memoryview) -> Iterator[bytes]:
        pending: bytes | memoryview = data
        while pending:
            if self._d.eof:
                if not self._members:
                    raise zlib.error("trailing data after the deflate stream")
                self._d = zlib.decompressobj(self._wbits)
            piece = self._d.decompress(pending, _OUT_CHUNK)
            pending = self._d.unused_data if self._d.eof else self._d.unconsumed_tail
            if piece:
                yield piece
        yield from self._drain()

    def _drain(self) -> Iterator[bytes]:  # output held back by the max_length cap
        while not self._d.eof and (piece := self._d.decompress(b"", _OUT_CHUNK)):
            yield piece

    def finish(self) -> Iterator[bytes]:
        yield from self._drain()
        if not self._d.eof:
            raise zlib.error("truncated stream")


class _Brotli:
    def __init__(self) -> None:
        self._d = brotli.Decompressor()

    def feed(self, data: memoryview) -> Iterator[bytes]:
        if self._d.is_finished():
            raise brotli.error("trailing data after the brotli stream")
        yield self._d.process(data, output_buffer_limit=_OUT_CHUNK)
        while not self._d.can_accept_more_data():
            yield self._d.process(b"", output_buffer_limit=_OUT_CHUNK)

    def finish(self) -> Iterator[bytes]:
        while not self._d.is_finished():
            piece = self._d.process(b"", output_buffer_limit=_OUT_CHUNK)
            if not piece:
                raise brotli.error("truncated stream")
            yield piece


class _Zstd:
    """zstd frames in sequence. decompressobj returns all output its input yields, so input
    goes in slices whose worst case (_ZSTD_RATIO per byte) is about _OUT_CHUNK."""

    def __init__(self) -> None:
        self._dctx = zstandard.ZstdDecompressor(max_window_size=_ZSTD_WINDOW)
        self._d = self._dctx.decompressobj()

    def feed(self, data: memoryview) -> Iterator[bytes]:
        for start in range(0, len(data), _ZSTD_STEP):
            pending: bytes | memoryview = data[start : start + _ZSTD_STEP]
            while pending:
                if self._d.eof:
                    self._d = self._dctx.decompressobj()
                piece = self._d.decompress(pending)
                pending = self._d.unused_data if self._d.eof else b""
                if piece:
                    yield piece

    def finish(self) -> Iterator[bytes]:
        if not self._d.eof:
            raise zstandard.ZstdError("truncated stream")
        yield from ()


def _is_zlib_header(data: bytes | bytearray) -> bool:
    return len(data) >= 2 and data[0] & 0x0F == 8 and data[0] >> 4 <= 7 and (data[0] << 8 | data[1]) % 31 == 0


def _make_decoder(name: str, data: bytes | bytearray) -> _Zlib | _Brotli | _Zstd:
    if name == "gzip":
        return _Zlib(16 + zlib.MAX_WBITS, members=True)
    if name == "deflate":  # RFC 9110 says zlib-wrapped; some clients send raw deflate
        return _Zlib(zlib.MAX_WBITS if _is_zlib_header(data) else -zlib.MAX_WBITS, members=False)
    if name == "br":
        return _Brotli()
    return _Zstd()

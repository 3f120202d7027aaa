"""Request bodies: every content coding round-trips; oversize, bombs, unknown and corrupt codings are refused."""

from __future__ import annotations

import asyncio
import gzip
import os
import struct
import tracemalloc
import zlib
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import brotli
import pytest
import zstandard

from helios.server.body import BodyError, read_body

MIB = 1 << 20
PAYLOAD = b'{"messages": [{"role": "user", "content": "hi"}]} ' * 2000 + os.urandom(3000)


def _raw_deflate(data: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


ENCODERS: dict[str, Callable[[bytes], bytes]] = {
    "gzip": gzip.compress,
    "x-gzip": gzip.compress,
    "GZip": gzip.compress,
    "deflate": zlib.compress,
    "br": brotli.compress,
    "zstd": zstandard.ZstdCompressor().compress,
}


async def _chunks(data: bytes, size: int = 65536) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def _read(data: bytes, encoding: str | None, max_bytes: int = 32 * MIB, pool: Any = None) -> bytes:
    return asyncio.run(read_body(_chunks(data), encoding, max_bytes, pool))


def _status(data: bytes, encoding: str | None, max_bytes: int = 32 * MIB) -> tuple[int, str]:
    with pytest.raises(BodyError) as info:
        _read(data, encoding, max_bytes)
    return info.value.status, info.value.message


@pytest.mark.parametrize("encoding", [None, "", "identity", " Identity "])
def test_identity_returns_the_body(encoding: str | None) -> None:
    assert _read(PAYLOAD, encoding) == PAYLOAD


@pytest.mark.parametrize("encoding", sorted(ENCODERS))
def test_each_coding_round_trips(encoding: str) -> None:
    assert _read(ENCODERS[encoding](PAYLOAD), encoding) == PAYLOAD


@pytest.mark.parametrize(
    "encoding,encode",
    [
        ("deflate", _raw_deflate),  # raw deflate without the zlib wrapper, as some clients send it
        ("gzip", lambda d: gzip.compress(d[:1000]) + gzip.compress(d[1000:])),  # concatenated members
        (
            "zstd",
            lambda d: zstandard.ZstdCompressor().compress(d[:1000]) + zstandard.ZstdCompressor().compress(d[1000:]),
        ),
        ("gzip, br", lambda d: brotli.compress(gzip.compress(d))),  # stacked codings decode in reverse
        ("identity, zstd", zstandard.ZstdCompressor().compress),
    ],
)
def test_coding_variants(encoding: str, encode: Callable[[bytes], bytes]) -> None:
    assert _read(encode(PAYLOAD), encoding) == PAYLOAD


def test_decoding_runs_in_the_given_pool() -> None:
    submitted: list[object] = []

    class Pool(ThreadPoolExecutor):
        def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
            submitted.append(fn)
            return super().submit(fn, *args, **kwargs)

    with Pool(1) as pool:
        assert _read(gzip.compress(PAYLOAD), "gzip", pool=pool) == PAYLOAD
    assert submitted


def test_encoded_overflow_is_refused_without_reading_the_rest() -> None:
    consumed = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal consumed
        while True:
            consumed += 1
            yield bytes(65536)

    with pytest.raises(BodyError) as info:
        asyncio.run(read_body(endless(), None, MIB))
    assert info.value.status == 413 and "max_body_bytes" in info.value.message
    assert consumed == MIB // 65536 + 1


def test_body_of_exactly_max_bytes_is_accepted() -> None:
    assert _read(bytes(MIB), None, MIB) == bytes(MIB)
    assert _status(bytes(MIB + 1), None, MIB)[0] == 413


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd"])
def test_decoded_overflow_is_refused(encoding: str) -> None:
    encode = ENCODERS[encoding]
    assert _read(encode(bytes(MIB)), encoding, MIB) == bytes(MIB)
    status, message = _status(encode(bytes(MIB + 1)), encoding, MIB)
    assert status == 413 and "Decoded" in message


def _gzip_bomb(mib: int) -> Iterable[bytes]:
    """A valid gzip member of `mib` MiB of zeros, ~1 KiB per MiB, built without holding the output:
    after a full flush every 1 MiB zero block compresses to the same bytes."""
    zeros = bytes(MIB)
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    first = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    block = c.compress(zeros) + c.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(mib):
        crc = zlib.crc32(zeros, crc)
    yield b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + first
    for _ in range(mib - 1):
        yield block
    yield c.flush() + struct.pack("<II", crc, (mib * MIB) & 0xFFFFFFFF)


def test_bomb_construction_is_valid_gzip() -> None:
    assert gzip.decompress(b"".join(_gzip_bomb(4))) == bytes(4 * MIB)


def test_gzip_bomb_is_refused_in_bounded_memory() -> None:
    bomb = b"".join(_gzip_bomb(1024))  # 1 GiB of zeros
    assert len(bomb) < 2 * MIB
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        with pytest.raises(BodyError) as info:
            _read(bomb, "gzip", 32 * MIB)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.status == 413
    assert peak < 64 * MIB, f"peak {peak / MIB:.1f} MiB"


@pytest.mark.parametrize("encoding", ["br", "zstd"])
def test_br_and_zstd_bombs_are_refused_in_bounded_memory(encoding: str) -> None:
    zeros = bytes(MIB)
    if encoding == "br":
        c = brotli.Compressor(quality=1)
        bomb = b"".join(c.process(zeros) for _ in range(1024)) + c.finish()
    else:
        z = zstandard.ZstdCompressor(level=1).compressobj()
        bomb = b"".join(z.compress(zeros) for _ in range(1024)) + z.flush()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        assert _status(bomb, encoding, 32 * MIB)[0] == 413
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * MIB, f"peak {peak / MIB:.1f} MiB"


@pytest.mark.parametrize("encoding", ["compress", "gzip, foo", "x-custom"])
def test_unknown_coding_is_415_before_reading(encoding: str) -> None:
    async def untouchable() -> AsyncIterator[bytes]:
        raise AssertionError("body read despite an unsupported coding")
        yield b""

    with pytest.raises(BodyError) as info:
        asyncio.run(read_body(untouchable(), encoding, MIB))
    assert info.value.status == 415
    assert encoding.split(",")[-1].strip() in info.value.message
    assert "gzip" in info.value.message and "zstd" in info.value.message


def test_too_many_stacked_codings_is_415() -> None:
    assert _status(b"x", "gzip, gzip, gzip, gzip")[0] == 415


@pytest.mark.parametrize(
    "encoding,body",
    [
        ("gzip", b"not gzip at all"),
        ("gzip", gzip.compress(PAYLOAD)[:-20]),  # truncated
        ("gzip", gzip.compress(PAYLOAD) + b"trailing junk"),
        ("deflate", b"\x78\x9c garbage"),
        ("deflate", zlib.compress(PAYLOAD)[:-10]),
        ("deflate", zlib.compress(PAYLOAD) + b"x"),
        ("br", b"\xff\xff not brotli"),
        ("br", brotli.compress(PAYLOAD)[:-5]),
        ("zstd", b"not zstd"),
        ("zstd", zstandard.ZstdCompressor().compress(PAYLOAD)[:-10]),
        ("zstd", zstandard.ZstdCompressor().compress(PAYLOAD) + b"junk"),
    ],
)
def test_corrupt_bodies_are_400(encoding: str, body: bytes) -> None:
    status, message = _status(body, encoding)
    assert status == 400 and encoding in message


def test_zstd_window_above_8_mib_is_refused() -> None:
    params = zstandard.ZstdCompressionParameters(window_log=24)
    body = zstandard.ZstdCompressor(compression_params=params).compress(os.urandom(1 << 16) * 300)
    assert _status(body, "zstd")[0] == 400

"""multipart/form-data bodies (System One image assets): split a bounded, already read body
into named parts. Only what the route needs: a boundary from the Content-Type, each part's
Content-Disposition name and Content-Type; nested multiparts and per-part encodings refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_NAME = re.compile(r'(?:^|;)\s*name="([^"]*)"', re.IGNORECASE)


class MultipartError(ValueError):
    """A body that is not well-formed multipart/form-data (HTTP 400)."""


@dataclass(frozen=True, slots=True)
class Part:
    name: str  # the Content-Disposition form-data name
    content_type: str  # lower-cased media type without parameters; "" when absent
    data: bytes


def boundary(content_type: str) -> bytes:
    match = _BOUNDARY.search(content_type)
    if match is None:
        raise MultipartError("multipart/form-data needs a boundary parameter in its Content-Type")
    value = match.group(1) or match.group(2)
    if not 1 <= len(value) <= 70:
        raise MultipartError("the multipart boundary must be 1 to 70 characters")
    return value.encode("latin-1")


def parse(body: bytes, content_type: str) -> list[Part]:
    """The parts in body order; the preamble and epilogue are ignored."""
    delimiter = b"--" + boundary(content_type)
    start = body.find(delimiter)
    if start < 0:
        raise MultipartError("the multipart body has no boundary line")
    parts: list[Part] = []
    position = start + len(delimiter)
    while True:
        if body.startswith(b"--", position):
            return parts  # the closing delimiter
        if not body.startswith(b"\r\n", position):
            raise MultipartError("a multipart boundary line must end with CRLF")
        end = body.find(b"\r\n" + delimiter, position + 2)
        if end < 0:
            raise MultipartError("the multipart body ends before its closing boundary")
        parts.append(_part(body[position + 2 : end]))
        position = end + 2 + len(delimiter)


def _part(raw: bytes) -> Part:
    head, separator, data = raw.partition(b"\r\n\r\n")
    if not separator:
        if raw.startswith(b"\r\n"):  # a part without headers
            head, data = b"", raw[2:]
        else:
            raise MultipartError("a multipart part has no blank line after its headers")
    headers: dict[str, str] = {}
    for line in head.decode("latin-1").split("\r\n"):
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon:
            raise MultipartError(f"malformed multipart header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    disposition = headers.get("content-disposition", "")
    match = _NAME.search(disposition.partition(";")[2]) if disposition.lower().startswith("form-data") else None
    if match is None:
        raise MultipartError("every multipart part needs Content-Disposition: form-data with a name")
    encoding = headers.get("content-transfer-encoding", "binary").lower()
    if encoding not in ("binary", "8bit", "7bit"):
        raise MultipartError(
            f"multipart part {match.group(1)!r} uses Content-Transfer-Encoding {encoding!r}; send the bytes as they are"
        )
    content_type = headers.get("content-type", "").split(";")[0].strip().lower()
    return Part(match.group(1), content_type, data)

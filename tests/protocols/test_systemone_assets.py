"""System One asset references and the multipart splitter, without a model: whole-value matches
first, nonoverlapping left-to-right (longest name at a position), keys stay text, JSON escaping
kept around a partial reference; multipart parts in order with their names and types."""

from __future__ import annotations

import pytest

from helios.frontend.inference import ImagePart
from helios.protocols import systemone
from helios.server import multipart

A = ImagePart(b"\x89PNG\r\n\x1a\na", "image/png")
B = ImagePart(b"\x89PNG\r\n\x1a\nb", "image/png")


def test_references_replace_whole_values_then_left_to_right_matches() -> None:
    refs = systemone.References({"img": A, "img10": B})
    assert refs.content("img") == (A,)
    assert refs.content("img10 beside img") == (B, " beside ", A)
    assert refs.content("no reference") == "no reference"
    assert refs.content({"img": "img", "n": 'see "img10"', "k": [1]}) == (
        '{"img": ',
        A,
        ', "n": "see \\"',
        B,
        '\\"", "k": [1]}',
    )
    assert refs.used == {"img", "img10"}
    assert systemone.References({}).content({"a": "img"}) == '{"a": "img"}'


def test_unreferenced_assets_and_orphan_parts_are_refused() -> None:
    body = {"model": "m", "state": "img", "questions": {"q": {"type": "noul", "instructions": "?"}}}
    assets = systemone.decode_assets(
        {
            **body,
            "assets": {
                "img": {"format": "png", "part": "p"},
                "other": {"format": "png", "data_base64": "iVBORw0KGgo="},
            },
        },
        {"p": A.data},
    )
    assert assets["img"].data == A.data
    with pytest.raises(systemone.RequestError, match="asset 'other' is never referenced"):
        systemone.decode(body, assets)
    with pytest.raises(systemone.RequestError, match="multipart part 'p' belongs to no asset"):
        systemone.decode_assets(body, {"p": A.data})
    with pytest.raises(systemone.SchemaError):
        systemone.decode_assets({**body, "assets": {"img": {"format": "png"}}})


def test_multipart_parts_in_order() -> None:
    body = (
        b'preamble\r\n--XyZ\r\nContent-Disposition: form-data; name="request"\r\nContent-Type: application/json\r\n'
        b'\r\n{"a": 1}\r\n--XyZ\r\nContent-Disposition: form-data; name="img"; filename="i.png"\r\n'
        b"Content-Type: image/png\r\n\r\n\x89PNG\r\n--Xy\r\n--XyZ--\r\n"
    )
    parts = multipart.parse(body, 'multipart/form-data; boundary="XyZ"')
    assert [(p.name, p.content_type, p.data) for p in parts] == [
        ("request", "application/json", b'{"a": 1}'),
        ("img", "image/png", b"\x89PNG\r\n--Xy"),
    ]
    with pytest.raises(multipart.MultipartError):
        multipart.parse(body[:-9], "multipart/form-data; boundary=XyZ")

"""A tiled image's feature rows sit in runs between framing tokens (EngineImage.runs): which prompt
positions they cover, and which rows each prefill chunk's step receives, with chunks cutting
through tiles and framing; the vision program runs once per view and only once per image."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from helios.engine.images import ImageEncoder
from helios.engine.request import EngineImage, EngineStats

# Two tiles of 4 rows, then a global view of 9: <patch_start> t t t t <patch_end> <patch_start> t t t t
# <patch_end> <im_start> g*9 <im_end>, the first feature row at prompt position 11.
RUNS = ((0, 4), (6, 4), (12, 9))
START = 11


def _views() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three views whose 'pixels' are their feature values, so rows can be traced."""
    return [
        (torch.arange(n, dtype=torch.float32)[:, None] + 100 * v, torch.zeros(n, 2, dtype=torch.int64))
        for v, n in enumerate((4, 4, 9))
    ]


def _image() -> EngineImage:
    return EngineImage(start=START, num_tokens=17, digest=b"d", prepare=_views, runs=RUNS)


def test_runs_cover_only_feature_rows() -> None:
    image = _image()
    assert image.end == START + 21 and image.spans() == [(11, 0, 4), (17, 4, 4), (23, 8, 9)]
    covered = [p for p in range(40) if image.covers(p)]
    assert covered == [*range(11, 15), *range(17, 21), *range(23, 32)]
    plain = EngineImage(start=3, num_tokens=5, digest=b"d", prepare=_views)
    assert (
        plain.end == 8 and plain.spans() == [(3, 0, 5)] and [p for p in range(10) if plain.covers(p)] == [3, 4, 5, 6, 7]
    )


def test_chunks_through_tiles_receive_their_rows_in_order() -> None:
    calls = []

    def program(weights, kv, pixel_values, pixel_positions):
        calls.append(pixel_values.shape[0])
        return {"image_features": pixel_values.repeat(1, 2)}  # width 2

    stats = EngineStats()
    encoder = ImageEncoder(program, {}, 2, 64, "cpu", stats)
    request = SimpleNamespace(images=(_image(),))
    seq = SimpleNamespace(request=request)
    got_rows, got_features = [], []
    for lo, hi in ((0, 13), (13, 19), (19, 40)):  # cuts inside tile 1, inside tile 2, then the rest
        inputs = encoder.step_inputs([SimpleNamespace(seq=seq, start=lo, num_tokens=hi - lo)], [0])
        rows = inputs["image_rows"].tolist()
        if rows != [-1]:
            got_rows += [lo + r for r in rows]
            got_features += inputs["image_features"][:, 0].tolist()
    assert got_rows == [p for p in range(40) if request.images[0].covers(p)]
    assert got_features == [0, 1, 2, 3, 100, 101, 102, 103, *(200 + i for i in range(9))]
    assert calls == [4, 4, 9] and stats.images["input_vision_encodes_total"] == 1
    assert encoder.stored_rows == 0  # the chunk with the last row freed the image's rows

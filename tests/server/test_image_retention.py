"""Host retention of CPU vision inputs on a tiny Gemma 4 vision core (spec "Configured host memory
and disk retention also cache source descriptions and CPU vision inputs"): after a restart over
the same host cache directory an image sent again after different text is neither decoded nor
preprocessed, and the answer is the one its fresh preparation gave; a corrupt disk record, or one
evicted under a small budget, is rebuilt from the supplied image data with the same views."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch
from live import live_server
from PIL import Image
from support import TinyCores

from helios.config import ServerConfig
from helios.core import Core
from helios.engine import VisionInputStore, vision_identity
from helios.frontend import images as imaging
from helios.frontend.image_cache import retained_inputs
from helios.frontend.inference import ImagePart
from helios.frontend.request import Frontend
from tests.ignition.vision_cases import GEMMA
from tests.ignition.vision_checks import tiny_vision


def _png(seed: int, width: int = 48, height: int = 30) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


PICTURE = _png(7)


@pytest.fixture(scope="module")
def core(tiny_cores: TinyCores) -> Path:
    """The tiny Gemma 4 vision core (float32) the vision and image tests share; its prompt-logprobs
    program is never run here."""
    return tiny_vision(tiny_cores, GEMMA)[1]


def _ask(url: str, text: str, salt: str) -> dict:
    """Text first, then the picture: a changed text leaves no prefix page that covers the image (the
    salt keeps any prefix of another server's requests out of reach as well)."""
    content = [
        {"type": "text", "text": text},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(PICTURE).decode()}},
    ]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 3,
        "logprobs": True,
        "top_logprobs": 3,
        "seed": 5,
        "cache_salt": salt,
    }
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _counts(state) -> dict[str, int]:
    names = (
        "input_decoded_images_total",
        "input_host_cache_hits_total",
        "input_host_cache_restores_total",
        "input_prepared_images_total",
        "input_vision_encodes_total",
    )
    snapshot = state.snapshot()
    return {name.removeprefix("input_").removesuffix("_total"): snapshot[name] for name in names}


def _record(state) -> Path:
    """The one vision-input record file of this server's retention."""
    (path,) = state.frontend.images.retained.store.directory.glob("*.rec")
    return path


def test_a_restart_neither_decodes_nor_preprocesses_a_retained_image(core: Path, tmp_path: Path) -> None:
    config = ServerConfig(kv_pages=256, speculation="off", prefill_chunk_size=40, host_cache_dir=str(tmp_path))
    later = "Something else entirely, then the same picture:"
    with live_server(core, config) as (url, state):
        _ask(url, "A picture:", "one")
        reference = _ask(url, later, "one")  # the features of its fresh preparation (prepared-input cache)
        assert _counts(state) == {
            "decoded_images": 1,
            "host_cache_hits": 0,
            "host_cache_restores": 0,
            "prepared_images": 1,
            "vision_encodes": 1,
        }
        state.frontend.images.retained.flush()
        record = _record(state)
    written = record.read_bytes()

    with live_server(core, config) as (url, state):  # a restart: every in-process cache is empty
        restored = _ask(url, later, "two")
        assert _counts(state) == {
            "decoded_images": 0,  # a restored record is not a decode
            "host_cache_hits": 1,
            "host_cache_restores": 1,
            "prepared_images": 0,
            "vision_encodes": 1,  # the vision graph still runs outside a reused prefix
        }
    assert restored == reference

    corrupt = bytearray(written)
    corrupt[len(corrupt) // 2] ^= 0xFF  # a payload byte: the checksum no longer matches
    record.write_bytes(bytes(corrupt))
    with live_server(core, config) as (url, state):
        rebuilt = _ask(url, later, "three")
        assert _counts(state) == {
            "decoded_images": 1,  # rebuilt from the supplied image data
            "host_cache_hits": 0,
            "host_cache_restores": 0,
            "prepared_images": 1,
            "vision_encodes": 1,
        }
        state.frontend.images.retained.flush()
        assert _record(state).read_bytes() == written  # retained again, sound
    assert rebuilt == reference


def _prepare(frontend: Frontend, data: bytes) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What the engine's prefill asks of one image: the frontend's EngineImage, then its views."""
    ((part, header, cost),) = frontend.images.check([ImagePart(data, "image/png")])
    return frontend.images.engine_image(part, header, cost, start=0).prepare()


def _same(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) and torch.equal(p, q) for (x, p), (y, q) in zip(a, b))


def test_an_image_evicted_under_a_small_budget_is_rebuilt_from_its_data(core: Path, tmp_path: Path) -> None:
    opened = Core.open(core)
    profile = opened.manifest.vision
    config = ServerConfig(host_cache_dir=str(tmp_path))
    first, second = _png(1), _png(2)
    fresh = imaging.prepare_views(imaging.decode(first), profile)
    size = sum(x.numel() * 4 + p.numel() * 8 for x, p in fresh)

    def frontend() -> Frontend:
        """A started frontend whose retention holds about one record in each tier."""
        made = Frontend(opened, config)
        made.images.retained = VisionInputStore(
            vision_identity(imaging.preparation(profile)), size * 3 // 2, tmp_path, size * 3 // 2
        )
        return made

    before = frontend()
    assert _same(_prepare(before, first), fresh)
    before.images.retained.flush()
    assert before.images.retained.disk_records == 1
    _prepare(before, second)  # the newer record pushes the first out of both tiers
    before.images.retained.flush()
    assert before.images.retained.memory_records == before.images.retained.disk_records == 1
    assert before.images.counters["input_decoded_images_total"] == 2

    after = frontend()  # a restart over the same directory
    assert _same(_prepare(after, second), imaging.prepare_views(imaging.decode(second), profile))
    assert after.images.counters["input_host_cache_hits_total"] == 1
    assert after.images.counters["input_decoded_images_total"] == 0
    assert _same(_prepare(after, first), fresh)  # evicted: decoded and prepared again
    assert after.images.counters["input_decoded_images_total"] == 1
    assert after.images.counters["input_host_cache_hits_total"] == 1
    assert after.images.counters["input_host_cache_restores_total"] == 1


def test_retention_follows_the_host_cache_settings(core: Path, tmp_path: Path) -> None:
    """host_cache = false keeps nothing; the disk tier is a directory of its own beside the prefix
    records, and another preparation (here: another profile) never reads its records."""
    profile = Core.open(core).manifest.vision
    assert retained_inputs(profile, ServerConfig(host_cache=False)) is None
    store = retained_inputs(profile, ServerConfig(host_cache_dir=str(tmp_path), image_cache_mb=1))
    assert store is not None and store.store.memory_bytes == 1 << 20 and store.store.directory.parent == tmp_path
    views = imaging.prepare_views(imaging.decode(PICTURE), profile)
    header = imaging.read_header(PICTURE, profile, "image 1")
    digest, source = imaging.content_digest(PICTURE, profile), imaging.source_description(header)
    assert store.retain(digest, source, views)
    store.flush()
    assert _same(store.restore(digest, source), views)
    assert store.restore(digest, (*source[:3], source[3] + 1)) is None  # another source under the digest
    other = retained_inputs(msgspec.structs.replace(profile, patch_size=8), ServerConfig(host_cache_dir=str(tmp_path)))
    assert other is not None and other.store.directory != store.store.directory
    assert other.restore(digest, source) is None

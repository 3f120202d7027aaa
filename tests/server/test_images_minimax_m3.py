"""Images through the real server on a tiny MiniMax M3 vision core (smart_resize profile): a JPEG in a
Chat Completions round trip through the strict OpenAI SDK, buffered and streamed, with usage's image
tokens; the rendered prompt's image span equal to transformers' MiniMaxM3VLProcessor expansion; the
first generated token's logprobs against MiniMaxM3SparseForConditionalGeneration on the same ids,
prefilled in chunks that cut through the image; an extreme aspect ratio whose smart_resize exceeds
the per-image token limit refused with its observed size."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from live import live_server
from PIL import Image

from helios.config import ServerConfig
from helios.frontend import images
from helios.frontend.inference import Conversation, ImagePart, Message, TextPart
from ignition.export import ExportOptions, export_core
from ignition.recipe import load_recipe
from ignition.sources import open_source
from ignition.testmodel import write_testmodel
from tests.ignition.test_minimax_m3_vision import SHAPES, encode, pixel_inputs, reference_processor

IMAGE = encode(*SHAPES[1])  # JPEG 300 x 200: scaled down to 252 x 168, 54 tokens
MEDIA = "image/jpeg"
QUESTION = "What is in this picture?"


def data_url(data: bytes, media: str) -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    checkpoint = write_testmodel(
        "minimax_m3", tmp_path_factory.mktemp("ckpt") / "tiny-minimax-m3-vision", seed=3, vision=True
    )
    out = tmp_path_factory.mktemp("cores") / "minimax-m3-vision"
    export_core(open_source(str(checkpoint)), load_recipe("minimax_m3"), ExportOptions(out=out, dtype="float32"))
    return checkpoint, out


@pytest.fixture(scope="module")
def served(vision: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    config = ServerConfig(
        kv_pages=128, speculation="off", prefill_chunk_size=24, host_cache_dir=str(tmp_path_factory.mktemp("prefix"))
    )
    with live_server(vision[1], config) as pair:
        yield pair


def _messages(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


def test_chat_completion_with_an_image_matches_transformers(vision, served) -> None:
    state = served[1]
    prompt = state.frontend.prompt(Conversation((Message("user", (TextPart(QUESTION), ImagePart(IMAGE, MEDIA))),)))
    cost = images.cost(300, 200, state.frontend.vision)
    assert (cost.height, cost.width) == (168, 252) and prompt.image_tokens == cost.num_tokens == 54
    oai = openai.OpenAI(base_url=served[0] + "/v1", api_key="k", _strict_response_validation=True, max_retries=0)
    completion = oai.chat.completions.create(
        model="m", messages=_messages(data_url(IMAGE, MEDIA)), max_tokens=2, logprobs=True, top_logprobs=20, seed=1
    )
    assert completion.choices[0].finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.prompt_tokens == len(prompt.token_ids)
    assert usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"] == cost.num_tokens
    ours = [t.logprob for t in completion.choices[0].logprobs.content[0].top_logprobs]

    stream = oai.chat.completions.create(
        model="m",
        messages=_messages(data_url(IMAGE, MEDIA)),
        max_tokens=2,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == completion.choices[0].message.content
    )
    assert chunks[-1].usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"] == cost.num_tokens

    from transformers import MiniMaxM3SparseForConditionalGeneration

    model = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        str(vision[0]), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with reference_processor(vision[0]) as processor:
        processed = processor(text="]<]image[>[", images=[Image.open(io.BytesIO(IMAGE))], return_tensors="pt")
    expansion = processed["input_ids"][0].tolist()
    start = prompt.images[0].start - 1  # ]<]start of image[>[ before the first feature row
    assert list(prompt.token_ids[start : start + len(expansion)]) == expansion
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt.token_ids]), **pixel_inputs(processed)).logits[0, -1].float()
    theirs = torch.log_softmax(logits, -1).topk(20).values.tolist()
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert worst <= 1e-3, worst
    print(f"first-token top-20 logprobs vs transformers: max |delta| {worst:.3g}")


def test_an_image_over_the_per_image_token_limit_is_refused_with_its_size(served) -> None:
    """5600 x 40: smart_resize floors the short side to one 28-pixel token row, so the area exceeds
    max_pixels (94 tokens > 64)."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((40, 5600, 3), 128, np.uint8)).save(buffer, format="PNG")
    cost = images.cost(5600, 40, served[1].frontend.vision)
    assert cost.num_tokens == 94 > served[1].frontend.vision.max_image_tokens_per_image
    body = {"model": "m", "max_tokens": 1, "messages": _messages(data_url(buffer.getvalue(), "image/png"))}
    response = httpx.post(served[0] + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "5600x40" in message and "max_image_tokens_per_image 64" in message

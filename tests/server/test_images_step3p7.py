"""Images through the real server on a tiny Step 3.7 (step5) vision core: a tiled image (3 x 2
tiles with framing and a row separator, then the global view) in a Chat Completions round trip
through the strict OpenAI SDK, buffered and streamed, with usage's image tokens; the first
generated token's logprobs against transformers' Step3p7ForConditionalGeneration on the same ids,
prefilled in chunks that cut through the tiles; prompt logprobs null exactly at the feature rows
(the framing tokens between tiles are ordinary prompt tokens)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
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
from tests.ignition.test_step3p7_vision import SHAPES, encode, pixel_inputs, reference_processor

IMAGE = encode(*SHAPES[1])  # JPEG 300 x 200: 3 x 2 tiles
MEDIA = "image/jpeg"
URL = f"data:{MEDIA};base64," + base64.b64encode(IMAGE).decode()


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    checkpoint = write_testmodel("step5", tmp_path_factory.mktemp("ckpt") / "tiny-step5-vision", seed=3, vision=True)
    out = tmp_path_factory.mktemp("cores") / "step5-vision"
    export_core(
        open_source(str(checkpoint)),
        load_recipe("step5"),
        ExportOptions(out=out, dtype="float32", prompt_logprobs=True),
    )
    return checkpoint, out


@pytest.fixture(scope="module")
def served(vision: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    config = ServerConfig(
        kv_pages=128, speculation="off", prefill_chunk_size=24, host_cache_dir=str(tmp_path_factory.mktemp("prefix"))
    )
    with live_server(vision[1], config) as pair:
        yield pair


def _messages() -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this picture?"},
                {"type": "image_url", "image_url": {"url": URL}},
            ],
        }
    ]


def test_chat_completion_with_a_tiled_image_matches_transformers(vision, served) -> None:
    state = served[1]
    prompt = state.frontend.prompt(
        Conversation((Message("user", (TextPart("What is in this picture?"), ImagePart(IMAGE, MEDIA))),))
    )
    cost = images.cost(300, 200, state.frontend.vision)
    assert cost.tiles == (3, 2) and prompt.image_tokens == cost.num_tokens == 6 * 4 + 9
    oai = openai.OpenAI(base_url=served[0] + "/v1", api_key="k", _strict_response_validation=True, max_retries=0)
    completion = oai.chat.completions.create(
        model="m", messages=_messages(), max_tokens=2, logprobs=True, top_logprobs=20, seed=1
    )
    usage = completion.usage
    assert usage.prompt_tokens == len(prompt.token_ids)
    assert usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"] == cost.num_tokens
    ours = [t.logprob for t in completion.choices[0].logprobs.content[0].top_logprobs]

    stream = oai.chat.completions.create(
        model="m", messages=_messages(), max_tokens=2, seed=1, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == completion.choices[0].message.content
    )
    assert chunks[-1].usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"] == cost.num_tokens

    from transformers import Step3p7ForConditionalGeneration

    model = Step3p7ForConditionalGeneration.from_pretrained(
        str(vision[0]), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with reference_processor(vision[0]) as processor:
        processed = processor(text="<im_patch>", images=[Image.open(io.BytesIO(IMAGE))], return_tensors="pt")
    expansion = processed["input_ids"][0].tolist()
    start = prompt.images[0].start - 1  # one <patch_start> before the first tile's rows
    assert list(prompt.token_ids[start : start + len(expansion)]) == expansion
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt.token_ids]), **pixel_inputs(processed)).logits[0, -1].float()
    theirs = torch.log_softmax(logits, -1).topk(20).values.tolist()
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert worst <= 1e-3, worst
    print(f"first-token top-20 logprobs vs transformers: max |delta| {worst:.3g}")


def test_prompt_logprobs_are_null_only_at_feature_rows(served) -> None:
    prompt = served[1].frontend.prompt(
        Conversation((Message("user", (TextPart("What is in this picture?"), ImagePart(IMAGE, MEDIA))),))
    )
    body = httpx.post(
        served[0] + "/v1/chat/completions",
        json={"model": "m", "messages": _messages(), "prompt_logprobs": 0, "max_tokens": 1},
        timeout=120,
    ).json()
    entries = body["prompt_logprobs"]
    assert len(entries) == len(prompt.token_ids)
    image = prompt.images[0]
    positions = set(prompt.image_positions)
    assert len(positions) == image.num_tokens and image.end - image.start > image.num_tokens  # framing inside
    assert {i for i, e in enumerate(entries) if e is None} == {0} | positions

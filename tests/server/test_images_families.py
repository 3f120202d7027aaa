"""Images through the real server on each vision family's tiny core (tests/ignition/vision_cases.py; Gemma 4
is tests/server/test_images.py's): the family's JPEG (300 x 200) in a Chat Completions round trip through
the strict OpenAI SDK, buffered and streamed, with usage's image tokens; the rendered prompt's framed
image span equal to transformers' processor expansion; the first generated token's logprobs against
the family's ForConditionalGeneration on the same ids, prefilled in chunks that cut through the image
(Step 3.7's: through its tiles); an image whose resize rule leaves it too few or too many tokens refused
with its observed size; prompt logprobs null exactly at the feature rows (Step 3.7, whose framing tokens
between tiles are ordinary prompt tokens).

GLM-5.3's text model is a KDA + DSA hybrid with state slots; Kimi K3's template renders
<|kimi_image_placeholder|> and the frontend expands it to K2.5's framing."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import httpx
import numpy as np
import openai
import pytest
import torch
from live import live_server
from PIL import Image
from support import TinyCores

from helios.config import ServerConfig
from helios.frontend import images
from helios.frontend.inference import Conversation, ImagePart, Message, TextPart
from tests.ignition.vision_cases import GLM, KIMI, MINIMAX, MUSE, STEP, VisionCase
from tests.ignition.vision_checks import tiny_vision

pytestmark = pytest.mark.sampled  # one family in CI, all with FLARE_SLOW_TESTS=1 (tests/conftest.py)

MEDIA = "image/jpeg"
QUESTION = "What is in this picture?"


@dataclass(frozen=True, eq=False)  # compared (and hashed) by identity: pytest groups the tests by server
class Served:
    vision: VisionCase
    resized: tuple[int, int]  # the JPEG's (height, width) after resizing, or (Step 3.7) its tiles
    tokens: int  # its image tokens
    before: int  # prompt tokens between the expansion's start and the first feature row
    refused: tuple[int, int, int, str] | None = None  # (width, height, tokens, why) of an image refused
    prompt_logprobs: bool = False  # the prompt-logprobs test runs on it (every core is exported with them)

    def __str__(self) -> str:
        return self.vision.family


CASES = (
    # JPEG 300 x 200: cut to 252 x 168, 54 tokens. 3000 x 1: no height keeps a 28-pixel-aligned canvas of
    # that aspect within 64 tokens, so GLM's rule falls back to one 28 x 28 token; the program needs two.
    Served(GLM, (168, 252), 54, 1, (3000, 1, 1, "at least 2")),  # the template's <|begin_of_image|>
    # Scaled to 139 x 93, padded to 140 x 112, 20 tokens. 111 x 223: 7 x 15 whole patches are over the
    # 64-patch budget, so navit scales it to 86 x 174, which pads to 4 x 7 = 28 tokens (> 64 / 4 + 16 / 2 + 1).
    Served(KIMI, (112, 140), 20, 3, (111, 223, 28, "max_image_tokens_per_image 25")),  # <|media_begin|> image ...
    # Scaled down to 252 x 168, 54 tokens. 5600 x 40: smart_resize floors the short side to one 28-pixel
    # token row, so the area exceeds max_pixels (94 tokens > 64).
    Served(MINIMAX, (168, 252), 54, 1, (5600, 40, 94, "max_image_tokens_per_image 64")),  # ]<]start of image[>[
    # A 9 x 6 grid under the 64-token cap, 252 x 168, 54 tokens. 5600 x 40: no grid within 64 tokens keeps
    # a whole token row, so transformers' fallback grid (1 x 95 tokens) exceeds the cap.
    Served(MUSE, (168, 252), 54, 1, (5600, 40, 95, "max_image_tokens_per_image 64")),  # <|image_start|>
    # 3 x 2 tiles of 4 tokens with framing and a row separator, then the 9-token global view.
    Served(STEP, (3, 2), 6 * 4 + 9, 1, prompt_logprobs=True),  # the first tile's <patch_start>
)


def cases(*chosen: Served) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("served", chosen, indirect=True, ids=str)


def data_url(data: bytes, media: str) -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def image(case: VisionCase) -> bytes:
    return case.encoded_images()[1]


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tiny_cores: TinyCores, tmp_path_factory: pytest.TempPathFactory):
    """(the case, its tiny checkpoint, the server's URL, its state) while the server runs; the core is
    the family's vision tests' (tests/ignition/vision_checks.py tiny_vision), exported once per run."""
    case: Served = request.param
    checkpoint, out = tiny_vision(tiny_cores, case.vision)
    config = ServerConfig(
        kv_pages=128, speculation="off", prefill_chunk_size=24, host_cache_dir=str(tmp_path_factory.mktemp("prefix"))
    )
    with live_server(out, config) as (url, state):
        yield case, checkpoint, url, state


def _messages(url: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]


def _prompt(state, case: VisionCase):
    return state.frontend.prompt(Conversation((Message("user", (TextPart(QUESTION), ImagePart(image(case), MEDIA))),)))


@cases(*CASES)
def test_chat_completion_with_an_image_matches_transformers(served) -> None:
    case, checkpoint, url, state = served
    data = image(case.vision)
    prompt = _prompt(state, case.vision)
    cost = images.cost(300, 200, state.frontend.vision)
    assert (cost.tiles if case.vision is STEP else (cost.height, cost.width)) == case.resized
    assert prompt.image_tokens == cost.num_tokens == case.tokens
    oai = openai.OpenAI(base_url=url + "/v1", api_key="k", _strict_response_validation=True, max_retries=0)
    completion = oai.chat.completions.create(
        model="m", messages=_messages(data_url(data, MEDIA)), max_tokens=2, logprobs=True, top_logprobs=20, seed=1
    )
    assert completion.choices[0].finish_reason in ("stop", "length")
    usage = completion.usage
    assert usage.prompt_tokens == len(prompt.token_ids)
    assert usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"] == cost.num_tokens
    ours = [t.logprob for t in completion.choices[0].logprobs.content[0].top_logprobs]

    stream = oai.chat.completions.create(
        model="m",
        messages=_messages(data_url(data, MEDIA)),
        max_tokens=2,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == completion.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"] == cost.num_tokens

    model = case.vision.reference(checkpoint)
    assert case.vision.processor is not None
    with case.vision.processor(checkpoint) as processor:
        processed = processor(text=case.vision.framed, images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    expansion = processed["input_ids"][0].tolist()
    start = prompt.images[0].start - case.before
    assert list(prompt.token_ids[start : start + len(expansion)]) == expansion
    if case.vision.placeholder is not None:  # expanded: only the framing and image tokens remain
        assert state.frontend.vision.placeholder_token_id not in prompt.token_ids
    with torch.no_grad():
        inputs = case.vision.pixel_inputs(processed)
        logits = model(input_ids=torch.tensor([prompt.token_ids]), **inputs).logits[0, -1].float()
    theirs = torch.log_softmax(logits, -1).topk(20).values.tolist()
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert worst <= 1e-3, worst
    print(f"first-token top-20 logprobs vs transformers: max |delta| {worst:.3g}")


@cases(*(case for case in CASES if case.refused))
def test_an_image_with_too_few_or_too_many_tokens_is_refused_with_its_size(served) -> None:
    """Under the vision program's two-token minimum, or over the per-image token limit."""
    case, _, url, state = served
    assert case.refused is not None
    width, height, tokens, why = case.refused
    buffer = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 128, np.uint8)).save(buffer, format="PNG")
    cost = images.cost(width, height, state.frontend.vision)
    assert cost.num_tokens == tokens
    assert tokens < 2 or tokens > state.frontend.vision.max_image_tokens_per_image
    body = {"model": "m", "max_tokens": 1, "messages": _messages(data_url(buffer.getvalue(), "image/png"))}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert f"{width}x{height}" in message and why in message


@cases(*(case for case in CASES if case.prompt_logprobs))
def test_prompt_logprobs_are_null_only_at_feature_rows(served) -> None:
    case, _, url, state = served
    prompt = _prompt(state, case.vision)
    body = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": "m",
            "messages": _messages(data_url(image(case.vision), MEDIA)),
            "prompt_logprobs": 0,
            "max_tokens": 1,
        },
        timeout=120,
    ).json()
    entries = body["prompt_logprobs"]
    assert len(entries) == len(prompt.token_ids)
    image_span = prompt.images[0]
    positions = set(prompt.image_positions)
    assert len(positions) == image_span.num_tokens and image_span.end - image_span.start > image_span.num_tokens
    assert {i for i, e in enumerate(entries) if e is None} == {0} | positions

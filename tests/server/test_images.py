"""Images end to end on a tiny Gemma 4 vision core: the OpenAI and Anthropic SDKs (strict) with
images in user turns and tool results, buffered and streamed; the first generated logprobs
against transformers; limits and budget rejections with their messages (a 30000 x 30000 PNG
bomb refused from its header, in bounded memory); prefix reuse across an appended image and
none across a changed one; the text-only core's refusals unchanged."""

from __future__ import annotations

import base64
import io
import json
import resource
import struct
import zlib
from pathlib import Path

import anthropic
import httpx
import numpy as np
import openai
import pytest
import torch
from live import live_server
from PIL import Image
from serving import SCHEMA_PATH, schema_validator, sse_events
from support import TinyCores, anthropic_spec

from helios.config import ServerConfig
from helios.frontend import images
from helios.frontend.inference import Conversation, ImagePart, Message, TextPart
from tests.ignition.test_gemma4_vision import encoded_images
from tests.ignition.vision_cases import GEMMA
from tests.ignition.vision_checks import tiny_vision

IMAGES = encoded_images()  # PNG 37x53, JPEG 64x40, WebP 90x90
MEDIA = ("image/png", "image/jpeg", "image/webp")


def data_url(index: int) -> str:
    return f"data:{MEDIA[index]};base64," + base64.b64encode(IMAGES[index]).decode()


def b64(index: int) -> str:
    return base64.b64encode(IMAGES[index]).decode()


@pytest.fixture(scope="module")
def vision(tiny_cores: TinyCores) -> tuple[Path, Path]:
    """The tiny Gemma 4 vision core (float32, prompt logprobs) the vision tests check, exported once per run."""
    return tiny_vision(tiny_cores, GEMMA)


@pytest.fixture(scope="module")
def served(vision: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    # Its own disk tier: records another test (or run) left for this core never count as reuse here.
    config = ServerConfig(
        kv_pages=256, speculation="off", prefill_chunk_size=40, host_cache_dir=str(tmp_path_factory.mktemp("prefix"))
    )
    with live_server(vision[1], config) as pair:
        yield pair


@pytest.fixture(scope="module")
def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="k", _strict_response_validation=True, max_retries=0)


@pytest.fixture(scope="module")
def claude(served) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=served[0],
        api_key="k",
        default_headers={"anthropic-version": "2023-06-01"},
        _strict_response_validation=True,
        max_retries=0,
    )


def _user(text: str, *indices: int) -> dict:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}]
        + [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in indices],
    }


def _post(served, body: dict) -> httpx.Response:
    return httpx.post(served[0] + "/v1/chat/completions", json={"model": "m", "max_tokens": 2, **body}, timeout=120)


# ---------------------------------------------------------------------------- numerics


def test_first_generated_logprobs_match_transformers(vision, served, oai: openai.OpenAI) -> None:
    """Three images in one user turn, prefilled in 40-token chunks that cut through them: the first
    token's 20 best logprobs equal transformers' Gemma4ForConditionalGeneration on the same ids."""
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from ignition.models import gemma4

    state = served[1]
    messages = [_user("Compare these:", 0, 1, 2)]
    parts = (TextPart("Compare these:"), *(ImagePart(d, m) for d, m in zip(IMAGES, MEDIA)))
    prompt = state.frontend.prompt(Conversation((Message("user", parts),)))
    completion = oai.chat.completions.create(model="m", messages=messages, max_tokens=1, logprobs=True, top_logprobs=20)
    ours = [t.logprob for t in completion.choices[0].logprobs.content[0].top_logprobs]
    assert completion.usage.prompt_tokens == len(prompt.token_ids)
    assert completion.usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"] == prompt.image_tokens

    model = Gemma4ForConditionalGeneration.from_pretrained(
        str(vision[0]), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    settings = {k: v for k, v in gemma4.TESTMODEL_PROCESSOR.items() if k != "image_processor_type"}
    processed = Gemma4ImageProcessorPil(**settings)(
        images=[Image.open(io.BytesIO(d)) for d in IMAGES], return_tensors="pt"
    )
    with torch.no_grad():
        logits = (
            model(
                input_ids=torch.tensor([prompt.token_ids]),
                pixel_values=processed["pixel_values"],
                image_position_ids=processed["image_position_ids"],
            )
            .logits[0, -1]
            .float()
        )
    theirs = torch.log_softmax(logits, -1).topk(20).values.tolist()
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert worst <= 1e-3, worst


def test_prompt_logprobs_are_null_at_image_positions(served) -> None:
    parts = (TextPart("Look:"), ImagePart(IMAGES[1], MEDIA[1]), TextPart("What is it?"))
    prompt = served[1].frontend.prompt(Conversation((Message("user", parts),)))
    body = _post(
        served,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Look:"},
                        {"type": "image_url", "image_url": {"url": data_url(1)}},
                        {"type": "text", "text": "What is it?"},
                    ],
                }
            ],
            "prompt_logprobs": 0,
            "max_tokens": 1,
        },
    ).json()
    entries = body["prompt_logprobs"]
    assert len(entries) == len(prompt.token_ids)
    nulls = {i for i, e in enumerate(entries) if e is None}
    assert nulls == {0} | set(prompt.image_positions)


# ---------------------------------------------------------------------------- SDKs


def test_openai_images_in_user_turns_and_tool_results(oai: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "snap", "parameters": {"type": "object", "properties": {}}}}]
    messages = [
        _user("What is in the picture?", 0),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "snap", "arguments": "{}"}}],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "photo:"}, {"type": "image_url", "image_url": {"url": data_url(1)}}],
        },
    ]
    buffered = oai.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=3, seed=1)
    image_tokens = buffered.usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"]
    assert image_tokens > 0 and buffered.usage.prompt_tokens > image_tokens
    stream = oai.chat.completions.create(
        model="m",
        messages=messages,
        tools=tools,
        max_tokens=3,
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens == buffered.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.model_extra["multimodal_tokens"]["image"] == image_tokens


def test_anthropic_images_in_user_turns_and_tool_results(claude: anthropic.Anthropic) -> None:
    image = lambda i: {"type": "image", "source": {"type": "base64", "media_type": MEDIA[i], "data": b64(i)}}  # noqa: E731
    tools = [{"name": "snap", "input_schema": {"type": "object", "properties": {}}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, image(2)]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "snap", "input": {}}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "shot"}, image(0)],
                }
            ],
        },
    ]
    message = claude.messages.create(model="m", max_tokens=3, messages=messages, tools=tools)
    counted = claude.messages.count_tokens(model="m", messages=messages, tools=tools)
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == counted.input_tokens
    image_tokens = message.usage.model_extra["multimodal_tokens"]["image"]
    assert 0 < image_tokens < counted.input_tokens
    with claude.messages.stream(model="m", max_tokens=3, messages=messages, tools=tools) as stream:
        final = stream.get_final_message()
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == counted.input_tokens
    assert final.usage.model_extra["multimodal_tokens"]["image"] == image_tokens


def test_messages_usage_reports_image_tokens_within_the_schemas(served) -> None:
    """Raw bodies: the buffered message and both stream usages (message_start, message_delta) carry
    multimodal_tokens.image and still validate against the hosted Anthropic schemas."""
    spec = anthropic_spec()
    image = {"type": "image", "source": {"type": "base64", "media_type": MEDIA[1], "data": b64(1)}}
    body = {
        "model": "m",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, image]}],
    }
    headers = {"anthropic-version": "2023-06-01"}
    expected = images.cost(64, 40, served[1].frontend.vision).num_tokens
    buffered = httpx.post(served[0] + "/v1/messages", json=body, headers=headers, timeout=120).json()
    schema_validator(spec, "Message").validate(buffered)
    assert buffered["usage"]["multimodal_tokens"] == {"image": expected}
    streamed = httpx.post(served[0] + "/v1/messages", json={**body, "stream": True}, headers=headers, timeout=120)
    events = {e["type"]: e for e in map(json.loads, sse_events(streamed))}
    schema_validator(spec, "MessageStartEvent").validate(events["message_start"])
    schema_validator(spec, "MessageDeltaEvent").validate(events["message_delta"])
    assert events["message_start"]["message"]["usage"]["multimodal_tokens"] == {"image": expected}
    assert events["message_delta"]["usage"]["multimodal_tokens"] == {"image": expected}
    text_only = httpx.post(
        served[0] + "/v1/messages",
        json={**body, "messages": [{"role": "user", "content": "Hi"}]},
        headers=headers,
        timeout=120,
    ).json()
    assert "multimodal_tokens" not in text_only["usage"]


def test_responses_input_image(served) -> None:
    body = {
        "model": "m",
        "max_output_tokens": 2,
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe"},
                    {"type": "input_image", "image_url": data_url(1)},
                ],
            }
        ],
    }
    response = httpx.post(served[0] + "/v1/responses", json=body, timeout=120)
    assert response.status_code == 200, response.text
    spec = json.loads(SCHEMA_PATH.read_text())
    schema_validator(spec, "Response").validate(response.json())
    usage = response.json()["usage"]
    expected = images.cost(64, 40, served[1].frontend.vision).num_tokens
    assert usage["input_tokens_details"]["multimodal_tokens"] == {"image": expected}
    assert usage["input_tokens"] > expected
    streamed = httpx.post(served[0] + "/v1/responses", json={**body, "stream": True}, timeout=120)
    events = [json.loads(e) for e in sse_events(streamed)]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")  # 2 tokens may run out
    schema_validator(spec, "ResponseStreamEvent").validate(events[-1])
    streamed_usage = events[-1]["response"]["usage"]  # its cached_tokens may differ: the prefix is warm now
    assert streamed_usage["input_tokens"] == usage["input_tokens"]
    assert streamed_usage["input_tokens_details"]["multimodal_tokens"] == {"image": expected}


# ---------------------------------------------------------------------------- prefix identity


def test_appending_an_image_reuses_the_prefix_and_a_changed_image_does_not(served) -> None:
    # Text after the image, so the first answer's full pages cover the whole image span.
    first = [_user("First picture:", 0)]
    first[0]["content"].append({"type": "text", "text": "Say what you see in it, in the fewest words you can."})
    usage = _post(served, {"messages": first}).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    before = dict(served[1].snapshot())
    appended = first + [{"role": "assistant", "content": "ok"}, _user("And another:", 1)]
    usage = _post(served, {"messages": appended}).json()["usage"]
    assert (
        usage["prompt_tokens_details"]["cached_tokens"]
        > usage["prompt_tokens_details"]["multimodal_tokens"]["image"] // 2
    )
    after = served[1].snapshot()
    assert after["input_reused_images_total"] == before["input_reused_images_total"] + 1  # image 1: no prep, no vision
    # image 2 is prepared once: encoded, or served by the prepared-input cache if an earlier test encoded it
    served_once = lambda s: s["input_vision_encodes_total"] + s["input_prepared_cache_hits_total"]  # noqa: E731
    assert served_once(after) == served_once(before) + 1
    # The same text around a different first image: nothing at or after the image is reused.
    changed = [_user("First picture:", 2)] + appended[1:]
    changed[0]["content"].append(first[0]["content"][-1])
    alone = Conversation((Message("user", (TextPart("First picture:"), ImagePart(IMAGES[2], MEDIA[2]))),))
    image_start = served[1].frontend.prompt(alone).images[0].start  # the same tokens precede it in `changed`
    usage = _post(served, {"messages": changed}).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] <= image_start


# ---------------------------------------------------------------------------- limits


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height, with one tiny IDAT (a decompression-bomb shape)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_png_bomb_is_refused_from_its_header_in_bounded_memory(served) -> None:
    bomb = "data:image/png;base64," + base64.b64encode(_png_header_only(30000, 30000)).decode()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB; the server runs in this process
    response = _post(
        served, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": bomb}}]}]}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "image 1 is 30000x30000 = 900000000 pixels, over max_image_pixels 50000000 (parameter: messages)"
    )
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200_000  # a decode would need 2.7 GB


def test_budget_rejection_costs_every_image_and_names_the_first_past_it(served) -> None:
    state = served[1]
    budget = state.frontend.limits.max_image_tokens_per_prompt
    cost = images.cost(90, 90, state.frontend.vision)  # the WebP: 96x96 after resizing, 24x24 patches
    per_image = cost.num_tokens
    assert (per_image, cost.num_patches) == (64, 576)
    count = budget // per_image + 2
    content = [{"type": "image_url", "image_url": {"url": data_url(2)}}] * count
    response = _post(served, {"messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400
    patches = count * cost.num_patches
    first = budget // per_image + 1
    assert response.json()["error"]["message"] == (
        f"the request's {count} images cost {count * per_image} image tokens ({patches} patches), over "
        f"max_image_tokens_per_prompt {budget}; image {first} (90x90 pixels, {per_image} tokens) is the first past it "
        "(parameter: messages)"
    )


def test_animated_remote_and_oversized_images_are_refused(served) -> None:
    frames = [Image.fromarray(np.full((8, 8, 3), v, np.uint8)) for v in (0, 255)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="WEBP", save_all=True, append_images=frames[1:], duration=50, loop=0)
    animated = "data:image/webp;base64," + base64.b64encode(buffer.getvalue()).decode()
    cases = [
        (animated, "image 1 is animated; only static images are accepted"),
        ("https://example.com/a.png", "images must be base64 data URLs (remote image downloads are unsupported)"),
        (
            "data:image/png;base64," + base64.b64encode(b"not a png").decode(),
            "image 1 is not a readable PNG, JPEG or WebP image",
        ),
    ]
    for url, message in cases:
        response = _post(
            served, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == message + " (parameter: messages)", response.text
    card = httpx.get(served[0] + "/v1/models").json()["data"][0]["flare"]
    assert card["input_modalities"] == ["text", "image"] and card["max_image_pixels"] == 50_000_000
    assert card["max_image_tokens_per_image"] == 70 and card["image_feature_window_tokens"] == 70
    show = httpx.post(
        served[0] + "/api/show", json={"model": card and httpx.get(served[0] + "/v1/models").json()["data"][0]["id"]}
    )
    assert "vision" in show.json()["capabilities"]


def test_text_only_core_refuses_images_everywhere(tiny_core: Path) -> None:
    with live_server(tiny_core, ServerConfig(kv_pages=64)) as (url, _):
        png = data_url(0)
        chat = httpx.post(
            url + "/v1/chat/completions",
            json={
                "model": "m",
                "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}]}],
            },
            timeout=60,
        )
        assert chat.status_code == 400
        assert chat.json()["error"]["message"] == (
            "this model does not accept images (its core has no vision program) (parameter: messages)"
        )
        messages = httpx.post(
            url + "/v1/messages",
            headers={"anthropic-version": "2023-06-01"},
            json={
                "model": "m",
                "max_tokens": 1,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(0)}}
                        ],
                    }
                ],
            },
            timeout=60,
        )
        assert messages.status_code == 400 and "does not accept images" in messages.json()["error"]["message"]
        responses = httpx.post(
            url + "/v1/responses",
            json={
                "model": "m",
                "max_output_tokens": 1,
                "input": [{"role": "user", "content": [{"type": "input_image", "image_url": png}]}],
            },
            timeout=60,
        )
        assert responses.status_code == 400 and "does not accept images" in responses.json()["error"]["message"]
        body = {**SYSTEMONE, "assets": {"receipt": {"data_base64": b64(0), "format": "png"}}}
        for send in (
            lambda: httpx.post(url + "/v1/systemone", json=body, headers=DANGER, timeout=60),
            lambda: httpx.post(
                url + "/v1/systemone",
                headers=DANGER,
                timeout=60,
                files=[("request", (None, json.dumps(body).encode(), "application/json"))],
            ),
        ):
            refused = send()
            assert refused.status_code == 400
            assert refused.json()["error"]["message"] == (
                "this model is text-only (its core has no vision program): image assets need a vision core"
            )
        card = httpx.get(url + "/v1/models").json()["data"][0]["flare"]
        assert card["input_modalities"] == ["text"] and card["max_images_per_prompt"] == 0


# ---------------------------------------------------------------------------- System One assets

DANGER = {"TypeSafe-Danger-Zone-Images": "true"}
SYSTEMONE = {
    "model": "m",
    "state": {"photo": "receipt", "note": "Seen on receipt's back"},
    "questions": {
        "paid": {"type": "noul", "instructions": "Does receipt show a payment?"},
        "kind": {"type": "choice", "criteria": {"receipt": "Looks like logo", "other": None}},
        "quality": {"type": "score", "criteria": ["blurry", "logo"]},
    },
}


def _systemone(served, body: dict, headers: dict | None = None, **kwargs) -> httpx.Response:
    return httpx.post(
        served[0] + "/v1/systemone", json=body, headers=DANGER if headers is None else headers, timeout=120, **kwargs
    )


def _multipart(served, body: dict, parts: list[tuple[str, bytes, str]], headers: dict | None = None) -> httpx.Response:
    files = [("request", (None, json.dumps(body).encode(), "application/json"))]
    files += [(name, (name, data, media)) for name, data, media in parts]
    return httpx.post(served[0] + "/v1/systemone", files=files, headers={**DANGER, **(headers or {})}, timeout=120)


def test_systemone_assets_base64_and_multipart_read_the_same_images(served) -> None:
    """References in nested state, instructions, choice descriptions and score levels become the
    images; keys and legends keep the text; a part given for an asset wins over its data_base64."""
    assets = {"receipt": {"data_base64": b64(0), "format": "png"}, "logo": {"data_base64": b64(1), "format": "jpeg"}}
    before = dict(served[1].snapshot())
    inline = _systemone(served, {**SYSTEMONE, "assets": assets})
    assert inline.status_code == 200, inline.text
    answers = inline.json()["answers"]
    assert list(answers["kind"]["probabilities"]) == ["receipt", "other"]  # keys stay text
    assert answers["quality"]["legend"] == {"0": "blurry", "1": "logo"}  # the original references
    assert sum(answers["kind"]["probabilities"].values()) == pytest.approx(1.0)
    seen = lambda s: s["input_decoded_images_total"] + s["input_decode_cache_hits_total"]  # noqa: E731
    assert seen(served[1].snapshot()) > seen(before)  # decoded, or served by the decoded-image cache
    text = _systemone(served, {**SYSTEMONE, "assets": {}}, headers={})  # the same words, no images
    assert text.status_code == 200, text.text
    per_image = [
        images.cost(37, 53, served[1].frontend.vision).num_tokens,
        images.cost(64, 40, served[1].frontend.vision).num_tokens,
    ]
    # state: 3 references to receipt; paid +1 receipt; kind +1 logo; quality +1 logo; each replacing one word
    assert inline.json()["usage"]["input_tokens"] > text.json()["usage"]["input_tokens"] + 6 * min(per_image)
    by_part = {**assets, "receipt": {"format": "png", "part": "r", "data_base64": b64(2)}}  # the part wins
    multipart = _multipart(served, {**SYSTEMONE, "assets": by_part}, [("r", IMAGES[0], "image/png")])
    assert multipart.status_code == 200, multipart.text
    assert multipart.json()["usage"]["input_tokens"] == inline.json()["usage"]["input_tokens"]
    for key, answer in multipart.json()["answers"].items():
        for name, p in answer.get("probabilities", {}).items():
            assert p == pytest.approx(answers[key]["probabilities"][name], abs=1e-4)


def test_systemone_asset_refusals(served) -> None:
    assets = {"receipt": {"data_base64": b64(0), "format": "png"}}
    body = {**SYSTEMONE, "assets": assets}
    bomb = base64.b64encode(_png_header_only(30000, 30000)).decode()
    cases = [
        (_systemone(served, body, headers={}), 400, "TypeSafe-Danger-Zone-Images: true"),
        (
            _systemone(served, {**body, "assets": {**assets, "spare": {"data_base64": b64(1), "format": "jpeg"}}}),
            400,
            "asset 'spare' is never referenced in state, instructions or criteria",
        ),
        (
            _systemone(served, {**body, "assets": {"receipt": {"data_base64": b64(1), "format": "png"}}}),
            400,
            "asset 'receipt' is not a PNG image (its format field says 'png')",
        ),
        (_systemone(served, {**body, "assets": {"receipt": {"data_base64": b64(2), "format": "webp"}}}), 422, None),
        (
            _systemone(served, {**body, "assets": {"receipt": {"data_base64": bomb, "format": "png"}}}),
            400,
            "image 1 is 30000x30000 = 900000000 pixels, over max_image_pixels 50000000 (parameter: assets)",
        ),
        (
            _systemone(
                served, {**body, "assets": {"receipt": {"data_base64": b64(0), "format": "png", "type": "audio"}}}
            ),
            400,
            "only image assets are supported",
        ),
        (
            _multipart(served, body, [("extra", IMAGES[1], "image/jpeg")]),
            400,
            "multipart part 'extra' belongs to no asset",
        ),
        (
            _multipart(served, {**body, "assets": {"receipt": {"format": "png", "part": "nope"}}}, []),
            400,
            "asset 'receipt' names multipart part 'nope', which the request does not have",
        ),
        (_multipart(served, body, [], headers={"Content-Encoding": "gzip"}), 415, "must not be compressed"),
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        if status == 422:
            assert response.json()["detail"][0]["loc"] == ["body", "assets", "receipt", "format"]
        else:
            assert message in response.json()["error"]["message"], response.text
    files = [
        ("receipt", ("r.png", IMAGES[0], "image/png")),
        ("request", (None, json.dumps(body).encode(), "application/json")),
    ]
    json_second = httpx.post(served[0] + "/v1/systemone", files=files, headers=DANGER, timeout=120)
    assert json_second.status_code == 400
    assert json_second.json()["error"]["message"] == "the first multipart part must be the application/json request"
    budget = served[1].frontend.limits.max_image_tokens_per_prompt
    per_image = images.cost(37, 53, served[1].frontend.vision).num_tokens
    many = {f"p{i}": {"data_base64": b64(0), "format": "png"} for i in range(budget // per_image + 2)}
    over = _systemone(served, {**SYSTEMONE, "state": " ".join(many), "assets": many})
    assert over.status_code == 400 and "max_image_tokens_per_prompt" in over.json()["error"]["message"], over.text


def test_a_repeated_image_is_neither_decoded_nor_encoded_again(served) -> None:
    """The same image after different text (so no prefix page covers it): the frontend's decoded-image
    cache and the engine's prepared-input cache serve it; the answer equals the one encoded afresh."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((48, 30, 3), (12, 200, 99), dtype=np.uint8)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    def ask(text: str) -> dict:
        content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
        body = {"messages": [{"role": "user", "content": content}], "logprobs": True, "top_logprobs": 3, "seed": 5}
        return _post(served, body).json()

    before = dict(served[1].snapshot())
    first = ask("A green picture:")
    middle = dict(served[1].snapshot())
    assert middle["input_decoded_images_total"] == before["input_decoded_images_total"] + 1
    assert middle["input_vision_encodes_total"] == before["input_vision_encodes_total"] + 1
    second = ask("Something else entirely, then the same green picture:")
    after = served[1].snapshot()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] < first["usage"]["prompt_tokens"] // 2
    assert after["input_decoded_images_total"] == middle["input_decoded_images_total"]
    assert after["input_decode_cache_hits_total"] == middle["input_decode_cache_hits_total"] + 1
    assert after["input_vision_encodes_total"] == middle["input_vision_encodes_total"]
    assert after["input_prepared_cache_hits_total"] == middle["input_prepared_cache_hits_total"] + 1
    assert after["input_prepared_cache_bytes"] > 0
    again = ask("A green picture:")  # the first prompt again: its prefix (and the image) reused from the pool
    assert again["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]

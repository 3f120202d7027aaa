"""OpenAI Responses (stateless): wire JSON <-> neutral request, response objects and SSE events.

`decode` maps a request (decode.py); `response_json` and `ResponsesStream` encode the
accumulated output the same way (encode.py).
"""

from helios.protocols.openai_responses.decode import ResponsesOptions, decode
from helios.protocols.openai_responses.encode import (
    OutputValidationError,
    ResponsesBuffer,
    ResponsesEncoder,
    ResponsesStream,
    call_item,
    custom_call,
    encoder,
    output_items,
    response_json,
    sse,
    status_of,
    usage_json,
)

__all__ = [
    "OutputValidationError",
    "ResponsesBuffer",
    "ResponsesEncoder",
    "ResponsesOptions",
    "ResponsesStream",
    "call_item",
    "custom_call",
    "decode",
    "encoder",
    "output_items",
    "response_json",
    "sse",
    "status_of",
    "usage_json",
]

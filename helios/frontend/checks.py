"""The option checks every protocol shares, against the loaded core: logprob capacity, stops,
reasoning budgets and what an output constraint excludes (spec: "Reasoning, sampling, and usage").

They read counts alone, so they run first, before any rendering or tokenization.
"""

from __future__ import annotations

from helios.core.manifest import MAX_LOGPROB_TOKEN_IDS, Manifest
from helios.frontend.inference import Conversation, InferenceRequest, RequestError

MAX_STOP_STRINGS = 4
MAX_STOP_BYTES = 4096
MAX_TOKEN_STOPS = 16
MAX_TOKEN_STOP_LEN = 64


def check_options(request: InferenceRequest, manifest: Manifest) -> None:
    """Refuse (RequestError, naming the field) options this core cannot honour or the spec excludes."""
    _check_logprobs(request, manifest)
    if request.thinking_token_budget is not None and manifest.recipe.reasoning_syntax is None:
        raise RequestError(
            "thinking_token_budget needs a model with reasoning syntax; this core declares none",
            "thinking_token_budget",
        )
    _check_stops(request, manifest.tokenizer.vocab_size)
    if request.output is not None:
        _check_output(request)


def _check_logprobs(request: InferenceRequest, manifest: Manifest) -> None:
    caps = manifest.capabilities
    lp = request.logprobs
    if lp.top is not None and caps.max_top_logprobs == 0:
        raise RequestError(
            "this core was exported without generation logprob outputs (allow_logprobs is false); "
            "re-export it with `ignition export --max-top-logprobs N` (N 1..20) to request logprobs",
            "logprobs",
        )
    if lp.top is not None and lp.top > caps.max_top_logprobs:
        raise RequestError(
            f"this model returns at most {caps.max_top_logprobs} alternatives per token (asked for {lp.top})",
            "top_logprobs",
        )
    if lp.token_ids:
        if not caps.explicit_logprob_ids:
            raise RequestError(
                "this core has no explicit-id logprob inputs; re-export it without "
                "--no-logprob-ids to use logprob_token_ids",
                "logprob_token_ids",
            )
        if len(lp.token_ids) > MAX_LOGPROB_TOKEN_IDS:
            raise RequestError(
                f"logprob_token_ids accepts at most {MAX_LOGPROB_TOKEN_IDS} ids, got {len(lp.token_ids)}",
                "logprob_token_ids",
            )
        vocab_size = manifest.tokenizer.vocab_size
        bad = next((t for t in lp.token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"logprob_token_ids entry {bad} is outside the vocabulary [0, {vocab_size})", "logprob_token_ids"
            )
    if lp.prompt is not None:
        if not caps.prompt_logprobs:
            raise RequestError(
                "this core was exported without prompt logprobs; re-export it with `ignition export --prompt-logprobs`",
                "prompt_logprobs",
            )
        if lp.prompt > caps.max_top_logprobs:
            raise RequestError(f"prompt_logprobs is at most {caps.max_top_logprobs} for this model", "prompt_logprobs")


def _check_stops(request: InferenceRequest, vocab_size: int) -> None:
    stop = request.stop
    if len(stop.strings) > MAX_STOP_STRINGS or any(not s for s in stop.strings):
        raise RequestError(f"stop accepts at most {MAX_STOP_STRINGS} nonempty strings", "stop")
    if sum(len(s.encode()) for s in stop.strings) > MAX_STOP_BYTES:
        raise RequestError(f"stop strings total more than {MAX_STOP_BYTES} UTF-8 bytes", "stop")
    sequences = [(t,) for t in stop.token_ids] + list(stop.token_sequences)
    if len(sequences) > MAX_TOKEN_STOPS or any(not s or len(s) > MAX_TOKEN_STOP_LEN for s in sequences):
        raise RequestError(
            f"token stops accept at most {MAX_TOKEN_STOPS} nonempty sequences of at most {MAX_TOKEN_STOP_LEN} ids",
            "stop_token_ids",
        )
    if any(not 0 <= t < vocab_size for s in sequences for t in s):
        raise RequestError("stop token ids must lie inside the vocabulary", "stop_token_ids")
    if stop.strings and sequences:
        raise RequestError("a request cannot combine string stops with token stops", "stop")


def _check_output(request: InferenceRequest) -> None:
    """Options an output constraint excludes."""
    param = request.output.param  # type: ignore[union-attr]
    if not isinstance(request.input, Conversation):
        raise RequestError("output constraints apply to conversational requests only", param)
    if request.input.continue_final_message:
        raise RequestError("assistant continuation cannot be combined with an output constraint", param)
    stop = request.stop
    if stop.strings or stop.token_ids or stop.token_sequences:
        raise RequestError("custom stops cannot be combined with an output constraint", "stop")
    if stop.ignore_eos:
        raise RequestError("ignore_eos cannot be combined with an output constraint", "ignore_eos")

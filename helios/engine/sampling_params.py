"""Per-choice sampling parameters: what the sampler runs with.

The frontend resolves them from a request (helios/frontend/sampling.py: defaults, ranges,
clamping); the engine trusts every field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What the sampler runs with for one choice; every field already valid and clamped."""

    temperature: float  # > 0; greedy is top_k == 1, never temperature 0
    top_p: float  # in (0, 1]; 1 keeps the whole distribution
    top_k: int  # -1 (disabled) or >= 1; 1 is exact greedy
    min_p: float  # in [0, 1]; 0 disables
    repetition_penalty: float  # > 0; 1 is neutral
    presence_penalty: float  # in [-2, 2]; 0 is neutral
    frequency_penalty: float  # in [-2, 2]; 0 is neutral
    seed: int  # in [0, 2**63), already advanced by the choice index
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id < vocab, bias in [-100, 100]) added to raw logits


# Exact greedy decoding with every penalty neutral: what a probe or a reproducible check runs with.
GREEDY = SamplingParams(
    temperature=1.0,
    top_p=1.0,
    top_k=1,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    seed=0,
)

"""Self-check helpers of ignition export (moved out of ignition.export to keep it readable)."""

from __future__ import annotations

import math

import torch

from ignition.errors import VerifyError


def check_logprob_outputs(
    kind: str, outputs: dict[str, torch.Tensor], logprobs: torch.Tensor, prompt: tuple[int, ...], tolerance: float
) -> None:
    """The program's derived outputs agree with its own full distribution."""
    checks: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    if "top_logprobs" in outputs:
        checks.append(("top_logprobs", outputs["top_logprobs"], logprobs.gather(1, outputs["top_ids"])))
    if "explicit_logprobs" in outputs:
        checks.append(("explicit_logprobs", outputs["explicit_logprobs"], logprobs[:, [0, 1]]))
    if "prompt_logprobs" in outputs:
        targets = torch.tensor(list(prompt[1:]))
        expected = logprobs[:-1].gather(1, targets[:, None])[:, 0]
        checks.append(("prompt_logprobs", outputs["prompt_logprobs"][:-1], expected))
        ranks = (logprobs[:-1] > expected[:, None]).sum(-1) + 1
        if not torch.equal(outputs["prompt_ranks"][:-1], ranks):
            raise VerifyError(f"self-check failed: {kind} prompt_ranks disagree with the distribution")
    for name, got, expected in checks:
        if float((got - expected).abs().max()) > tolerance:
            raise VerifyError(f"self-check failed: {kind} output {name} disagrees with the distribution")


def round_up(value: float) -> float:
    """A stable printable bound (two significant digits, rounded up) so reruns stay byte-identical."""
    if value <= 0:
        return 0.0
    exponent = math.floor(math.log10(value)) - 1
    return math.ceil(value / 10**exponent) * 10**exponent

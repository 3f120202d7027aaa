"""Golden values: full-vocabulary logprobs recorded at export, re-checked by verify."""

from __future__ import annotations

from typing import TYPE_CHECKING

from safetensors.torch import load_file

from helios.core.program import run_prompt

if TYPE_CHECKING:
    from torch import Tensor

    from helios.core.bundle import Core
    from helios.core.host_rows import HostFed
    from helios.core.program import Program


def golden_key(index: int) -> str:
    return f"prompt_{index}"


def recheck(core: Core, program: Program | HostFed | None = None, weights: dict[str, Tensor] | None = None) -> float:
    """Re-run the golden prompts through the saved step program (or `program` on `weights`: the
    step as the golden values were recorded, e.g. with int8 activations rounded as recorded).

    Returns the max absolute logprob difference; raises CoreError naming the first value
    that differs by more than the recorded tolerance.
    """
    from helios.core.bundle import CoreError

    golden = core.manifest.golden
    recorded = load_file(str(core.root / golden.file))
    program = program if program is not None else core.load_program()
    weights = weights if weights is not None else core.load_weights()
    worst = 0.0
    for index, prompt in enumerate(golden.prompts):
        expected = recorded[golden_key(index)]
        got = run_prompt(
            program,
            weights,
            core.manifest.kv,
            core.manifest.limits.page_tokens,
            list(prompt),
            chunk=golden.prefill_chunk,
        ).logprobs
        diff = (got - expected).abs()
        worst = max(worst, float(diff.max()))
        if float(diff.max()) > golden.tolerance:
            position, token = divmod(int(diff.argmax()), diff.shape[1])
            raise CoreError(
                f"{core.root / golden.file}: golden prompt {index} position {position} token {token}: "
                f"logprob {float(got[position, token]):.6f}, recorded {float(expected[position, token]):.6f} "
                f"(tolerance {golden.tolerance:g}); the program or weights do not reproduce the export"
            )
    return worst


__all__ = ["golden_key", "recheck"]

"""What speculation tests share: a drafter that knows the answer (the plain run's own continuation)
and the check that speculating changed no token."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from helios.engine.offline import ChoiceOutput
from helios.engine.request import EngineRequest


def wrong_every_third(
    plain: dict[str, list[ChoiceOutput]], requests: Sequence[EngineRequest]
) -> Callable[[Any, int], tuple[int, ...]]:
    """A `propose(seq, k)` drafting each choice's continuation from the plain run `plain`, every
    third round's middle draft wrong: verification then both accepts and rejects drafts."""
    truth = {
        (r.request_id, i): r.prompt_ids + tuple(plain[r.request_id][i].token_ids) for r in requests for i in range(r.n)
    }

    def oracle(seq: Any, k: int) -> tuple[int, ...]:
        n = len(seq.token_ids)
        drafts = list(truth[seq.request.request_id, seq.choice_index][n : n + k])
        if n % 3 == 0 and len(drafts) > 1:
            drafts[len(drafts) // 2] = (drafts[len(drafts) // 2] + 1) % 64
        return tuple(drafts)

    return oracle


def same_tokens(a: dict[str, list[ChoiceOutput]], b: dict[str, list[ChoiceOutput]]) -> None:
    """The two runs' outputs (request id -> choices) hold the same tokens."""
    assert {k: [c.token_ids for c in v] for k, v in a.items()} == {k: [c.token_ids for c in v] for k, v in b.items()}

"""Shaping raw-distribution logprobs from program outputs into ordered per-token entries.

Programs return logits [R, V] f32, logsumexp [R], top_logprobs/top_ids [R, N] (from
torch.topk, whose order among ties is unspecified) and explicit_logprobs [R, K]. Values
are logit - logsumexp, before any sampling transform (spec: "Generation log probabilities").
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import Tensor

NON_FINITE_LOGPROB = -9999.0  # JSON has no -inf; the spec reports non-finite prompt logprobs so

Alternatives = tuple[tuple[int, float], ...]  # (token_id, logprob), in reporting order


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The logprob entry of one generated token."""

    token_id: int  # the sampled token
    logprob: float  # its raw-distribution logprob
    alternatives: Alternatives  # natural: decreasing logprob, then increasing id; explicit: caller order


@dataclass(frozen=True, slots=True)
class RankedLogprob:
    """One token's value in a prompt logprob entry."""

    logprob: float  # finite; non-finite values are reported as -9999.0
    rank: int  # 1 + number of vocabulary entries with a strictly greater logprob


def natural_alternatives(logits_row: Tensor, lse: float, top_values: Tensor, top_ids: Tensor, num: int) -> Alternatives:
    """The `num` most likely tokens of a row, by decreasing logprob then increasing id.

    logits_row [V] and lse give the full row; top_values/top_ids [N] are the program's
    top-N logprobs. The top-N list answers unless a tie crosses the cut-off, where topk
    may have kept a higher id than the vocabulary offers: only then is the row scanned.
    """
    available = top_values.shape[-1]
    if not 0 <= num <= available:
        raise ValueError(f"asked for {num} alternatives, the core returns at most {available}")
    if num == 0:
        return ()
    values = top_values.tolist()
    cutoff = values[num - 1]
    # No next entry to look at when all N are asked for: count the vocabulary at or above the cut-off.
    at_cutoff = int((logits_row.float() - lse >= cutoff).sum()) if num == available else None
    listed = listed_alternatives(values, top_ids.tolist(), num, at_cutoff)
    return listed if listed is not None else scanned_alternatives(logits_row, lse, cutoff, num)


def listed_alternatives(
    values: Sequence[float], ids: Sequence[int], num: int, at_cutoff: int | None
) -> Alternatives | None:
    """natural_alternatives from the program's top-N list alone (host values), or None when a tie
    crosses the cut-off and the row must be scanned (scanned_alternatives). at_cutoff: how many
    vocabulary entries are at or above the num-th value, needed only when num is N."""
    if not 0 <= num <= len(values):
        raise ValueError(f"asked for {num} alternatives, the core returns at most {len(values)}")
    if num == 0:
        return ()
    cutoff = values[num - 1]
    if num < len(values):
        # The list is a true top-N, so a tie at the cut-off shows as an equal next entry.
        tied = values[num] == cutoff
    else:
        assert at_cutoff is not None, "all N alternatives asked for: the row's count at the cut-off is needed"
        tied = at_cutoff > num
    if tied:
        return None
    return tuple(sorted(zip(ids[:num], values[:num]), key=lambda pair: (-pair[1], pair[0])))


def scanned_alternatives(logits_row: Tensor, lse: float, cutoff: float, num: int) -> Alternatives:
    """The `num` most likely tokens of a host row [V] whose top list ties across `cutoff` (the
    num-th value): every id at or above it, by decreasing logprob then increasing id."""
    row = logits_row.float() - lse
    ids = (row >= cutoff).nonzero().flatten()  # ascending ids
    candidates = row[ids]
    # A stable descending sort keeps ascending ids among equal values.
    order = candidates.sort(descending=True, stable=True).indices[:num]
    return tuple(zip(ids[order].tolist(), candidates[order].tolist()))


def explicit_alternatives(
    ids: Sequence[int], values: Sequence[float], chosen: int, chosen_logprob: float
) -> Alternatives:
    """Caller-chosen ids with their logprobs, in caller order without duplicates; the
    chosen token is appended when absent (so at most 128 + 1 entries)."""
    entries: dict[int, float] = {}
    for token_id, value in zip(ids, values, strict=True):
        entries.setdefault(int(token_id), float(value))
    entries.setdefault(chosen, chosen_logprob)
    return tuple(entries.items())


def dedupe_token_ids(ids: Iterable[int]) -> list[int]:
    """Ids without duplicates, in first-occurrence order."""
    return list(dict.fromkeys(ids))


def _reportable(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else NON_FINITE_LOGPROB


def prompt_entry(
    actual_id: int, actual_logprob: float, actual_rank: int, alternatives: Alternatives
) -> dict[int, RankedLogprob]:
    """One prompt position's entry: the actual token first, then the alternatives.

    `alternatives` come from natural_alternatives, a top prefix of the vocabulary in
    reporting order, so each one's rank is counted among them; equal values share a rank.
    """
    entry = {actual_id: RankedLogprob(_reportable(actual_logprob), actual_rank)}
    for token_id, value in alternatives:
        rank = 1 + sum(other > value for _, other in alternatives)
        entry.setdefault(token_id, RankedLogprob(_reportable(value), rank))
    return entry

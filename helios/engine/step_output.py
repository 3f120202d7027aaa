"""The step's one device-to-host copy: what the host needs of a step's outputs, in one transfer.

The programs' outputs (logits, logsumexp, top logprobs, explicit logprobs, prompt scores) and
the sampled ids stay on the device the step ran on. After sampling, `fetch` selects there what
the host reads (the sampled ids, and for choices that asked for logprobs their rows' values)
and `to_host` copies all of it at once: one packed float64 tensor, exact for fp32 values and
for ids and ranks below 2**53. Every read of a device value in the step path goes through
`to_host`; a second copy happens only for a row whose natural alternatives tie across their
cut-off (`logits_row`: the row itself is scanned, as logprobs.natural_alternatives does).

`fetch_start` only starts the copy (on CUDA into pinned memory, without waiting for the device):
the engine's async output handling (helios.engine.overlap) launches the next step before it
reads this one's values with `PendingFetch.wait`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from helios.engine.executor import StepResult

HostValue = float | int | list  # a copied tensor: a number (0-d) or nested lists of its shape


@dataclass(frozen=True, slots=True)
class RowLogprobs:
    """Host values of one sampling row whose choice asked for logprobs."""

    logsumexp: float
    chosen_logit: float  # the raw logit of the sampled token
    top_values: tuple[float, ...] | None  # the program's top-N logprobs (None: the core returns none)
    top_ids: tuple[int, ...] | None
    explicit: tuple[float, ...] | None  # explicit_logprobs of the row (padded to the step's width)
    # Vocabulary entries at or above the N-th top value (the tie test of natural alternatives when
    # all N are asked for); None when the choice asked for fewer.
    at_cutoff: int | None


@dataclass(frozen=True, slots=True)
class HostStepResult:
    """What the host reads of one step, after its one copy."""

    tokens: tuple[int, ...]  # the sampled id of each sampling row
    logprobs: dict[int, RowLogprobs]  # sampling row index -> its values (choices asking for logprobs)
    prompt_scores: dict[int, dict[str, list]]  # id(chunk) -> output name -> per-token host values


class HostCopy:
    """A started copy of tensors to the host, in one transfer: a packed float64 tensor, exact for
    fp32 values and for ids and ranks below 2**53. On CUDA the copy goes into pinned memory without
    waiting for the device; `wait` returns the values (what to_host returns)."""

    def __init__(self, parts: Mapping[str, Tensor]) -> None:
        self._layout = [(name, tuple(t.shape), t.numel(), t.is_floating_point()) for name, t in parts.items()]
        self._event: torch.cuda.Event | None = None
        if not parts:
            self._host = torch.empty(0, dtype=torch.float64)
            return
        device = next(iter(parts.values())).device
        packed = torch.cat([t.reshape(-1).to(device=device, dtype=torch.float64) for t in parts.values()])
        if device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)  # the transfer, queued behind the step's work
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed.cpu()  # the transfer (none on the CPU)

    def wait(self) -> dict[str, HostValue]:
        """The copied values as numbers or nested lists of their shapes (ints for integer and bool
        tensors, floats otherwise), after the device has finished the copy."""
        if self._event is not None:
            self._event.synchronize()
        flat = self._host.tolist()
        out: dict[str, HostValue] = {}
        offset = 0
        for name, shape, count, floating in self._layout:
            values = flat[offset : offset + count]
            offset += count
            if not floating:
                values = [int(v) for v in values]
            out[name] = _nested(values, shape)
        return out


def to_host(parts: Mapping[str, Tensor]) -> dict[str, HostValue]:
    """Every tensor of `parts`, copied to the host in one transfer and returned as numbers or
    nested lists of its shape (ints for integer and bool tensors, floats otherwise). The only place
    where the step path reads device values (HostCopy: the same copy, its wait deferred)."""
    return HostCopy(parts).wait()


def _nested(values: list, shape: tuple[int, ...]) -> HostValue:
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    inner = len(values) // shape[0] if shape[0] else 0
    return [_nested(values[i * inner : (i + 1) * inner], shape[1:]) for i in range(shape[0])]


def fetch(result: StepResult, rows: Sequence[int], tokens: Tensor | None, asks: Sequence[int | None]) -> HostStepResult:
    """The step's host values, in one copy. rows[i]: the output row sampling row i read; tokens:
    the sampled ids [len(rows)] (None without sampling rows); asks[i]: the alternatives sampling
    row i's choice asked for (None: no logprobs)."""
    return fetch_start(result, rows, tokens, asks).wait()


@dataclass(frozen=True, slots=True)
class PendingFetch:
    """A step's host values whose copy has started (fetch_start); `wait` reads them."""

    copy: HostCopy
    wanted: tuple[int, ...]  # sampling rows whose choices asked for logprobs
    full: tuple[int, ...]  # those of them that asked for every alternative the core returns (tie test)
    prompt_names: dict[int, tuple[str, ...]]  # id(chunk) -> its prompt score names

    def wait(self) -> HostStepResult:
        host = self.copy.wait()
        counts = dict(zip(self.full, host.get("at_cutoff", [])))  # type: ignore[arg-type]
        logprobs = {
            i: RowLogprobs(
                logsumexp=host["lse"][n],  # type: ignore[index]
                chosen_logit=host["chosen"][n],  # type: ignore[index]
                top_values=tuple(host["top_values"][n]) if "top_values" in host else None,  # type: ignore[index]
                top_ids=tuple(host["top_ids"][n]) if "top_ids" in host else None,  # type: ignore[index]
                explicit=tuple(host["explicit"][n]) if "explicit" in host else None,  # type: ignore[index]
                at_cutoff=counts.get(i),
            )
            for n, i in enumerate(self.wanted)
        }
        prompt_scores: dict[int, dict[str, list]] = {}
        for key, names in self.prompt_names.items():
            prompt_scores[key] = {name: host[f"prompt/{key}/{name}"] for name in names}  # type: ignore[misc]
        return HostStepResult(tuple(host.get("tokens", ())), logprobs, prompt_scores)  # type: ignore[arg-type]


def fetch_start(
    result: StepResult, rows: Sequence[int], tokens: Tensor | None, asks: Sequence[int | None]
) -> PendingFetch:
    """Select on the device what the host reads of the step (fetch's arguments) and start its copy."""
    device = result.logits.device
    parts: dict[str, Tensor] = {}
    if tokens is not None:
        parts["tokens"] = tokens
    wanted = [i for i, ask in enumerate(asks) if ask is not None]
    width = result.top_logprobs.shape[-1] if result.top_logprobs is not None else 0
    full = [i for i in wanted if width and asks[i] == width]  # the tie test needs a count of the row
    if wanted:
        assert tokens is not None, "logprobs are asked for by sampling rows"
        index = torch.tensor(wanted, dtype=torch.int64, device=device)
        picked = torch.tensor([rows[i] for i in wanted], dtype=torch.int64, device=device)
        parts["lse"] = result.logsumexp.index_select(0, picked)
        parts["chosen"] = result.logits[picked, tokens.index_select(0, index)]
        if result.top_logprobs is not None and result.top_ids is not None:
            parts["top_values"] = result.top_logprobs.index_select(0, picked)
            parts["top_ids"] = result.top_ids.index_select(0, picked)
        if result.explicit_logprobs is not None:
            parts["explicit"] = result.explicit_logprobs.index_select(0, picked)
    if full:
        assert result.top_logprobs is not None
        # As logprobs.natural_alternatives counts it: fp32 logit - logsumexp against the N-th value.
        # A row at a time: [rows, V] temporaries cost more than the few extra launches.
        parts["at_cutoff"] = torch.stack(
            [
                (
                    result.logits[rows[i]].float() - result.logsumexp[rows[i]]
                    >= result.top_logprobs[rows[i], width - 1]
                ).sum()
                for i in full
            ]
        )
    for key, scores in result.prompt_scores.items():
        for name, tensor in scores.items():
            parts[f"prompt/{key}/{name}"] = tensor
    names = {key: tuple(scores) for key, scores in result.prompt_scores.items()}
    return PendingFetch(HostCopy(parts), tuple(wanted), tuple(full), names)


def logits_row(result: StepResult, row: int) -> Tensor:
    """One output row's logits as a host fp32 tensor: the second copy of a step, only for a row
    whose natural alternatives tie across their cut-off (logprobs.scanned_alternatives)."""
    values = to_host({"row": result.logits[row]})["row"]
    return torch.tensor(values, dtype=torch.float32)

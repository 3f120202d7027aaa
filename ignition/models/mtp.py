"""Multi-token-prediction drafter programs ("mtp_draft.N"), shared by the families that export them.

The contract helios.engine.mtp drafts with, whatever the architecture: the family's step and
scored_prefill programs return one more output, `hidden_states` [T, hidden] fp32 (the main
model's final-normed state of every row), and each MTP layer N is its own program taking the
step's paged inputs plus `hidden_states` (row t: token_ids[t] is the token AFTER positions[t],
hidden_states[t] the main (or previous MTP layer's) state at positions[t]); it writes its own KV
at slot_mapping[t] (KvLayout.extra "mtp_kv", on the step's pages) and returns the step's
distribution outputs for the logits_indices rows plus every row's MTP `hidden_states`.
Families supply the module, the plain-torch references and the checkpoint names (mimo_v2,
deepseek_v3); this module has the signature, the export description and the self-check.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from helios.core.manifest import KvLayout, TensorSpec
from helios.core.program import allocate_kv
from ignition.errors import SourceError
from ignition.models.heads import generation_outputs
from ignition.models.step import Paged

MTP_KIND = "mtp_draft"  # program kinds "mtp_draft.0", "mtp_draft.1", ...
MTP_CACHE = "mtp_kv"  # the KvLayout.extra caches the programs write (helios.engine.mtp reads the name)


@dataclass(frozen=True)
class ExtraProgram:
    """A program kind beyond step/scored_prefill that export traces into the core (extra_programs)."""

    kind: str
    module: torch.nn.Module
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    examples: dict[str, Tensor]  # example values of the inputs export has none for
    # (saved program, fp32 HF-named weights as stored, core weights, layout, page tokens) -> max |Δ logprob|
    check: Callable[[Any, dict[str, Tensor], dict[str, Tensor], KvLayout, int], float]


def hidden_states_spec(hidden_size: int) -> TensorSpec:
    return TensorSpec("hidden_states", "float32", ("T", hidden_size))


def extra_step_outputs(hidden_size: int, num_mtp_layers: int) -> tuple[TensorSpec, ...]:
    """What a family's step programs return after program_signature's: the drafter's input, with MTP layers."""
    return (hidden_states_spec(hidden_size),) if num_mtp_layers else ()


def signature(hidden_size: int, num_top: int) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """Inputs and outputs of an mtp_draft.N program (dims as program_signature's)."""
    hidden = hidden_states_spec(hidden_size)
    inputs = (
        TensorSpec("token_ids", "int64", ("T",)),
        TensorSpec("positions", "int64", ("T",)),
        hidden,
        TensorSpec("slot_mapping", "int64", ("T",)),
        TensorSpec("block_tables", "int32", ("B", "M")),
        TensorSpec("seq_lens", "int32", ("B",)),
        TensorSpec("query_start_loc", "int32", ("B+1",)),
        TensorSpec("logits_indices", "int64", ("R",)),
    )
    outputs = [TensorSpec("logits", "float32", ("R", "V")), TensorSpec("logsumexp", "float32", ("R",))]
    if num_top:
        outputs += [
            TensorSpec("top_logprobs", "float32", ("R", num_top)),
            TensorSpec("top_ids", "int64", ("R", num_top)),
        ]
    return inputs, (*outputs, hidden)


@dataclass(frozen=True, slots=True)
class DraftInputs:
    """One mtp_draft.N call's inputs (`signature`): row t joins token_ids[t], the token AFTER
    positions[t], with hidden[t], the main model's (or the previous MTP layer's) final-normed state at
    positions[t]; the layer writes its own KV at the slot of positions[t], as the step's."""

    token_ids: Tensor  # [T]
    hidden: Tensor  # [T, hidden] fp32
    paged: Paged
    logits_indices: Tensor  # [R] rows whose distributions are returned


class DraftForward:
    """The forward of an mtp_draft.N program (a mixin beside torch.nn.Module): `signature`'s inputs ->
    `draft`'s outputs."""

    num_top: int

    def forward(
        self,
        weights,
        kv_cache,
        token_ids,
        positions,
        hidden_states,
        slot_mapping,
        block_tables,
        seq_lens,
        query_start_loc,
        logits_indices,
    ):
        paged = Paged(slot_mapping, block_tables, seq_lens, query_start_loc, positions)
        return self.draft(weights, kv_cache, DraftInputs(token_ids, hidden_states, paged, logits_indices))

    def draft(self, weights: dict[str, Tensor], kv_cache: list[Tensor], d: DraftInputs) -> tuple[Tensor, ...]:
        """-> `draft_outputs`."""
        raise NotImplementedError

    def draft_outputs(self, out: Tensor, head: Tensor, d: DraftInputs, dtype: torch.dtype) -> tuple[Tensor, ...]:
        """The logits_indices rows' distributions (logits, logsumexp, top-N as the step's) from the MTP
        layer's final-normed states out [T, hidden] fp32 through `head`, then every row's state (the
        next draft's hidden_states)."""
        return (*generation_outputs(out[d.logits_indices].to(dtype), head, self.num_top, None), out)


class DraftModule(DraftForward, torch.nn.Module):
    """An mtp_draft.N program of MTP layer `layer`: a family writes `draft`."""

    def __init__(self, config: Any, layer: int, num_top: int) -> None:
        super().__init__()
        self.config = config
        self.layer = layer
        self.num_top = num_top


def require_layers(
    weights: dict[str, Tensor],
    num_mtp_layers: int,
    internal: Callable[[int], str],
    checkpoint_prefix: Callable[[int], str],
) -> None:
    """A SourceError when the config promises MTP layers whose tensors the checkpoint lacks
    (e.g. a transformers save_pretrained copy, which drops them)."""
    missing = [k for k in range(num_mtp_layers) if internal(k) not in weights]
    if missing:
        raise SourceError(
            f"num_nextn_predict_layers = {num_mtp_layers}, but the checkpoint has no "
            f"{checkpoint_prefix(missing[0])}* tensors; set num_nextn_predict_layers to "
            f"{missing[0]} in config.json to export without them"
        )


# (layer, saved program, fp32 HF-named weights, core weights, layout, page tokens) -> max |Δ logprob|
Checker = Callable[[int, Any, dict[str, Tensor], dict[str, Tensor], KvLayout, int], float]


def draft_programs(
    modules: list[torch.nn.Module], hidden_size: int, num_top: int, check: Checker
) -> tuple[ExtraProgram, ...]:
    """One mtp_draft.N program per module (MTP layer N), each checked at export by `check`."""
    inputs, outputs = signature(hidden_size, num_top)
    examples = {"hidden_states": torch.zeros(5, hidden_size)}

    def checker(layer: int) -> Callable[..., float]:
        return lambda program, hf_weights, weights, kv, page_tokens: check(
            layer, program, hf_weights, weights, kv, page_tokens
        )

    return tuple(
        ExtraProgram(f"{MTP_KIND}.{k}", module, inputs, outputs, examples, checker(k))
        for k, module in enumerate(modules)
    )


def logits_of(reference_forward: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., Tensor]:
    """A family's Reference.logits from the reference_forward its drafts are checked with (checked_drafts:
    -> (logits, final-normed hidden states)): the same forward, its logits only, under its module."""

    @functools.wraps(reference_forward)
    def reference_logits(*args: Any, **kwargs: Any) -> Tensor:
        return reference_forward(*args, **kwargs)[0]

    return reference_logits


def checked_drafts(
    config: Any,
    num_top: int,
    program: Callable[[Any, int, int], torch.nn.Module],
    reference_forward: Callable[[Any, dict[str, Tensor], list[int]], tuple[Tensor, Tensor]],
    reference_mtp: Callable[[Any, dict[str, Tensor], int, list[int], Tensor], tuple[Tensor, Tensor]],
) -> tuple[ExtraProgram, ...]:
    """One program(config, N, num_top) per MTP layer N of the config, each checked at export against
    the family's plain-torch references: reference_forward(config, hf_weights, ids) -> (logits,
    final-normed hidden states) and reference_mtp(config, hf_weights, N, next_ids, hidden) -> (logits,
    MTP hidden states)."""
    modules = [program(config, k, num_top) for k in range(config.num_mtp_layers)]
    check = reference_check(
        config.vocab_size,
        lambda w, ids: reference_forward(config, w, ids)[1],
        lambda w, layer, next_ids, hidden: reference_mtp(config, w, layer, next_ids, hidden)[0],
    )
    return draft_programs(modules, config.hidden_size, num_top, check)


def run_mtp_prompt(
    program: Any,
    weights: dict[str, Tensor],
    kv: KvLayout,
    page_tokens: int,
    next_ids: list[int],
    hidden: Tensor,
    chunk: int | None = None,
) -> dict[str, Tensor]:
    """One sequence through an mtp_draft program in chunks over a fresh paged cache (pages used
    in reverse order, as helios.core.program.run_prompt); outputs concatenated over chunks."""
    total = len(next_ids)
    chunk = chunk or total
    pages = list(reversed(range(math.ceil(total / page_tokens) + 1)))[: math.ceil(total / page_tokens)]
    caches = allocate_kv(kv, len(pages) + 1, page_tokens)
    ids = torch.tensor(next_ids, dtype=torch.int64)
    collected: dict[str, list[Tensor]] = {}
    for start in range(0, total, chunk):
        end = min(total, start + chunk)
        slots = torch.tensor([pages[t // page_tokens] * page_tokens + t % page_tokens for t in range(start, end)])
        inputs = {
            "token_ids": ids[start:end],
            "positions": torch.arange(start, end),
            "hidden_states": hidden[start:end],
            "slot_mapping": slots,
            "block_tables": torch.tensor([pages], dtype=torch.int32),
            "seq_lens": torch.tensor([end], dtype=torch.int32),
            "query_start_loc": torch.tensor([0, end - start], dtype=torch.int32),
            "logits_indices": torch.arange(end - start),
        }
        for name, value in program(weights, caches, **inputs).items():
            collected.setdefault(name, []).append(value)
    return {name: torch.cat(parts) for name, parts in collected.items()}


CHECK_TEXT_IDS = 40  # tokens of the export-time MTP check (several chunks and pages at 16-token pages)


def check_against_reference(
    program: Any,
    weights: dict[str, Tensor],
    kv: KvLayout,
    page_tokens: int,
    vocab_size: int,
    main_hidden: Callable[[list[int]], Tensor],
    mtp_logits: Callable[[list[int], Tensor], Tensor],
) -> float:
    """Max |Δ logprob| of an mtp_draft program against the family's reference on a fixed token
    sequence: main_hidden(ids) -> the reference's final-normed hidden states [T, hidden];
    mtp_logits(next_ids, hidden) -> the reference MTP layer's logits [T, V]; the program is fed
    the reference's own hidden states, prefilled in chunks of 7 rows."""
    ids = [(7 * t + 3) % vocab_size for t in range(CHECK_TEXT_IDS + 1)]
    hidden = main_hidden(ids[:-1])
    expected = mtp_logits(ids[1:], hidden)
    got = run_mtp_prompt(program, weights, kv, page_tokens, ids[1:], hidden, chunk=7)
    logprobs = got["logits"] - got["logsumexp"][:, None]
    return float((logprobs - torch.log_softmax(expected, dim=-1)).abs().max())


def reference_check(
    vocab_size: int,
    main_hidden: Callable[[dict[str, Tensor], list[int]], Tensor],
    mtp_logits: Callable[[dict[str, Tensor], int, list[int], Tensor], Tensor],
) -> Callable[..., float]:
    """draft_programs' `check` for a family with plain-torch references: main_hidden(hf_weights,
    ids) -> final-normed hidden states; mtp_logits(hf_weights, layer, next_ids, hidden) -> the
    reference MTP layer's logits (check_against_reference)."""

    def check(
        layer: int,
        program: Any,
        hf_weights: dict[str, Tensor],
        weights: dict[str, Tensor],
        kv: KvLayout,
        page_tokens: int,
    ) -> float:
        return check_against_reference(
            program,
            weights,
            kv,
            page_tokens,
            vocab_size,
            lambda ids: main_hidden(hf_weights, ids),
            lambda next_ids, hidden: mtp_logits(hf_weights, layer, next_ids, hidden),
        )

    return check

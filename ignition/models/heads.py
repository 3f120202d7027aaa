"""Output heads shared by every family: the logprob statistics a core's programs return.

Logprobs describe the raw distribution: logit - logsumexp(logits) in fp32, before any
sampling transform (spec "Generation log probabilities").
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# A tensor-parallel rank's vocabulary shard's logits [R, V / N] -> the full vocabulary's [R, V]
# (flare::all_gather; StepModule.gather_vocab), so every statistic below is the one-rank program's.
Gather = Callable[[Tensor], Tensor]


def head_logits(hidden: Tensor, lm_head: Tensor, softcap: float = 0.0, gather: Gather | None = None) -> Tensor:
    """fp32 logits; with `softcap` (Gemma's final_logit_softcapping) cap * tanh(logits / cap):
    the model's logits are the capped ones, so every logprob statistic is taken after it. `gather`:
    lm_head is a rank's vocabulary shard, gathered into the full vocabulary first."""
    logits = F.linear(hidden, lm_head).float()
    if gather is not None:
        logits = gather(logits)
    return softcap * torch.tanh(logits / softcap) if softcap > 0.0 else logits


def generation_outputs(
    rows: Tensor,
    lm_head: Tensor,
    num_top: int,
    logprob_token_ids: Tensor | None,
    softcap: float = 0.0,
    gather: Gather | None = None,
) -> list[Tensor]:
    """rows [R, hidden] -> [logits [R, V] f32, logsumexp [R], (top_logprobs [R, N], top_ids [R, N]), (explicit [R, K])]."""
    logits = head_logits(rows, lm_head, softcap, gather)
    lse = torch.logsumexp(logits, dim=-1)
    outputs = [logits, lse]
    if num_top > 0:
        values, ids = torch.topk(logits, num_top, dim=-1)
        outputs += [values - lse[:, None], ids]
    if logprob_token_ids is not None:
        outputs.append(logits.gather(1, logprob_token_ids) - lse[:, None])
    return outputs


def prompt_outputs(
    hidden: Tensor,
    lm_head: Tensor,
    target_ids: Tensor,
    num_top: int,
    softcap: float = 0.0,
    gather: Gather | None = None,
) -> list[Tensor]:
    """Score every position's next prompt token: hidden [T, hidden], target_ids [T].

    Returns [prompt_logprobs [T], prompt_ranks [T] (1 + count strictly greater),
    (prompt_top_logprobs [T, N], prompt_top_ids [T, N])]. Targets < 0 score token 0.
    """
    logprobs = torch.log_softmax(head_logits(hidden, lm_head, softcap, gather), dim=-1)
    target = logprobs.gather(1, target_ids.clamp(min=0)[:, None])  # [T, 1]
    ranks = (logprobs > target).sum(dim=-1) + 1
    outputs = [target[:, 0], ranks]
    if num_top > 0:
        values, ids = torch.topk(logprobs, num_top, dim=-1)
        outputs += [values, ids]
    return outputs


def step_outputs(
    hidden: Tensor,
    weights: dict[str, Tensor],
    tied: bool,
    logits_indices: Tensor,
    num_top: int,
    logprob_token_ids: Tensor | None,
    target_ids: Tensor | None,
    softcap: float = 0.0,
    gather: Gather | None = None,
) -> tuple[Tensor, ...]:
    """Every output of a step program, in program_signature's order, from the final-normed
    hidden states [T, hidden]: the rows' distributions, then (scored prefill) the prompt's."""
    lm_head = weights["embed"] if tied else weights["lm_head"]
    outputs = generation_outputs(hidden[logits_indices], lm_head, num_top, logprob_token_ids, softcap, gather)
    if target_ids is not None:
        outputs += prompt_outputs(hidden, lm_head, target_ids, num_top, softcap, gather)
    return tuple(outputs)

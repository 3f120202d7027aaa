"""Output heads shared by every family: the logprob statistics a core's programs return.

Logprobs describe the raw distribution: logit - logsumexp(logits) in fp32, before any
sampling transform (spec "Generation log probabilities").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def generation_outputs(
    rows: Tensor, lm_head: Tensor, num_top: int, logprob_token_ids: Tensor | None
) -> list[Tensor]:
    """rows [R, hidden] -> [logits [R, V] f32, logsumexp [R], (top_logprobs [R, N], top_ids [R, N]), (explicit [R, K])]."""
    logits = F.linear(rows, lm_head).float()
    lse = torch.logsumexp(logits, dim=-1)
    outputs = [logits, lse]
    if num_top > 0:
        values, ids = torch.topk(logits, num_top, dim=-1)
        outputs += [values - lse[:, None], ids]
    if logprob_token_ids is not None:
        outputs.append(logits.gather(1, logprob_token_ids) - lse[:, None])
    return outputs


def prompt_outputs(hidden: Tensor, lm_head: Tensor, target_ids: Tensor, num_top: int) -> list[Tensor]:
    """Score every position's next prompt token: hidden [T, hidden], target_ids [T].

    Returns [prompt_logprobs [T], prompt_ranks [T] (1 + count strictly greater),
    (prompt_top_logprobs [T, N], prompt_top_ids [T, N])]. Targets < 0 score token 0.
    """
    logprobs = torch.log_softmax(F.linear(hidden, lm_head).float(), dim=-1)
    target = logprobs.gather(1, target_ids.clamp(min=0)[:, None])  # [T, 1]
    ranks = (logprobs > target).sum(dim=-1) + 1
    outputs = [target[:, 0], ranks]
    if num_top > 0:
        values, ids = torch.topk(logprobs, num_top, dim=-1)
        outputs += [values, ids]
    return outputs

"""helios' CPU kernel for flare::gated_delta_rule (the core's reference kernel steps token by
token in Python, one sequence at a time).

Decode rows (one token per sequence) take one recurrent step each, in place in their slots
(batched over gathered slots where the states are small). Longer chunks use the chunked (WY /
UT-transform) form of the gated delta rule, as transformers' `torch_chunk_gated_delta_rule` and
flash-linear-attention compute it: within a chunk of up to CHUNK tokens, the delta-rule writes are condensed into
two unit-lower-triangular solves and a few matmuls; chunks are scanned in order. Same result
as the recurrence up to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from helios.core.ops.gated_delta import prepare
from helios.core.ops.recurrent import state_spans

CHUNK = 64  # tokens per chunk of the chunked form (transformers' and FLA's default)
_IN_PLACE_BYTES = 1 << 18  # decode states of at least this many bytes per slot update in place
# One chunk's step of a chunked form: (q, k, v, g, beta, state) -> (out, state), per head [H, c, ...]
ChunkStep = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def gated_delta_rule_cpu(q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm):
    return run_spans(
        q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm, (_chunk, CHUNK), _decode
    )


def run_spans(
    q, k, v, g, beta, state, state_slots, query_start_loc, positions, scale, qk_l2norm, chunk_form, decode_form
) -> Tensor:
    """A delta-rule op over a batch's sequences: chunks of more than one token in the chunked form
    (`chunk_form`: (one chunk's step, its most tokens), scanned by `_chunked`), one-token
    sequences together through `decode_form(DecodeRows, state, out)` (shared by gated DeltaNet
    and KDA, whose gates differ: per head, per key channel)."""
    q, k, v = prepare(q, k, v, scale, qk_l2norm)
    g, beta = g.float(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32)
    decode: list[tuple[int, int, bool]] = []  # (row, slot, fresh)
    for span in state_spans(state_slots, query_start_loc, positions):
        start, end = span.start, span.end
        if end - start == 1:
            decode.append((start, span.slot, span.fresh))
        elif end > start:
            initial = None if span.fresh else state[span.slot].float()
            o, final = _chunked(
                q[start:end], k[start:end], v[start:end], g[start:end], beta[start:end], initial, *chunk_form
            )
            out[start:end] = o
            state[span.slot] = final.to(state.dtype)
    if decode:
        rows = torch.tensor([r for r, _, _ in decode])
        decode_form(DecodeRows(tuple(decode), rows, q[rows], k[rows], v[rows], g[rows], beta[rows]), state, out)
    return out


def _chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial: Tensor | None, chunk: ChunkStep, size: int
) -> tuple[Tensor, Tensor]:
    """One sequence's rows in the chunked form: q, k [n, H, Dk] (prepared), v [n, H, Dv], g [n, H]
    or [n, H, Dk], beta [n, H], initial [H, Dk, Dv] or None (zero) -> (out [n, H, Dv], final state
    [H, Dk, Dv]); chunks of up to `size` tokens in order through `chunk(q, k, v, g, beta, s) ->
    (out, s)` on [H, c, ...] views."""
    n, heads, dk = k.shape
    dv = v.shape[-1]
    s = q.new_zeros(heads, dk, dv) if initial is None else initial.clone()
    out = torch.empty(n, heads, dv, dtype=torch.float32)
    qh, kh, vh, gh, bh = (t.transpose(0, 1) for t in (q, k, v, g, beta))  # [H, n, ...]
    for start in range(0, n, size):
        end = min(n, start + size)
        o, s = chunk(qh[:, start:end], kh[:, start:end], vh[:, start:end], gh[:, start:end], bh[:, start:end], s)
        out[start:end] = o.transpose(0, 1)
    return out, s


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A step's one-token sequences, their rows of the prepared inputs gathered.

    A decode form steps each one's state once. Large states (real models: megabytes per slot,
    memory-bound) update in place in their slots, one sequence after another: gathering them
    into a batch and scattering back would add two more passes over them (measured 4x slower at
    8 rows of 32 heads x 128 x 128). Small states batch all rows in one gather, where per-call
    overhead dominates.
    """

    entries: tuple[tuple[int, int, bool], ...]  # (row of the step, state slot, fresh) per sequence
    rows: Tensor  # [Bd] their rows of the step
    q: Tensor  # [Bd, H, Dk] prepared (normalized, scaled, repeated to the value heads)
    k: Tensor  # [Bd, H, Dk]
    v: Tensor  # [Bd, H, Dv]
    g: Tensor  # [Bd, H] (gated DeltaNet) or [Bd, H, Dk] (KDA) fp32 log decay
    beta: Tensor  # [Bd, H] fp32

    @staticmethod
    def in_place(state: Tensor, threshold: int) -> bool:
        """Whether the states (fp32 slots of at least `threshold` bytes) update in place."""
        return state[0].numel() * 4 >= threshold and state.dtype == torch.float32

    def slot_states(self, state: Tensor) -> Iterator[tuple[int, int, Tensor]]:
        """(index, row, its slot's state [H, Dk, Dv] as a view, zeroed when fresh) per sequence."""
        for i, (row, slot, fresh) in enumerate(self.entries):
            s = state[slot]
            if fresh:
                s.zero_()
            yield i, row, s

    def gathered(self, state: Tensor) -> tuple[Tensor, Tensor]:
        """(their slots [Bd], a fp32 copy of their states [Bd, H, Dk, Dv], the fresh ones zero)."""
        slots = torch.tensor([s for _, s, _ in self.entries])
        s = state.index_select(0, slots).float()
        fresh = [i for i, (_, _, f) in enumerate(self.entries) if f]
        if fresh:
            s[fresh] = 0.0
        return slots, s


def _decode(d: DecodeRows, state: Tensor, out: Tensor) -> None:
    """One recurrent step for every one-token sequence: the old state is read once for both
    S^T k and S^T q (one matmul), and o = S'^T q = exp(g) S^T q + (k . q) delta, so the updated
    state is not read again."""
    decay = d.g.exp()[..., None]  # [Bd, Hv, 1]
    qk = (d.k * d.q).sum(-1, keepdim=True)
    if d.in_place(state, _IN_PLACE_BYTES):
        for i, row, s in d.slot_states(state):
            read = torch.bmm(s.transpose(-1, -2), torch.stack([d.k[i], d.q[i]], dim=-1))  # [Hv, Dv, 2]
            delta = (d.v[i] - decay[i] * read[..., 0]) * d.beta[i][:, None]
            out[row] = decay[i] * read[..., 1] + qk[i] * delta
            s.mul_(decay[i][..., None]).baddbmm_(d.k[i][:, :, None], delta[:, None, :])
        return
    slots, s = d.gathered(state)
    read = s.transpose(-1, -2) @ torch.stack([d.k, d.q], dim=-1)  # [Bd, Hv, Dv, 2]: S^T k, S^T q
    delta = (d.v - decay * read[..., 0]) * d.beta[..., None]
    out[d.rows] = decay * read[..., 1] + qk * delta
    s.mul_(decay[..., None]).add_(d.k[..., None] * delta[..., None, :])
    state.index_copy_(0, slots, s.to(state.dtype))


def _chunk(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk of c tokens per head: q, k [H, c, Dk], v [H, c, Dv], g, beta [H, c], s [H, Dk, Dv]."""
    c = q.shape[1]
    cum = g.cumsum(dim=-1)  # [H, c] log decay from the chunk's start through each token
    causal = torch.ones(c, c, dtype=torch.bool).tril()
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, c, c], i >= j
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + strictly_lower(beta_i k_i . k_j decay_ij)) u = v_beta, and w for the decayed keys reading the old state
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    v_new = u - w @ s  # [H, c, Dv]: what each write adds beyond what the old state predicts
    attn = (q @ k.transpose(-1, -2)) * decay
    out = (q * cum.exp()[..., None]) @ s + attn @ v_new
    last = cum[:, -1:]  # [H, 1]
    s = s * last.exp()[..., None] + (k * (last - cum).exp()[..., None]).transpose(-1, -2) @ v_new
    return out, s


def register(library: torch.library.Library) -> None:
    """Install this kernel into helios' flare IMPL library (helios.engine.kernels.registry)."""
    library.impl("gated_delta_rule", gated_delta_rule_cpu, "CPU")

"""Next-token sampling over a batch: a straight pipeline of small vectorized stages.

mask -> penalties -> temperature -> top-k -> top-p -> min-p -> draw. Each stage maps
logits [B, V] f32 to new logits (dropped tokens become -inf) and skips its work when
every row is neutral for it. Logprobs are not computed here: they describe the raw
distribution, before any of these stages (see helios.engine.logprobs).

Every stage runs on the logits' device. A few shortcuts read a value on the host to pick a
cheaper path with the same distribution (a partial sort instead of a full one); on the CPU such
a read costs nothing, on an accelerator it would stall the step, so there the sampler takes the
full paths and no value leaves the device (Sampler.host_reads). A seeded top-k/top-p row then
draws from the same distribution, not always the same token. The engine copies the sampled ids
to the host once per step (helios.engine.step_output).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from helios.engine import native
from helios.engine.rows import MIN_ROWS, never_alone
from helios.engine.sampling_params import SamplingParams

TOP_P_CANDIDATES = 1024  # partial sort size for top-p; more only when these hold too little mass
CANDIDATE_SIZES = (128, TOP_P_CANDIDATES)  # the draw tries the smaller set first (a cheaper partial sort)
_EXP_FLOOR = -87.0  # exp() below this is subnormal in fp32 and very slow; such terms cannot move a sum >= 1


def logsumexp(x: Tensor, scratch: Tensor | None = None) -> Tensor:
    """Row-wise logsumexp, [B, V] -> [B]; equal to torch.logsumexp in fp32.

    torch.logsumexp takes a slow path when many terms underflow (e.g. logits scaled by a
    low temperature): ~10x slower over a 49k vocabulary. Every row's largest term is 1, so
    terms below e^-87 (about 1e-38 each) are far below the sum's resolution.

    scratch: a buffer of at least [max(B, 2), V] (Scratch) for the shifted terms, instead of a
    fresh tensor; the same values either way.

    A row's value does not depend on the rows beside it or on the thread count (rows.never_alone).
    """
    return never_alone(lambda rows: _logsumexp(rows, scratch), x)


def _logsumexp(x: Tensor, scratch: Tensor | None = None) -> Tensor:
    top = x.amax(dim=-1, keepdim=True)
    shifted = x - top if scratch is None else torch.sub(x, top, out=scratch[: x.shape[0]])
    return shifted.clamp_min_(_EXP_FLOOR).exp_().sum(dim=-1).log_() + top[:, 0]


_ARGMAX_BLOCK = 1024  # the widest block a blocked argmax uses (a power of two dividing the vocabulary)


def argmax(logits: Tensor) -> Tensor:
    """logits.argmax(dim=-1) of [B, V] host logits, the same ids (the first maximum of a row, a NaN
    counting as the maximum), about 7x faster over a 49k vocabulary: ATen's CPU argmax tracks an
    index per element without vectorizing (2.7 ms for 64 rows, one thread), where the maxima of
    fixed blocks vectorize (amax), and only the first block holding the row's maximum is searched."""
    rows, vocab = logits.shape
    block = _ARGMAX_BLOCK
    while block >= 64 and vocab % block:
        block //= 2
    if logits.device.type != "cpu" or block < 64 or vocab < 2 * block or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    blocks = logits.view(rows, vocab // block, block)
    first = blocks.amax(dim=-1).argmax(dim=-1)  # the first block whose maximum is the row's (NaN: the first NaN's)
    return first * block + blocks[torch.arange(rows), first].argmax(dim=-1)


class Scratch:
    """Reused host buffers for the sampler's full-vocabulary temporaries ([B, V] fp32, one per
    purpose). A fresh tensor that large (12 MB at 64 rows of a 49k vocabulary) may be mapped from
    the OS as untouched pages (whether glibc's heap keeps it depends on the process's allocation
    history), and faulting them in costs more than the arithmetic on them: measured on one thread,
    a 64-row temperature + top-p draw took 26 ms where its temporaries faulted, 15 ms where they did
    not. Buffers above `limit_bytes` are not kept (those are allocated per call); device tensors
    never use these (the caching allocator already reuses their memory)."""

    def __init__(self, limit_bytes: int = 32 << 20) -> None:
        self.limit_bytes = limit_bytes
        self._held: dict[str, Tensor] = {}

    def take(self, name: str, rows: int, like: Tensor) -> Tensor | None:
        """A [>= rows, V] buffer of `like`'s dtype for `name` (rows kept at least MIN_ROWS, as
        never_alone pads), or None where `like` is not a host tensor or the buffer would be too
        large. Its contents are garbage; a name serves one temporary of a call at a time."""
        rows = max(rows, MIN_ROWS)
        if (
            like.device.type != "cpu"
            or like.dim() != 2
            or rows * like.shape[1] * like.element_size() > self.limit_bytes
        ):
            return None
        held = self._held.get(name)
        if held is None or held.shape[0] < rows or held.shape[1] != like.shape[1] or held.dtype != like.dtype:
            held = torch.empty(rows, like.shape[1], dtype=like.dtype)
            self._held[name] = held
        return held


class MaskError(ValueError):
    """A token mask left some rows without any allowed token; `rows` are their indices."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"token mask allows no token in batch rows {rows}; the constraint cannot continue")
        self.rows = rows


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator for one request's draws; it must live on the device the logits do."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """splitmix64's finalizer: nearby inputs give unrelated outputs."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def position_generator(seed: int, position: int, device: str | torch.device = "cpu") -> torch.Generator:
    """The generator for one draw: a function of the choice's seed and the output position the
    draw fills, never of the step it happens in. So a token is the same whether it was drawn
    alone, while verifying drafts, or again after preemption."""
    return make_generator(_mix64(seed ^ _mix64(position)) >> 1, device)  # generators take seeds below 2**63


def _column(params: Sequence[SamplingParams], name: str, like: Tensor) -> Tensor:
    """One parameter for every row, as a [B, 1] tensor broadcastable against logits."""
    return torch.tensor([getattr(p, name) for p in params], dtype=like.dtype, device=like.device)[:, None]


def _token_counts(ids: Sequence[Tensor], batch: int, vocab: int, device: torch.device) -> Tensor:
    """How often each token occurs in each row's ids, [B, V] f32, without a per-row loop. The ids
    (host tensors, from the sequences) go to the device in one copy."""
    counts = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
    lengths = [len(t) for t in ids]  # shapes: known on the host, no read of the device
    if sum(lengths) == 0:
        return counts
    rows = torch.repeat_interleave(torch.arange(batch), torch.tensor(lengths)).to(device)
    flat = torch.cat([t.to(dtype=torch.int64) for t in ids]).to(device)
    return counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)


def check_mask(allowed: Tensor) -> None:
    """Raise MaskError where a constraint's mask ([B, V] bool) allows no token in a row, which
    would otherwise turn into a NaN distribution. Masks are built on the host (llguidance), so
    the sampler checks them there, before their one copy to the device."""
    empty = ~allowed.any(dim=-1)
    if bool(empty.any()):
        raise MaskError(empty.nonzero().flatten().tolist())


def apply_mask(logits: Tensor, allowed: Tensor | None) -> Tensor:
    """Drop tokens a constraint forbids. `allowed` is [B, V] bool (an unconstrained row
    is all True) or None when no row is constrained. Raises MaskError for an empty row."""
    if allowed is None:
        return logits
    check_mask(allowed)
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def apply_penalties(
    logits: Tensor, prompt_ids: Sequence[Tensor], output_ids: Sequence[Tensor], params: Sequence[SamplingParams]
) -> Tensor:
    """Repetition penalty over prompt and output tokens (vLLM/HF: positive logits divided,
    negative multiplied), then presence and frequency penalties over output tokens only."""
    repetition = [p.repetition_penalty != 1.0 for p in params]
    additive = [p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for p in params]
    if not any(repetition) and not any(additive):
        return logits
    batch, vocab = logits.shape
    output_counts = _token_counts(output_ids, batch, vocab, logits.device)  # [B, V]
    in_output = output_counts > 0
    if any(repetition):
        seen = in_output | (_token_counts(prompt_ids, batch, vocab, logits.device) > 0)
        penalty = _column(params, "repetition_penalty", logits)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if any(additive):
        logits = logits - _column(params, "presence_penalty", logits) * in_output
        logits = logits - _column(params, "frequency_penalty", logits) * output_counts
    return logits


def apply_temperature(logits: Tensor, params: Sequence[SamplingParams], out: Tensor | None = None) -> Tensor:
    """Scale logits by 1 / temperature (always > 0: greedy is top_k == 1); into `out` (a buffer of
    at least logits' rows, Scratch) where given, else a new tensor. Unscaled logits are returned as
    they are."""
    temperatures = {p.temperature for p in params}
    if temperatures == {1.0}:
        return logits
    # one shared value: a scalar division, ~3x cheaper than a column
    divisor = temperatures.pop() if len(temperatures) == 1 else _column(params, "temperature", logits)
    return logits / divisor if out is None else torch.div(logits, divisor, out=out[: logits.shape[0]])


def apply_top_k(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Keep each row's k largest logits (-1 keeps all). Tokens tied with the k-th are kept
    too, so the cut never depends on sort order; exact greedy is handled by the Sampler."""
    vocab = logits.shape[-1]
    ks = [vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params]
    if all(k == vocab for k in ks):
        return logits
    top = logits.topk(max(ks), dim=-1).values  # [B, max_k], sorted descending
    index = torch.tensor(ks, device=logits.device)[:, None] - 1
    kth = top.gather(-1, index)  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: Tensor, params: Sequence[SamplingParams], host_reads: bool = True) -> Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p; the top
    token always survives, so no row empties.

    With host_reads, the nucleus is searched among the TOP_P_CANDIDATES most likely tokens (a
    partial sort); only when some row's candidates hold less than top_p of the mass (a value
    read on the host) is the whole row sorted. Without, every row is sorted whole on the device.
    """
    if all(p.top_p >= 1.0 for p in params):
        return logits
    probs = logits.softmax(dim=-1)
    top_p = _column(params, "top_p", logits)  # [B, 1]
    if host_reads:
        values, order = probs.topk(min(TOP_P_CANDIDATES, logits.shape[-1]), dim=-1)  # descending
        if bool((values.sum(dim=-1, keepdim=True) < top_p).any()):
            values, order = probs.sort(dim=-1, descending=True)
    else:
        values, order = probs.sort(dim=-1, descending=True)
    # A token stays while the tokens ranked above it hold less than top_p of the mass.
    keep = (values.cumsum(dim=-1) - values) < top_p
    keep[:, 0] = True
    kept = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, keep)
    return logits.masked_fill(~kept, float("-inf"))


def apply_min_p(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    if all(p.min_p == 0.0 for p in params):
        return logits
    probs = logits.softmax(dim=-1)
    threshold = _column(params, "min_p", logits) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_logit_bias(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Add each row's logit_bias to its raw logits (masked tokens stay masked: -inf + b)."""
    if not any(p.logit_bias for p in params):
        return logits
    logits = logits.clone()
    for row, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
            logits[row].index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=logits.device))
    return logits


_DRAW_BLOCK = 1024  # inverse-CDF draws: block sums first, then a cumulative sum inside one block


def uniforms(generators: Sequence[torch.Generator], device: torch.device | str) -> Tensor:
    """Each row's one float64 uniform in [0, 1), the next number of its generator: what every draw
    (the torch path's and the native one's) picks its token with."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=device) for g in generators])


def draw(logits: Tensor, generators: Sequence[torch.Generator], scratch: Tensor | None = None) -> Tensor:
    """One categorical draw per row from softmax(logits), [B] int64.

    Inverse-CDF sampling: row i takes one uniform u from generators[i] (position_generator:
    one per choice and output position) and picks the first token whose cumulative weight (in
    float64) exceeds u times the row's total, so a zero-probability token is never picked. The
    cumulative weights are found in two levels (sums of 1024-token blocks, then a cumulative
    sum inside the chosen block): one random number and about one pass over the vocabulary
    per row, ~10x cheaper at 32 rows than an exponential race (a random number per token).
    A request's tokens depend on its seed and their positions, never on which other requests
    share the batch or whether the token was verified with drafts. scratch: a buffer of at least
    [B, V] for the weights (Scratch), instead of a fresh tensor.
    """
    rows, vocab = logits.shape
    # Unnormalized weights exp(logit - max) in (0, 1]; terms below e^-87 become exactly 0, not
    # fp32 subnormals (a low temperature makes them of most of the vocabulary, and they make
    # every later operation on them many times slower); they cannot move a sum >= 1.
    top = logits.amax(dim=-1, keepdim=True)
    shifted = logits - top if scratch is None else torch.sub(logits, top, out=scratch[:rows])
    weights = shifted.masked_fill_(shifted < _EXP_FLOOR, float("-inf")).exp_()
    pad = -vocab % _DRAW_BLOCK
    if pad:
        weights = torch.nn.functional.pad(weights, (0, pad))
    blocks = weights.view(rows, -1, _DRAW_BLOCK)
    coarse = blocks.sum(dim=-1).double().cumsum(dim=-1)  # [B, blocks] cumulative block sums (fp32 within a block)
    u = uniforms(generators, logits.device)
    target = u * coarse[:, -1]
    # The block holding the target: a block of zero weight never is (its cumulative sum does not rise).
    block = torch.searchsorted(coarse, target[:, None], right=True)[:, 0].clamp_(max=coarse.shape[1] - 1)
    before = torch.where(block > 0, coarse.gather(1, (block - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    inner = blocks[torch.arange(rows, device=logits.device), block].cumsum(dim=-1, dtype=torch.float64)
    # Within the block, stay below its own total (the block sum and the cumulative sum round
    # apart), so the pick is a token with weight.
    rest = torch.minimum((target - before).clamp_(min=0.0), inner[:, -1] * (1 - 2**-50))
    offset = torch.searchsorted(inner, rest[:, None], right=True)[:, 0].clamp_(max=_DRAW_BLOCK - 1)
    return block * _DRAW_BLOCK + offset


class Sampler:
    """Runs the pipeline for one batch of rows, one SamplingParams and generator each."""

    def __init__(self, host_reads: bool | None = None) -> None:
        """host_reads: whether the shortcuts may read tensor values on the host (the module
        docstring); None: exactly when the logits live on the CPU, where a read is no transfer.
        Without them the step's sampling never waits for the device: the ids stay there until
        the engine's one copy (step_output.to_host)."""
        self.host_reads = host_reads
        # None: fresh tensors each call (the same results). The buffers make sample() non-reentrant:
        # one engine's step loop calls it, never two threads at once; no result aliases a buffer.
        self.scratch: Scratch | None = Scratch()

    def reads_host(self, logits: Tensor) -> bool:
        return logits.device.type == "cpu" if self.host_reads is None else self.host_reads

    def sample(
        self,
        logits: Tensor,  # [B, V] f32 raw next-token logits
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        prompt_ids: Sequence[Tensor],  # B tensors of token ids
        output_ids: Sequence[Tensor],  # B tensors of token ids generated so far
        allowed: Tensor | None = None,  # [B, V] bool (built on the host), or None when no row is constrained
    ) -> Tensor:
        """The next token of every row, [B] int64, on the logits' device."""
        reads = self.reads_host(logits)
        logits = logits.float()
        if allowed is not None:
            if reads or allowed.device.type == "cpu":  # a host mask is checked where it is: no transfer
                check_mask(allowed)
            # one copy of the step's mask to the device (a no-op where both are on the host)
            allowed = allowed.to(logits.device, non_blocking=True)
            logits = logits.masked_fill(~allowed, float("-inf"))
        logits = apply_penalties(logits, prompt_ids, output_ids, params)
        logits = apply_logit_bias(logits, params)
        sampled = [row for row, p in enumerate(params) if p.top_k != 1]
        if len(sampled) == len(params):
            return self._draw(logits, params, generators, reads, self.scratch)
        # Greedy before temperature: division could round distinct logits into a tie.
        # argmax returns the first maximum, i.e. the lowest token id on ties.
        greedy_ids = argmax(logits)
        if not sampled:
            return greedy_ids
        if len(sampled) < len(params):
            # Only sampling rows draw: a greedy choice never uses its generator, and a
            # sampling row's draws depend only on its own generator and step count.
            picked = torch.tensor(sampled, device=logits.device)
            drawn = self._draw(
                logits.index_select(0, picked),
                [params[r] for r in sampled],
                [generators[r] for r in sampled],
                reads,
                self.scratch,
            )
            return greedy_ids.index_copy(0, picked, drawn)
        return self._draw(logits, params, generators, reads, self.scratch)

    @staticmethod
    def _draw(
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        reads: bool = True,
        scratch: Scratch | None = None,
    ) -> Tensor:
        """temperature -> top-k -> top-p -> min-p -> draw, for rows that all sample.

        With host reads, each row takes the smallest candidate set that provably holds its
        surviving tokens (a mass read on the host decides), on its own: how a row draws never
        depends on which other rows share the batch; top-p rows without top-k find theirs on the
        native kernel first (_native_nucleus). Without, every row takes the full path.
        scratch: buffers for the full-vocabulary temporaries (the same results without)."""
        rows_in = logits.shape[0]
        out = torch.empty(rows_in, dtype=torch.int64, device=logits.device)
        drawn = set(_native_nucleus(logits, params, generators, out) if reads else ())
        if not drawn:
            return Sampler._torch_draw(logits, params, generators, reads, scratch)
        rest = [r for r in range(rows_in) if r not in drawn]  # the torch path, on their own
        if not rest:
            return out
        picked = torch.tensor(rest, device=logits.device)
        out[picked] = Sampler._torch_draw(
            logits.index_select(0, picked), [params[r] for r in rest], [generators[r] for r in rest], reads, scratch
        )
        return out

    @staticmethod
    def _torch_draw(
        logits: Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator],
        reads: bool = True,
        scratch: Scratch | None = None,
    ) -> Tensor:
        """_draw's torch path: every stage as tensor operations over the whole vocabulary."""
        rows_in = logits.shape[0]
        take = (lambda name: scratch.take(name, rows_in, logits)) if scratch is not None else (lambda name: None)
        logits = apply_temperature(logits, params, take("scaled"))
        out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        vocab = logits.shape[-1]
        # Rows with neither top-k nor top-p keep the whole vocabulary: no candidate set can hold them
        # (without host reads, every row takes the full path).
        whole = [r for r, p in enumerate(params) if not (reads and (0 < p.top_k < vocab or p.top_p < 1.0))]
        pending = [r for r, p in enumerate(params) if reads and (0 < p.top_k < vocab or p.top_p < 1.0)]
        full_lse = logsumexp(logits, take("shifted")) if pending else None
        for size in CANDIDATE_SIZES if pending else ():
            k = min(size, vocab)
            if k == vocab:
                break
            rows = torch.tensor(pending, device=logits.device)
            # every row (in order): no copy of the logits
            held = logits if len(pending) == logits.shape[0] else logits.index_select(0, rows)
            values, ids = held.topk(k, dim=-1)  # descending; shared by the test and the draw
            mass = torch.exp(values - full_lse[rows][:, None]).sum(dim=-1).tolist()
            fits = [_fits(params[r], k, vocab, m) for r, m in zip(pending, mass)]
            if any(fits):
                picked = torch.tensor([j for j, ok in enumerate(fits) if ok], device=logits.device)
                chosen = [r for r, ok in zip(pending, fits) if ok]
                out[rows[picked]] = _candidate_draw(
                    values[picked],
                    ids[picked],
                    [params[r] for r in chosen],
                    [generators[r] for r in chosen],
                    full_lse[rows[picked]],
                    vocab,
                )
            pending = [r for r, ok in zip(pending, fits) if not ok]
            if not pending:
                break
        pending = sorted(pending + whole)
        if not pending:
            return out
        rest = [params[r] for r in pending]
        gens = [generators[r] for r in pending]
        if len(pending) == logits.shape[0]:  # every row (in order): no copy of the logits
            return draw(apply_min_p(apply_top_p(apply_top_k(logits, rest), rest, reads), rest), gens, take("weights"))
        picked = torch.tensor(pending, device=logits.device)
        out[picked] = draw(
            apply_min_p(apply_top_p(apply_top_k(logits[picked], rest), rest, reads), rest), gens, take("weights")
        )
        return out


def _nucleus_row(params: SamplingParams, vocab: int) -> bool:
    """A row whose surviving set is a top-p nucleus alone (no top-k): native candidates can hold it."""
    return params.top_p < 1.0 and not 0 < params.top_k < vocab


def _native_nucleus(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator], out: Tensor
) -> list[int]:
    """Draw the top-p rows (without top-k) whose nucleus lies among their likeliest tokens on the
    native kernel, in one call (native/sampling.cpp: nucleus_draw finds the row's logsumexp at its
    temperature and every token within log(TOP_P_CANDIDATES) of its maximum in two passes over the
    row, then takes _candidate_draw's top-p, min-p and draw over them), into `out`; the indices of
    the rows drawn. The torch path's draw from the same uniform, up to the last bits of the exp and
    sum terms; a row's result depends only on the row. Each such row takes its uniform from its
    generator first; a row the kernel leaves (more candidates, or candidates holding less than
    top_p) is drawn by the torch path from the generator's next number. Everything is left to the
    torch path where the native library is not loaded or the logits are not fp32 host tensors."""
    vocab = logits.shape[-1]
    rows = [r for r, p in enumerate(params) if _nucleus_row(p, vocab)]
    if not rows or logits.device.type != "cpu" or logits.dtype != torch.float32 or not native.loaded():
        return []
    held = logits if len(rows) == logits.shape[0] else logits.index_select(0, torch.tensor(rows))
    settings = torch.tensor([(params[r].temperature, params[r].top_p, params[r].min_p) for r in rows])
    uniform = uniforms([generators[r] for r in rows], logits.device)
    drawn = torch.ops.flare_native.nucleus_draw(held, settings, uniform, TOP_P_CANDIDATES).tolist()
    chosen = [r for r, token in zip(rows, drawn) if token >= 0]
    if chosen:
        out[torch.tensor(chosen)] = torch.tensor([token for token in drawn if token >= 0])
    return chosen


def _fits(params: SamplingParams, k: int, vocab: int, candidate_mass: float) -> bool:
    """Whether a row's surviving set provably lies among its k likeliest tokens: top-k within
    them, or a top-p nucleus whose mass they already hold."""
    has_top_k = 0 < params.top_k < vocab
    return (0 < params.top_k <= k or params.top_p < 1.0) and (has_top_k or candidate_mass >= params.top_p)


def _draw_among_candidates(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    size: int,
    full_lse: Tensor | None,
) -> tuple[Tensor | None, Tensor | None]:
    """The same pipeline (top-k -> top-p -> min-p -> draw) on each row's `size` most likely
    tokens, when every row's surviving set provably lies among them.

    Exact, not an approximation: top-k <= candidates, or a top-p nucleus whose mass the
    candidates already hold. Returns (None, full_lse) when some row's set may reach past
    them (the caller tries more candidates, then the full path); full_lse is reused.
    """
    vocab = logits.shape[-1]
    k = min(size, vocab)
    if k == vocab:
        return None, full_lse
    values, ids = logits.topk(k, dim=-1)  # descending
    if full_lse is None:
        full_lse = logsumexp(logits)  # [B]
    mass = torch.exp(values - full_lse[:, None]).sum(dim=-1).tolist()
    if not all(_fits(p, k, vocab, m) for p, m in zip(params, mass)):
        return None, full_lse  # some row's set may reach past the candidates
    return _candidate_draw(values, ids, params, generators, full_lse, vocab), full_lse


def _candidate_draw(
    values: Tensor,
    ids: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    full_lse: Tensor,
    vocab: int,
) -> Tensor:
    """top-k -> top-p -> min-p -> draw over rows' k likeliest tokens (values descending, ids
    [B, k]), for rows whose surviving sets lie among them (_fits)."""
    k = values.shape[-1]
    has_top_k = torch.tensor([0 < p.top_k < vocab for p in params])
    top_p = _column(params, "top_p", values)[:, 0]
    ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else k for p in params])[:, None]
    position = torch.arange(k)[None, :]
    values = values.masked_fill((position >= ks) & has_top_k[:, None], float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        # After top-k the distribution renormalizes over the survivors; without top-k the
        # nucleus is measured against the whole vocabulary.
        norm = torch.where(has_top_k, logsumexp(values), full_lse)
        probs = torch.exp(values - norm[:, None])
        keep = (probs.cumsum(dim=-1) - probs) < top_p[:, None]
        keep[:, 0] = True
        values = values.masked_fill(~keep, float("-inf"))
    values = apply_min_p(values, params)
    return ids.gather(1, draw(values, generators)[:, None])[:, 0]

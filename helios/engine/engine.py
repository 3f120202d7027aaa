"""LLMEngine: one step = schedule -> run -> postprocess (sample, stop, emit events)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch

from helios.core import Core
from helios.engine.executor import Executor, StepResult
from helios.engine.kv_cache import BlockManager
from helios.engine.logprobs import TokenLogprobs, explicit_alternatives, natural_alternatives, prompt_entry
from helios.engine.request import EngineEvent, EngineRequest, EngineStats, FinishCause
from helios.engine.sampler import Sampler
from helios.engine.scheduler import Chunk, Scheduler, SchedulerConfig, Sequence

log = logging.getLogger("helios.engine")

MaskHook = Callable[[list[Sequence]], "torch.Tensor | None"]  # rows' allowed-token masks [B, V] bool


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_concurrency: int = 64  # live choices at once
    max_pending: int = 256  # waiting requests before submissions are refused
    prefill_chunk_size: int = 512  # prefill tokens per step
    num_pages: int | None = None  # KV pool size in pages; None: from kv_memory_bytes
    kv_memory_bytes: int = 1 << 30  # used when num_pages is None
    max_model_len: int | None = None  # None: the core's limit
    device: str = "cpu"
    enable_prefix_cache: bool = True
    serial_decode_rows: int = 0  # CPU: decode-only steps of at most this many rows use one thread


class LLMEngine:
    def __init__(self, core: Core, config: EngineConfig, mask_hook: MaskHook | None = None) -> None:
        m = core.manifest
        self.core = core
        self.config = config
        self.vocab_size = m.tokenizer.vocab_size
        self.eos_ids = frozenset(m.tokenizer.eos_token_ids)
        self.max_model_len = min(config.max_model_len or m.limits.max_model_len, m.limits.max_model_len)
        page_bytes = 2 * m.kv.num_layers * m.limits.page_tokens * m.kv.num_kv_heads * m.kv.head_dim * torch.tensor(
            [], dtype=getattr(torch, m.kv.dtype)).element_size()  # fmt: skip
        num_pages = config.num_pages or max(1, config.kv_memory_bytes // page_bytes)
        self.blocks = BlockManager(num_pages, m.limits.page_tokens)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_concurrency, config.max_pending, config.prefill_chunk_size, self.max_model_len),
            self.blocks,
        )
        self.executor = Executor(core, num_pages, config.device, config.serial_decode_rows)
        self.sampler = Sampler()
        self.mask_hook = mask_hook
        self.stats = EngineStats(total_pages=num_pages, page_tokens=m.limits.page_tokens,
                                 decode_weight_bytes=m.decode_weight_bytes)  # fmt: skip
        self._aborted: set[tuple[str, int | None]] = set()

    # ------------------------------------------------------------------ requests
    def check(self, request: EngineRequest) -> str | None:
        """Why the engine can never run this request, or None."""
        if not request.prompt_ids:
            return "the prompt is empty"
        if request.max_tokens < 1 and request.prompt_logprobs is None:
            return "max_tokens must be positive (zero only for prompt scoring)"
        total = len(request.prompt_ids) + request.max_tokens
        if total > self.max_model_len:
            return f"prompt ({len(request.prompt_ids)} tokens) plus max_tokens ({request.max_tokens}) exceeds the context limit of {self.max_model_len} tokens"
        needed = self.blocks.pages_for(len(request.prompt_ids)) + request.n - 1
        if needed > self.blocks.num_pages:
            return f"the prompt needs {needed} KV pages but the pool has {self.blocks.num_pages}"
        if request.prompt_logprobs is not None and self.executor.scored is None:
            return "prompt logprobs need a core exported with `ignition export --prompt-logprobs`"
        return None

    def add(self, request: EngineRequest) -> None:
        if not self.config.enable_prefix_cache and request.use_prefix_cache:
            request = replace(request, use_prefix_cache=False)
        self.scheduler.add(request)

    def abort(self, request_id: str, choice_index: int | None = None) -> None:
        """Cancel a request (every choice, or one); applied before the next step."""
        self._aborted.add((request_id, choice_index))

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running or self._aborted)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[EngineEvent]:
        events = self._process_aborts()
        plan = self.scheduler.schedule()
        for seq in plan.out_of_pages:
            events.append(self._finish(seq, FinishCause.LENGTH))
        if plan.chunks:
            try:
                result = self.executor.run(plan.chunks)
            except Exception as exc:  # a failed step must not take down the other requests' server
                log.exception("step failed")
                for chunk in plan.chunks:
                    events.append(self._finish(chunk.seq, FinishCause.ERROR, error=f"execution failed: {exc}"))
            else:
                events += self._postprocess(plan.chunks, result)
        self._refresh_gauges()
        self.stats.steps += 1
        return events

    def _postprocess(self, chunks: tuple[Chunk, ...], result: StepResult) -> list[EngineEvent]:
        for chunk in chunks:
            seq = chunk.seq
            if seq.prefilling:
                self.stats.prefill_tokens += chunk.num_tokens
            seq.num_computed += chunk.num_tokens
            self.scheduler.publish_full_pages(seq)
            if chunk.scored:
                self._collect_prompt_logprobs(chunk, result.prompt_scores[id(chunk)])
        rows: list[int] = []
        seqs: list[Sequence] = []
        scored_only = [c.seq for c in result.sampled if c.seq.request.max_tokens == 0]
        events = [self._finish(seq, FinishCause.LENGTH) for seq in scored_only]  # prompt scoring, no output
        for row, chunk in enumerate(result.sampled):
            if chunk.seq.request.max_tokens == 0:
                continue
            group = [chunk.seq]
            if chunk.seq.num_output == 0 and chunk.seq.request.n > 1:
                group += self.scheduler.fork(chunk.seq, self.executor.copy_page)
            rows += [row] * len(group)
            seqs += group
        try:
            allowed = self.mask_hook(seqs) if self.mask_hook else None
            if allowed is not None:
                rows, seqs, allowed = self._drop_blocked(rows, seqs, allowed, events)
            if not seqs:
                return events
            identity = rows == list(range(result.logits.shape[0]))
            logits = result.logits if identity else result.logits.index_select(0, torch.tensor(rows))
            tokens = self._sample(logits, seqs, allowed).tolist()
        except Exception as exc:
            log.exception("sampling failed")
            return events + [self._finish(s, FinishCause.ERROR, error=f"sampling failed: {exc}") for s in seqs]
        for row, seq, token in zip(rows, seqs, tokens):
            forced = self._budget_cut(seq)
            if forced is not None:
                token = forced
            elif seq.request.reasoning_budget is not None:
                self._track_reasoning(seq, token)
            wants = seq.request.num_top_logprobs is not None and forced is None  # forced tokens have no entry
            entry = self._logprobs(seq, token, row, result) if wants else None
            seq.token_ids.append(token)
            self.stats.generated_tokens += 1
            if seq.num_output > 1:
                self.stats.verification_rounds += 1
            rejected = seq.constraint is not None and not seq.constraint.advance(token)  # forced tokens too
            events.append(self._after_token(seq, token, entry))
            if rejected and seq.finish is None:
                events.append(self._finish(seq, FinishCause.ERROR, error=self._constraint_error(seq)))
        return events

    def _drop_blocked(self, rows: list[int], seqs: list[Sequence], allowed: torch.Tensor,
                      events: list[EngineEvent]) -> tuple[list[int], list[Sequence], torch.Tensor]:  # fmt: skip
        """Finish (with an error) the choices whose constraint allows no token; keep the rest."""
        blocked = set((~allowed.any(dim=-1)).nonzero().flatten().tolist())
        if not blocked:
            return rows, seqs, allowed
        keep = [i for i in range(len(seqs)) if i not in blocked]
        events += [self._finish(seqs[i], FinishCause.ERROR, error=self._constraint_error(seqs[i])) for i in sorted(blocked)]
        return [rows[i] for i in keep], [seqs[i] for i in keep], allowed[keep]

    @staticmethod
    def _constraint_error(seq: Sequence) -> str:
        reason = seq.constraint.error if seq.constraint is not None else None
        return f"output constraint failed: {reason or 'no token is allowed'}"

    def _budget_cut(self, seq: Sequence) -> int | None:
        """The close delimiter, when this sequence's reasoning budget is spent and output remains."""
        budget = seq.request.reasoning_budget
        if budget is None or not seq.reasoning_open or seq.reasoning_tokens < budget.budget:
            return None
        if seq.num_output + 1 >= seq.request.max_tokens:
            return None  # no capacity left to continue after the close
        seq.reasoning_open = False
        self.stats.reasoning_budget_cuts += 1
        return budget.close_id

    @staticmethod
    def _track_reasoning(seq: Sequence, token: int) -> None:
        budget = seq.request.reasoning_budget
        assert budget is not None
        if token == budget.close_id or token in budget.implicit_close_ids:
            seq.reasoning_open = False
        elif seq.reasoning_open:
            seq.reasoning_tokens += 1

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], allowed: torch.Tensor | None) -> torch.Tensor:
        params = [s.request.params[s.choice_index] for s in seqs]
        penalized = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params)
        empty = torch.empty(0, dtype=torch.int64)
        prompt_ids = [torch.tensor(s.token_ids[: s.num_prompt]) if penalized else empty for s in seqs]
        output_ids = [torch.tensor(s.output_ids, dtype=torch.int64) if penalized else empty for s in seqs]
        if allowed is not None:
            allowed = allowed.to(logits.device, non_blocking=True)
        return self.sampler.sample(logits, params, [s.generator for s in seqs], prompt_ids, output_ids, allowed)

    def _logprobs(self, seq: Sequence, token: int, row: int, result: StepResult) -> TokenLogprobs:
        lse = float(result.logsumexp[row])
        chosen = float(result.logits[row, token]) - lse
        ids = seq.request.logprob_token_ids
        if ids:
            assert result.explicit_logprobs is not None
            values = result.explicit_logprobs[row, : len(ids)].tolist()
            alternatives = explicit_alternatives(ids, values, token, chosen)
        elif result.top_logprobs is not None and seq.request.num_top_logprobs:
            alternatives = natural_alternatives(result.logits[row], lse, result.top_logprobs[row],
                                                result.top_ids[row], seq.request.num_top_logprobs)  # fmt: skip
        else:
            alternatives = ()
        return TokenLogprobs(token, chosen, alternatives)

    def _collect_prompt_logprobs(self, chunk: Chunk, scores: dict[str, torch.Tensor]) -> None:
        seq = chunk.seq
        num = seq.request.prompt_logprobs or 0
        if chunk.start == 0:
            seq.prompt_entries.append(None)  # the first prompt position has no prediction
        values = scores["prompt_logprobs"].tolist()
        ranks = scores["prompt_ranks"].tolist()
        for i in range(chunk.num_tokens):
            position = chunk.start + i + 1
            if position >= seq.num_prompt:
                break
            alternatives = ()
            if num:
                pairs = zip(scores["prompt_top_ids"][i, :num].tolist(), scores["prompt_top_logprobs"][i, :num].tolist())
                alternatives = tuple(sorted(pairs, key=lambda p: (-p[1], p[0])))
            seq.prompt_entries.append(prompt_entry(seq.token_ids[position], values[i], ranks[i], alternatives))

    def _after_token(self, seq: Sequence, token: int, entry: TokenLogprobs | None) -> EngineEvent:
        request = seq.request
        cause = None
        if token in self.eos_ids and not request.ignore_eos:
            cause = FinishCause.EOS
        elif token in request.stop_token_ids:
            cause, seq.stop_match_len = FinishCause.STOP_TOKEN, 1
        elif request.stop_token_sequences:
            output = seq.output_ids
            for stop in request.stop_token_sequences:
                if len(output) >= len(stop) and tuple(output[-len(stop) :]) == stop:
                    cause, seq.stop_match_len = FinishCause.STOP_TOKEN, len(stop)
                    break
        if cause is None and (seq.num_output >= request.max_tokens or len(seq.token_ids) >= self.max_model_len):
            cause = FinishCause.LENGTH
        event = self._event(seq, (token,), (entry,), cause)
        if cause is not None:
            self.scheduler.finish(seq, cause)
            self.stats.completed += 1
        return event

    def _event(self, seq: Sequence, tokens: tuple[int, ...], entries, cause: FinishCause | None,
               error: str | None = None) -> EngineEvent:  # fmt: skip
        first = not seq.sent_first
        seq.sent_first = True
        return EngineEvent(
            request_id=seq.request.request_id,
            choice_index=seq.choice_index,
            token_ids=tokens,
            logprobs=entries if seq.request.num_top_logprobs is not None else None,
            finish=cause,
            num_prompt_tokens=seq.num_prompt,
            num_cached_tokens=seq.num_cached,
            stop_match_len=seq.stop_match_len,
            prompt_logprobs=tuple(seq.prompt_entries) if first and seq.request.prompt_logprobs is not None else None,
            error=error,
        )

    def _finish(self, seq: Sequence, cause: FinishCause, error: str | None = None) -> EngineEvent:
        event = self._event(seq, (), () if seq.request.num_top_logprobs is not None else None, cause, error)
        self.scheduler.finish(seq, cause)
        if cause is FinishCause.ERROR:
            self.stats.failed += 1
        elif cause is not FinishCause.ABORT:
            self.stats.completed += 1
        return event

    def _process_aborts(self) -> list[EngineEvent]:
        if not self._aborted:
            return []
        events = []
        doomed = self._aborted
        self._aborted = set()
        hit = lambda rid, index: (rid, None) in doomed or (rid, index) in doomed  # noqa: E731
        for seq in [s for s in self.scheduler.running if hit(s.request.request_id, s.choice_index)]:
            events.append(self._finish(seq, FinishCause.ABORT))
        for request in [r for r in self.scheduler.waiting if (r.request_id, None) in doomed]:
            self.scheduler.waiting.remove(request)
            for index in range(request.n):
                events.append(EngineEvent(request.request_id, index, (), None, FinishCause.ABORT, len(request.prompt_ids)))
        return events

    def _refresh_gauges(self) -> None:
        self.stats.active = len(self.scheduler.running)
        self.stats.pending = len(self.scheduler.waiting)
        self.stats.free_pages = self.blocks.num_free
        self.stats.cached_pages = self.blocks.num_cached
        self.stats.reused_tokens = self.scheduler.reused_tokens

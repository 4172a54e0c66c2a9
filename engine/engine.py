"""The single-process engine: add requests, step, abort, drain.

This is the API the workers build on and the oracle every cluster topology is compared to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceType
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import msgspec
import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model_runner import SINGLE_RANK, ModelRunner
from pdserve.engine.parallel import TensorParallel
from pdserve.engine.penalties import History
from pdserve.engine.prefix_cache import CacheEvent, CacheListener, PrefixCache, PrefixCacheStats
from pdserve.engine.sampler import PromptLogprobs, SampledLogprobs, Sampler, TokenLogprobs
from pdserve.engine.sampling import RequestError, SamplingParams, validate_request
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.step_channel import StepSender
from pdserve.engine.step_plan import StepPlan, build_plan, host_copy, pending_token, prompt_logprob_positions
from pdserve.engine.timings import RequestTimings

__all__ = ["CacheEvent", "CacheListener", "EngineStats", "LLMEngine", "RequestOutput", "Reservation"]


@dataclass
class RequestOutput:
    """What one step produced for one request. Its first output carries the timings so far
    (queue, prefill, cached tokens: an abort may come before the end), its finished one all."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | prefilled
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    timings: RequestTimings = field(default_factory=RequestTimings)
    # finish_reason "prefilled": the blocks holding the prompt's KV, kept until ``release``.
    kv_block_ids: list[int] | None = None
    # One per new token where the request asked for log-probabilities (``SamplingParams.logprobs``).
    logprobs: list[TokenLogprobs] | None = None
    # With the first token, where the request asked (``SamplingParams.prompt_logprobs``): entry i
    # is prompt token i + 1's.
    prompt_logprobs: list[TokenLogprobs] | None = None


class Reservation(NamedTuple):
    """Decode role: the blocks reserved for a request's prompt KV, in order; the first
    ``num_cached_blocks`` already hold it (the prefix cache's), the rest await the transfer."""

    block_ids: list[int]
    num_cached_blocks: int


@dataclass(frozen=True)
class EngineStats:
    """The engine's KV pool and queues at one moment."""

    num_blocks: int
    free_blocks: int  # free, or cached with no request using them (evicted when needed)
    running: int
    waiting: int
    kv_held: int  # requests holding blocks outside the queues: prefilled, or reserved for KV arriving
    prefix_cache: PrefixCacheStats | None = None  # None with prefix caching off
    preemptions: int = 0  # sequences preempted for want of blocks (recomputed later), cumulative


@dataclass
class _InFlight:
    """A launched step's sampled tokens: row i is ``seqs[i]``'s token at ``token_ids[indexes[i]]``
    (a placeholder until the step is read back). ``tokens`` stay on the device for the next
    step's inputs; ``host_tokens`` is their copy, ``host_logprobs`` that of the rows'
    log-probabilities that were asked for, and ``host_prompt`` that of the prompt positions'
    (``prompt``: each row's sequence and position), complete once ``copied`` has passed."""

    seqs: list[Sequence]
    indexes: list[int]
    tokens: torch.Tensor
    host_tokens: torch.Tensor
    host_logprobs: SampledLogprobs | None
    copied: torch.cuda.Event | None
    prompt: list[tuple[Sequence, int]] = field(default_factory=list)
    host_prompt: PromptLogprobs | None = None

    @classmethod
    def launch_copy(
        cls,
        seqs: list[Sequence],
        indexes: list[int],
        tokens: torch.Tensor,
        logprobs: SampledLogprobs | None,
        prompt: list[tuple[Sequence, int]],
        prompt_logprobs: PromptLogprobs | None,
    ) -> _InFlight:
        """Queue the copy to the host behind the sampling. Reading the device tensor itself
        (``tolist``) would wait for everything queued on the stream, the next step included."""
        if tokens.device.type != "cuda":
            return cls(seqs, indexes, tokens, tokens, logprobs, None, prompt, prompt_logprobs)
        host = host_copy(tokens)
        host_logprobs = None if logprobs is None else logprobs.to_host()
        host_prompt = None if prompt_logprobs is None else prompt_logprobs.to_host()
        copied = torch.cuda.Event()
        copied.record()
        return cls(seqs, indexes, tokens, host, host_logprobs, copied, prompt, host_prompt)

    def read(self) -> tuple[list[int], dict[int, TokenLogprobs], list[TokenLogprobs]]:
        """The sampled tokens, the log-probabilities of the rows that asked, and those of the
        prompt positions; waits for this step's copy only."""
        if self.copied is not None:
            self.copied.synchronize()
        logprobs = {} if self.host_logprobs is None else self.host_logprobs.per_row([s.params for s in self.seqs])
        prompt = (
            []
            if self.host_prompt is None
            else self.host_prompt.rows([s.params.prompt_logprobs or 0 for s, _ in self.prompt])
        )
        return self.host_tokens.tolist(), logprobs, prompt


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TensorParallel = SINGLE_RANK) -> None:
        self.config = config
        self.model_config = ModelConfig.from_pretrained(Path(config.model))
        self.runner = ModelRunner(config, self.model_config, tp)
        self.max_model_len = self.runner.max_model_len
        block_size = config.cache.block_size
        if self.runner.num_blocks * block_size < self.max_model_len:
            raise ValueError(
                f"the KV pool holds {self.runner.num_blocks * block_size} tokens, fewer than "
                f"max_model_len {self.max_model_len}: give it more memory or lower max_model_len"
            )
        sched = config.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({sched.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )
        prefix_cache = PrefixCache(block_size) if config.cache.enable_prefix_caching else None
        self.block_manager = BlockManager(self.runner.num_blocks, block_size, prefix_cache)
        self.scheduler = Scheduler(sched, self.block_manager)
        self.sampler = Sampler()
        self.requests: dict[str, Sequence] = {}
        # Prefill role: prefilled requests whose KV blocks are kept until the transfer is done.
        self.held: dict[str, Sequence] = {}
        # Decode role: requests with blocks reserved for KV that is still arriving.
        self.reserved: dict[str, Sequence] = {}
        self._admitted: list[str] = []  # since the last step: their KV must be in place first
        # Requests that asked for their prompt's log-probabilities, until their first token: the
        # entry of each prompt position whose step has been read back.
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        self.overlap = config.overlap_scheduling
        self._in_flight: _InFlight | None = None  # the launched step not yet read back

    @property
    def kv_cache(self) -> torch.Tensor:
        """This rank's KV pool (``ModelRunner``'s layout), for the transfer backends."""
        return self.runner.kv_cache

    @property
    def step_channel(self) -> StepSender | None:
        """The channel to this leader's TP peers (None without peers): a KV transfer's command
        goes on it so that every rank issues its part in step order."""
        return self.runner.step_channel

    # -- requests ------------------------------------------------------------------------

    def validate(self, prompt_token_ids: SequenceType[int], params: SamplingParams, generated: int = 0) -> None:
        """Raise ``RequestError`` naming the field if this request cannot be served."""
        validate_request(
            prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len, generated=generated
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceType[int],
        params: SamplingParams,
        prefill_only: bool = False,
        generated: int = 0,
    ) -> None:
        """Queue a request. ``prefill_only``: finish it with reason "prefilled" after its first
        token (unless that token already ends it) and keep its KV blocks for a transfer.
        ``generated``: a request moved from a failed group, prefilled again with its output so
        far, the last ``generated`` of ``prompt_token_ids``: its limits and penalties count them
        as output, as the engine it started on did."""
        self._check_new_id(request_id)
        self.validate(prompt_token_ids, params, generated)
        num_prompt_tokens = len(prompt_token_ids) - generated
        seq = Sequence(
            request_id, list(prompt_token_ids), params, num_prompt_tokens=num_prompt_tokens, prefill_only=prefill_only
        )
        self.requests[request_id] = seq
        if params.prompt_logprobs is not None and not generated:  # filled by position as its steps are read back
            self._prompt_logprobs[request_id] = [None] * (seq.num_prompt_tokens - 1)
        self.scheduler.add(seq)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.held or request_id in self.reserved:
            raise RequestError("request_id", f"{request_id!r} is already running")

    def release(self, request_id: str) -> None:
        """Prefill role: the KV of a prefilled request has moved; free its blocks (nothing to do
        if an abort freed them already)."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.block_manager.free(seq)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that ``num_tokens`` tokens take."""
        return self.block_manager.blocks_for(num_tokens)

    def cached_blocks(self, prompt_token_ids: SequenceType[int]) -> int:
        """Decode role: how many leading full blocks of a prompt's KV this engine's prefix cache
        holds now (nothing is locked: ``reserve`` may find fewer once others are evicted)."""
        cache = self.block_manager.prefix_cache
        if cache is None:
            return 0
        block_ids, _ = cache.match(prompt_token_ids[: len(prompt_token_ids) - 1], count=False)
        return len(block_ids)

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: SequenceType[int],
        first_token: int,
        params: SamplingParams,
        keep_free: int = 0,
        generated: int = 0,
    ) -> Reservation | None:
        """Decode role: blocks for the prompt's KV, or None if too few are free or the group holds
        ``max_num_seqs`` sequences already (try later); ``keep_free`` more blocks stay free (for a
        request waiting ahead of this one).

        With a prefix cache the reservation starts with the longest cached prefix of the
        prompt's full blocks (leaving its last token, as a prompt's own match does), locked:
        only the blocks after it need the prefill group's KV. The request then waits, outside
        the scheduler, for ``admit`` once that KV is in place.
        """
        self._check_new_id(request_id)
        self.validate(prompt_token_ids, params, generated)
        running_or_reserved = len(self.scheduler.running) + len(self.reserved)
        if running_or_reserved + len(self.scheduler.waiting) >= self.config.scheduler.max_num_seqs:
            return None  # the batch is full: its steps (and the graphs captured for them) stay in bounds
        seq = Sequence(
            request_id,
            [*prompt_token_ids, first_token],
            params,
            num_prompt_tokens=len(prompt_token_ids) - generated,
        )
        # Counted once it is granted: the prefill side retries a refused one every few ms.
        self.block_manager.match_prefix(seq, len(prompt_token_ids) - 1)
        seq.num_cached_tokens = seq.num_computed_tokens
        # Keep one free block per running or arriving sequence for its next tokens, this one's
        # included if it will grow into another (a prompt that fills its last block needs a new
        # one at its first step): admitting work that would force a preemption right away is
        # worse than asking the prefill side to wait. One that never grows must fit an idle pool.
        final_kv_tokens = seq.num_prompt_tokens + params.max_tokens - 1  # the last token is never fed
        grows = self.blocks_for(final_kv_tokens) > self.blocks_for(len(prompt_token_ids))
        headroom = running_or_reserved + int(grows)
        needed = self.block_manager.blocks_needed(seq, len(prompt_token_ids))
        if needed + headroom + keep_free > self.block_manager.num_free_blocks:
            self.block_manager.free(seq)  # unlocks the matched prefix
            return None
        self.block_manager.allocate(seq, len(prompt_token_ids))
        if self.block_manager.prefix_cache is not None:
            self.block_manager.prefix_cache.count_query(seq.num_cached_tokens, len(prompt_token_ids) - 1)
        # Until ``admit`` only the cached prefix counts as computed: an abort before then must
        # not offer the cache blocks whose KV may never have arrived on every rank.
        self.reserved[request_id] = seq
        return Reservation(seq.block_table.tolist(), seq.num_shared_blocks)

    def admit(self, request_id: str) -> None:
        """Decode role: the reserved request's KV has arrived; decode it from the next step."""
        seq = self.reserved.pop(request_id)
        # Every token's KV is in place but the first token's, a moved request's output so far
        # included (it came in the prompt): the first step decodes that token.
        seq.num_computed_tokens = seq.num_tokens - 1
        self.requests[request_id] = seq
        self._admitted.append(request_id)
        seq.milestones.first_scheduled = seq.milestones.first_token = time.monotonic()
        self.scheduler.admit_running(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is (queued, running, held, reserved) and free its blocks;
        None if it is unknown."""
        for parked in (self.held, self.reserved):
            if request_id in parked:
                seq = parked.pop(request_id)
                self.block_manager.free(seq)
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                self.requests[request_id] = seq
                return self._finish(seq)
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self._finish(seq)

    def abort_all(self) -> None:
        """Abort every request this engine knows, wherever it is."""
        for request_id in [*self.requests, *self.held, *self.reserved]:
            self.abort(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(
            self.block_manager.num_blocks,
            self.block_manager.num_free_blocks,
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            len(self.held) + len(self.reserved),
            self.block_manager.cache_stats(),
            self.scheduler.num_preemptions,
        )

    def has_unfinished(self) -> bool:
        """Requests to step, or a launched step whose tokens are still to be read back."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def set_cache_listener(self, listener: CacheListener | None) -> bool:
        """Report every block the prefix cache takes in or evicts, in order, to ``listener``
        (a leader forwards them to the router). False, and nothing reported, without a cache."""
        cache = self.block_manager.prefix_cache
        if cache is None:
            return False
        cache.listener = listener
        return True

    def close(self) -> None:
        """Release the TP peers (if any) from their step loop."""
        self.runner.close()

    # -- stepping ------------------------------------------------------------------------

    def step(self, emit: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Run one scheduled batch; one output per request that got a token.

        Overlapped (``EngineConfig.overlap_scheduling``): the batch is planned and launched while
        the GPU still runs the previous one, whose tokens are then read back and returned, so
        a request's token comes out one call later and the GPU never waits for the host's
        scheduling. A sequence whose token stops it (EOS, a stop id) has meanwhile run one more
        step, whose token is dropped; length limits and prefill-only requests are known ahead
        (``Sequence.finishing``) and cost nothing. Otherwise each call returns its own tokens.

        Before a step that runs eagerly (no graph holds it: launching its kernels one by one takes
        the host longer than the GPU's work), the previous step is read back first; ``emit``, when
        given, gets those outputs at once, so that a server sends them before that launch instead
        of after it.
        """
        batch = self.scheduler.schedule()
        previous, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if batch is not None:
            plan = build_plan(batch, self.runner.block_size)
            prompt = [] if batch.is_decode else prompt_logprob_positions(batch, plan.cu_seqlens_q)
            plan.prompt_rows = [row for row, _, _ in prompt]
            # A step that sampled nothing (only part of a prompt ran) names no placeholder.
            sampled = previous.tokens if previous is not None and previous.seqs else None
            if previous is not None and not self.runner.replays(plan):
                # The host is about to launch every kernel itself, which outlasts the GPU's work:
                # nothing to overlap, and the finished step's tokens need not wait behind it.
                ready = self._read_back(previous)
                previous = None
                if emit is not None:
                    emit(ready)
                else:
                    outputs += ready
            self._in_flight = self._launch(batch, plan, sampled, [(seq, p) for _, seq, p in prompt])
        if previous is not None:
            outputs += self._read_back(previous)
        if self._in_flight is not None and not self.overlap:
            outputs += self._read_back(self._in_flight)
            self._in_flight = None
        return outputs

    def _launch(
        self,
        batch: ScheduledBatch,
        plan: StepPlan,
        sampled: torch.Tensor | None,
        prompt: list[tuple[Sequence, int]],
    ) -> _InFlight | None:
        """Run ``plan`` (placeholders filled from ``sampled``) and sample on the device; append
        each sampled sequence's placeholder. ``prompt``: the sequence and position of each of the
        plan's prompt rows. None if no sequence reached its last token and no prompt row ran."""
        plan.kv_ready, self._admitted = self._admitted, []  # their KV must be in place first
        arrived = set(plan.kv_ready)
        prompt_logprobs = None
        if prompt:
            logits, hidden = self.runner.step_with_prompt_rows(plan, sampled)
            targets = [seq.token_ids[p + 1] for seq, p in prompt]
            k = max(seq.params.prompt_logprobs or 0 for seq, _ in prompt)
            prompt_logprobs = PromptLogprobs.of(hidden, self.runner.logits, targets, k)
        else:
            logits = self.runner.step(plan, sampled)
        sampled_seqs = []  # sequences whose last token ran: they get a new one
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                sampled_seqs.append(seq)
                if seq.num_output_tokens == 0 or seq.request_id in arrived:
                    # Its prompt is done, or its KV arrived (decode role): requests scheduled from
                    # now on share its full blocks (their steps queue behind this one, which
                    # writes them or, on a peer, first waits for them to land).
                    self.block_manager.cache_blocks(seq)
        if not sampled_seqs:
            if not prompt:
                return None
            empty = torch.empty(0, dtype=torch.int64, device=logits.device)
            return _InFlight.launch_copy([], [], empty, None, prompt, prompt_logprobs)
        params = [s.params for s in sampled_seqs]
        histories = None
        if any(p.penalized for p in params):
            histories = [History(s.token_ids, s.num_prompt_tokens) for s in sampled_seqs]
        banned = None
        if any(p.min_tokens for p in params):
            banned = [
                self._stop_ids(s.params) if s.num_output_tokens < s.params.min_tokens else () for s in sampled_seqs
            ]
        tokens = self.sampler(logits, params, [s.num_tokens for s in sampled_seqs], histories, sampled, banned)
        logprobs = SampledLogprobs.of(logits, tokens, params)
        indexes = []
        for row, seq in enumerate(sampled_seqs):
            indexes.append(seq.num_tokens)
            seq.token_ids.append(pending_token(row))
            seq.finishing = seq.prefill_only or self._length_reached(seq, seq.num_tokens)
        return _InFlight.launch_copy(sampled_seqs, indexes, tokens, logprobs, prompt, prompt_logprobs)

    def _read_back(self, step: _InFlight) -> list[RequestOutput]:
        """The launched step's tokens, in place of their placeholders: stop checks and outputs."""
        tokens, logprobs, prompt_logprobs = step.read()
        for (seq, position), entry in zip(step.prompt, prompt_logprobs):
            if seq.status is SequenceStatus.FINISHED:  # aborted meanwhile: its id may name a new request
                continue
            wanted = self._prompt_logprobs.get(seq.request_id)
            if wanted is not None:
                wanted[position] = entry
        now = time.monotonic()
        outputs = []
        for row, (seq, index, token) in enumerate(zip(step.seqs, step.indexes, tokens)):
            if seq.status is SequenceStatus.FINISHED:  # aborted, or stopped by the step before
                continue
            token_logprobs = [logprobs[row]] if row in logprobs else None
            seq.token_ids[index] = token
            first = seq.milestones.first_token is None
            prompt_entries = None
            if first:
                seq.milestones.first_token = now
                prompt_entries = self._take_prompt_logprobs(seq.request_id)
            reason = self._stop_reason(seq, token, index + 1)
            if reason is None and seq.prefill_only:
                self.scheduler.finish(seq, "prefilled", free_blocks=False)
                self.held[seq.request_id] = seq
                output = self._finish(seq, [token], token_logprobs, prompt_entries)
                output.kv_block_ids = seq.block_table.tolist()
                outputs.append(output)
            elif reason is None:
                outputs.append(
                    RequestOutput(
                        seq.request_id,
                        [token],
                        num_prompt_tokens=seq.num_prompt_tokens,
                        num_output_tokens=index + 1 - seq.num_prompt_tokens,
                        timings=self._timings(seq) if first else RequestTimings(),
                        logprobs=token_logprobs,
                        prompt_logprobs=prompt_entries,
                    )
                )
            else:
                self.scheduler.finish(seq, reason)
                outputs.append(self._finish(seq, [token], token_logprobs, prompt_entries))
        return outputs

    def _length_reached(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``seq`` ends once it holds ``num_tokens`` tokens, whatever the last one is."""
        return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= self.max_model_len

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        """What ``min_tokens`` holds back: the stop ids, and the end-of-sequence ids even under
        ``ignore_eos`` (vLLM's), which only keeps them from ending the request."""
        return (*self.model_config.eos_token_ids, *params.stop_token_ids)

    def _stop_reason(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        """Why ``seq`` ends with ``token`` as its ``num_tokens``-th token, or None."""
        params = seq.params
        if num_tokens - seq.num_prompt_tokens < params.min_tokens:  # a stop id only where all were banned
            return "length" if self._length_reached(seq, num_tokens) else None
        if not params.ignore_eos and token in self.model_config.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if self._length_reached(seq, num_tokens):
            return "length"
        return None

    def _take_prompt_logprobs(self, request_id: str) -> list[TokenLogprobs] | None:
        """A request's prompt log-probabilities, complete once its first token is read back."""
        entries = self._prompt_logprobs.pop(request_id, None)
        if entries is None:
            return None
        assert all(entry is not None for entry in entries), f"{request_id}: prompt positions without logits"
        return entries  # type: ignore[return-value]

    def _finish(
        self,
        seq: Sequence,
        new_tokens: list[int] | None = None,
        logprobs: list[TokenLogprobs] | None = None,
        prompt_logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        seq.drop_pending()  # a token stopped it (or an abort) while its next step was in flight
        del self.requests[seq.request_id]
        self._prompt_logprobs.pop(seq.request_id, None)  # an abort before the first token
        return RequestOutput(
            seq.request_id,
            new_tokens or [],
            finished=True,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            timings=self._timings(seq),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _timings(self, seq: Sequence) -> RequestTimings:
        timings = seq.milestones.durations()
        if self.block_manager.prefix_cache is None:
            return timings
        return msgspec.structs.replace(timings, cached_tokens=float(seq.num_cached_tokens))

    def drain(self) -> Iterator[list[RequestOutput]]:
        """Step until every request has finished, yielding each step's outputs."""
        while self.has_unfinished():
            yield self.step()

    def generate(
        self, prompts: SequenceType[SequenceType[int]], params: SamplingParams | SequenceType[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion together (continuous batching); output token ids per prompt."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"generate-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, per_prompt):
            self.add_request(request_id, prompt, p)
        results: dict[str, list[int]] = {i: [] for i in ids}
        for outputs in self.drain():
            for out in outputs:
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]

"""Engine: add_request / step / abort, and generate / stream as loops over step()."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator, Sequence

from thunder_batch.chat import prompt_style_for
from thunder_batch.config import EngineConfig, ParamError, SamplingParams, choice_seed, is_chat
from thunder_batch.drafts import Drafter, accepted_tokens
from thunder_batch.forced import ForcedTokens
from thunder_batch.intake import PromptIntake
from thunder_batch.kv_cache import bytes_per_token
from thunder_batch.observe import Observers, StepEvent
from thunder_batch.quantized import check_quantized
from thunder_batch.request import GenerationResult, Request, StepOutput, joined_outputs
from thunder_batch.runner import Runner, program_stats
from thunder_batch.scheduler import Scheduler
from thunder_batch.step_plan import StepPlan


class Engine:
    """Continuous batching over a fixed batch of slots with one compiled step program.

    model: a litgpt GPT; tokenizer: a litgpt Tokenizer, or None to work in token ids only;
    prompt_style: litgpt PromptStyle for chat prompts (default: litgpt's style for the model name).
    """

    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None, prompt_style=None) -> None:
        self.config = config or EngineConfig()
        self.model, self.tokenizer = model, tokenizer
        self.prompt_style = prompt_style or prompt_style_for(model.config)
        check_quantized(model, self.config)
        self.runner = Runner(model, self.config)
        cfg = self.config
        store_tokens = cfg.prefix_store_mb * 2**20 // bytes_per_token(self.runner.caches)
        self.scheduler = Scheduler(
            cfg.batch_size, cfg.prefill_chunk, cfg.lane_counts, cfg.prefix_reuse, cfg.prefix_copy_min, store_tokens
        )
        self.drafter = Drafter(cfg) if cfg.speculative_tokens else None
        self.forced = ForcedTokens(cfg)  # a constrained request's tokens fed unsampled where that pays
        self.vocab_size = model.config.padded_vocab_size
        self.intake = PromptIntake(self.config.max_seq_length, tokenizer, self.prompt_style, self.vocab_size)
        eos = getattr(tokenizer, "eos_id", None)
        self.eos_ids = frozenset() if eos is None else frozenset({eos})
        self._next_id = itertools.count()
        self._seeds = random.Random()  # seeds for requests that bring none
        self._counters = dict(steps=0, generated_tokens=0, prompt_tokens=0, finished_requests=0)
        self._grammar_compiler = None  # constraints.GrammarCompiler, on the first constrained request
        self.observers = Observers()  # callables given each step's StepEvent (the server's metrics, the bench)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir=None, config: EngineConfig | None = None, dtype=None, device="cpu"):
        """Load a litgpt checkpoint dir (None: the default model, converted once) with its tokenizer
        and prompt style."""
        import torch

        from thunder_batch.checkpoints import default_checkpoint_dir, load_checkpoint

        checkpoint_dir = default_checkpoint_dir() if checkpoint_dir is None else checkpoint_dir
        model, tokenizer, model_config = load_checkpoint(checkpoint_dir, dtype=dtype or torch.float32, device=device)
        return cls(model, config, tokenizer, prompt_style_for(model_config, checkpoint_dir))

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id=None):
        """Queue a prompt (str, list of token ids, or chat messages); returns its id. Bad input raises
        ValueError here, before any step, and leaves every other request untouched."""
        return self.submit(prompt, params, request_id).request_id

    def submit(self, prompt, params: SamplingParams | None = None, request_id=None) -> Request:
        """add_request, returning the queued Request itself: its prompt_ids (after the chat template),
        params (max_new_tokens resolved) and output_ids. The server counts usage from it."""
        [request] = self.prepare(prompt, params, [request_id])
        self.enqueue([request])
        return request

    def prepare(self, prompt, params: SamplingParams | None = None, request_ids=(None,)) -> list[Request]:
        """Validate and encode a prompt once into one Request per id, without queueing them: the
        choices of one prompt, choice i drawing from `choice_seed(seed, i)` (choice 0 is the request
        alone). Reads no scheduler state, so it may run beside a step (the server tokenizes here)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if is_chat(prompt):
            params = self.intake.with_chat_stops(params)
        prompt_ids = self.intake.encode(prompt)
        params = self.intake.fitted(len(prompt_ids), params)
        seed = self._seeds.getrandbits(63) if params.seed is None else params.seed  # the full 63 bits
        requests = []
        for choice, request_id in enumerate(request_ids):
            request_id = next(self._next_id) if request_id is None else request_id
            detok = self._detokenizer(prompt_ids) if self.tokenizer is not None else None
            requests.append(Request(request_id, prompt_ids, params, choice_seed(seed, choice), self.eos_ids, detok))
        if params.constraint is not None:
            for request in requests:  # each choice its own grammar state
                request.constraint = self._grammars().constraint(*params.constraint, request.stop_ids)
        return requests

    def _grammars(self):
        """The structured-output compiler for this engine's tokenizer, made on the first constrained request."""
        if self._grammar_compiler is None:
            from thunder_batch.constraints import GrammarCompiler

            if self.tokenizer is None or not self.eos_ids:
                raise ParamError("json_schema", "structured output needs the model's tokenizer and its EOS token")
            eos = min(self.eos_ids)
            self._grammar_compiler = GrammarCompiler(self.tokenizer, eos, self.vocab_size)
        return self._grammar_compiler

    def enqueue(self, requests: list[Request]) -> None:
        """Queue prepared Requests (all or none: an id already in use raises ValueError)."""
        ids = [r.request_id for r in requests]
        taken = [i for i in ids if self.scheduler.find(i) is not None]
        if taken or len(set(ids)) < len(ids):
            raise ValueError(f"request_id {(taken or ids)[0]!r} is already in use")
        for request in requests:
            self.scheduler.add(request)

    def encode(self, prompt) -> list[int]:
        """Token ids of a prompt: a str or chat messages (both need a tokenizer), or a non-empty list of ids in
        the vocabulary (intake.PromptIntake.encode)."""
        return self.intake.encode(prompt)

    def _detokenizer(self, prompt_ids: list[int]):
        from thunder_batch.detokenize import IncrementalDetokenizer

        return IncrementalDetokenizer(self.tokenizer, prompt_ids)

    def abort(self, request_id) -> bool:
        """Cancel a queued or running request; its slot is free for the next step."""
        request = self.scheduler.find(request_id)
        if request is None:
            return False
        request.abort()
        self.scheduler.remove(request, keep=False)
        if self.drafter is not None:
            self.drafter.finished(request_id)
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every slot's kept tokens, so no later prompt reuses cache entries computed before now.
        Running requests go on with their own entries. A change of the model's weights that the engine sees
        (in place, a new tensor, new data: see `update_weights`) does this by itself at the next step."""
        self.scheduler.drop_kept()

    # -- weights ------------------------------------------------------------------------------
    def update_weights(self, weights) -> None:
        """Copy new weights into the model in place: `weights` is a state dict or (name, tensor) pairs, names as
        in `model.state_dict()`, any subset. Every name and shape is checked first (ValueError naming the bad
        one, nothing written). No retrace; packed copies are made now; kept prefixes are dropped. Safe between
        steps while requests run: their next tokens use the new weights (an RL loop's weight sync)."""
        self.runner.update_weights(weights)
        self.reset_prefix_cache()

    def refresh_weights(self) -> None:
        """Read every weight afresh after writes that no version counter sees (`p.data.copy_(t)`, writes through
        another view of the memory): packed copies made again, kept prefixes dropped, nothing retraced. Edits
        in place (`p.mul_()`), new tensors (`load_state_dict(sd, assign=True)`) and new data (`p.data = t`)
        are followed without it."""
        self.runner.refresh_weights()
        self.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the one primitive --------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Admit waiting requests into free slots, run one step, and return what it produced."""
        # The programs follow replaced weights; kept entries computed by other weights must not be reused.
        if self.runner.follow_weights():
            self.reset_prefix_cache()
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        if self.drafter is not None:
            plan = self.drafter.propose(plan)
        planned = time.perf_counter()
        try:
            result = self.runner.run(plan)
        except BaseException:  # the caches may be half written: no prompt may take entries from them
            self.scheduler.step_failed(plan)
            raise
        seconds = time.perf_counter() - planned
        self._counters["steps"] += 1
        self.forced.record(plan, seconds)
        outputs = [output for work in plan.work if (output := self._advance(work, result)) is not None]
        if self.drafter is not None and (plan.verify or not plan.busy_lanes):  # the gate weighs decode steps
            self.drafter.gate.record(result.shape.lanes if plan.verify else "plain", seconds)
        self._observed(plan, result, planned - start, seconds, outputs)
        return outputs

    def probe_step(self) -> float:
        """One step with every slot empty (its padding writes only scratch entries), observed like any: raises if
        stepping fails (the server's health probe); returns its seconds. Changes no request."""
        plan = StepPlan([])
        start = time.perf_counter()
        result = self.runner.run(plan)
        seconds = time.perf_counter() - start
        self._observed(plan, result, 0.0, seconds)
        return seconds

    def _observed(self, plan, result, schedule_seconds: float, seconds: float, outputs=()) -> None:
        """Hand the step just run to every observer (a StepEvent)."""
        shape = result.shape
        timing = (schedule_seconds, result.inputs_seconds, seconds)
        self.observers.notify(StepEvent(plan, shape, shape.describe(self.config), *timing, tuple(outputs)))

    def _advance(self, work, result) -> StepOutput | None:
        """After the step, one slot's work: its prompt logprobs, counters, and what it sampled appended
        (Scheduler.postprocess); None while it samples nothing."""
        request = work.request
        if result.row_logprobs is not None and request.params.prompt_logprobs is not None:
            self._score_prompt(work, result)
        self._counters["prompt_tokens"] += min(len(work.token_ids), max(len(request.prompt_ids) - work.start_pos, 0))
        outputs = self.scheduler.postprocess(work, self._sampled(work, result))
        self._counters["generated_tokens"] += len(outputs)
        if request.finished:
            self._counters["finished_requests"] += 1
            if self.drafter is not None:
                self.drafter.finished(request.request_id)
        return joined_outputs(outputs) if outputs else None

    def _sampled(self, work, result) -> list[tuple]:
        """(token, logprob, alternatives) sampled after a work's tokens: one where its slot samples, a verify
        lane's accepted tokens (drafts.accepted_tokens), none while a prompt is still being read."""
        if not work.draft:
            if not work.samples:
                return []
            token, top = result.tokens[work.slot], result.top[work.slot] if result.top is not None else None
            forced = self.forced.after(work.request, token, top is not None, self.scheduler.num_running)
            return [(token, result.logprobs[work.slot], top), *forced]
        first = work.lane * (self.config.speculative_tokens + 1)
        tokens = accepted_tokens(work.draft, result.verify_tokens[first : first + len(work.token_ids)])
        self.drafter.record(work, len(tokens) - 1)
        rows = range(first, first + len(tokens))
        tops = [result.verify_top[r] if result.verify_top is not None else None for r in rows]
        return list(zip(tokens, [result.verify_logprobs[r] for r in rows], tops))

    def _score_prompt(self, work, result) -> None:
        """Record the logprobs of the prompt tokens that follow this work's rows (a `_prompt` head)."""
        request = work.request
        first = self.runner.first_row(work)
        for i in range(len(work.token_ids)):
            if work.start_pos + i + 1 < len(request.prompt_ids):
                request.score_prompt(result.row_logprobs[first + i], result.row_top[first + i])

    # -- loops over step() --------------------------------------------------------------------
    def generate(
        self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Run prompts to completion (more prompts than slots is fine); results in prompt order."""
        ids = self._add_all(prompts, params)
        requests = [self.scheduler.find(i) for i in ids]
        while any(not r.finished for r in requests):
            self.step()
        return [r.result() for r in requests]

    def stream(
        self, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[StepOutput]:
        """Yield StepOutputs of these prompts as steps produce them; aborts leftovers if closed early."""
        ids = self._add_all(prompts, params)
        live = set(ids)
        try:
            while live:
                for output in self.step():
                    if output.request_id in live:
                        if output.finished:
                            live.discard(output.request_id)
                        yield output
        finally:
            for request_id in live:
                self.abort(request_id)

    def _add_all(self, prompts: Sequence, params) -> list:
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise ValueError("prompts must be a list of prompts")
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        requests = [r for prompt, p in zip(prompts, per_prompt) for r in self.prepare(prompt, p)]  # all valid first
        self.enqueue(requests)
        return [request.request_id for request in requests]

    def warmup(self, progress: bool = False) -> dict:
        """Compile (or load) the step program for every step shape now; seconds per shape (described)."""
        return self.runner.warmup(progress)

    def counters(self) -> dict:
        """What the engine has done and holds, cheap enough for every step: steps, generated_tokens,
        finished_requests, `prompt_tokens` (every prompt token of the requests admitted:
        `prompt_tokens_computed` fed to the model, `prompt_tokens_reused` taken from a slot's cache),
        `prompt_tokens_looked_up` (those of the requests admitted with a prefix lookup: /metrics exports it and
        `prompt_tokens_reused` as vLLM's `prefix_cache_queries` / `prefix_cache_hits`),
        `prefix_store_tokens` (tokens of the prefixes kept in host memory), `running` and `waiting` requests,
        `kv_cache_tokens` (KV-cache entries the running requests hold, of batch_size x max_seq_length)."""
        computed, scheduler = self._counters["prompt_tokens"], self.scheduler
        return dict(
            self._counters,
            prompt_tokens=computed + scheduler.prompt_tokens_reused,
            prompt_tokens_computed=computed,
            prompt_tokens_reused=scheduler.prompt_tokens_reused,
            prompt_tokens_looked_up=scheduler.prompt_tokens_looked_up,
            prefix_store_tokens=scheduler.store.tokens if scheduler.store is not None else 0,
            running=scheduler.num_running(),
            waiting=len(scheduler.waiting),
            kv_cache_tokens=sum(r.num_cached for r in scheduler.slots if r is not None),
        )

    def stats(self) -> dict:
        """`counters()`, and the step programs': `cache_misses` (step shapes made: one per shape in
        `step_shapes`, whatever the traffic), `programs` (per piece: prefix, block, head variants),
        `traced`/`disk_cache_hits` (pieces traced here / loaded from the compile cache),
        `thunder_traces` (traces Thunder itself counts: a retrace shows here), and `compile_seconds`
        (per piece: `compile_seconds_by_piece`), `stacked_shapes` (step shapes whose layers run as one native
        loop: compile.block_op); with speculative decoding, `speculative`: verify steps,
        draft tokens proposed and accepted."""
        return dict(
            self.counters(),
            **program_stats(self.runner),
            **({} if self.drafter is None else dict(speculative=self.drafter.stats())),
            step_shapes=[shape.describe(self.config) for shape in self.config.step_shapes],
        )

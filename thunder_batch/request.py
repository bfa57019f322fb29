"""Request state, stop handling and typed outputs (pure Python: no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from thunder_batch.config import SamplingParams
from thunder_batch.stops import StopSequenceMatcher, StopStringHolder

STOP, LENGTH, ABORT = "stop", "length", "abort"


@dataclass
class StepOutput:
    """What one step produced for one request: tokens (and text) released to the caller."""

    request_id: object
    token_ids: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)


@dataclass
class GenerationResult:
    """A finished request. `token_ids` excludes the prompt, EOS/stop tokens and stop sequences."""

    request_id: object
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[float]


class Request:
    """One request's tokens and stop state. Tokens are released to callers only once no
    stop sequence can still claim them (held back while a stop might be forming)."""

    def __init__(
        self,
        request_id,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        eos_ids: frozenset[int] = frozenset(),
        detokenizer=None,
    ) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.seed = seed
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.num_cached = 0  # tokens of prompt + output already written to the slot's KV cache
        self.slot: int | None = None
        self.finish_reason: str | None = None
        self.text = "" if detokenizer is not None else None
        self._stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        sequences = params.stop_sequences
        self._stop_state = StopSequenceMatcher(sequences).new_state() if sequences else None
        self._detok = detokenizer
        self._stop_text = StopStringHolder(params.stop_strings) if detokenizer and params.stop_strings else None
        self._num_released = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending_ids(self) -> list[int]:
        """Tokens not yet in the KV cache: the prompt's rest in prefill, the last sampled token in decode."""
        start = self.num_cached
        if start < len(self.prompt_ids):
            return self.prompt_ids[start:]
        return self.output_ids[start - len(self.prompt_ids) :]

    def append(self, token_id: int, logprob: float) -> StepOutput:
        """Record one sampled token, apply stops and length, and release what is safe."""
        self.output_ids.append(token_id)
        self.logprobs.append(logprob)
        held = 0
        if token_id in self._stop_ids:
            self._drop_last(1)
            self.finish_reason = STOP
        elif self._stop_state is not None:
            matched = self._stop_state.feed(token_id)
            if matched:
                self._drop_last(matched)
                self.finish_reason = STOP
            held = self._stop_state.pending
        if not self.finished and len(self.output_ids) >= self.params.max_new_tokens:
            self.finish_reason, held = LENGTH, 0
        return self._release(len(self.output_ids) - (0 if self.finished else held))

    def abort(self) -> StepOutput:
        self.finish_reason = ABORT
        return self._release(len(self.output_ids))

    def result(self) -> GenerationResult:
        return GenerationResult(
            self.request_id, self.prompt_ids, list(self.output_ids), self.text, self.finish_reason, list(self.logprobs)
        )

    def _drop_last(self, n: int) -> None:
        del self.output_ids[len(self.output_ids) - n :]
        del self.logprobs[len(self.logprobs) - n :]

    def _release(self, upto: int) -> StepOutput:
        new_ids = self.output_ids[self._num_released : upto]
        new_logprobs = self.logprobs[self._num_released : upto]
        self._num_released = max(self._num_released, upto)
        text = self._release_text(new_ids) if self._detok is not None else None
        return StepOutput(self.request_id, new_ids, text, self.finished, self.finish_reason, new_logprobs)

    def _release_text(self, new_ids: list[int]) -> str:
        delta = "".join(self._detok.push(t) for t in new_ids)
        if self.finished:
            delta += self._detok.flush()
        if self._stop_text is not None:
            delta, stopped = self._stop_text.push(delta)
            if stopped and self.finish_reason != ABORT:
                self.finish_reason = STOP
            elif self.finished:
                delta += self._stop_text.flush()
        self.text += delta
        return delta

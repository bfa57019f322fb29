"""Request state, stop handling and typed outputs (pure Python: no torch)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field

from thunder_batch.config import ParamError, SamplingParams
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
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, if asked for


def joined_outputs(outputs: list[StepOutput]) -> StepOutput:
    """Several tokens' StepOutputs of one request, in order, as one (a verify step's accepted tokens)."""
    if len(outputs) == 1:
        return outputs[0]
    last, texts = outputs[-1], [o.text for o in outputs]
    return StepOutput(
        last.request_id,
        [t for o in outputs for t in o.token_ids],
        None if last.text is None else "".join(texts),
        last.finished,
        last.finish_reason,
        [lp for o in outputs for lp in o.logprobs],
        [top for o in outputs for top in o.top_logprobs],
    )


@dataclass
class GenerationResult:
    """A finished request. `token_ids` excludes the prompt, EOS/stop tokens, stop sequences and the
    tokens of a stop string (a token whose text begins before the stop string is kept: its text up to
    the stop is in `text`). `prompt_logprobs`: [None, then each prompt token's logprob] when asked for."""

    request_id: object
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)


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
        if params.stop_strings and detokenizer is None:
            raise ParamError("stop", f"stop strings {list(params.stop_strings)} need a tokenizer; pass token-id stops")
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per output token, when params.logprobs is set
        scored = params.prompt_logprobs is not None  # the first prompt token has nothing before it
        self.prompt_logprobs: list[float | None] = [None] if scored else []
        self.prompt_top_logprobs: list[list[tuple[int, float]] | None] = [None] if scored else []
        self.num_cached = 0  # tokens of prompt + output already written to the slot's KV cache
        self.constraint = None  # constraints.Constraint when params set one (the engine compiles it)
        self.slot: int | None = None
        self.finish_reason: str | None = None
        self.stop_token: tuple | None = None  # (id, logprob, top) of the stop token (EOS) that ended it
        self.text = "" if detokenizer is not None else None
        self._stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids)
        sequences = params.stop_sequences
        self._stop_state = StopSequenceMatcher(sequences).new_state() if sequences else None
        self._detok = detokenizer
        self._stop_text = StopStringHolder(params.stop_strings) if params.stop_strings else None
        self._num_released = 0
        self._pushed = 0  # output tokens fed to the detokenizer
        self._text_ends: list[int] = []  # per pushed token: length of the text decoded up to it

    @property
    def stop_ids(self) -> frozenset[int]:
        """The token ids that end this request: its stop_token_ids, and EOS unless ignore_eos."""
        return self._stop_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def pending_ids(self) -> list[int]:
        """Tokens not yet in the KV cache: the prompt's rest in prefill, the last sampled token in decode."""
        start = self.num_cached
        if start < len(self.prompt_ids):
            return self.prompt_ids[start:]
        return self.output_ids[start - len(self.prompt_ids) :]

    def append(self, token_id: int, logprob: float, top: list[tuple[int, float]] | None = None) -> StepOutput:
        """Record one sampled token (and its most likely alternatives), apply stops and length, and
        release what is safe."""
        self.output_ids.append(token_id)
        self.logprobs.append(logprob)
        if self.params.logprobs is not None:
            self.top_logprobs.append(list(top or [])[: self.params.logprobs])
        held = 0
        if token_id in self._stop_ids:  # kept aside: a scorer (OpenAI's completions logprobs) reports it
            self.stop_token = (token_id, logprob, list(top or [])[: self.params.logprobs or 0])
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

    def score_prompt(self, logprob: float, top: list[tuple[int, float]]) -> None:
        """The logprob of the next prompt token (and the most likely tokens there)."""
        self.prompt_logprobs.append(logprob)
        self.prompt_top_logprobs.append(list(top)[: self.params.prompt_logprobs])

    def result(self) -> GenerationResult:
        return GenerationResult(
            self.request_id,
            self.prompt_ids,
            list(self.output_ids),
            self.text,
            self.finish_reason,
            list(self.logprobs),
            list(self.top_logprobs),
            list(self.prompt_logprobs),
            list(self.prompt_top_logprobs),
        )

    def _drop_last(self, n: int) -> None:
        self._keep(len(self.output_ids) - n)

    def _keep(self, n: int) -> None:
        del self.output_ids[n:], self.logprobs[n:], self.top_logprobs[n:]

    def _release(self, upto: int) -> StepOutput:
        """Release tokens up to `upto` (past the stop sequences that could still form); with text, only
        those whose text is out (a stop string may still claim the rest)."""
        if self._detok is not None:
            delta = self._push_text(upto)
            upto = len(self.output_ids) if self.finished else bisect_right(self._text_ends, len(self.text))
        else:
            delta = None
        new = slice(self._num_released, max(self._num_released, upto))
        self._num_released = new.stop
        top = self.top_logprobs[new] if self.params.logprobs is not None else []
        ids, logprobs = self.output_ids[new], self.logprobs[new]
        return StepOutput(self.request_id, ids, delta, self.finished, self.finish_reason, logprobs, top)

    def _push_text(self, upto: int) -> str:
        """Decode tokens up to `upto`, pass the text through the stop strings; the new text out."""
        deltas, length = [], self._text_ends[-1] if self._text_ends else 0
        for token_id in self.output_ids[self._pushed : upto]:
            deltas.append(self._detok.push(token_id))
            length += len(deltas[-1])
            self._text_ends.append(length)
        self._pushed = max(self._pushed, upto)
        if self.finished:
            deltas.append(self._detok.flush())
            if self._text_ends:
                self._text_ends[-1] += len(deltas[-1])
        delta = "".join(deltas)
        if self._stop_text is not None:
            delta, stopped = self._stop_text.push(delta)
            if stopped and self.finish_reason != ABORT:
                self.finish_reason = STOP
                self._cut_at(len(self.text) + len(delta))
            elif self.finished:
                delta += self._stop_text.flush()
        self.text += delta
        return delta

    def _cut_at(self, stop_start: int) -> None:
        """A stop string starts at text offset `stop_start`: keep the tokens whose text begins before it."""
        starts = [0, *self._text_ends[:-1]]
        keep = max(bisect_left(starts, stop_start), self._num_released)  # what is out stays out
        self._keep(keep)
        self._pushed, self._text_ends = keep, self._text_ends[:keep]

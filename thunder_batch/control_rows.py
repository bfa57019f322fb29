"""Each slot's logit-control rows on the step's device, the inputs of the `controlled_` heads (program.StepHead).

A slot's rows are made when a controlled request takes it (its logit_bias, its prompt's tokens as seen, no
counts; -inf on its stop tokens while min_tokens holds them back) and advanced before each step by the tokens
it generated since the last one: a few entries written, not [B, V] sent. A constrained request's grammar takes
those tokens and writes the row's allowed-token bits (constraints.Constraint). A slot whose request sets no
control has neutral rows (zero bias, every token allowed), so it samples as under an uncontrolled head.
"""

from __future__ import annotations

import torch

from thunder_batch.logit_controls import has_controls

NEUTRAL_KNOBS = (0.0, 0.0, 1.0, 0.0)  # presence, frequency, repetition, min_p


class ControlRows:
    def __init__(self, batch_size: int, vocab_size: int, device) -> None:
        self.batch_size, self.vocab_size, self.device = batch_size, vocab_size, device
        self.bias = self.counts = self.seen = None  # [B, V] each, made at the first controlled step
        self.allowed = None  # [B, ceil(V / 32)] int32 bits
        self.owner: list = [None] * batch_size  # the request each slot's rows were made for
        self.counted = [0] * batch_size  # its output tokens already in counts and seen
        self.holding = [False] * batch_size  # its stop tokens still at -inf (min_tokens)

    def inputs(self, work) -> dict[str, torch.Tensor] | None:
        """StepInputs' bias, counts, seen, allowed and knobs for a step's work, or None when no slot that samples
        in it sets a control (the step then takes an uncontrolled head)."""
        if not any(w.samples and has_controls(w.request.params) for w in work):
            return None
        if self.bias is None:
            shape, dev = (self.batch_size, self.vocab_size), self.device
            self.bias, self.counts = torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)
            self.seen = torch.zeros(shape, dtype=torch.bool, device=dev)
            words = -(-self.vocab_size // 32)
            self.allowed = torch.full((self.batch_size, words), -1, dtype=torch.int32, device=dev)
        knobs = [NEUTRAL_KNOBS] * self.batch_size
        for w in work:
            self._follow(w.slot, w.request)
            p = w.request.params
            if has_controls(p):
                knobs[w.slot] = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p)
        knobs = torch.tensor(knobs, dtype=torch.float32, device=self.device)  # [B, 4]
        return dict(bias=self.bias, counts=self.counts, seen=self.seen, allowed=self.allowed, knobs=knobs)

    def _follow(self, slot: int, request) -> None:
        """Bring the slot's rows to its request: made anew for a new request, then its new tokens counted."""
        params = request.params
        if self.owner[slot] is not request:
            self.owner[slot], self.counted[slot] = request, 0
            self.bias[slot], self.counts[slot], self.seen[slot], self.allowed[slot] = 0.0, 0.0, False, -1
            self.holding[slot] = False
            if not has_controls(params):
                return
            self._set_bias(slot, params.logit_bias)
            self.seen[slot, self._ids(request.prompt_ids)] = True
            self.holding[slot] = params.min_tokens > 0
            if self.holding[slot]:
                self.bias[slot, self._stop_ids(request)] = float("-inf")
        if not has_controls(params):
            return
        new = request.output_ids[self.counted[slot] :]
        if new:
            ids = self._ids(new)
            self.counts[slot].index_put_((ids,), torch.ones(len(new), device=self.device), accumulate=True)
            self.seen[slot, ids] = True
            self.counted[slot] = len(request.output_ids)
        if request.constraint is not None:
            request.constraint.advance(request.output_ids)
            self._allow(slot, request.constraint)
        if self.holding[slot] and len(request.output_ids) >= params.min_tokens:
            self.holding[slot] = False  # the stop tokens get their own bias back (0 unless logit_bias sets one)
            self.bias[slot, self._stop_ids(request)] = 0.0
            self._set_bias(slot, params.logit_bias)

    def _allow(self, slot: int, constraint) -> None:
        row = self.allowed[slot]
        if row.device.type == "cpu":
            constraint.fill(row.numpy())  # written in place
        else:
            words = row.cpu().numpy()
            constraint.fill(words)
            row.copy_(torch.from_numpy(words))

    def _set_bias(self, slot: int, pairs) -> None:
        if pairs:
            ids, values = zip(*pairs)
            self.bias[slot, self._ids(ids)] = torch.tensor(values, dtype=torch.float32, device=self.device)

    def _stop_ids(self, request) -> torch.Tensor:
        """Its stop tokens the model can sample (a stop_token_ids entry past the vocabulary never comes)."""
        return self._ids(sorted(t for t in request.stop_ids if t < self.vocab_size))

    def _ids(self, ids) -> torch.Tensor:
        return torch.tensor(list(ids), dtype=torch.int64, device=self.device)

"""The inference worker of `thunder-batch serve`: one Engine per worker process, continuous batching.

LitServe runs three kinds of process: the main process (`server`), which starts the others and waits;
an HTTP process per worker (`routes`); and the inference workers (devices x workers_per_device), each
owning one Engine built in `EngineAPI.setup`. Inside a worker, `loop.EngineLoop` runs two tasks that
both touch the engine, so its state sits behind a lock (and every engine call runs on one engine thread):
- intake: takes a bounded number of requests off LitServe's queue, tokenizes them outside the lock
  (`prepare`), then queues them in the engine under it (`admit`);
- steps: `Engine.step()` back to back while any request is unfinished (`step`).
One HTTP request may carry several choices (n, or a list of prompts): each is an engine Request,
id "<uid>/<choice>", and the request finishes when its last choice does.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass, field

import litserve as ls

from thunder_batch.config import ContextLengthError, ParamError, is_chat
from thunder_batch.observe import StepEvent
from thunder_batch.serve.loop import EngineLoop
from thunder_batch.serve.metrics import Metrics
from thunder_batch.serve.openai import APIError
from thunder_batch.serve.shared_state import UNHEALTHY_AFTER_FAILED_STEPS
from thunder_batch.serve.token_texts import TokenTexts

logger = logging.getLogger(__name__)
RECENT = 4096  # finished uids remembered, to clear a cancel that raced the end of its request
PUBLISH_S = 0.25  # a busy worker publishes its counters this often

Event = tuple  # (uid, message dict for the HTTP side, finished: bool)


@dataclass
class _Choices:
    """One HTTP request in this worker: its choices (engine Requests) and how to report them."""

    requests: list
    prompts: list  # as the client sent them; choice c answers prompts[c // n]
    n: int
    echo: bool
    logprobs: bool
    arrival: float
    echo_only: bool = False  # max_tokens 0: only the echoed prompt goes back
    live: set = field(default_factory=set)  # choices still running
    echoed: set = field(default_factory=set)  # choices whose prompt was sent back (echo)
    last_token: dict = field(default_factory=dict)  # choice -> time of its last token


class EngineAPI(ls.LitAPI):
    """The Engine behind LitServe. Messages to the HTTP side (see `calls.Call`): {"event": "claimed",
    "worker", "pid"} as soon as a worker takes the request, then {"event": "accepted", "prompt_tokens"} or
    an error; {"event": "delta", "index", "text"[, "logprobs", "echo"][, "finish_reason",
    "completion_tokens"]} per choice; {"event": "error", "error": APIError fields}."""

    def __init__(self, options, spec, state, board, model: str = "model"):
        """options: the command's EngineOptions (each worker builds its own Engine from them in `setup`);
        spec: the HTTP side's LitSpec; state: the SharedState; board: the CancelBoard."""
        super().__init__(spec=spec, loop=EngineLoop())
        self.options, self.state, self.board, self.model = options, state, board, model
        self.engine, self.lock, self.index = None, None, 0
        self.engine_thread: ThreadPoolExecutor | None = None  # made in the worker: it does not pickle

    def setup(self, device) -> None:
        self.index = int(os.environ.get("LITSERVE_WORKER_ID", "0"))
        with suppress(ValueError):  # SIGTERM waits for the main process's drain (not the main thread: no handler)
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self.start(device)

    def start(self, device) -> None:
        """Build this worker's engine on its engine thread and serve it (LitServe's `setup`, a Ray replica)."""
        fields = dict(ready=0, failed_steps=0, queue_lost=0, running=0, waiting=0)
        self.state.set_worker(self.index, pid=os.getpid(), **fields)
        self.engine_thread = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.attach(self.engine_thread.submit(self._load_engine, device).result())

    def _load_engine(self, device):
        """On the engine thread, like every step after it: each thread that starts torch's OpenMP
        regions gets a team of its own, and with more OpenMP threads than cores libgomp stops spinning
        between regions (a decode step warmed up on one thread and run on another: 25-45% slower)."""
        share_cpu_threads(device, self.state.workers)
        engine = self.options.load_engine(device)
        if engine.config.compile == "thunder":
            engine.warmup(progress=True)  # make every step shape now, not on the first request
        return engine

    def attach(self, engine) -> None:
        """Serve `engine`; every engine call goes through `engine_thread` (see `_load_engine`)."""
        self.engine, self.lock = engine, threading.Lock()
        self.engine_thread = self.engine_thread or ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.metrics = Metrics(self.model)
        self._jobs: dict[str, _Choices] = {}  # uid -> its choices, for every request in the engine
        self._requests: dict = {}  # engine request id -> (uid, choice)
        self._finished: OrderedDict = OrderedDict()  # recently finished uids
        self._texts = TokenTexts(engine.tokenizer)
        self._compiles, self._published_at = (0, 0), 0.0
        engine.observers.add(self._time_step)
        self._report()
        self.state.beat(self.index)
        capacity = engine.config.batch_size * engine.config.max_seq_length
        self.state.set_worker(self.index, slots=engine.config.batch_size, kv_capacity=capacity)
        self.state.set_worker(self.index, pid=os.getpid(), ready=1)

    def _on_sigterm(self, signum, frame) -> None:
        if self.state.stopping:  # the drain is over: nothing in flight is lost
            os._exit(0)
        logger.info("worker %d: SIGTERM before the drain is over; the main process drains first", self.index)

    def has_active_requests(self) -> bool:
        return bool(self._jobs)

    def room(self) -> int:
        """Choices this worker takes now: up to B waiting beside B slots; none while it is unhealthy."""
        if self.state.worker(self.index).failed_steps >= UNHEALTHY_AFTER_FAILED_STEPS:
            return 0
        counters = self.engine.counters()
        return max(2 * self.engine.config.batch_size - counters["running"] - counters["waiting"], 0)

    # -- intake: prepare (tokenize, outside the lock), then admit ---------------------------------
    def prepare(self, items: list[tuple[str, dict]]) -> list[tuple[str, dict, object]]:
        """(uid, payload) -> (uid, payload, its Requests or a final error Event), tokenizing each prompt once."""
        out = []
        for uid, payload in items:
            try:
                out.append((uid, payload, self._requests_for(uid, payload)))
            except ContextLengthError as e:
                out.append((uid, payload, _error(uid, _context_error(e, payload["prompts"]))))
            except ParamError as e:  # e.g. stop strings the tokenizer cannot serve, a schema that does not compile
                param = payload.get("names", {}).get(e.param, e.param)
                out.append((uid, payload, _error(uid, APIError(400, str(e), param, "invalid_value"))))
            except ValueError as e:  # the engine's own checks: roles, token ids, chat template
                error = APIError(400, str(e), _prompt_param(payload["prompts"]), "invalid_value")
                out.append((uid, payload, _error(uid, error)))
            except Exception:  # a bug, not the client's fault: fail this request, keep serving the others
                logger.exception("could not admit request %s", uid)
                out.append((uid, payload, _error(uid, APIError(500, "could not admit the request"))))
        return out

    def _requests_for(self, uid: str, payload: dict) -> list:
        n, requests = payload["n"], []
        for p, prompt in enumerate(payload["prompts"]):
            ids = [f"{uid}/{p * n + j}" for j in range(n)]
            requests += self.engine.prepare(prompt, payload["params"], ids)
        return requests

    def admit(self, prepared: list[tuple[str, dict, object]]) -> list[Event]:
        """Queue prepared requests in the engine, unless their client already left."""
        with self.lock:
            cancelled = set(self.board.claim([uid for uid, _, _ in prepared]))
            return [self._admit(uid, payload, requests, uid in cancelled) for uid, payload, requests in prepared]

    def _admit(self, uid: str, payload: dict, requests, cancelled: bool) -> Event:
        if cancelled:  # a cancel that came before admission: nobody waits for an answer
            return uid, {"event": "aborted"}, True
        if isinstance(requests, tuple):
            return requests
        self.engine.enqueue(requests)
        n = payload["n"]
        job = _Choices(requests, payload["prompts"], n, payload["echo"], payload["logprobs"], payload["arrival"])
        job.echo_only = payload.get("echo_only", False)
        job.live.update(range(len(requests)))
        self._jobs[uid] = job
        for choice, request in enumerate(requests):
            self._requests[request.request_id] = (uid, choice)
        self.metrics.labels(self.metrics.prompt_tokens).inc(sum(len(r.prompt_ids) for r in requests))
        prompt_tokens = sum(len(r.prompt_ids) for r in requests[::n])  # each prompt once, as OpenAI counts
        return uid, {"event": "accepted", "prompt_tokens": prompt_tokens}, False

    def _publish(self) -> None:
        """The engine counters /stats shows, in shared memory (at most every PUBLISH_S while busy)."""
        now = time.monotonic()
        if self._jobs and now - self._published_at < PUBLISH_S:
            return
        self._published_at = now
        stats = self.engine.stats()
        self._record_compiles(stats)
        batch_size = self.engine.config.batch_size
        stats.update(batch_size=batch_size, free_slots=batch_size - stats["running"], requests=len(self._jobs))
        self.state.publish(self.index, stats)

    # -- steps ------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        """Abort what clients abandoned, run one engine step, and report what it released."""
        with self.lock:
            events = [self._abort(uid) for uid in self.board.claim(self._jobs)]
            self.board.claim(self._finished)  # cancels that raced the end of their request
            outputs = self.engine.step() if self._jobs else []
            events += self._events(outputs)
            self._report()
        return events

    def _abort(self, uid: str) -> Event:
        for request in self._jobs[uid].requests:
            self.engine.abort(request.request_id)
        self._forget(uid)
        return uid, {"event": "aborted"}, True  # nobody reads it: it closes the uid

    def _forget(self, uid: str) -> None:
        for request in self._jobs.pop(uid).requests:
            self._requests.pop(request.request_id, None)
        self._finished[uid] = None
        while len(self._finished) > RECENT:
            self._finished.popitem(last=False)

    def _events(self, outputs) -> list[Event]:
        now, messages = time.time(), []
        for output in outputs:
            uid, choice = self._requests[output.request_id]
            job = self._jobs[uid]
            self._time_token(job, choice, now)
            message = self._message(job, choice, output)
            if message is not None:
                messages.append((uid, message))
        self.metrics.labels(self.metrics.generation_tokens).inc(len(outputs))
        final = {uid: i for i, (uid, _) in enumerate(messages)}  # a request's last message this step
        events = []
        for i, (uid, message) in enumerate(messages):
            last = final[uid] == i and not self._jobs[uid].live
            if last:
                self._forget(uid)
            events.append((uid, message, last))
        return events

    def _message(self, job: _Choices, choice: int, output) -> dict | None:
        request = job.requests[choice]
        message = {"event": "delta", "index": choice, "text": "" if job.echo_only else output.text or ""}
        if job.logprobs and not job.echo_only:
            message["logprobs"] = self._texts.entries(output.token_ids, output.logprobs, output.top_logprobs)
            if request.stop_token and not is_chat(job.prompts[choice // job.n]):  # OpenAI/vLLM list the EOS
                message["logprobs"] += self._texts.entries(*([x] for x in request.stop_token))
        if output.finished:
            job.live.discard(choice)
            if job.echo_only:  # as asked: max_tokens 0 ends at its length
                message.update(finish_reason="length", completion_tokens=0)
            else:
                message.update(finish_reason=output.finish_reason, completion_tokens=len(request.output_ids))
        if job.echo and choice not in job.echoed:  # the prompt first (its logprobs are known by now)
            job.echoed.add(choice)
            message["echo"] = self._texts.echo(job.prompts[choice // job.n], request, job.logprobs)
        if not (output.finished or message["text"] or message.get("logprobs") or "echo" in message):
            return None
        return message

    def fail_all(self) -> list[Event]:
        """After a failed step: abort every request and tell each client (500)."""
        with self.lock:
            uids = list(self._jobs)
            for uid in uids:
                for request in self._jobs[uid].requests:
                    self.engine.abort(request.request_id)
                self._forget(uid)
            self._report()
        error = APIError(500, "the engine failed during a step; see the server log", code="engine_error").to_dict()
        return [(uid, {"event": "error", "error": error}, True) for uid in uids]

    def probe(self) -> None:
        """A step with every slot empty (padding writes only scratch entries): raises if stepping fails."""
        with self.lock:
            self.engine.probe_step()

    # -- bookkeeping ------------------------------------------------------------------------------
    def step_failed(self, failed: bool) -> None:
        failures = self.state.worker(self.index).failed_steps + 1 if failed else 0
        self.state.set_worker(self.index, failed_steps=failures)
        if failed:
            self.metrics.labels(self.metrics.failed_steps).inc()

    def _report(self) -> None:
        counters = self.engine.counters()
        running, waiting, kv_tokens = counters["running"], counters["waiting"], counters["kv_cache_tokens"]
        self.state.set_worker(self.index, running=running, waiting=waiting, kv_tokens=kv_tokens)
        self.metrics.count_prefix_cache(counters["prompt_tokens_looked_up"], counters["prompt_tokens_reused"])
        self._publish()

    def _time_token(self, job: _Choices, choice: int, now: float) -> None:
        last = job.last_token.get(choice)
        if last is None:
            self.metrics.labels(self.metrics.ttft).observe(max(now - job.arrival, 0.0))
        else:
            self.metrics.labels(self.metrics.itl).observe(now - last)
        job.last_token[choice] = now

    def _time_step(self, event: StepEvent) -> None:
        self.metrics.labels(self.metrics.step, shape=event.shape_name).observe(event.seconds)

    def _record_compiles(self, stats: dict) -> None:
        """The pieces loaded and traced since the last publication, as metrics (from Engine.stats)."""
        loaded, traced = stats["disk_cache_hits"], stats["traced"]
        if (loaded, traced) != self._compiles:
            self.metrics.labels(self.metrics.compile_cache_hits).inc(loaded - self._compiles[0])
            self.metrics.labels(self.metrics.compiled_pieces).inc(traced - self._compiles[1])
            self._compiles = (loaded, traced)


def share_cpu_threads(device, workers: int) -> None:
    """CPU workers split the cores: each takes its share of torch's threads (unless OMP_NUM_THREADS says
    otherwise), as OpenMP threads spinning in one worker would take the cores another one computes on."""
    import torch

    if workers > 1 and str(device).startswith("cpu") and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, torch.get_num_threads() // workers))


def _error(uid: str, error: APIError) -> Event:
    return uid, {"event": "error", "error": error.to_dict()}, True


def _prompt_param(prompts) -> str:
    return "messages" if prompts and is_chat(prompts[0]) else "prompt"


def _context_error(e: ContextLengthError, prompts) -> APIError:
    """In the client's terms: max_tokens when the prompt alone fits, else the prompt is too long."""
    n, limit, wanted = e.prompt_tokens, e.max_seq_length, e.max_new_tokens
    param = "max_tokens" if n < limit else _prompt_param(prompts)
    counted = f"at least {n}" if e.at_least else n
    return APIError(
        400,
        f"this server's context length is {limit} tokens (max_seq_length): the prompt has {counted} "
        f"tokens and max_tokens asks for {wanted or 'at least 1'} more",
        param,
        "context_length_exceeded",
    )

"""The step function the Runner calls when compiling: per argument signature (one per step width),
a program loaded from the persistent cache, or traced by Thunder and then stored."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from thunder_batch.compile.cache import EntryStore, make_key, warn
from thunder_batch.compile.trace_export import LoadedProgram, NotExportable, export_program

# Load-time check of a stored program against the eager program on a padding-only step.
PROBE_RTOL, PROBE_ATOL = 1e-4, 1e-5


class CachedStepProgram:
    """Stands in for `thunder.jit(program)`: same call, same results, traces only on a cache miss.

    make_jit: builds the Thunder-jitted program (called at most once, on the first miss).
    probe_inputs(width): arguments of a padding-only step (all slots empty) used to validate loads.
    describe_options(): (executor names, compile options as JSON-able dict) for the cache key.
    """

    def __init__(self, program: nn.Module, config, make_jit: Callable[[], Callable],
                 probe_inputs: Callable[[int], tuple], describe_options: Callable[[], tuple], store: EntryStore | None):
        self.program, self.config, self.store = program, config, store
        self._make_jit, self._probe_inputs, self._describe_options = make_jit, probe_inputs, describe_options
        self.jitted: Callable | None = None
        self._programs: dict[tuple, Callable] = {}
        self.traced = self.disk_hits = self.hits = 0
        self.compile_seconds = 0.0

    def __call__(self, *args: torch.Tensor):
        signature = tuple((a.shape, a.dtype, a.device) for a in args)  # what Thunder's prologue checks
        fn = self._programs.get(signature)
        if fn is not None:
            self.hits += 1
            return fn(*args)
        start = time.perf_counter()
        try:
            return self._first_call(signature, args)
        finally:
            self.compile_seconds += time.perf_counter() - start

    def _first_call(self, signature: tuple, args: tuple):
        key = self._key(args) if self.store is not None else None
        hit = self._load(key, args) if key is not None else None
        if hit is not None:
            loaded, probe, probe_result = hit
            self._programs[signature] = loaded
            self.disk_hits += 1
            if all(torch.equal(a, p) for a, p in zip(args, probe)):
                return probe_result  # a warm-up step: the load-time check just ran exactly this step
            return loaded(*args)
        if self.jitted is None:
            self.jitted = self._make_jit()
        result = self.jitted(*args)  # traces this signature
        self.traced += 1
        self._programs[signature] = self.jitted
        if key is not None:
            self._store(key, args)
        return result

    def _key(self, args):
        executors, options = self._describe_options()
        return make_key(self.program, self.config, args, executors, options)

    def _load(self, key, args) -> tuple[LoadedProgram, tuple, tuple] | None:
        """(program, probe arguments, its outputs on them) for a sound stored entry, else None."""
        record = self.store.load(key)
        if record is None:
            return None
        name = self.store.path(key).name
        try:
            loaded = LoadedProgram(record, self.program)
        except Exception as e:
            warn(f"compile cache entry {name} ignored, retracing: unloadable ({type(e).__name__}: {e})")
            return None
        probe = self._probe_inputs(int(args[0].shape[1]))
        problem, result = self._validate(loaded, probe)
        if problem:
            warn(f"compile cache entry {name} ignored, retracing: failed its load-time check ({problem})")
            return None
        return loaded, probe, result

    @torch.no_grad()
    def _validate(self, loaded: LoadedProgram, probe: tuple) -> tuple[str | None, tuple | None]:
        """Run the eager program and the loaded one on the same padding-only step (which writes only
        scratch cache entries) from the same cache state; outputs and in-place writes must agree.
        Returns (what is wrong or None, the loaded program's outputs)."""
        watched = loaded.writes[:1] + loaded.writes[-1:]  # first and last written buffers: cheap, telling
        before = [b.clone() for b in watched]
        want = self.program(*probe)
        after_eager = [b.clone() for b in watched]
        for buffer, saved in zip(watched, before):
            buffer.copy_(saved)
        try:
            got = loaded(*probe)
        except Exception as e:
            return f"raised {type(e).__name__}: {e}", None
        if not torch.equal(got[0], want[0]):
            return f"tokens {got[0].tolist()} != eager {want[0].tolist()}", got
        if not torch.allclose(got[1], want[1], rtol=PROBE_RTOL, atol=PROBE_ATOL):
            return f"logprobs differ from eager by {(got[1] - want[1]).abs().max().item():.3g}", got
        if not all(torch.allclose(b, e, rtol=PROBE_RTOL, atol=PROBE_ATOL) for b, e in zip(watched, after_eager)):
            return "KV cache writes differ from eager (not written in place?)", got
        return None, got

    def _store(self, key, args) -> None:
        try:
            record = export_program(self.jitted, args, self.program)
        except NotExportable as e:
            warn(f"step program for width {key.width} not stored in the compile cache: {e}")
            return
        except Exception as e:  # never let the cache break a step that already ran fine
            warn(f"step program for width {key.width} not stored in the compile cache: export failed "
                 f"({type(e).__name__}: {e})")
            return
        self.store.save(key, record)

    def stats(self) -> dict:
        """cache_misses counts programs made (traced or loaded): one per step width, whatever the traffic."""
        return dict(cache_misses=self.traced + self.disk_hits, cache_hits=self.hits, traced=self.traced,
                    disk_cache_hits=self.disk_hits, compile_seconds=self.compile_seconds)

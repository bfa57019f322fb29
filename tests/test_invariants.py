"""docs/DESIGN.md invariants 1-5, 7, 8 and batch-size independence of the traced step, each tested directly."""

from __future__ import annotations

import pytest
import torch

from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch._compat import import_thunder
from thunder_batch.compile.step import execution_traces
from thunder_batch.config import StepShape
from thunder_batch.model import visibility_masks
from thunder_batch.program import StepProgram

from helpers import ENGINE_CONFIG, litgpt_greedy, mixed_prompts, tiny_gpt

S, C = ENGINE_CONFIG["max_seq_length"], ENGINE_CONFIG["prefill_chunk"]


def eager_engine(family="llama", **overrides) -> Engine:
    return Engine(tiny_gpt(family), EngineConfig(compile="eager", **{**ENGINE_CONFIG, **overrides}))


def engine_for(compile: str, family="llama", **overrides) -> Engine:
    """An eager engine, or a Thunder one with the default executors (the Inductor fusion included: the
    tests passing "thunder" are marked `fusion`)."""
    return Engine(tiny_gpt(family), EngineConfig(compile=compile, **{**ENGINE_CONFIG, **overrides}))


# Engine-level invariants hold for the oracle and for the program users run.
MODES = ["eager", pytest.param("thunder", marks=pytest.mark.fusion)]


def host_syncs(trace) -> list[str]:
    """Operations of a Thunder trace (nested ones included) that copy a tensor's value to the host."""
    found = []
    stack = list(trace.bound_symbols)
    while stack:
        bsym = stack.pop()
        if bsym.sym.name in ("item", "tolist", "_local_scalar_dense"):
            found.append(bsym.sym.name)  # one sync, whatever it decomposes into
        else:
            stack.extend(bsym.subsymbols)
    return found


def caches(engine: Engine):
    return engine.runner.caches


def fill_with_garbage(engine: Engine, seed=0) -> None:
    g = torch.Generator().manual_seed(seed)
    for cache in caches(engine):
        cache.k.copy_(torch.randn(cache.k.shape, generator=g) * 5)
        cache.v.copy_(torch.randn(cache.v.shape, generator=g) * 5)


@pytest.mark.parametrize("compile", MODES)
def test_padding_and_empty_slots_never_touch_real_entries(compile):
    """Invariant 1: one 3-token request in slot 0 of 4, one mixed step (4 decode rows, 2 lanes of C = 8).
    A prompt step opens only lanes it fills, so the step shape is forced here: a verify step and a
    warm-up have idle lanes."""
    engine = engine_for(compile)
    fill_with_garbage(engine)
    before = [c.k.clone() for c in caches(engine)]
    engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    plan = engine.scheduler.schedule()
    assert plan.busy_lanes == 1 and 2 in engine.config.lane_counts
    engine.runner.run(plan, shape=StepShape(2, engine.config.attention_length(plan.span)))
    for cache, old in zip(caches(engine), before):
        changed = (cache.k != old).any(dim=-1).any(dim=1)  # [B, S + 1 + C]: entries written
        assert changed[0, :3].all() and not changed[0, 3:S].any()  # the request's positions only
        assert not changed[1:, :S].any()  # empty slots: no real entry touched
        # idle decode rows write scratch entry S; pad t of a lane writes S + 1 + t: lane 0 (slot 0)
        # pads t = 3..7, idle lane 1 borrows slot 1 for all t
        assert changed[:, S].all() and changed[0, S + 4 :].all() and not changed[0, S + 1 : S + 4].any()
        assert changed[1, S + 1 :].all() and not changed[2:, S + 1 :].any()
    assert engine.runner.caches[0].k.shape[2] == S + 1 + C  # every index < S + 1 + C


@pytest.mark.parametrize("compile", MODES)
def test_slot_reuse_without_clearing_hides_stale_entries(compile):
    """Invariant 2: caches full of garbage (and earlier requests) do not change any output; the
    entries a slot keeps for prefix reuse are exactly the valid ones."""
    gpt = tiny_gpt("llama")
    prompts = mixed_prompts(6, [3, 12, 20])
    engine = engine_for(compile, batch_size=2)
    fill_with_garbage(engine, seed=1)
    first = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    fill_with_garbage(engine, seed=2)
    engine.reset_prefix_cache()  # written behind the engine's back: no kept entry is valid any more
    again = engine.generate(prompts[::-1], SamplingParams(max_new_tokens=6))[::-1]
    reused = engine.stats()["prompt_tokens_reused"]
    kept = engine.generate(prompts[:2], SamplingParams(max_new_tokens=6))  # the last two prompts' slots kept
    assert engine.stats()["prompt_tokens_reused"] - reused == len(prompts[0]) + len(prompts[1]) - 2
    for p, a, b in zip(prompts, first, again):
        want = litgpt_greedy(gpt, p, 6)
        assert a.token_ids == want and b.token_ids == want
    assert [r.token_ids for r in kept] == [r.token_ids for r in first[:2]]


@pytest.mark.parametrize("family", ["pythia", "llama", "gemma2", "phi2"])
def test_per_slot_positions_and_chunking_match_full_forward(family):
    """Invariants 3 and 4: each slot at its own offset, chunk boundaries anywhere, one-token feeds
    through decode rows and longer ones through lanes, the live window read at varying lengths L,
    sliding window on: logits equal litgpt's uncached full forward at every real position."""
    gpt = tiny_gpt(family, sliding_window_size=5) if family == "gemma2" else tiny_gpt(family)
    B, T = 3, 4
    program = StepProgram(gpt, B, 32, T)
    seqs = torch.randint(0, 256, (B, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = gpt.lm_head(gpt.transformer.ln_f(_full_hidden(gpt, seqs)))  # [B, 11, V]
        chunks = [[4, 4, 1, 2, 0], [1, 4, 4, 1, 1], [0, 3, 4, 1, 3]]  # tokens per step per slot (0: idle)
        got = _run_chunks(program, seqs, chunks, T)
    torch.testing.assert_close(got, reference, rtol=0, atol=2e-5)


def _full_hidden(gpt, seqs):
    """litgpt's own uncached forward, stopped before ln_f/lm_head."""
    hidden = []
    handle = gpt.transformer.ln_f.register_forward_hook(lambda m, i, o: hidden.append(i[0]))
    gpt(seqs)
    handle.remove()
    return hidden[0]


def _run_chunks(program, seqs, chunks, T):
    """Steps of B decode rows + B lanes of T rows (lane b feeds slot b), reading L = 8 * ceil(span / 8)."""
    B, S, gpt = seqs.shape[0], program.prefix.cos.shape[0], program.prefix.gpt
    done, outs = [0] * B, [[] for _ in range(B)]
    for step in range(len(chunks[0])):
        x = torch.zeros(B + B * T, dtype=torch.long)
        pos = torch.tensor([S] * B + [S + 1 + t for _ in range(B) for t in range(T)])  # pads -> scratch
        row_slot = torch.cat((torch.arange(B), torch.arange(B).repeat_interleave(T)))
        rows = []
        for b in range(B):
            n = chunks[b][step]
            first = b if n == 1 else B + b * T
            x[first : first + n] = seqs[b, done[b] : done[b] + n]
            pos[first : first + n] = torch.arange(done[b], done[b] + n)
            rows.append(range(first, first + n))
            done[b] += n
        span = max(done)
        key_pos = torch.arange(-(-span // 8) * 8)
        hidden, *shared = program.prefix(x, pos, row_slot, key_pos)
        for block in program.blocks:
            hidden = block(hidden, *shared)
        logits = gpt.lm_head(gpt.transformer.ln_f(hidden))  # [N, V]
        for b in range(B):
            outs[b].append(logits[list(rows[b])])
    return torch.stack([torch.cat(o) for o in outs])


def test_mask_follows_from_positions():
    """Invariant 4: key j visible to a row at position p iff j <= p (and within the window if any)."""
    config = tiny_gpt("gemma2", sliding_window_size=3).config
    pos = torch.tensor([0, 1, 2, 10, 5, 6, 70, 71])
    causal, windowed = visibility_masks(pos, torch.arange(72), config)
    j = torch.arange(72)
    for i, p in enumerate(pos.tolist()):
        assert torch.equal(causal[i], j <= p)
        assert torch.equal(windowed[i], (j <= p) & (j > p - 3))


def test_lm_head_runs_on_last_real_token_only():
    """Invariant 5 in eager: lm_head sees [B, C] during a mixed step of 4 + 2 * 8 rows."""
    engine = eager_engine()
    shapes = []
    engine.runner.gpt.lm_head.register_forward_hook(lambda m, i, o: shapes.append(tuple(i[0].shape)))
    engine.add_request(list(range(1, 20)), SamplingParams(max_new_tokens=2))
    engine.step()
    assert shapes == [(4, engine.runner.gpt.config.n_embd)]


@pytest.mark.parametrize("compile", MODES)
def test_seeded_sampling_is_independent_of_slot_and_batchmates(compile):
    """Invariant 7: same seed -> same tokens alone, or in another slot among other requests."""
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    prompt = [9, 8, 7, 6]
    engine = engine_for(compile)
    alone = engine.generate([prompt], params)[0].token_ids
    crowd = mixed_prompts(5, [2, 9, 17])
    others = [SamplingParams(max_new_tokens=5 + i, temperature=0.7, seed=i) for i in range(5)]
    # Admitted when the first slot frees and still running when `prompt` joins: those steps sort, alone's do not.
    others[4] = SamplingParams(max_new_tokens=20, temperature=0.7, top_p=0.8, seed=4)
    batch = engine.generate(crowd + [prompt], others + [params])[-1].token_ids
    assert alone == batch
    other_seed = engine.generate([prompt], SamplingParams(**{**_kw(params), "seed": 99}))[0]
    assert other_seed.token_ids != alone


def _kw(params):
    return dict(
        max_new_tokens=params.max_new_tokens, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p
    )


@pytest.mark.regression
@pytest.mark.fusion
def test_mixed_traffic_never_retraces_and_matches_eager(tmp_path):
    """Invariant 8, with the default executors: joins, leaves, aborts, stops and mixed sampling settings
    make the three shapes the workload needs (decode only, one lane, two lanes) and nothing more, the
    same traffic again traces nothing, every token equals the eager program's (sampling included), and
    no traced piece syncs with the host.
    A compile cache of its own: every piece is traced here, so its traces can be read."""
    engine = engine_for("thunder", cache_dir=str(tmp_path))
    want = _mixed_workload(eager_engine())
    assert _mixed_workload(engine) == want
    first = engine.stats()
    assert first["cache_misses"] == 3
    assert _mixed_workload(engine) == want
    again = engine.stats()
    counters = ("cache_misses", "thunder_traces", "traced")
    assert [again[c] for c in counters] == [first[c] for c in counters], (first, again)
    traces = execution_traces(engine.runner.step_fn)
    assert traces and [op for t in traces for op in host_syncs(t)] == []


def test_the_host_sync_check_finds_a_sync():
    """The check above on a program that does sync: a value read back with .item() inside the trace."""
    thunder = import_thunder()

    def syncing(x):
        return x * x.sum().item()

    jitted = thunder.jit(syncing)
    jitted(torch.ones(3))
    assert host_syncs(thunder.last_traces(jitted)[-1]) == ["item"]


def _mixed_workload(engine: Engine):
    prompts = mixed_prompts(9, [1, 7, 19, 30], seed=5)
    params = [
        SamplingParams(
            max_new_tokens=3 + i % 4,
            temperature=[0.0, 0.8, 1.3][i % 3],
            top_k=[None, 5, 0][i % 3],
            top_p=[1.0, 0.5, 0.9][i % 3],
            seed=i,
            stop=[[7, 7]] if i == 4 else (),
        )
        for i in range(9)
    ]
    engine.reset_prefix_cache()  # each run from the same state: no prompt reuses the last run's entries
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    results = {}
    for out in engine.step():
        results.setdefault(out.request_id, []).extend(out.token_ids)
    engine.abort(ids[2])  # leaves mid-prefill
    while engine.has_unfinished():
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.token_ids)
    return [results.get(i) for i in ids]


@pytest.mark.regression
def test_traced_step_op_count_does_not_grow_with_batch():
    """Occupancy is data: the traced program for B = 2 and B = 6 has the same operations."""
    thunder = import_thunder()
    counts = []
    for B in (2, 6):
        gpt = tiny_gpt("llama", n_layer=1).requires_grad_(False)
        jitted = thunder.jit(StepProgram(gpt, B, 16))
        zeros = torch.zeros(B, dtype=torch.long)
        args = (zeros, zeros, torch.arange(B), torch.arange(16), zeros, torch.zeros(B), zeros, torch.ones(B), zeros)
        jitted(*args)
        names = sorted(b.sym.name for b in thunder.last_traces(jitted)[-1].bound_symbols)
        counts.append(names)
    assert counts[0] == counts[1]
    assert "index_copy_" in counts[0] or "index_copy" in counts[0]

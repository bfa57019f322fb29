"""Persistent compile cache: keys, loads in a fresh process, bit-identical outputs, in-place KV
writes, and fail-safe handling of every kind of bad entry or root.

One cold run of a 1-layer model (prefix, block, head traced and stored) serves the whole file
(module fixture); everything else loads it, edits an entry on disk, or exercises the store.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

import thunder_batch.compile.cache as cc
from thunder_batch import Engine, EngineConfig, SamplingParams
from thunder_batch.cli import compile as compile_cli
from thunder_batch.compile import provenance
from thunder_batch.compile.cache import (
    FORMAT_VERSION,
    CacheKey,
    CompileCacheFiles,
    CompileCacheWarning,
    canonical_json,
    read_entry,
    resolve_root,
    sha256,
)
from thunder_batch.compile.layered import LayeredProgram
from thunder_batch.compile.step import compile_options
from thunder_batch.compile.trace_export import NotExportable, ctx_recipe
from thunder_batch.compile.traced_piece import piece_from_record
from thunder_batch.config import StepShape
from thunder_batch.native import build as native_build
from thunder_batch.step_plan import StepPlan

from helpers import tiny_gpt

CONFIG = dict(batch_size=2, max_seq_length=16, prefill_chunk=1)  # one step shape: decode rows, L = 16
PROMPTS = [[1, 2, 3], [4, 5]]
PARAMS = SamplingParams(max_new_tokens=4, temperature=0.8, top_k=100, seed=7)  # sampling: logprobs matter
# What one shape of a 1-layer model stores: prompt tokens sample nothing that counts (greedy head),
# then every request samples with a top-k above SMALL_TOP_K (the filtered head: the sort).
PIECES = {"prefix", "block", "layers", "head-filtered", "head-greedy"}
TESTS_DIR = Path(__file__).parent


def make_engine(root, n_layer: int = 1, **config) -> Engine:
    return Engine(tiny_gpt("llama", n_layer=n_layer), EngineConfig(**{**CONFIG, **config}, cache_dir=str(root)))


def outputs(results) -> list:
    return [(r.token_ids, [float(x).hex() for x in r.logprobs]) for r in results]


def entries(root: Path) -> dict[str, Path]:
    """Entry file per piece kind (one shape: one entry each)."""
    return {json.loads(p.read_text())["key"]["piece"]: p for p in sorted(root.glob("*.json"))}


def key_of_entry(path: Path) -> CacheKey:
    fields = json.loads(path.read_text())["key"]
    return CacheKey(
        **{
            k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
            for k, v in fields.items()
        }
    )


def cache_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CompileCacheWarning)]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A cold engine: every piece traced once and stored, no warning."""
    root = tmp_path_factory.mktemp("cache")
    engine = make_engine(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = engine.generate(PROMPTS, PARAMS)
    path = entries(root)["block"]
    return dict(
        root=root,
        engine=engine,
        key=key_of_entry(path),
        path=path,
        outputs=outputs(results),
        warnings=cache_warnings(caught),
    )


def test_cold_start_stores_every_piece(traced):
    assert traced["warnings"] == []
    stats = traced["engine"].stats()
    assert (stats["cache_misses"], stats["traced"], stats["disk_cache_hits"]) == (1, 4, 0)
    assert stats["programs"] == {"prefix": 1, "block": 1, "head-filtered": 1, "head-greedy": 1}
    assert set(entries(traced["root"])) == PIECES
    record, problem = read_entry(traced["path"], traced["key"])
    assert problem is None and record["fn_name"] == "computation"
    assert not list(traced["root"].glob(".*.tmp"))  # atomic writes left no temp file


def test_bad_entry_is_retraced_and_overwritten(traced, tmp_path):
    """A garbage entry: one warning, that piece alone is traced again and its entry rewritten."""
    root = copy_root(traced["root"], tmp_path)
    head = root / entries(traced["root"])["head-filtered"].name
    head.write_bytes(b"\x00garbage")
    engine = make_engine(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert outputs(engine.generate(PROMPTS, PARAMS)) == traced["outputs"]
    messages = cache_warnings(caught)
    assert len(messages) == 1 and "truncated" in messages[0], messages
    stats = engine.stats()
    assert (stats["traced"], stats["disk_cache_hits"]) == (1, 3)  # the head traced; the rest loaded
    assert read_entry(head, key_of_entry(head))[1] is None  # rewritten whole


def copy_root(source: Path, tmp_path) -> Path:
    """A private copy of the compile cache entries at `source`, under tmp_path / "cache"."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    for path in source.glob("*.json"):
        shutil.copy(path, root)
        (root / path.name).chmod(0o600)
    return root


def test_fresh_process_loads_bit_identical_outputs(traced):
    script = textwrap.dedent(f"""
        import json, sys, warnings
        sys.path.insert(0, {str(TESTS_DIR)!r})
        from thunder_batch.compile.cache import CompileCacheWarning
        warnings.simplefilter("error", CompileCacheWarning)
        from helpers import use_defaults_without_fusion
        use_defaults_without_fusion()  # as in this process (conftest)
        from test_compile_cache import make_engine, outputs, PROMPTS, PARAMS
        engine = make_engine({str(traced["root"])!r})
        results = engine.generate(PROMPTS, PARAMS)
        print(json.dumps(dict(outputs=outputs(results), stats=engine.stats())))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [list(map(list, o)) for o in traced["outputs"]] == loaded["outputs"]
    stats = loaded["stats"]
    assert (stats["cache_misses"], stats["traced"], stats["disk_cache_hits"]) == (1, 0, 4)  # loaded, not traced


@torch.no_grad()
def test_loaded_block_matches_traced_block_and_writes_cache_in_place(traced):
    runner = traced["engine"].runner
    (block_piece,) = [p for p in runner.step_fn.pieces if p.record and p.record["writes"]]
    twin = copy.deepcopy(runner.program)  # same weights and cache contents, separate buffers
    record, _ = read_entry(traced["path"], traced["key"])
    loaded = piece_from_record(record).bind(twin.blocks[0])
    idx, pos = torch.tensor([9, 10]), torch.tensor([5, 3])  # real tokens at real positions, one per slot
    args = twin.prefix(idx, pos, torch.arange(2), torch.arange(16))
    cache = twin.blocks[0].cache
    before = cache.k[:, :, 5].clone()
    want, got = block_piece.jitted(*args), loaded(*args)
    assert torch.equal(want, got)
    original = runner.program.blocks[0].cache
    assert torch.equal(original.k, cache.k) and torch.equal(original.v, cache.v)
    assert not torch.equal(cache.k[:, :, 5], before)  # written in place by the loaded program
    assert [id(b) for b in loaded.writes] == [id(cache.k), id(cache.v)]  # found from the trace


# -- keys -------------------------------------------------------------------------------------
def test_every_key_field_changes_the_digest(traced):
    key = traced["key"]
    for field in dataclasses.fields(CacheKey):
        value = getattr(key, field.name)
        if isinstance(value, int):
            other = value + 1
        else:
            other = (*value, ("x", "y")) if isinstance(value, tuple) else value + "x"
        assert dataclasses.replace(key, **{field.name: other}).digest() != key.digest(), field.name


@pytest.mark.parametrize(
    "change",
    [
        "batch_size",
        "max_seq_length",
        "prefill_chunk",
        "executors",
        "model",
        "dtype",
        "versions",
        "source",
        "codegen",
        "native_kernels",
    ],
)
def test_key_follows_what_the_program_depends_on(traced, change, tmp_path, monkeypatch):
    def key_of(engine, shape=None):  # the prefix's key: every field but the piece's own
        idx, input_pos, _, key_pos, *_ = engine.runner.inputs_for(StepPlan([]), shape)
        return engine.runner.step_fn.cache.key("prefix", "", (idx, input_pos, key_pos))

    base = key_of(make_engine(tmp_path))
    if change in ("batch_size", "max_seq_length"):
        engine = make_engine(tmp_path, **{change: CONFIG[change] * 2})
    elif change == "prefill_chunk":  # adds a mixed shape with lanes of 4 (and scratch room) next to decode
        engine = make_engine(tmp_path, prefill_chunk=4)
        assert key_of(engine, StepShape(2, 16)) not in (base, key_of(engine))
    elif change == "executors":
        engine = make_engine(tmp_path, executors=("torch", "python"))
    elif change == "model":
        engine = make_engine(tmp_path, n_layer=2)
    elif change == "dtype":
        gpt = tiny_gpt("llama", n_layer=1).to(torch.bfloat16)
        engine = Engine(gpt, EngineConfig(**CONFIG, cache_dir=str(tmp_path)))
    elif change == "versions":
        engine = make_engine(tmp_path)
        monkeypatch.setattr(cc, "versions", lambda: (("torch", "0.0.0"),))
    elif change == "source":  # what the copied-package tests (test_provenance.py) change for real
        engine = make_engine(tmp_path)
        monkeypatch.setattr(provenance, "source_digest", lambda: sha256("an edited sampler"))
    elif change == "codegen":  # a cache shared with a machine of another ISA
        engine = make_engine(tmp_path)
        monkeypatch.setattr(provenance, "codegen", lambda device_type: "another ISA and compiler")
    else:  # a program traced while the native kernels' build failed claims no linear
        engine = make_engine(tmp_path)
        monkeypatch.setattr(native_build, "unavailable", lambda: "build failed: no compiler")
    assert key_of(engine) != base


def test_cuda_graphs_load_the_pieces_a_plain_engine_stored(traced):
    """cuda_graphs=True changes no piece (the graph is taken around the composed step, compile/cuda_graphs.py):
    a layered program made for that config finds and loads every entry the plain engine stored."""
    engine = traced["engine"]
    config = dataclasses.replace(engine.config, cuda_graphs=True)
    program = copy.deepcopy(engine.runner.program)
    layered = LayeredProgram(program, config, compile_options(config), CompileCacheFiles(traced["root"]))
    args = tuple(engine.runner.inputs_for(StepPlan([])))
    for head in ("filtered", "greedy"):
        layered(*args, head=head)
    stats = layered.stats()
    assert (stats["traced"], stats["disk_cache_hits"]) == (0, 4), stats


def test_a_stored_piece_is_checked_on_real_rows_before_it_runs(traced, tmp_path, monkeypatch):
    """A warm-up step's rows are padding (position S, past every entry read). Here the eager step hides
    from each row its own position's entry (a stale read: the bug a fusion once had), which changes
    real rows only: the stored prefix must disagree with it on a probe step whose rows are real, so the
    check rejects the entry (one warning) and the prefix is traced again."""
    from thunder_batch import model

    visible = model.visibility_masks

    def stale(input_pos, key_pos, config):
        return [m & (key_pos < input_pos.unsqueeze(-1)) for m in visible(input_pos, key_pos, config)]

    monkeypatch.setattr(model, "visibility_masks", stale)
    engine = make_engine(copy_root(traced["root"], tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.runner.warm(engine.config.step_shapes[0], ("greedy",))
    messages = cache_warnings(caught)
    assert len(messages) == 1 and "load-time check" in messages[0], messages
    stats = engine.stats()
    assert stats["traced"] == 1 and stats["disk_cache_hits"] == 2, stats  # the prefix traced; block, head loaded


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuda_graphs=True needs a CUDA device; there is none here")
def test_a_cuda_graphs_engine_gives_eager_tokens_from_stored_pieces(tmp_path):
    """A real engine with cuda_graphs=True over pieces a plain engine stored: the eager engine's greedy
    tokens, every step after a shape's first replayed from its CUDA graph, nothing traced again."""
    plain = Engine(tiny_gpt("llama", n_layer=1).cuda(), EngineConfig(**CONFIG, cache_dir=str(tmp_path)))
    greedy = SamplingParams(max_new_tokens=4)
    want = [r.token_ids for r in plain.generate(PROMPTS, greedy)]
    config = EngineConfig(**CONFIG, cuda_graphs=True, cache_dir=str(tmp_path))
    engine = Engine(tiny_gpt("llama", n_layer=1).cuda(), config)
    eager = Engine(tiny_gpt("llama", n_layer=1).cuda(), EngineConfig(**CONFIG, compile="eager"))
    assert [r.token_ids for r in engine.generate(PROMPTS, greedy)] == want
    assert want == [r.token_ids for r in eager.generate(PROMPTS, greedy)]
    stats = engine.stats()
    assert stats["traced"] == 0 and stats["disk_cache_hits"] > 0 and stats["cuda_graphs"]["replays"] > 0, stats


def test_root_resolution(monkeypatch):
    monkeypatch.delenv("THUNDER_BATCH_CACHE_DIR", raising=False)
    assert resolve_root(None) == Path("compile_cache")
    monkeypatch.setenv("THUNDER_BATCH_CACHE_DIR", "/env/root")
    assert resolve_root(None) == Path("/env/root")
    assert resolve_root("/flag/root") == Path("/flag/root")


# -- bad entries and roots: each is a miss with exactly one warning ------------------------------
def rehash(body: dict) -> dict:
    body.pop("sha256", None)
    body["sha256"] = sha256(canonical_json(body))
    return body


def edit_source(old: str, new: str):
    """A valid entry for a wrong program: the last `old` in the code (not in a comment) becomes `new`."""

    def edit(body):
        body["record"]["source"] = new.join(body["record"]["source"].rsplit(old, 1))
        return rehash(body)

    return edit


DAMAGE = {
    "truncated": (lambda text: text[: len(text) // 2], "truncated"),
    "corrupt": (lambda text: text.replace("torch.", "torcH.", 1), "content hash mismatch"),
    "stale format": (lambda body: rehash({**body, "format": FORMAT_VERSION - 1}), "stale format"),
    "stale version": (lambda body: rehash({**body, "key": {**body["key"], "versions": [["torch", "0.0"]]}}), "stale"),
    "unloadable": (
        lambda body: rehash(
            {
                **body,
                "record": {**body["record"], "ctx": {**body["record"]["ctx"], "torch": ["module", "no_such_module"]}},
            }
        ),
        "unloadable",
    ),
    "wrong outputs": (edit_source("return (", "return (lambda *outs: tuple(o + 1 for o in outs))("), "outputs differ"),
    "not in place": (lambda body: writes_to_copies(body), "KV cache writes"),
}


def writes_to_copies(body: dict) -> dict:
    """The block's KV cache writes go to copies that attention reads, never copied back: in the one-op
    decode attention (a decode-only step's), else in the last index_copy and its copy_ back."""
    if "= thunder_batch_decode_rows_attention(" in body["record"]["source"]:
        op = "thunder_batch_decode_rows_attention"
        return edit_source(
            f"= {op}(", f"= (lambda q, k, v, ck, cv, *rest: {op}(q, k, v, ck.clone(), cv.clone(), *rest))("
        )(body)
    return edit_source("= copy_(", "= (lambda a, b, grad_enabled: a)(")(
        edit_source(
            "= thunder_batch_index_copy_into(",
            "= (lambda a, dim, index, src: a.clone().index_copy_(dim, index, src))(",
        )(body)
    )


def fresh_engine_with_entry(traced, tmp_path, text: str):
    """An engine on a copy of the sound cache whose block entry holds `text`."""
    root = copy_root(traced["root"], tmp_path)
    (root / traced["path"].name).write_text(text)
    return make_engine(root)


def step_with_warnings(engine):
    """One padding-only step; the compile-cache warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.runner.run(StepPlan([]), head="filtered")
    return cache_warnings(caught)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_entry_is_a_miss_with_one_warning(traced, tmp_path, kind):
    damage, expected = DAMAGE[kind]
    text = traced["path"].read_text()
    text = damage(text) if kind in ("truncated", "corrupt") else canonical_json(damage(json.loads(text)))
    engine = fresh_engine_with_entry(traced, tmp_path, text)
    messages = step_with_warnings(engine)
    assert len(messages) == 1 and expected in messages[0], messages
    stats = engine.stats()
    assert stats["traced"] == 1  # the block retraced
    assert stats["programs"] == {"prefix": 1, "block": 1, "head-filtered": 1}


def test_a_lane_step_block_writing_to_copies_is_a_miss_with_one_warning(tmp_path):
    """A prompt-lane step's block writes its KV entries with index copies (the one-op decode attention is
    for decode-only steps): written to copies that are never copied back, its stored entry fails the
    load-time check."""
    engine = make_engine(tmp_path / "cold", prefill_chunk=4)
    tokens = [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]
    blocks = [p for p in (tmp_path / "cold").glob("*.json") if json.loads(p.read_text())["key"]["piece"] == "block"]
    lane_block = next(p for p in blocks if "= thunder_batch_index_copy_into(" in p.read_text())
    root = copy_root(tmp_path / "cold", tmp_path)
    (root / lane_block.name).write_text(canonical_json(writes_to_copies(json.loads(lane_block.read_text()))))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = [r.token_ids for r in make_engine(root, prefill_chunk=4).generate(PROMPTS, PARAMS)]
    messages = cache_warnings(caught)
    assert len(messages) == 1 and "KV cache writes" in messages[0], messages
    assert again == tokens  # the block retraced: the same tokens


def test_a_stored_block_is_checked_on_its_first_layer_only_and_serves_the_rest(tmp_path, monkeypatch):
    """The load-time check runs the eager layer beside the stored block at the step's full shape (at B=64,
    checking every layer took 40 of a 53 s warm start): once per loaded block, on the first layer it
    serves; later layers pass the same prologue checks and run the same program. A damaged block is still
    caught there (`test_damaged_entry_is_a_miss_with_one_warning`)."""
    import thunder_batch.compile.layered as layered

    cold = make_engine(tmp_path / "cold", n_layer=3)
    tokens = [r.token_ids for r in cold.generate(PROMPTS, PARAMS)]
    checked = []

    def counting(bound, module, *args, **kw):
        checked.append(type(module).__name__)
        return check(bound, module, *args, **kw)

    check = layered.checked_call
    monkeypatch.setattr(layered, "checked_call", counting)
    warm = make_engine(copy_root(tmp_path / "cold", tmp_path), n_layer=3)
    assert [r.token_ids for r in warm.generate(PROMPTS, PARAMS)] == tokens
    assert warm.stats()["traced"] == 0
    blocks = [name for name in checked if name == type(warm.runner.program.blocks[0]).__name__]
    assert len(blocks) == warm.stats()["programs"]["block"] >= 1, (checked, warm.stats())  # per piece, not layer


def test_missing_entry_is_a_plain_miss(tmp_path):
    """No entry yet is the normal cold start: traced and stored, no warning."""
    engine = make_engine(tmp_path)
    assert step_with_warnings(engine) == [] and engine.stats()["traced"] == 3


def test_sound_entry_loads_without_warning(traced, tmp_path):
    engine = fresh_engine_with_entry(traced, tmp_path, traced["path"].read_text())
    assert step_with_warnings(engine) == []
    assert (engine.stats()["traced"], engine.stats()["disk_cache_hits"]) == (0, 3)


@pytest.mark.parametrize("target", ["root", "entry"])
def test_paths_others_can_write_are_refused(traced, tmp_path, target):
    """Entries are code that will run: a group/other-writable root or entry is never loaded."""
    fresh_engine_with_entry(traced, tmp_path, traced["path"].read_text())
    key, root = traced["key"], tmp_path / "cache"
    (root if target == "root" else root / traced["path"].name).chmod(0o777 if target == "root" else 0o666)
    with pytest.warns(CompileCacheWarning, match="writable by group or others") as caught:
        assert CompileCacheFiles(root).load(key) is None
    assert len(caught) == 1


def test_read_only_root_falls_back_to_memory(traced, tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    store = CompileCacheFiles(tmp_path)
    monkeypatch.setattr(cc.tempfile, "mkstemp", read_only)
    record, _ = read_entry(traced["path"], None)
    with pytest.warns(CompileCacheWarning, match="not writable") as caught:
        assert not store.save(traced["key"], record)
        assert not store.save(traced["key"], record)  # warned once, then memory only
    assert len(caught) == 1 and not store.writable and not list(tmp_path.iterdir())


def test_uncreatable_root_falls_back_to_memory(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.warns(CompileCacheWarning, match="cannot create"):
        store = CompileCacheFiles(tmp_path / "file" / "cache")
    assert not store.readable and not store.writable


def test_concurrent_writers_leave_one_valid_entry(traced, tmp_path):
    """Two processes storing the same key at once (as two engines finishing the same trace would)."""
    script = textwrap.dedent(f"""
        import importlib.util, json, sys
        # The store module alone (stdlib only): these writers start in milliseconds, so they overlap.
        spec = importlib.util.spec_from_file_location("cc", {str(Path(cc.__file__))!r})
        cc = sys.modules["cc"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cc)
        body = json.load(open({str(traced["path"])!r}))
        key = cc.CacheKey(**{{k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                             if isinstance(v, list) else v for k, v in body["key"].items()}})
        store = cc.CompileCacheFiles({str(tmp_path)!r})
        assert store.path(key).name == {traced["path"].name!r}
        for _ in range(20):
            assert store.save(key, body["record"])
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True) for _ in range(2)]
    path = tmp_path / traced["path"].name
    while any(p.poll() is None for p in procs):  # a reader racing the writers never sees a torn entry
        if path.exists():
            assert read_entry(path, traced["key"])[1] is None
        time.sleep(0.01)
    assert [p.wait() for p in procs] == [0, 0], [p.stderr.read()[-2000:] for p in procs]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # one entry, no temp files left
    assert read_entry(path, traced["key"])[1] is None


def test_fusion_regions_are_not_stored():
    """torch.compile and nvFuser regions are compiled objects, not source: such programs stay in memory."""
    with pytest.raises(NotExportable, match="torch.compile"):
        ctx_recipe("TorchCompile0", lambda *args: args)  # named as Thunder names its regions
    with pytest.raises(NotExportable, match="nvFuser"):
        ctx_recipe("nvFusion0", object())
    with pytest.raises(NotExportable, match="not importable"):
        ctx_recipe("helper", lambda x: x)
    assert ctx_recipe("torch", torch) == ["module", "torch"]


@pytest.mark.slow
def test_torchcompile_programs_run_but_are_not_stored(tmp_path):
    """The torchcompile executor's regions are Inductor closures: the engine runs, warns, stores nothing."""
    engine = make_engine(tmp_path, executors=("torchcompile", "torch", "python"))
    with pytest.warns(CompileCacheWarning, match="torch.compile"):
        engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=1))
    assert engine.stats()["not_stored"] == 3
    assert not list(tmp_path.glob("*.json"))


def test_compile_command_lists_and_clears(traced, tmp_path, capsys):
    root = copy_root(traced["root"], tmp_path)
    (root / "damaged.json").write_text("{")
    (root / ".left.tmp").write_text("")
    (root / "README.md").write_text("kept")
    compile_cli.compile_command(list=True, cache_dir=str(root))
    out = capsys.readouterr().out
    assert "6 entries" in out and "B=2 N=2 S=16" in out and out.count(" ok") == 5 and "BAD" in out
    assert all(f"  {piece} " in out for piece in PIECES)
    compile_cli.compile_command(clear=True, cache_dir=str(root))
    assert [p.name for p in root.iterdir()] == ["README.md"]


@pytest.mark.slow
def test_two_engines_compiling_the_same_key_at_once(traced, tmp_path):
    """Each traces what it does not find stored and may load a piece the other has just stored: no
    warning either way, one sound entry per piece, and both give the outputs of a single engine."""
    script = textwrap.dedent(f"""
        import json, sys, warnings
        sys.path.insert(0, {str(TESTS_DIR)!r})
        from thunder_batch.compile.cache import CompileCacheWarning
        warnings.simplefilter("error", CompileCacheWarning)
        from helpers import use_defaults_without_fusion
        use_defaults_without_fusion()  # as in this process (conftest)
        from test_compile_cache import make_engine, outputs, PROMPTS, PARAMS
        engine = make_engine({str(tmp_path)!r})
        print(json.dumps(dict(outputs=outputs(engine.generate(PROMPTS, PARAMS)))))
    """)
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    for out, _ in results:
        got = json.loads(out.strip().splitlines()[-1])
        assert got["outputs"] == [list(map(list, o)) for o in traced["outputs"]]
    assert set(entries(tmp_path)) == PIECES and len(list(tmp_path.iterdir())) == len(PIECES)  # no temp files
    assert all(read_entry(entry, None)[1] is None for entry in tmp_path.iterdir())

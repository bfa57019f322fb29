"""Measure llguidance and xgrammar as the engine's constrained-decoding backend, on this CPU.

Per library: tokenizer-info build time; compile time of 21 JSON schemas, a regex and a choice list; a walk through
a valid instance of each (each step: forced tokens if any, else fill the int32 mask row, take the longest allowed
token that continues the text, advance; EOS last), checked with jsonschema, then again after reset(); one batched
fill; and whether a thread doing long mask fills stalls a Python main thread (the GIL). llguidance and jsonschema come
with `make install`; a library not installed is skipped. xgrammar installs beside the pinned torch without its triton
dependency (`.venv/bin/pip install --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2`):
    .venv/bin/python benchmarks/grammar_libraries.py --tokenizer checkpoints/SmolLM2-135M-Instruct/tokenizer.json
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import re
import subprocess
import threading
import time

import jsonschema
import numpy as np
import tokenizers

STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
CHOICES, PHONE = ["positive", "negative", "neutral"], r"\(\d{3}\) \d{3}-\d{4}"


def obj(props: dict, required: list | None = None) -> dict:
    """A closed object (additionalProperties false, so both libraries force each key), all keys required."""
    req = list(props) if required is None else required
    return {"type": "object", "properties": props, "required": req, "additionalProperties": False}


def arr(items: dict, **kw) -> dict:
    return {"type": "array", "items": items, **kw}


def rng(lo: int, hi: int | None = None) -> dict:
    return {"type": "integer", "minimum": lo} | ({} if hi is None else {"maximum": hi})


REF, PT, ITEM = {"$ref": "#/$defs/pt"}, obj({"x": INT, "y": INT}), obj({"sku": STR, "qty": rng(1)})
SHAPES = [obj({"kind": {"const": "circle"}, "r": NUM}), obj({"kind": {"const": "rect"}, "w": NUM, "h": NUM})]
TOOL = obj({"name": {"enum": ["search", "fetch_url", "calc"]}, "arguments": obj({"query": STR, "limit": rng(1, 50)})})
NEST = obj({"u": obj({"id": INT, "p": obj({"email": STR, "ok": BOOL})})})
LONG = "The quick brown fox jumps over the lazy dog, then naps at the café near the river bank."
# (name, schema, valid instance); an instance's keys follow its schema's property order.
JSON_CASES = [
    ("flat", obj({"name": STR, "age": INT}), {"name": "Ada Lovelace", "age": 36}),
    ("int_range", obj({"score": rng(0, 100)}), {"score": 87}),
    ("enum", obj({"color": {"enum": ["red", "green", "blue"]}}), {"color": "green"}),
    ("nested", NEST, {"u": {"id": 7, "p": {"email": "a@b", "ok": True}}}),
    ("array_ints", obj({"values": arr(INT, minItems=1, maxItems=5)}), {"values": [3, 1, 4]}),
    ("array_objs", obj({"items": arr(ITEM)}), {"items": [{"sku": "A1", "qty": 2}, {"sku": "B", "qty": 1}]}),
    ("optional", obj({"title": STR, "sub": STR, "tags": arr(STR)}, ["title"]), {"title": "Q3", "tags": ["a", "b"]}),
    ("anyof_scalar", obj({"value": {"anyOf": [INT, STR]}}), {"value": "n/a"}),
    ("pattern", obj({"date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}}), {"date": "2024-02-29"}),
    ("numbers", obj({"lat": NUM, "lon": NUM}), {"lat": 48.8566, "lon": -2.35}),
    ("bool_null", obj({"flag": BOOL, "note": {"type": "null"}}), {"flag": False, "note": None}),
    ("const", obj({"version": {"const": "v1"}, "mode": {"enum": ["fast", "slow"]}}), {"version": "v1", "mode": "slow"}),
    ("str_len", obj({"code": {"type": "string", "minLength": 3, "maxLength": 6}}), {"code": "XK42"}),
    ("enum_ints", obj({"level": {"enum": [1, 2, 3]}}), {"level": 2}),
    ("tool_call", TOOL, {"name": "search", "arguments": {"query": "weather in Paris", "limit": 5}}),
    ("enum_array", obj({"tags": arr({"enum": ["a", "b", "c"]}, maxItems=3)}), {"tags": ["b", "a"]}),
    ("deep", obj({"a": obj({"b": obj({"c": obj({"d": STR})})})}), {"a": {"b": {"c": {"d": "leaf"}}}}),
    ("anyof_objs", obj({"shape": {"anyOf": SHAPES}}), {"shape": {"kind": "rect", "w": 2.5, "h": 4}}),
    ("refs", obj({"a": REF, "b": REF}) | {"$defs": {"pt": PT}}, {"a": {"x": 0, "y": 1}, "b": {"x": -3, "y": 12}}),
    ("top_array", arr(obj({"k": STR, "v": INT})), [{"k": "a", "v": 1}, {"k": "bb", "v": 22}]),
    ("long_string", obj({"summary": STR}), {"summary": LONG}),
]


def cases() -> list[tuple]:
    """(name, kind, spec, target text, check(text) -> bool) for every JSON case, the regex and the choice list."""
    out = []
    for name, schema, inst in JSON_CASES:
        jsonschema.validate(inst, schema)
        text = json.dumps(inst, separators=(",", ":"), ensure_ascii=False)
        out.append((name, "json", schema, text, lambda t, s=schema: jsonschema.validate(json.loads(t), s) is None))
    out.append(("regex_phone", "regex", PHONE, "(555) 123-4567", lambda t: re.fullmatch(PHONE, t) is not None))
    return out + [("choice", "choice", CHOICES, "negative", lambda t: t in CHOICES)]


class Llg:
    """The calls the engine would make, in llguidance."""

    name = "llguidance"

    def __init__(self, tok: tokenizers.Tokenizer, eos: int):
        import llguidance as llg
        import llguidance.numpy as lnp

        self.llg, self.eos, self.tok = llg, eos, llg.LLTokenizer(tok.to_str(), eos_token=eos)
        self.fill = lambda m, bm: lnp.fill_next_token_bitmask(m, bm, 0)
        self.forced = lambda m: m.compute_ff_tokens()
        # consume_tokens([eos]) on a stopped matcher is an error; consume_token(eos) is accepted
        self.advance = lambda m, ts: m.consume_token(ts[0]) if len(ts) == 1 else m.consume_tokens(ts)
        self.done = lambda m: m.is_stopped() and not m.is_error()
        self.copy = lambda m: m.deep_copy()
        ex = llg.LLExecutor(num_threads=1)
        self.batch_fill = lambda ms, bm: lnp.fill_next_token_bitmask_par(ex, [(m, i) for i, m in enumerate(ms)], bm)

    def compile(self, kind: str, spec):
        if kind == "json":
            ws = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
            grammar = self.llg.LLMatcher.grammar_from_json_schema(spec, overrides=ws)
        else:
            grammar = self.llg.grammar_from(kind, spec if kind == "regex" else json.dumps(spec))
        m = self.llg.LLMatcher(self.tok, grammar)
        assert not m.is_error(), m.get_error()
        return m


class Xgr:
    """The calls the engine would make, in xgrammar."""

    name = "xgrammar"

    def __init__(self, tok: tokenizers.Tokenizer, eos: int):
        import xgrammar as xgr

        vocab = [s for s, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=len(vocab), stop_token_ids=[eos])
        self.xgr, self.eos, self.compiler = xgr, eos, xgr.GrammarCompiler(info, max_threads=2)
        self.fill = lambda m, bm: m.fill_next_token_bitmask(bm, 0)
        self.forced = lambda m: m.find_jump_forward_tokens()
        self.advance = lambda m, ts: all(m.accept_token(t) for t in ts)
        self.done = lambda m: m.is_terminated()
        self.copy = lambda m: m.fork()
        batcher = xgr.BatchGrammarMatcher(max_threads=1)
        self.batch_fill = lambda ms, bm: batcher.batch_fill_next_token_bitmask(ms, bm)

    def compile(self, kind: str, spec):
        if kind == "json":
            compiled = self.compiler.compile_json_schema(spec, any_whitespace=False, separators=(",", ":"))
        elif kind == "regex":
            compiled = self.compiler.compile_regex(spec)
        else:
            compiled = self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
        return self.xgr.GrammarMatcher(compiled)


def vocab_bytes(tok: tokenizers.Tokenizer) -> dict[bytes, int]:
    """bytes -> token id for the ordinary (byte-level BPE) tokens, via GPT-2's byte<->unicode table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = [b for b in range(256) if b not in bs]
    dec = {chr(c): b for b, c in zip(bs + extra, bs + [256 + k for k in range(len(extra))])}
    special = set(tok.get_added_tokens_decoder())
    return {bytes(dec[ch] for ch in s): i for s, i in tok.get_vocab().items() if i not in special}


def allowed(bm: np.ndarray, t: int) -> bool:
    return bool((int(bm[0, t >> 5]) >> (t & 31)) & 1)


def pick(bm: np.ndarray, rest: bytes, vb: dict[bytes, int], maxlen: int) -> int | None:
    """The longest allowed vocab token that is a prefix of the remaining target bytes."""
    ts = (vb.get(rest[:k]) for k in range(min(len(rest), maxlen), 0, -1))
    return next((t for t in ts if t is not None and allowed(bm, t)), None)


def walk(lib, m, target: str, vb: dict, st: dict) -> list[int]:
    """Drive the matcher through target, then EOS; returns the tokens consumed before EOS."""
    rest, out, inv, maxlen = target.encode(), [], {i: b for b, i in vb.items()}, max(map(len, vb))
    bm = np.zeros((1, st["words"]), dtype=np.int32)
    while True:
        t0 = time.perf_counter()
        ff = lib.forced(m)
        st["ff"].append(time.perf_counter() - t0)
        if ff and rest:
            ff_bytes = b"".join(inv[t] for t in ff)
            assert rest.startswith(ff_bytes) and lib.advance(m, ff), f"bad forced tokens {ff_bytes!r}"
            rest, out, st["forced"] = rest[len(ff_bytes) :], out + ff, st["forced"] + len(ff)
            continue
        t0 = time.perf_counter()
        lib.fill(m, bm)
        st["mask"].append(time.perf_counter() - t0)
        t = pick(bm, rest, vb, maxlen) if rest else (lib.eos if allowed(bm, lib.eos) else None)
        assert t is not None, f"no allowed token continues {rest[:20]!r}"
        t0 = time.perf_counter()
        assert lib.advance(m, [t]), f"token {t} rejected"
        st["advance"].append(time.perf_counter() - t0)
        if not rest:
            assert lib.done(m), "matcher not finished after EOS"
            return out
        rest, out = rest[len(inv[t]) :], out + [t]


def run_lib(lib, tok: tokenizers.Tokenizer, vb: dict) -> tuple[list[dict], list]:
    """Per case: compile time, one cold walk, one warm walk (after reset). Also the matchers half way through."""
    rows, halves, words = [], [], (tok.get_vocab_size() + 31) // 32
    for name, kind, spec, target, check in cases():
        st = {"name": name, "mask": [], "warm": [], "ff": [], "advance": [], "forced": 0, "words": words}
        t0 = time.perf_counter()
        m = lib.compile(kind, spec)
        st["compile"] = time.perf_counter() - t0
        try:
            out = walk(lib, m, target, vb, st)
            st["valid"] = tok.decode(out, skip_special_tokens=False) == target and check(target)
            m.reset()
            warm = {**st, "mask": [], "ff": [], "advance": [], "forced": 0}
            walk(lib, m, target, vb, warm)
            st["warm"] = warm["mask"]
            halves.append(lib.compile(kind, spec))
            lib.advance(halves[-1], out[: len(out) // 2])
        except Exception as e:  # a failure is a result here: report it and go on
            st["valid"], st["error"] = False, f"{type(e).__name__}: {e}"[:160]
        st["steps"] = len(st["advance"]) + st["forced"]
        rows.append(st)
    return rows, halves


def batch_and_gil(lib, ms: list, words: int) -> dict:
    """One batched fill of all rows vs a loop of single-row fills; then the longest main-thread stall while a
    thread runs long batched fills (about the call time: the call holds the GIL; much less: it releases it)."""
    bm = np.zeros((len(ms), words), dtype=np.int32)
    lib.batch_fill(ms, bm)  # warm-up
    t0 = time.perf_counter()
    lib.batch_fill(ms, bm)
    t1 = time.perf_counter()
    for i, m in enumerate(ms):
        lib.fill(m, bm[i : i + 1])
    t2 = time.perf_counter()
    big = [lib.copy(m) for m in ms for _ in range(100)]
    bm_big = np.zeros((len(big), words), dtype=np.int32)
    stop, calls = threading.Event(), []

    def spin():
        while not stop.is_set():
            t0 = time.perf_counter()
            lib.batch_fill(big, bm_big)
            calls.append(time.perf_counter() - t0)

    th = threading.Thread(target=spin)
    th.start()
    stall, last, end = 0.0, time.perf_counter(), time.perf_counter() + 1.0
    while (now := time.perf_counter()) < end:  # the main thread: pure Python, needs the GIL
        stall, last = max(stall, now - last), now
    stop.set()
    th.join()
    gil = f"{stall * 1e3:.0f}/{np.median(calls) * 1e3:.0f}" if calls else "thread failed"
    return {"B": len(ms), "batch_ms": (t1 - t0) * 1e3, "serial_ms": (t2 - t1) * 1e3, "gil": gil}


def us(xs: list[float], q: float) -> str:
    return f"{np.percentile(xs, q) * 1e6:.0f}" if xs else "-"


def table(header: list[str], rows: list[list]) -> None:
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(x) for x in row) + " |")


def report(results: dict) -> None:
    head = ["case", "lib", "compile ms", "steps", "forced", "mask p50 us", "mask max us", "warm max us", "ff p50 us"]
    rows = []
    for i in range(len(cases())):
        for lib, r in results.items():
            s = r["rows"][i]
            ok = "yes" if s["valid"] else "NO " + s.get("error", "")
            cells = [us(s["mask"], 50), us(s["mask"], 100), us(s["warm"], 100), us(s["ff"], 50), us(s["advance"], 50)]
            rows.append([s["name"], lib, f"{s['compile'] * 1e3:.2f}", s["steps"], s["forced"], *cells, ok])
    table(head + ["advance p50 us", "ok"], rows)
    head = ["lib", "version", "tok info s", "compile p50/max ms", "mask p50/p99 us", "warm p50/p99 us", "ff p50 us"]
    head += ["advance p50 us", "forced/total", "valid", "batch of B: ms", "B single fills: ms", "GIL: stall/call ms"]
    rows = []
    for lib, r in results.items():
        rs, bg = r["rows"], r["bg"]
        cat = {k: [x for s in rs for x in s[k]] for k in ("mask", "warm", "ff", "advance")}
        comp = [s["compile"] * 1e3 for s in rs]
        forced, total = sum(s["forced"] for s in rs), sum(s["steps"] for s in rs)
        rows.append([lib, r["version"], f"{r['tok_s']:.3f}", f"{np.median(comp):.2f}/{max(comp):.2f}"])
        rows[-1] += [f"{us(cat[k], 50)}/{us(cat[k], 99)}" for k in ("mask", "warm")] + [us(cat["ff"], 50)]
        rows[-1] += [us(cat["advance"], 50), f"{forced}/{total}", f"{sum(s['valid'] for s in rs)}/{len(rs)}"]
        rows[-1] += [f"{bg['B']}: {bg['batch_ms']:.2f}", f"{bg['serial_ms']:.2f}", bg["gil"]]
    table(head, rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="path to tokenizer.json")
    ap.add_argument("--eos", default="<|im_end|>", help="EOS token text")
    args = ap.parse_args()
    subprocess.run("lscpu | grep Flags", shell=True, check=False)
    tok = tokenizers.Tokenizer.from_file(args.tokenizer)
    eos, vb, results = tok.token_to_id(args.eos), vocab_bytes(tok), {}
    for cls in (Llg, Xgr):
        try:
            version, _ = importlib.metadata.version(cls.name), importlib.import_module(cls.name)
        except (ImportError, importlib.metadata.PackageNotFoundError) as e:
            print(f"{cls.name}: not available ({e})")
            continue
        t0 = time.perf_counter()
        lib = cls(tok, eos)
        tok_s = time.perf_counter() - t0
        rows, halves = run_lib(lib, tok, vb)
        bg = batch_and_gil(lib, halves, (tok.get_vocab_size() + 31) // 32)
        results[cls.name] = {"version": version, "tok_s": tok_s, "rows": rows, "bg": bg}
    report(results)


if __name__ == "__main__":
    main()

"""The native CPU kernels: exact against torch's linear, and a build that a killed build never blocks."""

import fnmatch
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from thunder_batch.native import build


def test_a_killed_build_leaves_no_lasting_lock(tmp_path):
    """torch's builder waits forever on the baton file a killed build leaves; ours clears it first."""
    build_dir = tmp_path / "py_cpu" / build.build_name()
    build_dir.mkdir(parents=True)
    (build_dir / build.TORCH_BATON).touch()  # what a build killed midway leaves behind
    with build.locked_build_dir(build_dir):
        assert not (build_dir / build.TORCH_BATON).exists()
    assert (build_dir / "thunder_batch.flock").exists()


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
def test_a_fresh_process_builds_past_a_stale_baton_and_a_cut_short_source(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    ask = f"from torch.utils.cpp_extension import _get_build_directory as g; print(g({build.build_name()!r}, False))"
    where = [sys.executable, "-c", ask]
    build_dir = subprocess.run(where, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert build_dir.startswith(str(tmp_path))
    os.makedirs(build_dir, exist_ok=True)  # torch makes it when asked where it is
    open(os.path.join(build_dir, build.TORCH_BATON), "w").close()
    with open(os.path.join(build_dir, build.SOURCES[0].name), "wb") as cut:  # a copy a killed process cut short
        cut.write(build.SOURCES[0].read_bytes()[:300])
    run = [sys.executable, "-c", "from thunder_batch.native.build import unavailable; print(unavailable())"]
    done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "None", done.stderr[-2000:]


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
def test_every_file_the_build_reads_ships_in_the_package():
    """A wheel install builds the kernels from its own copy: every source and header must be package data
    (the headers were not, so a non-editable install could not build them)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(build.__file__).parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    shipped = patterns["thunder_batch"]
    for path in build.SOURCES + build.HEADERS:
        assert path.exists(), path
        name = f"native/{path.name}"
        assert any(fnmatch.fnmatch(name, pattern) for pattern in shipped), name


@pytest.mark.parametrize(
    "rows,out_features,bias",
    [(1, 48, True), (3, 40, True), (5, 37, False), (6, 40, False), (16, 16, True), (7, 1000, True)]
    + [(11, 1000, False), (13, 1000, False), (130, 40, False), (520, 40, True)],
)
def test_packed_linear_matches_torch(rows, out_features, bias):
    """Every tile of rows and blocks, a partial last block, several L2 groups of blocks (AVX-512: passes of
    1-8, 8 + 3, 8 + 5, 16 + ... rows; AVX2: 6, 5, 4 + 3, 6 + 5, ...)."""
    assert build.unavailable() is None
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 64, generator=g)  # [batch, rows, in]
    w = torch.randn(out_features, 64, generator=g)
    b = torch.randn(out_features, generator=g) if bias else None
    got = build.packed_linear(x, build.pack_linear_weight(w), b, out_features)
    assert got.shape == (2, rows, out_features)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


BF16_CASES = [(1, 48, True), (2, 40, False), (5, 37, False), (16, 16, True), (3, 1000, False), (1, 1000, True)]
BF16_CASES += [(8, 2100, True), (40, 40, False), (130, 40, True)]


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
@pytest.mark.parametrize("in_features", [64, 48])  # on AMX: 64 runs the tiles (32 inputs each), 48 vdpbf16ps
@pytest.mark.parametrize("rows,out_features,bias", BF16_CASES)
def test_bf16_packed_linear_is_torchs_result_up_to_the_last_bit(rows, out_features, bias, in_features):
    """float32 accumulation of exact bf16 products, rounded once: within one bf16 rounding of the exact
    product, and torch's own bf16 result for nearly every output (they differ in summation order only).
    Every path: AMX (one or two row tiles of 32-row passes, one or two blocks), vdpbf16ps, AVX2."""
    assert build.bf16_available()
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(out_features, in_features, generator=g) * 0.1).bfloat16()
    x = torch.randn(2, rows, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16() if bias else None
    got = build.packed_linear_bf16(x, build.pack_linear_weight_bf16(w), b, out_features)
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    assert got.shape == (2, rows, out_features) and got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()  # one rounding to bf16
    assert (got == torch.nn.functional.linear(x, w, b)).float().mean() > 0.95


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
def test_a_thread_held_up_leaves_the_rest_of_its_blocks_to_the_other():
    """The kernels' split of blocks among threads: every block taken once; a thread the OS holds up after
    its first chunk (0.3 s here; each chunk takes 5 ms) gets no more than that chunk, the other takes the
    rest of its range from the back (with fixed halves it kept its 32 blocks and the op waited for it)."""
    assert build.unavailable() is None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        quiet = torch.ops.thunder_batch.share_blocks_probe(64, 4, 5_000, 0)
        held_up = torch.ops.thunder_batch.share_blocks_probe(64, 4, 5_000, 300_000)
    finally:
        torch.set_num_threads(threads)
    for taken in (quiet, held_up):
        assert taken[:, 1].tolist() == [1] * 64  # each block taken once
    by_thread = held_up[:, 0].tolist()
    assert by_thread[:32] == [0] * 32 and by_thread.count(1) <= 4  # its first chunk at most


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
@pytest.mark.parametrize("in_features", [64, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype, in_features):
    """Bit for bit, alone or among 1-70 others at any place: a slot's tokens are the same in a decode step,
    a prompt lane or a verify lane (speculative decoding and prefix reuse are exact on this)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(200, in_features, generator=g) * 0.1).to(dtype)
    x = torch.randn(71, in_features, generator=g).to(dtype)
    pack, linear = (
        (build.pack_linear_weight, build.packed_linear)
        if dtype == torch.float32
        else (build.pack_linear_weight_bf16, build.packed_linear_bf16)
    )
    packed = pack(w)
    alone = torch.cat([linear(x[i : i + 1], packed, None, 200) for i in range(len(x))])
    for rows in (2, 6, 8, 13, 17, 33, 71):
        assert torch.equal(linear(x[:rows], packed, None, 200), alone[:rows]), rows


def test_bf16_linears_are_claimed_only_where_a_kernel_runs_them():
    """The native bf16 kernel (AMX, vdpbf16ps, or widening on AVX2) or oneDNN's bf16 linear; else torch's.
    A prompt step's rows go to the native kernel where it is the fastest there: AMX, or AVX2 only."""
    from thunder_batch.compile.project_executor import PACKED_ROWS, claims_linear, native_bf16, packed_linear

    bf16 = torch.bfloat16
    runs_here = native_bf16(64) or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert claims_linear("cpu", [bf16, bf16], (64, 64), 4) == runs_here
    amx = {"amx_bf16", "amx_tile"} <= build.cpu_flags()
    assert build.amx_runs(64) == amx and not build.amx_runs(48)
    if native_bf16(64) and "avx512f" in build.cpu_flags():
        assert claims_linear("cpu", [bf16, bf16], (64, 64), 520) == amx
        assert not claims_linear("cpu", [bf16, bf16], (64, 48), PACKED_ROWS[bf16] + 1)
    if runs_here:
        x, w = torch.randn(4, 64, dtype=bf16), torch.randn(64, 64, dtype=bf16)
        torch.testing.assert_close(packed_linear(x, w), torch.nn.functional.linear(x, w), atol=0.05, rtol=0.02)


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_features,in_features", [(1, 8), (7, 36), (37, 64), (100, 129)])
def test_plain_linear_is_a_float64_matmul_within_float32_rounding(dtype, out_features, in_features):
    """The own-layout kernel at every row count it splits differently (1; passes of up to 4 rows at 2-16; the
    16-output blocks widened into L2 above 16), outputs in groups of 3 and a rest, inputs past a multiple of 8:
    float32 sums of the exact products, so within float32 rounding of a float64 matmul; bfloat16 rounded once."""
    assert build.unavailable() is None
    torch.manual_seed(0)
    w = torch.randn(out_features, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    for rows in (1, 2, 3, 5, 8, 16, 17, 40):
        x = torch.randn(rows, in_features).to(dtype)
        got = torch.ops.thunder_batch.plain_linear(x, w, bias, out_features)
        exact = x.double() @ w.double().T + bias.double()
        size = x.double().abs() @ w.double().abs().T + bias.double().abs()
        assert got.dtype == dtype and got.shape == (rows, out_features)
        if dtype == torch.float32:
            assert ((got.double() - exact).abs() <= 1e-6 * size + 1e-30).all(), rows
        else:  # one rounding to bfloat16 (2^-9 of the value) on a float32 sum
            assert ((got.double() - exact).abs() <= 2.0**-8 * exact.abs() + 1e-6 * size).all(), rows


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_read_in_its_own_layout_is_never_copied(dtype):
    """Where `own_layout` says so (an AVX2 CPU without AVX-512, all of them for float32), the executor's
    "packed copy" is the weight's own memory, followed through in-place changes and new data alike."""
    from thunder_batch.compile.project_executor import PackedWeights, own_layout

    weights = PackedWeights()
    w, x = torch.randn(48, 64).to(dtype), torch.randn(3, 64).to(dtype)
    if dtype == torch.float32 and "avx512f" not in build.cpu_flags():
        assert own_layout(w)
    packed, kernel = weights.get(w)
    assert (packed.data_ptr() == w.data_ptr()) == own_layout(w)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    w.data = torch.randn(48, 64).to(dtype)  # new data under the same tensor
    weights.refresh([w])
    packed, kernel = weights.get(w)
    assert (packed.data_ptr() == w.data_ptr()) == own_layout(w)
    torch.testing.assert_close(kernel(x, packed, None, 48).float(), (x @ w.T).float(), **tol)


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
def test_packed_copies_follow_their_weights():
    """A weight changed in place is packed again; a weight that dies takes its packed copy with it."""
    import gc

    from thunder_batch.compile.project_executor import PackedWeights, packed_linear

    weights = PackedWeights()
    w, x = torch.randn(32, 64), torch.randn(3, 64)
    first, kernel = weights.get(w)
    assert weights.get(w)[0] is first  # made once
    torch.testing.assert_close(kernel(x, first, None, 32), x @ w.T, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        w.mul_(2)
    again, _ = weights.get(w)
    assert again is not first
    torch.testing.assert_close(packed_linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    del w
    gc.collect()
    assert weights._packed == {}


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("Q,D", [(3, 64), (7, 80), (16, 128), (5, 4)])
def test_decode_attention_is_torchs_attention(dtype, tol, Q, D):
    """Query rows per group over strided cache views, each slot seeing its own prefix; a slot seeing
    nothing (a padding row) gets zeros. Torch's sdpa is the oracle, float64 the tie-breaker. Query rows
    in register blocks of 4 and a rest (3, 7, 5), four keys at a time and a rest (3 + 9b visible), and
    a head size the vector loops do not take (4)."""
    from thunder_batch.compile.attention import claims_tensors, decode_attention

    B, G, L = 5, 3, 40
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, B, G, L + 7, D, generator=g).to(dtype)
    k, v = cache[0, :, :, :L], cache[1, :, :, :L]  # [B, G, L, D], rows 7 entries apart at each slot's end
    q = torch.randn(B, G, Q, D, generator=g).to(dtype)
    mask = torch.zeros(B, 1, 1, L, dtype=dtype)
    for b in range(B):
        mask[b, ..., 3 + 9 * b :] = torch.finfo(dtype).min
    mask[2] = float("-inf")  # nothing visible
    assert claims_tensors(q, k, v, attn_mask=mask, scale=0.125)
    got = decode_attention(q, k, v, attn_mask=mask, scale=0.125)
    seen = [0, 1, 3, 4]
    want = torch.nn.functional.scaled_dot_product_attention(q[seen], k[seen], v[seen], mask[seen], scale=0.125)
    torch.testing.assert_close(got[seen], want, rtol=tol, atol=tol)
    assert got[2].eq(0).all()
    assert not claims_tensors(q, k, v, attn_mask=mask.expand(B, 1, Q, L), scale=0.125)  # a mask per row: torch's
    assert not claims_tensors(q, k, v, attn_mask=None)


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,G,D", [(9, 3, 64), (4, 4, 32), (16, 1, 16)])
def test_decode_rows_attention_writes_and_attends_as_the_models_ops(dtype, H, G, D):
    """The one-op decode attention (compile.attention, native) against the model's own ops: the same KV
    writes bit for bit (k and v as strided views of one qkv row, as the step feeds them) and the same
    attention as the native kernel over the written caches, for each slot at its own position."""
    from thunder_batch.compile.attention import decode_rows_attention as one_op
    from thunder_batch.compile.project_executor import ProjectKernelsMode
    from thunder_batch.index_ops import flat_rows
    from thunder_batch.model import decode_rows_attention as model_ops

    B, S, L = 4, 24, 16
    g = torch.Generator().manual_seed(1)
    caches = torch.randn(2, B, G, S, D, generator=g).to(dtype)
    qkv = torch.randn(B, (H + 2 * G) * D, generator=g).to(dtype)
    q, k, v = qkv.split((H * D, G * D, G * D), dim=-1)
    q, k, v = q.reshape(B, H, D), k.view(B, G, D), v.view(B, G, D)  # k, v: rows (H + 2G) * D apart
    pos = torch.tensor([0, 5, 15, 9])
    rows = flat_rows(caches[0].shape, 2, torch.arange(B), pos)
    mask = torch.where(torch.arange(L) <= pos.view(B, 1, 1, 1), 0.0, torch.finfo(dtype).min).to(dtype)
    mine, theirs = caches.clone(), caches.clone()
    got = one_op(q, k, v, mine[0], mine[1], rows, mask, 0.125)
    with ProjectKernelsMode():  # the model's ops with the executor's attention kernel, as the load check runs them
        want = model_ops(q, k, v, theirs[0], theirs[1], rows, mask, 0.125)
    assert torch.equal(mine, theirs)
    assert mine[0, 2, :, 15].equal(k[2]) and mine[1, 1, :, 5].equal(v[1])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    exact = model_ops(q.double(), k.double(), v.double(), *caches.double().clone(), rows, mask.double(), 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_rows_attention_writes_and_attends_as_the_models_ops(dtype):
    """A verify step's one-op attention (native) against the model's ops: 3 decode rows, then a lane of 4
    rows of slot 1 at positions 6-9, each seeing its slot's entries up to its own position (the lane's
    earlier rows written in the same call): the same writes bit for bit, the same attention as the native
    kernel over each row's copied slot entries, and float64's within rounding."""
    from thunder_batch.compile.attention import slot_rows_attention as one_op
    from thunder_batch.compile.project_executor import ProjectKernelsMode
    from thunder_batch.index_ops import flat_rows
    from thunder_batch.model import slot_rows_attention as model_ops

    H, G, D, B, S, L = 9, 3, 64, 3, 24, 16
    g = torch.Generator().manual_seed(2)
    caches = torch.randn(2, B, G, S, D, generator=g).to(dtype)
    N = B + 4
    qkv = torch.randn(N, (H + 2 * G) * D, generator=g).to(dtype)
    q, k, v = qkv.split((H * D, G * D, G * D), dim=-1)
    q, k, v = q.reshape(N, H, D), k.view(N, G, D), v.view(N, G, D)
    row_slot = torch.tensor([0, 1, 2, 1, 1, 1, 1])
    pos = torch.tensor([3, S - 2, 12, 6, 7, 8, 9])  # slot 1's decode row: a pad at a scratch position (>= L)
    rows = flat_rows(caches[0].shape, 2, row_slot, pos)
    mask = torch.where(torch.arange(L) <= pos.view(N, 1, 1, 1), 0.0, torch.finfo(dtype).min).to(dtype)
    mine, theirs = caches.clone(), caches.clone()
    got = one_op(q, k, v, mine[0], mine[1], rows, row_slot, mask, 0.125)
    with ProjectKernelsMode():
        want = model_ops(q, k, v, theirs[0], theirs[1], rows, row_slot, mask, 0.125)
    assert torch.equal(mine, theirs)
    assert mine[0, 1, :, 8].equal(k[5]) and mine[1, 2, :, 12].equal(v[2])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    exact = model_ops(
        q.double(), k.double(), v.double(), *caches.double().clone(), rows, row_slot, mask.double(), 0.125
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol)


@pytest.mark.skipif(not {"avx2", "fma"} <= build.cpu_flags(), reason="the kernels need AVX2 and FMA")
def test_float32_linears_are_claimed_up_to_the_rows_where_the_kernel_is_the_faster():
    """AVX-512: up to PACKED_ROWS[float32] rows (torch's GEMM above); AVX2 only: every row count."""
    import math

    from thunder_batch.compile.project_executor import PACKED_ROWS, claims_linear, packed_rows

    f32 = torch.float32
    limit = PACKED_ROWS[f32] if "avx512f" in build.cpu_flags() else math.inf
    assert packed_rows(f32) == limit and claims_linear("cpu", [f32, f32], (64, 64), 64)
    assert claims_linear("cpu", [f32, f32], (64, 64), 520) == (limit == math.inf)

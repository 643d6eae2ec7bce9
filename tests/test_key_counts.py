"""Padding masks read as key counts (issue 42): which masks take that road, and that it equals
the float64 reference with the mask, in every native clone and with the native kernels off."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tests.conftest import tol

import qkv
from qkv import reference
from qkv.engine import run
from qkv.engine.kernels import dispatch, native, router
from qkv.masks import tail_counts
from qkv.testing.strategies import values
from qkv.validate import make_plan

ISAS = list(native.ISAS)
ROADS = [("native", None), *(("native", isa) for isa in ISAS), ("numpy", None)]
SIZES = [1, 2, 15, 16, 17, 37, 53, 120, 150]  # the grid's short lengths, odd ones, a prefill


def padding(counts: np.ndarray, S: int) -> np.ndarray:
    """The boolean ``(B, 1, 1, S)`` mask that lets row ``b`` see keys ``[0, counts[b])``."""
    return (np.arange(S)[None, :] < np.asarray(counts)[:, None])[:, None, None, :]


def middle(counts: np.ndarray, S: int) -> np.ndarray:
    """Keys ``[0, S)`` minus one run in the middle of each row: not a padding mask."""
    j = np.arange(S)[None, :]
    lo = np.asarray(counts)[:, None] // 2
    return ~((j >= lo) & (j < lo + 1) & (j < S - 1))[:, None, None, :]


def forms(keep: np.ndarray, L: int) -> dict[str, np.ndarray]:
    """One mask as bool, as a 0/-inf float bias, and as (B, 1, L, S)."""
    return {
        "bool": keep,
        "float": np.where(keep, 0.0, -np.inf).astype(np.float32),
        "rows": np.broadcast_to(keep, keep.shape[:2] + (L, keep.shape[-1])),
    }


@pytest.fixture
def road(monkeypatch):
    """The roads the calls that may run on their key counts took (the router's choice each
    call ran on, kept by the short road or chosen by the general one; a padded plain call's
    kept set-up counts as its road)."""
    calls: list[str] = []
    real = dispatch._attend

    def spy(plan, kernel, choice):
        if plan.key_counts is not None and router.holds(router.ON_KEY_COUNTS, plan, kernel):
            ran = choice if choice is not None else dispatch.choose(plan, kernel)
            calls.append(ran.counts or "the mask")
        return real(plan, kernel, choice)

    real_keep = dispatch.keep_counted

    def keep(plan, choice, q_like=None):
        kept = real_keep(plan, choice, q_like)
        if kept is None:
            return None

        def counted(*args):
            done = kept.run(*args)
            if done is not None:  # (else the general road runs: the spy above records it)
                calls.append(choice.counts)
            return done

        return kept.like(counted)  # (called on arrays or, tensors', addresses: Kept.at)

    monkeypatch.setattr(dispatch, "_attend", spy)
    monkeypatch.setattr(dispatch, "keep_counted", keep)
    run.forget()  # (set-ups kept before hold no spy)
    run._counted.cache_clear()
    return calls


def set_road(monkeypatch, which: tuple[str, str | None]) -> None:
    kind, isa = which
    monkeypatch.setenv("QKV_NATIVE", "0" if kind == "numpy" else "1")
    if isa is None:
        monkeypatch.delenv("QKV_NATIVE_ISA", raising=False)
    else:
        monkeypatch.setenv("QKV_NATIVE_ISA", isa)


def test_tail_counts_reads_only_a_tail_per_batch_row():
    S = 6
    keep = padding([6, 3, 0], S)
    assert tail_counts(keep, 2).tolist() == [6, 3, 0]
    assert tail_counts(np.broadcast_to(keep, (3, 1, 4, S)), 2).tolist() == [6, 3, 0]
    assert tail_counts(middle(np.array([6, 4, 5]), S), 2) is None  # a middle run hidden
    assert tail_counts(~keep, 2) is None  # the head of the keys hidden
    heads = np.broadcast_to(keep, (3, 2, 1, S)).copy()
    heads[0, 1, 0, -1] = False  # one head sees less: head-dependent
    assert tail_counts(heads, 2) is None
    causal = np.tril(np.ones((S, S), bool))[None, None]
    assert tail_counts(causal, 2) is None  # the query rows differ
    rows = np.broadcast_to(keep, (3, 1, 4, S)).copy()
    rows[1, 0, 2, 2] = False  # one query row of batch row 1 hides another key
    assert tail_counts(rows, 2) is None
    assert tail_counts(padding([4], S)[0], 1).tolist() == [4]  # (1, 1, S): one count
    assert tail_counts(np.broadcast_to(keep[:, :, 0], (3, 2, S)), 1) is None  # per head
    assert tail_counts(np.ones((3, 1, 1, 0), bool), 2) is None  # no key: nothing to read
    odd = np.array([2, 2, 1, 0], np.uint8).view(bool).reshape(1, 1, 1, 4)  # True stored as 2
    assert tail_counts(odd, 2).tolist() == [3]


@settings(max_examples=200, deadline=None)
@given(
    B=st.integers(1, 20),
    L=st.integers(1, 4),
    S=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    spoil=st.sampled_from(["none", "middle", "query row", "head"]),
)
def test_tail_counts_few_and_many_rows_agree_with_the_definition(B, L, S, seed, spoil):
    """Up to 8 batch rows the mask's bytes are read row by row, past that in vectorized
    passes: both give each row's count where every query row of a batch row shows the same
    run of leading keys, and None for anything else (the definition, row by row below)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, S + 1, size=B)
    keep = np.broadcast_to(padding(counts, S), (B, 1, L, S)).copy()
    if spoil == "middle" and S > 2:
        keep[rng.integers(B), :, :, rng.integers(S - 1)] ^= True
    elif spoil == "query row" and L > 1:
        keep[rng.integers(B), 0, rng.integers(1, L), rng.integers(S)] ^= True
    elif spoil == "head":
        keep = np.concatenate([keep, keep], axis=1)
        keep[rng.integers(B), 1, :, rng.integers(S)] ^= True
    want = []
    for b in range(B):
        first = keep[b, 0, 0]
        n = int(first.sum())
        if not (keep[b] == first).all() or not first[:n].all():
            want = None
            break
        want.append(n)
    got = tail_counts(keep, 2)
    assert (got is None) == (want is None)
    if want is not None:
        assert got.dtype == np.int64 and got.tolist() == want


def test_plan_carries_counts_and_drops_a_mask_that_hides_nothing():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((3, 2, 5, 8)) for _ in range(3))
    for m in forms(padding([5, 2, 0], 5), 5).values():
        plan = make_plan(q, k, v, mask=m)
        assert plan.key_counts.tolist() == [5, 2, 0]
        assert plan.mask is not None or plan.bias is not None  # kept for the other kernels
    for m in forms(padding([5, 5, 5], 5), 5).values():
        plan = make_plan(q, k, v, mask=m)
        assert plan.mask is None and plan.bias is None and plan.key_counts is None
    bias = np.where(padding([5, 2, 0], 5), 0.5, -np.inf)  # a true bias: kept as it is
    assert make_plan(q, k, v, mask=bias).key_counts is None
    assert make_plan(q, k, v, mask=middle(np.array([5, 4, 3]), 5)).key_counts is None


# Not qkv.testing.strategies' shapes: the sizes are the grid's and the odd ones (SIZES), and
# the masks are the four kinds the key-count road must tell apart.
@st.composite
def problems(draw):
    B = draw(st.integers(1, 4))
    Hkv = draw(st.integers(1, 4))
    Hq = Hkv * draw(st.sampled_from([1, 2, 4]))
    L, S = draw(st.sampled_from(SIZES)), draw(st.sampled_from(SIZES))
    d = draw(st.sampled_from([8, 16, 32, 64, 128]))
    kind = draw(st.sampled_from(["nothing", "everything", "tail", "middle"]))
    if kind == "nothing":
        counts = np.full(B, S)
    elif kind == "everything":
        counts = np.zeros(B, int)
    else:
        counts = np.array(draw(st.lists(st.integers(0, S), min_size=B, max_size=B)))
        counts[draw(st.integers(0, B - 1))] = S  # some row full
        if kind == "tail" and (counts == S).all():
            counts[0] = S - 1 if S > 1 else 0
    window = draw(st.one_of(st.none(), st.tuples(st.integers(0, 20), st.just(0))))
    causal = draw(st.booleans())
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    return B, Hq, Hkv, L, S, d, kind, counts, causal, window, dtype, seed


@pytest.mark.parametrize("which", ROADS, ids=lambda w: w[1] or w[0])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["tail", "middle"])
def test_a_decoding_steps_padding_forms_give_one_answer(monkeypatch, which, dtype, kind):
    """One query row (a decoding step) under a padding mask given as booleans and as a 0/-inf
    float mask, or a mask hiding a middle run in both forms: one plan, so equal bits (the
    float form once ran on another kernel than the boolean one's native step; hypothesis found
    B3 S120 d128 float64, counts [120, 0, 0], both kinds)."""
    set_road(monkeypatch, which)
    rng = np.random.default_rng(7)
    q = values(rng, (3, 2, 1, 128)).astype(dtype)
    k, v = (values(rng, (3, 2, 120, 128)).astype(dtype) for _ in range(2))
    counts = np.array([120, 0, 37])
    keep = padding(counts, 120) if kind == "tail" else middle(counts, 120)
    want = reference.attention(q, k, v, mask=keep)
    got = {n: qkv.attention(q, k, v, mask=m) for n, m in forms(keep, 1).items()}
    np.testing.assert_allclose(got["bool"], want, **tol("fast path", dtype))
    assert np.array_equal(got["bool"], got["float"]) and np.array_equal(got["bool"], got["rows"])


@pytest.mark.parametrize("which", ROADS, ids=lambda w: w[1] or w[0])
@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(problem=problems())
def test_padding_masks_equal_the_reference(monkeypatch, road, which, problem):
    B, Hq, Hkv, L, S, d, kind, counts, causal, window, dtype, seed = problem
    set_road(monkeypatch, which)
    road.clear()
    rng = np.random.default_rng(seed)
    q = values(rng, (B, Hq, L, d)).astype(dtype)
    k, v = (values(rng, (B, Hkv, S, d)).astype(dtype) for _ in range(2))
    keep = middle(counts, S) if kind == "middle" else padding(counts, S)
    want, want_lse = reference.attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
        mask=keep, causal=causal, window=window, return_lse=True,
    )  # fmt: skip
    results = []
    for name, m in forms(keep, L).items():
        out, lse = qkv.attention(q, k, v, mask=m, causal=causal, window=window, return_lse=True)
        np.testing.assert_allclose(out, want, **tol("fast path", dtype), err_msg=name)
        assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse)), name
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[fin], want_lse[fin], **tol("fast path", dtype))
        results.append(out)
    found = tail_counts(keep, 2)
    if kind == "middle" and not keep.all():
        assert found is None  # a middle run hidden: never read as key counts
    expected = found is not None and L > 1 and not (found == S).all()
    assert len(road) == (3 if expected else 0), (kind, counts.tolist(), L)
    assert np.array_equal(results[0], results[1]) and np.array_equal(results[0], results[2])


@pytest.mark.parametrize("which", ROADS, ids=lambda w: w[1] or w[0])
@pytest.mark.parametrize(
    ("B", "H", "kv", "L", "S", "d", "counts"),
    [
        (1, 8, 2, 512, 512, 32, [300]),  # one sentence: its keys alone, no mask (grouped)
        (4, 8, 8, 256, 256, 64, [256, 100, 100, 0]),  # two counts and an empty row
        (3, 12, 3, 200, 260, 32, [260, 7, 131]),  # three counts: the native prefill clips keys
        (8, 12, 12, 16, 16, 64, [16, 9, 3, 16, 0, 9, 12, 16]),  # the count-aware dense kernel
        (32, 12, 12, 53, 53, 32, None),  # the MiniLM batch: the native prefill clips keys
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_grid_shapes_on_their_key_counts(
    monkeypatch, road, which, B, H, kv, L, S, d, counts, causal
):
    set_road(monkeypatch, which)
    rng = np.random.default_rng(B * L + S)
    if counts is None:
        counts = rng.integers(S // 2, S + 1, B)
        counts[0] = S
    counts = np.asarray(counts)
    q = values(rng, (B, H, L, d)).astype(np.float32)
    k, v = (values(rng, (B, kv, S, d)).astype(np.float32) for _ in range(2))
    keep = padding(counts, S)
    want = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), mask=keep, causal=causal)
    outs = [qkv.attention(q, k, v, mask=m, causal=causal) for m in forms(keep, L).values()]
    for out in outs:
        np.testing.assert_allclose(out, want, **tol("fast path", np.float32))
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    assert len(road) == 3
    assert not outs[0][counts == 0].any()  # rows that see no key: output 0


def test_causal_is_aligned_to_all_the_keys():
    """A tail cut at c with causal: query i sees keys j <= S - L + i and j < c (the mask ANDed
    with causal over the original S positions), not causal over the c keys."""
    rng = np.random.default_rng(3)
    L, S, c = 4, 9, 6
    q = rng.standard_normal((1, 1, L, 8))
    k, v = rng.standard_normal((1, 1, S, 8)), rng.standard_normal((1, 1, S, 8))
    for m in (padding([c], S), padding([c, S], S)):
        B = m.shape[0]
        qb, kb, vb = (np.repeat(x, B, 0) for x in (q, k, v))
        got = qkv.attention(qb, kb, vb, mask=m, causal=True)
        want = reference.attention(qb, kb, vb, mask=m, causal=True)
        np.testing.assert_allclose(got, want, **tol("fast path", np.float64))
    short = reference.attention(q, k[..., :c, :], v[..., :c, :], causal=True)
    assert not np.allclose(got[:1], short)  # (the other alignment gives other numbers)


@pytest.mark.parametrize("form", ["bool", "float"])
def test_tensors_and_bfloat16_take_the_road(road, form):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    B, H, L, S, d = 3, 4, 40, 40, 16
    q, k, v = (torch.from_numpy(values(rng, (B, H, L, d))) for _ in range(3))
    keep = torch.from_numpy(padding([40, 25, 25], S))
    mask = keep if form == "bool" else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    for dt in (torch.float32, torch.bfloat16):
        out = qkv.attention(q.to(dt), k.to(dt), v.to(dt), mask=mask)
        want = reference.attention(
            *(x.to(dt).double().numpy() for x in (q, k, v)), mask=keep.numpy()
        )
        assert out.dtype == dt
        np.testing.assert_allclose(out.double().numpy(), want, **tol("tensor dtypes", dt))
    assert len(road) == 2


def test_padded_encoder_batch_through_transformers(road):
    """A BERT encoder's padding mask (B, 1, L, S) through the transformers backend takes the
    key-count road and gives sdpa's hidden states at the real tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from qkv.integrations.transformers import register

    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    ids = torch.randint(1, 64, (4, 11))
    mask = torch.ones(4, 11, dtype=torch.long)
    mask[1, 7:] = mask[2, 3:] = mask[3, 9:] = 0
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        model.set_attn_implementation(register())
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    np.testing.assert_allclose(
        got[real].numpy(), want[real].numpy(), **tol("model states", np.float32)
    )
    assert len(road) == cfg.num_hidden_layers


@pytest.mark.skipif(not native.available()[0], reason="the native prefill is not built here")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("window", [None, (40, 0), (3, 17)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_native_prefill_clips_each_rows_keys(monkeypatch, isa, window, causal, dtype):
    """The native prefill takes the key counts itself (no mask read): K/V in the compute dtype
    or stored in 16 bits, causal and windows aligned to all the keys, rows that see none."""
    import ml_dtypes

    monkeypatch.delenv("QKV_NATIVE", raising=False)
    monkeypatch.setenv("QKV_NATIVE_ISA", isa)
    seen: list = []
    real = native.attend
    monkeypatch.setattr(
        native, "attend", lambda p, **kw: seen.append(kw.get("counts")) or real(p, **kw)
    )
    rng = np.random.default_rng(11)
    B, H, kv, L, S, d = 5, 4, 2, 150, 170, 16
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    q = values(rng, (B, H, L, d)).astype(dt)
    k, v = (values(rng, (B, kv, S, d)).astype(dt) for _ in range(2))
    counts = np.array([170, 0, 90, 169, 3])
    keep = padding(counts, S)
    want = reference.attention(
        *(x.astype(np.float64) for x in (q, k, v)), mask=keep, causal=causal, window=window
    )
    outs = [
        qkv.attention(q, k, v, mask=m, causal=causal, window=window)
        for m in forms(keep, L).values()
    ]
    name = "float32" if dtype == "bfloat16" else dtype  # computed in float32
    for out in outs:
        got = out.astype(np.float64)
        if dtype == "bfloat16":
            np.testing.assert_allclose(got, want, **tol("tensor dtypes", "bfloat16"))
        else:
            np.testing.assert_allclose(got, want, **tol("fast path", name))
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    if qkv.route(q, k, v, causal=causal, window=window).kernel in router.READ_BY:
        assert len(seen) == 3
        assert all(c is not None and c.tolist() == counts.tolist() for c in seen)
    # (else the bfloat16 tile products, which read the mask: AVX512_BF16 machines)


@pytest.mark.parametrize("which", ROADS, ids=lambda w: w[1] or w[0])
@pytest.mark.parametrize(
    ("B", "H", "L", "S", "d"), [(8, 12, 16, 16, 64), (4, 8, 120, 120, 32), (3, 4, 300, 300, 64)]
)
def test_roads_kept_for_any_counts_do_not_depend_on_them(monkeypatch, which, B, H, L, S, d):
    """A road of router.FOR_ANY_COUNTS chosen for some counts is chosen for any others of the
    same shapes (the short road keeps it per shapes): one, two, three and B distinct counts."""
    set_road(monkeypatch, which)
    rng = np.random.default_rng(B + L)
    q = values(rng, (B, H, L, d)).astype(np.float32)
    k = v = values(rng, (B, H, S, d)).astype(np.float32)
    roads = set()
    for distinct in (1, 2, 3, B):
        counts = np.resize(np.arange(S, S - distinct, -1), B)
        counts[0] = max(S - 1, 1)  # hides something
        roads.add(dispatch.choose(make_plan(q, k, v, mask=padding(counts, S))).counts)
    kept = roads & set(router.FOR_ANY_COUNTS)
    assert not kept or roads == kept, roads

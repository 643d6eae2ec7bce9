"""One spine: every public function under one tensor policy, each call checked once.

For every public function and every kind of input (NumPy arrays, CPU tensors, CPU tensors that
require grad, tensors on the ``meta`` device standing in for a GPU): the result's type, dtype
and device follow the input and its values equal the NumPy path's (which the rest of the suite
ties to the float64 reference); gradients equal PyTorch autograd through PyTorch's own
operations; what has no gradient, unknown keywords and refused devices give ``InputError``
naming the argument. A counting test checks that a public call is validated once, ring and
cache included, and never per block.
"""

from __future__ import annotations

import cProfile
import pstats

import numpy as np
import pytest
from tests.conftest import tol

import qkv
from qkv import validate

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(0)
Q = RNG.standard_normal((2, 4, 3, 8)).astype(np.float32)
K = RNG.standard_normal((2, 2, 5, 8)).astype(np.float32)  # grouped: 2 query heads per kv head
V = RNG.standard_normal((2, 2, 5, 6)).astype(np.float32)


def _t(a, grad=False):
    return torch.tensor(a, requires_grad=grad)


# ----- each public function: (name, call on (q, k, v) of one kind) -----


def _cache(q, k, v):
    c = qkv.KVCache(batch=2, kv_heads=2, head_dim=8, value_dim=6, dtype=np.float32)
    c.append(k, v)
    return c.attend(q)


def _merge(q, k, v):
    a = qkv.attention(q, k[..., :2, :], v[..., :2, :], return_lse=True)
    b = qkv.attention(q, k[..., 2:, :], v[..., 2:, :], return_lse=True)
    return qkv.merge([a, b])[0]


def _varlen(q, k, v):
    # (total, heads, d) packing of the two batch rows as two sequences
    def pack(x):
        return x.swapaxes(1, 2).reshape(-1, x.shape[1], x.shape[3])

    cu_q, cu_k = [0, 3, 6], [0, 5, 10]
    return qkv.attention_varlen(pack(q), pack(k), pack(v), cu_q, cu_k, causal=True)


FUNCTIONS = {
    "attention": lambda q, k, v: qkv.attention(q, k, v, causal=True),
    "attention_weights": lambda q, k, v: qkv.attention_weights(q, k, causal=True),
    "scores": lambda q, k, v: qkv.scores(q, k),
    "softmax": lambda q, k, v: qkv.softmax(q),
    "merge": _merge,
    "attention_varlen": _varlen,
    "attention_vjp": lambda q, k, v: qkv.attention_vjp(q, k, v, qkv.attention(q, k, v))[0],
    "KVCache": _cache,
}
NO_GRAD = {"attention_varlen": "q", "attention_vjp": "q", "KVCache": "k"}


@pytest.mark.parametrize("name", FUNCTIONS)
def test_tensors_in_give_tensors_out_with_the_numpy_paths_values(name):
    f = FUNCTIONS[name]
    want = f(Q, K, V)
    assert isinstance(want, np.ndarray) and want.dtype == np.float32
    got = f(_t(Q), _t(K), _t(V))
    assert isinstance(got, torch.Tensor), type(got)
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    np.testing.assert_allclose(got.numpy(), want, **tol("rule floor", np.float32))
    f64 = f(*(_t(x.astype(np.float64)) for x in (Q, K, V)))
    assert f64.dtype == torch.float64
    bf16 = f(*(_t(x).to(torch.bfloat16) for x in (Q, K, V)))
    assert bf16.dtype == torch.bfloat16  # computed in float32, rounded once
    np.testing.assert_allclose(bf16.float().numpy(), want, **tol("rounded inputs", torch.bfloat16))


def _torch_reference(name, q, k, v):
    """The same quantity through PyTorch's own operations (the peer for gradients)."""
    scale = q.shape[-1] ** -0.5
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = q @ kr.transpose(-1, -2) * scale
    if name == "scores":
        return s
    if name == "softmax":
        return torch.softmax(q, dim=-1)
    L, S = s.shape[-2:]
    ok = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
    w = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
    if name == "attention_weights":
        return w
    if name == "attention":
        return w @ vr
    # merge of two unmasked halves = attention over all keys, no mask
    return torch.softmax(s, dim=-1) @ vr


@pytest.mark.parametrize("name", ["attention", "attention_weights", "scores", "softmax", "merge"])
def test_gradients_flow_and_equal_pytorch_autograd(name):
    q64, k64, v64 = (x.astype(np.float64) for x in (Q, K, V))
    ours = [_t(x, grad=True) for x in (q64, k64, v64)]
    peer = [_t(x, grad=True) for x in (q64, k64, v64)]
    g = torch.tensor(RNG.standard_normal(tuple(FUNCTIONS[name](*ours).shape)))
    (FUNCTIONS[name](*ours) * g).sum().backward()
    (_torch_reference(name, *peer) * g).sum().backward()
    for a, b in zip(ours, peer, strict=True):
        if b.grad is None:  # the peer does not use this input (scores: v)
            assert a.grad is None or not a.grad.any()
            continue
        torch.testing.assert_close(a.grad, b.grad, **tol("backward", np.float64))


@pytest.mark.parametrize("name", sorted(NO_GRAD))
def test_functions_without_a_gradient_refuse_tensors_that_require_it(name):
    arg = NO_GRAD[name]
    ins = {n: _t(x, grad=(n == arg)) for n, x in zip("qkv", (Q, K, V), strict=True)}
    with pytest.raises(qkv.InputError, match=f"^{arg}: requires grad"):
        FUNCTIONS[name](ins["q"], ins["k"], ins["v"])
    with torch.no_grad():  # and under no_grad they run, giving tensors
        assert isinstance(FUNCTIONS[name](ins["q"], ins["k"], ins["v"]), torch.Tensor)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_device_tensors_are_refused_or_routed_never_copied_silently(name):
    meta = [torch.empty(x.shape, device="meta") for x in (Q, K, V)]
    with pytest.raises(qkv.InputError, match=r"^(q|k|x|parts\[0\] out|q, k, v, mask)[:,].*meta"):
        FUNCTIONS[name](*meta)


@pytest.mark.parametrize(
    ("call", "fn"),
    [
        (lambda: qkv.attention(Q, K, V, softcaps=1.0), "attention"),
        (lambda: qkv.attention_weights(Q, K, sink=[0.0] * 4), "attention_weights"),
        (
            lambda: qkv.attention_vjp(Q, K, V, np.ones((2, 4, 3, 6)), alibi=[1.0] * 4),
            "attention_vjp",
        ),
        (lambda: qkv.explain([2, 1], [[1, 0], [3, 2]], softcaps=1.0), "explain"),
        (lambda: _cache_with(softcaps=1.0), "KVCache.attend"),
        (
            lambda: qkv.attention(
                *(torch.empty(x.shape, device="meta") for x in (Q, K, V)), softcaps=1.0
            ),
            "attention",
        ),  # fmt: skip
    ],
)
def test_an_unknown_keyword_is_named_with_the_public_function(call, fn):
    with pytest.raises(qkv.InputTypeError, match=rf"{fn}\(\) got an unexpected keyword"):
        call()


def _cache_with(**kw):
    c = qkv.KVCache(batch=2, kv_heads=2, head_dim=8, value_dim=6, dtype=np.float32)
    c.append(K, V)
    return c.attend(Q, **kw)


def test_every_variant_reaches_the_gpu_path_and_falls_back_visibly(monkeypatch):
    """A variant the Triton kernels lack is computed on the CPU with the fallback warning,
    never a TypeError (the kernels run here in the interpreter on CPU tensors)."""
    api = pytest.importorskip("qkv.gpu.api")
    q, k, v = (_t(x) for x in (Q, K, V))
    for kw in ({"softcap": 5.0}, {"sinks": [0.5] * 4}, {"alibi_slopes": [0.5, 0.25, 0.1, 0.05]}):
        with pytest.warns(api.GpuFallbackWarning, match=next(iter(kw))):
            got = api.attention(q, k, v, causal=True, **kw)
        want = qkv.reference.attention(Q, K, V, causal=True, **kw)
        np.testing.assert_allclose(got.numpy(), want, **tol("float32 path", np.float32))


# ----- one validation per public call -----


def _checks(fn):
    """How many times ``fn()`` validated arguments (calls of ``make_plan``, and of
    ``plain_plan`` outside it: the commonest call's check, made once per shapes by
    :func:`qkv.engine.run.plain` and kept)."""
    prof = cProfile.Profile()
    prof.runcall(fn)
    stats = pstats.Stats(prof).stats
    made = _calls(stats, validate.make_plan)
    return made + _calls(stats, validate.plain_plan) - _calls(stats, validate.plain_plan, made)


def _calls(stats, fn, caller=None):
    """Calls of ``fn`` in ``stats`` (only those from ``make_plan`` when ``caller`` is set)."""
    code = fn.__code__
    key = (code.co_filename, code.co_firstlineno, code.co_name)
    if key not in stats:
        return 0
    if caller is None:
        return stats[key][1]
    mk = validate.make_plan.__code__
    callers = stats[key][4]
    return callers.get((mk.co_filename, mk.co_firstlineno, mk.co_name), (0, 0))[1]


def _ring():
    from qkv.distributed import ring_attention, ring_attention_vjp

    q, k, v = (RNG.standard_normal((2, 16, 8)) for _ in range(3))
    out, lse = ring_attention(q, k, v, causal=True, return_lse=True)
    return ring_attention_vjp(q, k, v, np.ones_like(out), out, lse, causal=True)


def _ragged_cache():
    c = qkv.KVCache(batch=3, kv_heads=2, head_dim=8, value_dim=6, dtype=np.float32)
    for b, n in enumerate((5, 2, 4)):
        c.append(K[0, :, :n], V[0, :, :n], seq=b)
    return c.attend(np.concatenate([Q[:, :, :1], Q[:1, :, :1]]), sinks=np.zeros((3, 4)))


def _first_of_its_shapes(*args, **options):
    """A plain call whose shapes were not seen before (the kept checks cleared)."""
    from qkv.engine import run

    run.forget()
    return qkv.attention(*args, **options)


def _autograd():
    q = _t(Q, grad=True)
    qkv.attention(q, _t(K), _t(V), causal=True).sum().backward()


@pytest.mark.parametrize(
    ("what", "fn", "checks"),
    [
        ("attention", lambda: _first_of_its_shapes(Q, K, V, causal=True), 1),
        ("attention again", lambda: qkv.attention(Q, K, V, causal=True), 0),
        ("attention, tiled", lambda: qkv.attention(Q, K, V, kernel="tiled", window=(2, 0)), 1),
        ("tensors with autograd, forward and backward", _autograd, 1),
        ("explain", lambda: qkv.explain([2, 1], [[1, 0], [3, 2]], [[1, 2], [3, 4]], d=4), 1),
        ("KVCache.attend over sequences of 3 lengths", _ragged_cache, 1),
        ("ring forward and backward (2 chunks, blocks per step)", _ring, 2),
        ("attention_varlen (buckets)", lambda: _varlen(Q, K, V), 0),
    ],
)
def test_each_public_call_is_validated_once_never_per_block(what, fn, checks):
    if what.endswith("again"):
        fn()  # its shapes seen once: the check is kept
    assert _checks(fn) == checks, what

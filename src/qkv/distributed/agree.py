"""The check before the ring: every rank validates its own arguments, then one all-gather of a
small integer description of the call (shapes, dtypes, options, and whether the rank's own
checks failed). A rank whose arguments are bad raises its own error; every other rank raises an
:class:`~qkv.InputError` naming the disagreement, so no rank is left waiting in the ring.

The same all-gather tells each rank how many ranks share its host, so they split its cores.
"""

from __future__ import annotations

import socket
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np

from ..checks import check_real
from ..engine.kernels.threads import workers
from ..errors import InputError, InputTypeError
from ..masks import Window
from ..options import Options
from ..validate import Plan, as_array, check_window, make_plan
from .comm import Communicator, RankTimeout, get_comm
from .layout import check_layout, chunk_ids

__all__ = [
    "DEFAULT_TIMEOUT",
    "Setup",
    "agree",
    "check_timeout",
    "dtype_code",
    "setup",
    "shape_field",
    "threads_for",
]


def shape_field(shape: tuple[int, ...] | None) -> list[int]:
    s = list(shape) if shape is not None else []
    return [len(s)] + (s + [-1] * 8)[:8] if len(s) <= 8 else [len(s)] + s[:8]


@dataclass
class Setup:
    comm: Communicator
    plan: Plan  # the whole local problem, validated (q, k, v in their compute dtype)
    q: np.ndarray  # as given (not broadcast), for the gradients' shapes
    k: np.ndarray
    v: np.ndarray
    causal: bool
    layout: str
    h: int  # tokens per chunk
    threads: int
    window: Window | None = None  # over the whole sequence (global positions)


DEFAULT_TIMEOUT = 300.0  # seconds every rank has to enter a call before the others give up


def check_timeout(timeout: Any) -> float | None:
    """``timeout=``: seconds (> 0) or a :class:`datetime.timedelta`; ``None`` waits as long as
    the engine does."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return check_real(timeout, "timeout (seconds, or None: the engine's own)", positive=True)


def agree(
    comm: Communicator,
    what: str,
    fields: list[tuple[str, list[int]]],
    err: Exception | None,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> np.ndarray:
    """All-gather every rank's description of its call; raise the same error on every rank
    when one rank failed its own checks or the ranks disagree, and :class:`RankTimeout` naming
    the ranks that did not enter the call within ``timeout`` seconds. Returns the gathered
    rows."""
    host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
    names: list[str] = []
    flat: list[int] = [1 if err is not None else 0, host]
    for name, vals in fields:
        names.extend([name] * len(vals))
        flat.extend(int(x) for x in vals)
    try:
        rows = comm.timed_allgather(np.asarray(flat, dtype=np.int64), timeout)
    except RankTimeout as exc:
        raise RankTimeout(
            f"{what}: rank(s) {exc.missing} of {comm.size} did not enter the call: {exc} (this "
            f"is rank {comm.rank}); every rank of the group must call {what}. The group is now "
            "broken: create a new one before calling again",
            exc.missing,
        ) from None
    if err is not None:
        raise err
    bad = [int(r) for r in np.flatnonzero(rows[:, 0])]
    if bad:
        raise InputError(
            f"{what}: rank(s) {bad} of {comm.size} rejected their arguments; see the error on "
            "those ranks"
        )
    mine = rows[comm.rank, 2:]
    for r in range(comm.size):
        diff = np.flatnonzero(rows[r, 2:] != rows[0, 2:])
        if diff.size:
            name = names[int(diff[0])]
            raise InputError(
                f"{what}: ranks disagree on {name}: rank 0 has {_show(name, names, rows[0, 2:])}, "
                f"rank {r} has {_show(name, names, rows[r, 2:])} (this is rank {comm.rank}, "
                f"with {_show(name, names, mine)})"
            )
    return rows


def _show(name: str, names: list[str], row: np.ndarray) -> str:
    vals = [int(x) for n, x in zip(names, row, strict=True) if n == name]
    if name.endswith("shape"):
        return str(tuple(vals[1 : 1 + vals[0]])) if vals[0] >= 0 else "no array"
    if name.endswith("dtype"):
        return _DTYPES[vals[0]] if 0 <= vals[0] < len(_DTYPES) else "another dtype"
    if name == "scale":
        return repr(float(np.int64(vals[0]).view(np.float64)))
    if name == "causal":
        return {1: "True", 0: "False"}.get(vals[0], "a value that is not True or False")
    if name == "layout":
        return ("zigzag", "contiguous")[vals[0]] if vals[0] >= 0 else "?"
    return str(vals[0] if len(vals) == 1 else vals)


_DTYPES = ("float16", "float32", "float64", "longdouble")


def dtype_code(a: np.ndarray | None) -> list[int]:
    if a is None:
        return [-1]
    names = [np.dtype(n) for n in _DTYPES]
    return [names.index(a.dtype) if a.dtype in names else len(names)]


def threads_for(comm: Communicator, rows: np.ndarray) -> int:
    """This rank's share of the cores it may use (ranks on one host split them), at most
    ``OMP_NUM_THREADS`` when that is set."""
    local = int(np.count_nonzero(rows[:, 1] == rows[comm.rank, 1]))
    return workers(share=local)


def setup(
    what: str,
    comm: Any,
    q: Any,
    k: Any,
    v: Any,
    options: Options,
    layout: Any,
    extra: dict[str, Any],
    timeout: Any = DEFAULT_TIMEOUT,
) -> tuple[Setup, dict[str, np.ndarray]]:
    """Validate locally, then agree with every other rank (one all-gather, waiting at most
    ``timeout`` seconds for them).

    ``options`` as :func:`qkv.attention` takes them (no ``mask``, no ``score_mod``), with the
    ``window`` over the whole sequence, so not clamped to this rank's tokens; the ranks agree
    on the scale, causal, the window, the softcap and which variants are given.
    """
    c = get_comm(comm)
    seconds: float | None = DEFAULT_TIMEOUT
    causal, window, variants = options.causal, options.window, options.variants()
    win: Window | None = None
    err: Exception | None = None
    arrays: dict[str, np.ndarray | None] = {"q": None, "k": None, "v": None}
    arrays.update(dict.fromkeys(extra))
    plan = None
    lay, h = -1, 0
    try:
        seconds = check_timeout(timeout)
        lay_name = check_layout(layout)
        lay = ("zigzag", "contiguous").index(lay_name)
        for name, x in (("q", q), ("k", k), ("v", v), *extra.items()):
            arrays[name] = as_array(x, name)
        qa, ka = arrays["q"], arrays["k"]
        assert qa is not None and ka is not None
        if qa.ndim < 2:
            raise InputError(f"q: expected this rank's shard (..., n_local, d), got {qa.shape}")
        win = check_window(window)
        plan = make_plan(qa, ka, arrays["v"], options.replace(window=None))
        if qa.shape[-2] != ka.shape[-2]:
            raise InputError(
                f"q, k: this rank's shards must hold the same tokens: q has shape {qa.shape}, "
                f"k has shape {ka.shape}"
            )
        per = len(chunk_ids(0, c.size, lay_name))
        if qa.shape[-2] % per:
            raise InputError(
                f"q: {qa.shape[-2]} tokens on this rank (shape {qa.shape}) cannot be {per} equal "
                f"chunks of a sequence cut for layout {lay_name!r} with world size {c.size}"
            )
        h = qa.shape[-2] // per
        want = plan.batch + (plan.L, plan.dv)
        for name in extra:
            a = arrays[name]
            assert a is not None
            shape = want[:-1] if name == "lse" else want
            if name == "grad_out":
                try:
                    ok = np.broadcast_shapes(a.shape, shape) == shape
                except ValueError:
                    ok = False
            else:
                ok = a.shape == shape
            if not ok:
                raise InputError(
                    f"{name}: expected shape {shape} (this rank's output), got {a.shape}"
                )
    except (InputError, InputTypeError) as exc:
        err = exc
    scale_bits = np.float64(plan.scale if plan else 0.0).view(np.int64)
    fields = [
        ("layout", [lay]),
        ("causal", [int(bool(causal)) if isinstance(causal, (bool, np.bool_)) else -1]),
        ("scale", [int(scale_bits)]),
        ("window", [-1 if w is None else min(int(w), 1 << 62) for w in (win or (None, None))]),
        (
            "softcap",
            [int(np.float64(plan.softcap if plan and plan.softcap else 0.0).view(np.int64))],
        ),
        (
            "variants",
            [int(variants.get(n) is not None) for n in ("sinks", "alibi_slopes", "mask_mod")],
        ),
    ]
    for name, a in arrays.items():
        fields.append((f"{name} dtype", dtype_code(a)))
        fields.append((f"{name} shape", shape_field(None if a is None else a.shape)))
    rows = agree(c, what, fields, err, seconds)
    assert plan is not None
    setup = Setup(
        comm=c,
        plan=plan,
        q=arrays["q"],  # type: ignore[arg-type]
        k=np.ascontiguousarray(arrays["k"]),
        v=np.ascontiguousarray(arrays["v"]),
        causal=bool(causal),
        layout=("zigzag", "contiguous")[lay],
        h=h,
        threads=threads_for(c, rows),
        window=win,
    )
    return setup, {n: a for n, a in arrays.items() if n in extra}  # type: ignore[misc]

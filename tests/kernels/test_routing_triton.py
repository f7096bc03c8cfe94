"""The Triton routing kernel itself, run by the Triton interpreter on CPU, against the reference.

The kernel is launched on torch CPU tensors with ``TRITON_INTERPRET=1`` (:func:`routing_blocks_torch`);
its per-block outputs go through the same global-rank and capacity code as the Pallas path
(:mod:`moefast.kernels.routing.ops`), and the result must equal :func:`route_reference`: indices,
slots and counts bitwise, gates and statistics to float32 rounding. The cases are the Pallas
kernel's grid (every token count 1/13/129/4099, expert count 7/8/64/256, top_k 1/2/4/8, both
dtypes, ties and ±1e4 logits, masks, both policies, block sizes that do not divide T).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch (a test dependency) is not installed")
pytest.importorskip("triton", reason="triton (a test dependency) is not installed")

import importlib.util  # noqa: E402
import pathlib  # noqa: E402

# The Pallas kernel test's cases and helpers (a sibling file, not a package).
_spec = importlib.util.spec_from_file_location("_pallas_cases", pathlib.Path(__file__).with_name("test_routing_kernel.py"))
_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cases)
CASES, TOLERANCE, INT_FIELDS = _cases.CASES, _cases.TOLERANCE, _cases.INT_FIELDS
capacity_of, make_logits, make_mask = _cases.capacity_of, _cases.make_logits, _cases.make_mask

from moefast.kernels.routing import ops, triton as triton_kernel  # noqa: E402
from moefast.kernels.routing.reference import chosen_probs, finish, route_reference  # noqa: E402


def _torch(x):
    x = np.asarray(x)
    if x.dtype == jnp.bfloat16:
        return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(x.copy())


def route_with_triton_interpreter(logits, *, top_k, capacity, policy, mask, block_tokens, bias=None):
    t, e = logits.shape
    m = jnp.ones((t,), bool) if mask is None else mask
    b = torch.zeros(e) if bias is None else _torch(bias)
    out = triton_kernel.routing_blocks_torch(_torch(logits), _torch(m), b, top_k=top_k, block_tokens=block_tokens)

    def global_result(lg, m, index, gates, block_rank, counts, prob_sum, z_sum):  # as ops does after the kernel
        rank, tokens_per_expert = ops._position_ranks(block_rank, counts, index, block_tokens)
        score = chosen_probs(lg.astype(jnp.float32), index) if policy == "priority" else None
        return finish(index, gates, rank, tokens_per_expert, prob_sum.sum(0), z_sum.sum(), m, capacity=capacity,
                      policy=policy, priority_score=score)

    return _cases.run_once(global_result, logits, m, *map(jnp.asarray, out))


@pytest.mark.parametrize("t,e,k,policy,dtype,kind,cap,masked,bt", CASES,
                         ids=[f"T{c[0]}-E{c[1]}-K{c[2]}-{c[3]}-{jnp.dtype(c[4]).name}-{c[5]}-{c[6]}cap"
                              f"{'-mask' if c[7] else ''}-bt{c[8]}" for c in CASES])
def test_interpreted_triton_kernel_matches_reference(t, e, k, policy, dtype, kind, cap, masked, bt):
    logits = make_logits(kind, t, e, dtype, seed=t + e + k)
    capacity = capacity_of(cap, t, e, k)
    mask = make_mask(t) if masked else None
    kw = dict(top_k=k, capacity=capacity, policy=policy, mask=mask)
    got = route_with_triton_interpreter(logits, block_tokens=bt, **kw)
    want = _cases.run_once(lambda lg: route_reference(lg, **kw), logits)
    for name in INT_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
    for name in ("gates", "prob_sum", "z_sum", "num_tokens"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name,
                                   **TOLERANCE[name])


@pytest.mark.parametrize("policy", ["position", "priority"])
def test_interpreted_triton_kernel_with_a_selection_bias(policy):
    """A non-zero bias (with -0.0 entries on -0.0 logits: equal scores must tie as +0.0 does)."""
    logits = jnp.round(2 * jax.random.normal(jax.random.key(0), (13, 8)))
    bias = jnp.round(jax.random.normal(jax.random.key(5), (8,))).at[0].set(-0.0)
    kw = dict(top_k=3, capacity=2, policy=policy, mask=make_mask(13), bias=bias)
    got = route_with_triton_interpreter(logits, block_tokens=4, **kw)
    want = _cases.run_once(lambda lg: route_reference(lg, **kw), logits)
    for name in INT_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)


def test_triton_impl_says_what_it_needs_off_gpu():
    from moefast.kernels.routing import route

    with pytest.raises(RuntimeError, match="triton"):
        route(jnp.zeros((4, 8)), top_k=2, capacity=2, impl="triton")


def _fake_jax_triton():
    """A stand-in for jax-triton that keeps its documented calling convention — the positional
    arrays and scalars in order, then one pointer per ``out_type`` entry, then the keyword
    constexprs — and runs the kernel in the Triton interpreter on the host (``jax.pure_callback``),
    so the JAX launcher (:func:`triton_kernel.routing_blocks`) and ``route(impl="triton")`` run on
    CPU exactly as they are wired on a GPU."""
    import types

    def triton_call(*args, kernel, out_type, grid, num_warps=None, **meta):
        arrays = [a for a in args if isinstance(a, jax.Array)]
        assert all(isinstance(a, int) for a in args if not isinstance(a, jax.Array)), "scalars must be Python ints"

        def host(*values):
            it = iter(values)
            ordered = [_torch(next(it)) if isinstance(a, jax.Array) else a for a in args]
            outs = [torch.empty(o.shape, dtype=getattr(torch, jnp.dtype(o.dtype).name)) for o in out_type]
            kernel[grid](*ordered, *outs, **meta)
            return tuple(o.numpy() for o in outs)

        return jax.pure_callback(host, tuple(out_type), *arrays)

    return types.SimpleNamespace(triton_call=triton_call)


@pytest.mark.parametrize("policy,dtype", [("position", jnp.float32), ("priority", jnp.bfloat16)])
def test_the_jax_launcher_binds_the_kernel_as_jax_triton_does(policy, dtype, monkeypatch):
    """route(impl="triton") under jit, forward and backward, through routing_blocks and the custom
    VJP, with jax-triton's argument order: equal to the reference."""
    import sys

    from moefast.kernels.routing import route

    monkeypatch.setitem(sys.modules, "jax_triton", _fake_jax_triton())
    monkeypatch.setattr(triton_kernel, "available", lambda: None)
    # routing_blocks sets Triton's ptxas knob, which writes TRITON_PTXAS_BLACKWELL_PATH to os.environ
    monkeypatch.setattr(triton_kernel, "_assembler_for_jax", lambda ptxas=None: None)
    logits = make_logits("normal", 129, 8, dtype, seed=3)
    kw = dict(top_k=2, capacity=40, policy=policy, mask=make_mask(129))

    def run(impl):
        def loss(x):
            r = route(x, impl=impl, **kw)
            return jnp.sum(r.gates * jnp.arange(1.0, 3.0)[None, :]) + jnp.sum(r.prob_sum * jnp.arange(8)) + 1e-3 * r.z_sum, r
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(logits)

    (_, got), g_got = run("triton")
    (_, want), g_want = run("reference")
    for name in INT_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
    np.testing.assert_allclose(np.asarray(got.gates), np.asarray(want.gates), **TOLERANCE["gates"])
    np.testing.assert_allclose(np.asarray(g_got, np.float32), np.asarray(g_want, np.float32), atol=1e-5, rtol=1e-5)


def test_the_launchers_check_their_arguments():
    with pytest.raises(ValueError, match="top_k=9"):
        triton_kernel.routing_blocks_torch(torch.zeros(4, 8), torch.ones(4), torch.zeros(8), top_k=9)
    with pytest.raises(ValueError, match="mask must be"):
        triton_kernel.routing_blocks_torch(torch.zeros(13, 8), torch.ones(5), torch.zeros(8), top_k=2)
    with pytest.raises(ValueError, match="top_k=9"):  # a bad argument is named before any jax-triton message
        from moefast.kernels.routing import route

        route(jnp.zeros((4, 8)), top_k=9, capacity=2, impl="triton")

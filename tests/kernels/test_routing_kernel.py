"""The Pallas routing kernel against the reference, in the style of jax's ``gpu_ops_test``.

``_RoutingKernelCases`` holds the tests; ``TestRoutingKernel`` compiles the kernel (GPU only) and
``TestRoutingKernelInterpret`` runs the same tests in the Pallas interpreter on CPU. Interpret mode
compiles one program per shape (~1–2 s here), so the grid below is a representative sample that
includes every listed size, policy, dtype and input kind at least once, with token counts that do
not divide the block size.
"""

from __future__ import annotations

import functools

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moefast.kernels.routing import IMPLS, route
from moefast.kernels.routing.ops import route_pallas
from moefast.kernels.routing.reference import route_reference

INT_FIELDS = ("expert_index", "slot", "tokens_per_expert", "num_dropped")
# Math is float32 whatever the logits' dtype; differences come only from reduction order.
TOLERANCE = {
    "gates": dict(rtol=1e-6, atol=1e-7),
    "prob_sum": dict(rtol=1e-5, atol=1e-5),
    "z_sum": dict(rtol=1e-5, atol=0.0),
    "num_tokens": dict(rtol=0.0, atol=0.0),
    "grad": dict(rtol=1e-5, atol=1e-6),  # atol relative to max |grad|
}


def make_logits(kind: str, t: int, e: int, dtype, seed: int = 0):
    """Router logits [T, E] of a given kind: random, integer-valued (ties), all-equal rows, ±1e4."""
    key = jax.random.key(seed)
    if kind == "normal":
        x = 2.0 * jax.random.normal(key, (t, e))
    elif kind == "integer":  # many exact ties, across experts and across tokens
        x = jax.random.randint(key, (t, e), -2, 3).astype(jnp.float32)
    elif kind == "equal":  # every third row all-equal, the others random integers
        x = jax.random.randint(key, (t, e), 0, 4).astype(jnp.float32)
        x = jnp.where((jnp.arange(t) % 3 == 0)[:, None], 1.0, x)
    elif kind == "large":  # ±1e4 with a few exact ties
        x = 1e4 * jax.random.randint(key, (t, e), -2, 3).astype(jnp.float32)
        x = x + jax.random.normal(jax.random.key(seed + 1), (t, e)) * 100.0 * (jnp.arange(e) % 2)[None, :]
    else:
        raise ValueError(kind)
    return x.astype(dtype)


def make_mask(t: int, seed: int = 1):
    m = jax.random.bernoulli(jax.random.key(seed), 0.75, (t,))
    return m.at[0].set(True)


def loss_cotangents(result, seed: int = 2):
    """Random cotangents for the float outputs, float0 for the integer ones."""
    keys = iter(jax.random.split(jax.random.key(seed), len(result)))
    return type(result)(*[
        np.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.floating)
        else jax.random.normal(next(keys), x.shape, jnp.float32) for x in result])


def run_once(fn, *args):
    """Compiles and runs ``fn`` once. On CPU, with XLA's backend (LLVM) optimisation off: these
    programs run once on tiny inputs, so compile time dominates (about 2x less)."""
    options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
    return jax.jit(fn).lower(*args).compile(options)(*args)


def with_vjp(fn, cotangent_seed: int = 2):
    """``logits -> (result, d<result, random cotangents>/d logits)``."""
    def run(lg):
        out, vjp = jax.vjp(fn, lg)
        (g,) = vjp(loss_cotangents(out, cotangent_seed))
        return out, g
    return run


def kernel_and_reference(kernel_fn, reference_fn, logits):
    """Both implementations' results and VJPs, from one compiled program."""
    return run_once(lambda lg: (with_vjp(kernel_fn)(lg), with_vjp(reference_fn)(lg)), logits)


def assert_same_routing(got, want):
    for name in INT_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                      err_msg=name)
    for name in ("gates", "prob_sum", "z_sum", "num_tokens"):
        np.testing.assert_allclose(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                   err_msg=name, **TOLERANCE[name])


def assert_close_grads(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    tol = TOLERANCE["grad"]
    np.testing.assert_allclose(got, want, rtol=tol["rtol"], atol=tol["atol"] * max(1.0, np.abs(want).max()))


# (tokens, experts, top_k, policy, dtype, logits kind, capacity kind, masked, block_tokens)
CASES = [
    (1, 7, 1, "position", jnp.float32, "normal", "large", False, 8),
    (1, 256, 8, "priority", jnp.bfloat16, "equal", "small", True, 8),
    (13, 7, 4, "position", jnp.float32, "integer", "small", True, 8),
    (13, 8, 8, "priority", jnp.bfloat16, "normal", "large", False, 4),
    (13, 64, 2, "priority", jnp.float32, "large", "small", True, 8),
    (13, 256, 4, "position", jnp.float32, "normal", "small", True, 16),
    (129, 7, 2, "priority", jnp.float32, "equal", "small", False, 16),
    (129, 8, 2, "position", jnp.bfloat16, "integer", "small", True, 32),
    (129, 64, 4, "position", jnp.float32, "normal", "small", False, 32),
    (129, 64, 8, "priority", jnp.bfloat16, "equal", "small", True, 128),
    (129, 256, 1, "priority", jnp.float32, "integer", "small", True, 64),
    (129, 256, 8, "position", jnp.bfloat16, "large", "large", True, 64),
    (4099, 7, 2, "position", jnp.bfloat16, "normal", "small", True, 1024),
    (4099, 8, 8, "priority", jnp.float32, "integer", "small", True, 1024),
    (4099, 8, 1, "priority", jnp.bfloat16, "large", "large", False, 512),
]


def capacity_of(kind: str, t: int, e: int, k: int) -> int:
    return t * k if kind == "large" else max(1, (t * k) // (2 * e))


class _RoutingKernelCases:
    """The tests, shared by the compiled and interpreted variants."""

    INTERPRET = False

    def route(self, logits, **kw):
        return route_pallas(logits, interpret=self.INTERPRET, **kw)

    @pytest.mark.parametrize("t,e,k,policy,dtype,kind,cap,masked,bt", CASES,
                             ids=[f"T{c[0]}-E{c[1]}-K{c[2]}-{c[3]}-{jnp.dtype(c[4]).name}-{c[5]}-{c[6]}cap"
                                  f"{'-mask' if c[7] else ''}-bt{c[8]}" for c in CASES])
    def test_matches_reference(self, t, e, k, policy, dtype, kind, cap, masked, bt):
        logits = make_logits(kind, t, e, dtype, seed=t + e + k)
        capacity = capacity_of(cap, t, e, k)
        mask = make_mask(t) if masked else None
        kw = dict(top_k=k, capacity=capacity, policy=policy, mask=mask)
        (got, got_g), (want, want_g) = kernel_and_reference(
            lambda lg: self.route(lg, block_tokens=bt, **kw), lambda lg: route_reference(lg, **kw), logits)
        assert_same_routing(got, want)
        assert_close_grads(got_g, want_g)
        assert got_g.dtype == logits.dtype
        n_real = t if mask is None else int(mask.sum())
        if n_real * k > capacity * e:  # pigeonhole: the drop path must have been exercised
            assert int(got.num_dropped) > 0

    @pytest.mark.parametrize("policy", ["position", "priority"])
    def test_bias_and_capacity_limit(self, policy):
        t, e, k = 50, 8, 2
        logits = make_logits("integer", t, e, jnp.float32, seed=3)
        bias = jnp.asarray([0.0, 0.3, -0.2, 0.0, 0.1, 0.0, 0.25, -1.0], jnp.float32)
        limit = jnp.asarray([1, 2, 3, 4, 5, 6, 0, 9], jnp.int32)
        kw = dict(top_k=k, capacity=8, policy=policy, mask=make_mask(t), bias=bias, capacity_limit=limit)
        (got, got_g), (want, want_g) = kernel_and_reference(
            lambda lg: self.route(lg, block_tokens=16, **kw), lambda lg: route_reference(lg, **kw), logits)
        assert_same_routing(got, want)
        assert_close_grads(got_g, want_g)
        assert int(got.num_dropped) > 0 and not bool(jnp.any(got.slot[got.expert_index == 6] >= 0))

    def test_block_size_and_rank_method_do_not_change_the_result(self):
        t, e, k = 77, 8, 4
        logits = make_logits("integer", t, e, jnp.float32, seed=5)
        mask = make_mask(t)
        configs = [(1, "cumsum"), (16, "cumsum"), (128, "cumsum"), (16, "matmul"), (128, "matmul")]
        kw = dict(top_k=k, capacity=20, mask=mask)
        results, want = run_once(
            lambda lg: ([self.route(lg, block_tokens=bt, rank_method=m, **kw) for bt, m in configs],
                        route_reference(lg, **kw)), logits)
        for r in results:
            assert_same_routing(r, want)
        assert int(want.num_dropped) > 0

    def test_vmap_over_groups(self):
        logits = make_logits("integer", 40, 8, jnp.float32, seed=11).reshape(2, 20, 8)
        kw = dict(top_k=2, capacity=4)
        got, want = run_once(lambda lg: (jax.vmap(lambda x: self.route(x, block_tokens=8, **kw))(lg),
                                         jax.vmap(lambda x: route_reference(x, **kw))(lg)), logits)
        assert_same_routing(got, want)

    def test_bias_gets_zero_gradient(self):
        t, e = 20, 8
        logits = make_logits("normal", t, e, jnp.float32)
        bias = jnp.linspace(-0.1, 0.1, e)

        def f(b):
            r = self.route(logits, top_k=2, capacity=4, bias=b, block_tokens=8)
            return jnp.sum(r.gates) + jnp.sum(r.prob_sum) + r.z_sum

        np.testing.assert_array_equal(np.asarray(run_once(jax.grad(f), bias)), np.zeros(e, np.float32))

    _programs: dict = {}

    def _kernel_and_reference(self, k: int, capacity: int):
        """One compiled program per (k, capacity), shared by all hypothesis examples."""
        key = (self.INTERPRET, k, capacity)
        if key not in self._programs:
            def both(lg, mask):
                kw = dict(top_k=k, capacity=capacity, mask=mask)
                return self.route(lg, block_tokens=8, **kw), route_reference(lg, **kw)
            options = {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else None
            spec = (jax.ShapeDtypeStruct((24, 6), jnp.float32), jax.ShapeDtypeStruct((24,), jnp.bool_))
            self._programs[key] = jax.jit(both).lower(*spec).compile(options)
        return self._programs[key]

    @settings(max_examples=20, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(k_capacity=st.sampled_from([(1, 3), (3, 5)]),
           logits=hnp.arrays(np.int8, (24, 6), elements=st.integers(-2, 2)),
           mask=hnp.arrays(np.bool_, (24,)))
    def test_slots_unique_and_below_capacity(self, k_capacity, logits, mask):
        """Slots are unique per expert, below capacity and without holes; counts sum to real tokens x K."""
        k, capacity = k_capacity
        e = logits.shape[1]
        r, want = self._kernel_and_reference(k, capacity)(jnp.asarray(logits, jnp.float32), jnp.asarray(mask))
        idx, slot = np.asarray(r.expert_index), np.asarray(r.slot)
        n_real = int(mask.sum())
        assert int(np.asarray(r.tokens_per_expert).sum()) == n_real * k
        assert np.all(slot[~mask] == -1) and np.all(slot < capacity)
        for ex in range(e):
            s = slot[(idx == ex) & (slot >= 0)]
            np.testing.assert_array_equal(np.sort(s), np.arange(len(s)))  # unique, 0..n-1, no holes
        assert int(r.num_dropped) == n_real * k - int((slot >= 0).sum())
        assert_same_routing(r, want)


@pytest.mark.gpu
class TestRoutingKernel(_RoutingKernelCases):
    """The compiled kernel (Pallas Triton backend)."""

    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_gpu(self):
        if jax.default_backend() != "gpu":
            pytest.skip("the compiled Pallas kernel needs an NVIDIA GPU (Pallas Triton backend); "
                        "TestRoutingKernelInterpret runs the same tests in the Pallas interpreter")


class TestRoutingKernelInterpret(_RoutingKernelCases):
    INTERPRET = True


# --- Dispatcher, argument checks and the CUDA lowering (backend-independent) ------------------------

def test_dispatcher_lists_pallas_and_auto_picks_the_reference_until_the_gpu_check():
    assert "pallas" in IMPLS and "auto" in IMPLS
    logits = make_logits("integer", 9, 4, jnp.float32)
    via_route, want = run_once(lambda lg: (route(lg, top_k=2, capacity=3, impl="pallas"),
                                           route_reference(lg, top_k=2, capacity=3)), logits)
    assert_same_routing(via_route, want)
    texts = {impl: jax.jit(lambda lg, impl=impl: route(lg, top_k=2, capacity=3, impl=impl)).lower(logits).as_text()
             for impl in ("auto", "reference", "pallas")}
    expected = "reference"  # the kernel becomes "auto" on GPU once scripts/gpu_check.py has passed there
    assert texts["auto"] == texts[expected] and texts["reference"] != texts["pallas"]


@pytest.mark.parametrize("bad,match", [
    (dict(block_tokens=12), "block_tokens"), (dict(block_tokens=0), "block_tokens"),
    (dict(block_tokens=8, rank_method="matmul"), "block_tokens"), (dict(rank_method="sort"), "rank_method"),
    (dict(policy="random"), "policy"), (dict(top_k=9), "top_k"), (dict(capacity=0), "capacity"),
    (dict(mask=jnp.ones(3, bool)), "mask"), (dict(bias=jnp.ones(3)), "bias"),
    (dict(capacity_limit=jnp.ones(3, jnp.int32)), "capacity_limit"),
])
def test_bad_arguments_raise_at_trace_time(bad, match):
    kw = dict(top_k=2, capacity=2) | bad
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(route_pallas, **kw), jax.ShapeDtypeStruct((4, 8), jnp.float32))


@pytest.mark.parametrize("t,e,k,dtype,rank_method", [(4099, 7, 3, jnp.bfloat16, "cumsum"),
                                                      (256, 256, 8, jnp.float32, "cumsum"),
                                                      (4099, 7, 3, jnp.bfloat16, "matmul")])
def test_lowers_for_cuda_from_cpu(t, e, k, dtype, rank_method):
    """The compiled (Triton) path lowers to a Triton custom call, forward and backward.

    This checks the Pallas -> Triton IR lowering (shapes, supported primitives, power-of-two blocks)
    on a CPU-only jaxlib; compiling the Triton IR to PTX needs a GPU (scripts/gpu_check.py).
    """
    f = functools.partial(route_pallas, top_k=k, capacity=64, interpret=False, block_tokens=128,
                          rank_method=rank_method)

    def loss(lg):
        r = f(lg)
        return jnp.sum(r.gates) + jnp.sum(r.prob_sum) + r.z_sum

    x = jax.ShapeDtypeStruct((t, e), dtype)
    for fn in (f, jax.grad(loss)):
        text = jax.jit(fn).trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("xla.gpu.triton") == 1, "expected exactly one Triton kernel launch"


def test_inside_shard_map():
    """Per-shard routing under jax.shard_map: the compiled path lowers with check_vma=True (outputs
    declare their varying mesh axes); the interpreter runs with check_vma=False and refuses, with a
    clear error, to run with check_vma=True (a limitation of the Pallas interpreter)."""
    from jax.sharding import AxisType, PartitionSpec as P
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices("cpu")[:4], axis_types=(AxisType.Auto,))
    logits = make_logits("integer", 64, 8, jnp.float32, seed=7)
    mask, bias = make_mask(64), jnp.linspace(0.0, 0.1, 8)
    specs = dict(mesh=mesh, in_specs=(P("data"), P("data"), P()), out_specs=(P("data"), P("data"), P("data")))

    def per_shard(fn):
        def f(lg, m, b):
            r = fn(lg, top_k=2, capacity=5, mask=m, bias=b)
            return r.slot, r.gates, r.tokens_per_expert[None, :]
        return f

    interp = functools.partial(route_pallas, interpret=True, block_tokens=8)
    got, want = run_once(lambda *a: (jax.shard_map(per_shard(interp), check_vma=False, **specs)(*a),
                                     jax.shard_map(per_shard(route_reference), **specs)(*a)),
                         logits, mask, bias)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)
    with pytest.raises(NotImplementedError, match="check_vma"):
        jax.jit(jax.shard_map(per_shard(interp), **specs)).trace(logits, mask, bias)

    compiled = functools.partial(route_pallas, interpret=False)
    text = jax.jit(jax.shard_map(per_shard(compiled), **specs)).trace(logits, mask, bias).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "xla.gpu.triton" in text

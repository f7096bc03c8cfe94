"""One Gated DeltaNet layer's train-step cost as compiled for a GPU (compile-only, no GPU needed).

Compiles forward + backward of :class:`moefast.model.gated_deltanet.GatedDeltaNet` at Qwen3.5-35B-A3B's shapes
(d_model 2048, 16 key heads and 32 value heads of 128, conv width 4, bfloat16) for one compile-only
GPU, at several row lengths with the same tokens per step (default 65,536: 16 x 4k, 4 x 16k,
1 x 64k), and prints per implementation and row length:

- XLA's temporaries (``memory_analysis().temp_size_in_bytes``) — linear in T means equal at equal
  tokens per step;
- XLA's FLOP count of the compiled module against moefast's analytical count
  (:mod:`moefast.model.flops`: the layer's projections plus the chunked gated delta rule,
  forward + backward = 3x forward). The Pallas kernel is a custom call, so XLA's count holds its
  backward (the chunked form's VJP) and not its forward: the ``chunked`` rows are the comparison.

Run: ``python benchmarks/gated_deltanet_gpu_compile.py [--gpu h100] [--tokens 65536] [--json OUT]``
(needs the gpu-compile plugin install of the README's test command). Figures: docs/perf.md.
"""

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", default="h100")
    p.add_argument("--tokens", type=int, default=65536, help="tokens per step (rows x row length)")
    p.add_argument("--rows", default="4096,16384,65536", help="row lengths T, comma-separated")
    p.add_argument("--impls", default="chunked,pallas")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from moefast.bench import gpu_compile as gc
    gc.prepare_process()
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from moefast.config import ModelConfig
    from moefast.model import flops as flops_mod
    from moefast.model.gated_deltanet import GatedDeltaNet

    devs = gc.compile_only_devices(args.gpu, 1, 1)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=devs)
    m = ModelConfig(d_model=2048, num_layers=1, layer_types=("linear_attention",), linear_num_key_heads=16,
                    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4)
    weights, _ = flops_mod._linear_params(m)
    # forward FLOPs per token: 2 per weight (in_proj, conv, out_proj) + the recurrence's chunked count
    per_token = 2 * weights + flops_mod._delta_rule_flops(m)
    rows = []
    for impl in args.impls.split(","):
        for t in (int(x) for x in args.rows.split(",")):
            b = args.tokens // t
            layer = GatedDeltaNet(m.d_model, num_key_heads=m.linear_num_key_heads,
                                  num_value_heads=m.linear_num_value_heads, key_head_dim=m.linear_key_head_dim,
                                  value_head_dim=m.linear_value_head_dim, conv_width=m.linear_conv_kernel_dim,
                                  dtype=jnp.bfloat16, init_std=0.02, out_std=0.02, norm_eps=1e-6, impl=impl,
                                  rngs=nnx.Rngs(0))
            graphdef, params = nnx.split(layer)

            def loss(params, x, seg):
                out, _ = nnx.merge(graphdef, params)(x, seg, None)
                return jnp.mean(jnp.square(out.astype(jnp.float32)))

            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
            abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), params)
            x = jax.ShapeDtypeStruct((b, t, m.d_model), jnp.bfloat16, sharding=sharding)
            seg = jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=sharding)
            with jax.set_mesh(mesh), gc._quiet_native_stderr():
                compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(abstract, x, seg).compile()
            ma = compiled.memory_analysis()
            xla = gc._flops(compiled)
            model = 3.0 * per_token * b * t
            row = {"impl": impl, "rows": b, "T": t, "temp_bytes": int(ma.temp_size_in_bytes),
                   "xla_flops": xla, "model_flops": model, "custom_calls": gc._custom_calls(compiled.as_text())}
            rows.append(row)
            print(f"{impl:8s} {b:3d} x {t:6d}: temporaries {row['temp_bytes'] / 2**30:7.2f} GiB, XLA FLOPs "
                  f"{xla:.4g}, analytical {model:.4g} ({xla / model:.3f}x), kernels {row['custom_calls']}",
                  flush=True)
    for impl in args.impls.split(","):
        mine = [r for r in rows if r["impl"] == impl]
        print(f"{impl}: temporaries {mine[-1]['T']} vs {mine[0]['T']} tokens per row: "
              f"{mine[-1]['temp_bytes'] / mine[0]['temp_bytes']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": args.gpu, "jax": jax.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The gated delta rule on CPU: the token-by-token recurrence against the chunked form at several
chunk sizes, forward + backward, side by side in one run (docs/perf.md). Run: python benchmarks/gated_delta_rule_cpu.py"""
import time, jax, jax.numpy as jnp, numpy as np
from moefast.kernels.gated_delta_rule import gated_delta_rule
B,T,H,K,V=8,1024,4,32,32   # configs/tiny_qwen3_next.yaml's DeltaNet shapes at T=1024
ks=jax.random.split(jax.random.key(0),5)
q=jax.random.normal(ks[0],(B,T,H,K)); k=jax.random.normal(ks[1],(B,T,H,K)); v=jax.random.normal(ks[2],(B,T,H,V))
q=q/jnp.linalg.norm(q,axis=-1,keepdims=True); k=k/jnp.linalg.norm(k,axis=-1,keepdims=True)
g=-jax.nn.softplus(jax.random.normal(ks[3],(B,T,H))); beta=jax.nn.sigmoid(jax.random.normal(ks[4],(B,T,H)))
seg=jnp.asarray(np.repeat(np.arange(1,5),T//4)[None].repeat(B,0),jnp.int32)
res={}
for impl, cs in (("reference",64),("chunked",64),("chunked",32),("chunked",16)):
    f=jax.jit(jax.grad(lambda q,k,v: gated_delta_rule(q,k,v,g,beta,segment_ids=seg,impl=impl,chunk_size=cs)[0].sum(), argnums=(0,1,2)))
    jax.block_until_ready(f(q,k,v))
    ts=[]
    for _ in range(5):
        t=time.perf_counter(); jax.block_until_ready(f(q,k,v)); ts.append(time.perf_counter()-t)
    res[(impl,cs)]=min(ts); print(impl, cs, f"{min(ts)*1e3:.1f} ms fwd+bwd (min of 5)", flush=True)
print({k: round(res[("reference",64)]/v,2) for k,v in res.items()})

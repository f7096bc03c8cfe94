"""Autoregressive sampling with a KV cache.

The prompt is run once (prefill) to fill the cache; each new token is then decoded alone, its
position continuing from the prompt. Routing never drops during generation (capacity = tokens), so
a token's next-token distribution is the same as in a full forward pass over the whole sequence.

Under a mesh (a run's expert/fsdp axes: :func:`moefast.parallel.inference_mesh`) the parameters
stay split as in training, so a model larger than one device can be sampled; the sequence is
repeated on each of the mesh's token shards (the batch is split over them) and row 0 is sampled.
Every process of a multi-process job runs the same loop and gets the same text.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from moefast.data import Tokenizer
from moefast.model import init_cache
from moefast.parallel import BATCH_AXES
from moefast.train.step import ModelDef

__all__ = ["generate"]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def generate(model_def: ModelDef, params: dict, tokenizer: Tokenizer, prompt: str, *,
             max_new_tokens: int = 200, temperature: float = 0.8, seed: int = 0,
             routing_state: dict | None = None, return_logits: bool = False,
             mesh: jax.sharding.Mesh | None = None):
    """Samples a continuation of ``prompt``.

    Args:
      model_def: model structure; ``params``: its parameters (pure dict).
      tokenizer: the run's tokenizer; the prompt is encoded after its BOS token, when it has one.
      prompt: text to continue (non-empty when the tokenizer has no BOS).
      max_new_tokens: tokens to sample at most (stops early at EOS). BOS, PAD (unless it is EOS)
        and ids at or above the tokenizer's ``vocab_size`` are never sampled.
      temperature: softmax temperature (> 0); 0 means greedy (argmax).
      seed: sampling seed.
      routing_state: the run's routing state (selection bias), from the checkpoint.
      return_logits: also return the float32 [steps, V] next-token logits used at each step.
      mesh: the mesh ``params`` are sharded over (e.g. a :class:`~moefast.train.Trainer`'s);
        ``None``: no mesh (``params`` on one device, or left to the partitioner).

    Returns:
      The sampled text (without the prompt); with ``return_logits``, ``(text, logits)``.

    Raises:
      ValueError: negative temperature, an empty prompt with a tokenizer without BOS (nothing to
        condition on), or prompt + ``max_new_tokens`` longer than ``model.max_seq_len`` tokens.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    max_len = model_def.cfg.model.max_seq_len
    bos = np.asarray([] if tokenizer.bos_id is None else [tokenizer.bos_id], np.int32)
    ids = np.concatenate([bos, tokenizer.encode(prompt)]).astype(np.int32)
    if not len(ids):
        raise ValueError("the prompt is empty and the tokenizer has no BOS token to start from; pass a prompt")
    total = len(ids) + max_new_tokens
    if total > max_len:
        incl = " incl. BOS" if len(bos) else ""
        raise ValueError(f"prompt ({len(ids)} tokens{incl}) + max_new_tokens ({max_new_tokens}) = "
                         f"{total} exceeds model.max_seq_len={max_len}; shorten the prompt or "
                         "generate fewer tokens")
    cache_len = min(max_len, _round_up(total, 128))
    vocab = model_def.abstract_params["embed"].shape[0]
    banned = np.zeros((vocab,), bool)
    banned[tokenizer.vocab_size:] = True
    banned[[i for i in tokenizer.special_ids if i != tokenizer.eos_id]] = True  # BOS, PAD; EOS stops

    rows, batch_axes = 1, ()
    if mesh is not None:  # the batch is split over the token axes: one copy of the sequence per shard
        batch_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
        rows = math.prod(mesh.shape[a] for a in batch_axes)
    if mesh is None:
        jit_step = jit_sample = jax.jit
    else:  # logits (row 0) and sampled ids replicated, the cache split like the batch
        rep, split = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*s)) for s in ((), (batch_axes,)))
        jit_step = functools.partial(jax.jit, out_shardings=(rep, split))
        jit_sample = functools.partial(jax.jit, out_shardings=rep)
    module = model_def.module(params)

    def step(params, routing, cache, tokens, index):
        out = model_def.module(params)(tokens, cache=cache, cache_index=index, drop_tokens=False,
                                       routing_state=routing)
        return out.logits[0, -1], out.cache

    @jit_step
    def prefill(params, routing, cache, tokens):
        return step(params, routing, cache, jnp.broadcast_to(tokens[None], (rows, tokens.shape[0])), 0)

    @jit_step
    def decode(params, routing, cache, token, index):
        return step(params, routing, cache, jnp.broadcast_to(token, (rows, 1)), index)

    @jit_sample
    def sample(logits, i):
        logits = jnp.where(banned, -jnp.inf, logits)
        if temperature == 0:
            return jnp.argmax(logits).astype(jnp.int32)
        key = jax.random.fold_in(jax.random.key(seed), i)
        return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

    # Host inputs are numpy (the same in every process); device values stay inside the jitted steps.
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        cache = jax.jit(lambda: init_cache(module, rows, cache_len),
                        out_shardings=None if mesh is None else split)()
        logits, cache = prefill(params, routing_state, cache, ids)
        out_ids, all_logits = [], []
        for i in range(max_new_tokens):
            all_logits.append(logits)
            tok = sample(logits, np.int32(i))
            tok_i = int(tok)
            if tok_i == tokenizer.eos_id:
                break
            out_ids.append(tok_i)
            if i + 1 < max_new_tokens:
                logits, cache = decode(params, routing_state, cache, tok, np.int32(len(ids) + i))
    text = tokenizer.decode(np.asarray(out_ids, np.int32))
    if return_logits:
        return text, np.stack([np.asarray(x) for x in all_logits]) if all_logits else np.zeros((0, vocab))
    return text

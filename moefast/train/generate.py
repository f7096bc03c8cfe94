"""Autoregressive sampling with a KV cache.

The prompt is run once (prefill) to fill the cache; each new token is then decoded alone, its
position continuing from the prompt. Routing never drops during generation (capacity = tokens), so
a token's next-token distribution is the same as in a full forward pass over the whole sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moefast.data import Tokenizer
from moefast.model import init_cache
from moefast.train.step import ModelDef

__all__ = ["generate"]


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def generate(model_def: ModelDef, params: dict, tokenizer: Tokenizer, prompt: str, *,
             max_new_tokens: int = 200, temperature: float = 0.8, seed: int = 0,
             routing_state: dict | None = None, return_logits: bool = False):
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
                         "lower --max-new-tokens")
    cache_len = min(max_len, _round_up(total, 128))
    vocab = model_def.abstract_params["embed"].shape[0]
    banned = np.zeros((vocab,), bool)
    banned[tokenizer.vocab_size:] = True
    banned[[i for i in tokenizer.special_ids if i != tokenizer.eos_id]] = True  # BOS, PAD; EOS stops
    banned = jnp.asarray(banned)

    @jax.jit
    def prefill(params, cache, tokens):
        out = model_def.module(params)(tokens, cache=cache, cache_index=0, drop_tokens=False,
                                       routing_state=routing_state)
        return out.logits[:, -1], out.cache

    @jax.jit
    def decode(params, cache, token, index):
        out = model_def.module(params)(token[None, None], cache=cache, cache_index=index, drop_tokens=False,
                                       routing_state=routing_state)
        return out.logits[:, -1], out.cache

    @jax.jit
    def sample(logits, key):
        logits = jnp.where(banned, -jnp.inf, logits[0])
        if temperature == 0:
            return jnp.argmax(logits).astype(jnp.int32)
        return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

    cache = init_cache(model_def.module(params), 1, cache_len)
    logits, cache = prefill(params, cache, jnp.asarray(ids)[None])
    key = jax.random.key(seed)
    out_ids, all_logits = [], []
    for i in range(max_new_tokens):
        all_logits.append(logits[0])
        tok = sample(logits, jax.random.fold_in(key, i))
        tok_i = int(tok)
        if tok_i == tokenizer.eos_id:
            break
        out_ids.append(tok_i)
        if i + 1 < max_new_tokens:
            logits, cache = decode(params, cache, tok, jnp.int32(len(ids) + i))
    text = tokenizer.decode(np.asarray(out_ids, np.int32))
    if return_logits:
        return text, np.stack([np.asarray(x) for x in all_logits]) if all_logits else np.zeros((0, vocab))
    return text

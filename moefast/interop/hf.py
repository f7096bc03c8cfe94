"""Hugging Face checkpoints in and out: the generic engine over :mod:`moefast.interop.families`.

Dimension letters: L layers, D d_model, H query heads, G key/value heads, Hd head_dim, F d_ff (of
the routed experts), Fd dense d_ff, Fs shared-expert d_ff, E experts, V vocab.

A Hugging Face (HF) model directory holds ``config.json`` and its weights in ``*.safetensors``
files (one ``model.safetensors``, or shards listed in ``model.safetensors.index.json``). Each family
moefast supports is one :class:`~moefast.interop.families.FamilySpec` in
:data:`~moefast.interop.families.REGISTRY` (its config keys and tensor table); this module reads
and writes any of them and names none.

* :func:`config_from_hf` reads ``config.json`` into an :class:`~moefast.config.ExperimentConfig`
  (``model`` and ``moe`` sections from the checkpoint, everything else from a base config and
  overrides). Hybrid families (Qwen3-Next, Qwen3.5-MoE) give ``model.layer_types`` (transformers'
  default from ``full_attention_interval`` when absent), the ``linear_*`` keys, the attention output
  gate and zero-centred norms; Nemotron-H (``nemotron_h``) its pattern of single sublayers
  (``layers_block_type``: Mamba-2, attention, MoE, MLP) as ``model.layer_types`` with Mamba-2's
  shape in the ``linear_*`` keys; a vision-language config (Qwen3.5-MoE's ``qwen3_5_moe``) is read
  from its ``text_config``. Options moefast does not implement (sliding windows, RoPE scaling other than the
  YaRN of families with ``yarn``, partial rotary outside families with ``partial_rotary``, a
  ``scoring_func`` / ``topk_method`` the family's router does not compute, a family's own
  ``unsupported`` keys, a ``quantization_config`` other than FP8 blocks, unknown
  ``model_type``) raise :class:`HFFormatError` naming the field.
* :func:`load_hf_params` streams the weights tensor by tensor into moefast's parameters (either
  layer layout, ``model.scan_layers``), each straight into its target sharding: a device's shard
  of an expert tensor reads only that device's experts from disk, so no host holds the whole model.
  Both on-disk expert layouts are read: one tensor per expert (what ``save_pretrained`` writes by
  default) and fused ``experts.gate_up_proj`` [E, 2F, D] / ``experts.down_proj`` [E, D, F]
  (transformers 5's in-memory layout, ``save_pretrained(save_original_format=False)``).
  Multi-token-prediction layers (DeepSeek-V3, GLM-4.5: ``num_nextn_predict_layers`` layers after
  ``num_hidden_layers``, their copies of the embedding and output head equal to the main ones,
  which moefast shares; Qwen3-Next, Qwen3.5: ``mtp_num_hidden_layers`` layers ``mtp.layers.{j}``
  with one ``mtp.fc``, its norms and ``mtp.norm``, at most one of them) are read into the model's
  ``model.mtp_depth`` MTP modules (by default as many as the files hold, see
  :func:`config_from_hf`); layers beyond ``model.mtp_depth`` are skipped with a note.
  transformers' forward pass never runs them (vLLM's speculative decoding does). FP8 block-quantized
  checkpoints (DeepSeek-V3/R1, Kimi K2 on the hub: F8_E4M3 weights [O, I] with float32
  ``weight_scale_inv`` [ceil(O/BO), ceil(I/BI)], config.json's ``quantization_config``) are
  dequantized on read, tensor by tensor, to float32 (with a note); every other quantization is
  refused naming ``quantization_config.quant_method``. Parts of a checkpoint that a family marks
  as not read (``FamilySpec.skipped_tensors``: a vision tower, ``mtp.*`` tensors beyond
  ``mtp_num_hidden_layers``) are left out with one note.
* :func:`load_hf_routing` reads a router's selection bias (``e_score_correction_bias`` [E] per MoE
  layer) into moefast's routing state ``{"bias": [L_moe, E], "load_ema": [L_moe, E]}`` float32,
  where moefast keeps it (out of the parameters and the optimizer).
* :func:`save_peft_adapter`, :func:`load_peft_adapter` and :func:`adapter_lora_config`: a LoRA
  run's adapters as a PEFT adapter directory and back (:mod:`.hf_adapter`); :func:`save_hf` writes
  a LoRA run with its adapters merged.
* :func:`save_hf` writes the reverse: safetensors (sharded above ``max_shard_bytes``, with the
  index; the routing state's bias as each MoE layer's ``e_score_correction_bias``; the MTP
  modules as layers ``num_hidden_layers + k - 1`` with ``num_nextn_predict_layers``, or as
  Qwen3-Next's ``mtp.*`` with ``mtp_num_hidden_layers``), a
  ``config.json`` that ``transformers.AutoModelForCausalLM.from_pretrained`` loads, and the
  tokenizer files of a run that has them. A model read from a vision-language checkpoint is
  written as its text model (``FamilySpec.export_as``: Qwen3.5-MoE as ``qwen3_5_moe_text``). A
  tensor that several parameters share (Qwen3-Next's gated ``q_proj``: query and gate rows per
  head) is assembled from the :class:`~moefast.interop.families.Part` s their transforms write.

Conventions (checked against transformers 5.24 by ``tests/interop/test_hf.py``): HF linear weights
are [out, in] (moefast's are [in, out]); moefast fuses q|k|v into one [D, (H + 2G)·Hd] matrix and
each SwiGLU's gate|up into [D, 2F] (gate first, as HF's ``gate_up_proj``); both use split-half
RoPE (``rotate_half``) with ``inv_freq = base^(-2i/Hd)``, so q/k weights need no permutation,
except the RoPE columns of checkpoints stored interleaved (DeepSeek's ``rope_interleave``), permuted
once per parameter by the family's ``rope_interleave`` table at import and back at export.

Where things are: :mod:`.hf_files` (the checkpoint's files: safetensors headers and shards, FP8
blocks, :class:`HFFormatError`), :mod:`.hf_tables` (which HF tensor holds which parameter, per
layer and per MTP layer), :mod:`.hf_configs` (``config.json`` in and out, the family a model is
written as), :mod:`.hf_read` and :mod:`.hf_write` (the weights in and out), :mod:`.hf_adapter`
(LoRA adapters out and in). This module is the
public face: the names below import from here.
"""

from moefast.interop.hf_configs import FAMILIES, _hf_sections, config_from_hf, family_spec, hf_family
from moefast.interop.hf_files import HFFormatError, _Files, hf_config
from moefast.interop.hf_read import _abstract_params, load_hf, load_hf_params, load_hf_routing
from moefast.interop.hf_write import save_hf
from moefast.interop.hf_adapter import adapter_lora_config, load_peft_adapter, save_peft_adapter

__all__ = ["FAMILIES", "HFFormatError", "adapter_lora_config", "config_from_hf", "family_spec", "hf_config",
           "hf_family", "load_hf", "load_hf_params", "load_hf_routing", "load_peft_adapter", "save_hf",
           "save_peft_adapter"]
# private names other moefast modules and the tests use
_PRIVATE = (_Files, _abstract_params, _hf_sections)

"""Interoperability with other checkpoint formats: Hugging Face (:mod:`moefast.interop.hf`, the
generic engine; one :class:`~moefast.interop.families.FamilySpec` per family in
:mod:`moefast.interop.families`).

Depends on :mod:`moefast.config` and :mod:`moefast.model` only (never on training code).
"""

from moefast.interop.hf import (FAMILIES, HFFormatError, adapter_lora_config, config_from_hf, load_hf, load_hf_params,
                                load_hf_routing, load_peft_adapter, save_hf, save_peft_adapter)

__all__ = ["FAMILIES", "HFFormatError", "adapter_lora_config", "config_from_hf", "load_hf", "load_hf_params",
           "load_hf_routing", "load_peft_adapter", "save_hf", "save_peft_adapter"]

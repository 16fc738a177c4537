"""GPT-2, Llama, Ministral and Mixtral: the families pretrain/model/hf_mapping.py maps (one rule table both ways).

A GPT-layout recipe is GPT-2's; a Llama-layout one without QK-norm is Llama's, Ministral's with sliding-window
layers, Mixtral's with experts (with QK-norm it is Qwen3's: pretrain/hf/families/qwen3.py)."""
from __future__ import annotations

from ...config.schema import JobConfig
from ...model import hf_mapping
from ..exporters import Exporter, register


def _llama_layout(cfg: JobConfig) -> bool:
    return cfg.model.arch == "llama" and not cfg.model.mla.enabled and not cfg.model.qk_layernorm


def _mismatch(config, cfg: JobConfig) -> str:
    return "; ".join(filter(None, [hf_mapping.window_mismatch(config, cfg), hf_mapping.rope_mismatch(config, cfg)]))


def _family(name: str, architecture: str, claims) -> Exporter:
    return register(Exporter(name=name, architectures=(architecture,), claims=claims,
                             architecture=lambda cfg: architecture, unsupported=hf_mapping.unsupported,
                             to_hf=hf_mapping.to_hf, hf_config=hf_mapping.hf_config, from_hf=hf_mapping.from_hf,
                             mismatch=_mismatch))


GPT2 = _family("gpt2", "GPT2LMHeadModel", lambda cfg: cfg.model.arch == "gpt" and not cfg.model.mla.enabled)
LLAMA = _family("llama", "LlamaForCausalLM", lambda cfg: _llama_layout(cfg) and not cfg.moe.enabled
                and cfg.model.window_size is None)
MINISTRAL = _family("ministral", "MinistralForCausalLM", lambda cfg: _llama_layout(cfg) and not cfg.moe.enabled
                    and cfg.model.window_size is not None)
MIXTRAL = _family("mixtral", "MixtralForCausalLM", lambda cfg: _llama_layout(cfg) and cfg.moe.enabled)

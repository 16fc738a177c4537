"""DeepseekV3: every recipe with multi-head latent attention (pretrain/hf/deepseek_export.py), export and import."""
from __future__ import annotations

from .. import deepseek_export
from ..exporters import Exporter, register

DEEPSEEK_V3 = register(Exporter(
    name="deepseek_v3", architectures=(deepseek_export.ARCHITECTURE,), claims=lambda cfg: cfg.model.mla.enabled,
    architecture=deepseek_export.architecture, unsupported=deepseek_export.unsupported,
    to_hf=deepseek_export.to_hf, hf_config=deepseek_export.hf_config, from_hf=deepseek_export.from_hf,
    mismatch=deepseek_export.mismatch, hf_groups=deepseek_export.hf_groups))

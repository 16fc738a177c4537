"""Megatron-BERT (export and import) and T5 (refused: no transformers class matches it); pretrain/hf/bert_export.py."""
from __future__ import annotations

from .. import bert_export
from ..exporters import Exporter, register

MEGATRON_BERT = register(Exporter(
    name="megatron_bert", architectures=("MegatronBertForPreTraining", "MegatronBertForMaskedLM"),
    claims=lambda cfg: cfg.model.arch == "bert", architecture=bert_export.architecture,
    unsupported=bert_export.unsupported, to_hf=bert_export.to_hf, hf_config=bert_export.hf_config,
    from_hf=bert_export.from_hf, mismatch=bert_export.mismatch, hf_groups=bert_export.hf_groups))
T5 = register(Exporter(
    name="t5", architectures=("T5ForConditionalGeneration",), claims=lambda cfg: cfg.model.arch == "t5",
    architecture=bert_export.architecture, unsupported=bert_export.unsupported, to_hf=bert_export.to_hf,
    hf_config=bert_export.hf_config))

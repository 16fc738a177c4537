"""The data chapter's config: the `data.fim` section and the rules of FIM and document masking.

Names follow Megatron-LM's `--fim-*` flags (GPTFIMDatasetConfig) without the prefix; the transform
is pretrain/data/fim.py. The sentinel tokens must be in the tokenizer (checked when the datasets are
built, where the tokenizer is loaded): preprocessing's `tokenizer.fim_sentinels: true` trains
them in (conf/data/demo-fim.yaml).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from common.config import doc


@dataclass
class FimConfig:
    rate: float = doc(0.0, "Probability that a document (each EOD-separated segment of a packed sample) is put in "
                           "fill-in-the-middle form (--fim-rate); 0: off.")
    spm_rate: float = doc(0.5, "Of the FIM documents, the share in SPM order (<fim_prefix><fim_suffix> suffix "
                               "<fim_middle> prefix middle) instead of PSM (--fim-spm-rate).")
    split_sample: Optional[str] = doc(None, "A single-token string (e.g. a file separator) splitting each document "
                                            "into fragments, each FIM'd at fragment_rate (--fim-split-sample); "
                                            "null: whole documents.")
    fragment_rate: float = doc(0.5, "With split_sample: FIM probability of each fragment of a document chosen at "
                                    "`rate` (--fim-fragment-rate).")
    no_prefix: Optional[str] = doc(None, "Leave a document whose text starts with this string as it is "
                                         "(--fim-no-prefix); null: none.")
    prefix_token: str = doc("<fim_prefix>", "Sentinel before the prefix (FIM_PREFIX).")
    middle_token: str = doc("<fim_middle>", "Sentinel before the middle (FIM_MIDDLE).")
    suffix_token: str = doc("<fim_suffix>", "Sentinel before the suffix (FIM_SUFFIX).")
    pad_token: str = doc("<fim_pad>", "Pads a sample that FIM left shorter; its label positions get no loss "
                                      "(FIM_PAD).")

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def sentinels(self) -> dict:
        return {"prefix": self.prefix_token, "middle": self.middle_token, "suffix": self.suffix_token,
                "pad": self.pad_token}


def fim_problems(cfg, add) -> None:
    """The rules of `data.fim`; `add` collects each problem."""
    fim, data = cfg.data.fim, cfg.data
    for key in ("rate", "spm_rate", "fragment_rate"):
        value = getattr(fim, key)
        if not 0.0 <= value <= 1.0:
            add(f"data.fim.{key}={value} is not a probability. Fix: a value in [0, 1].")
    if not fim.enabled:
        return
    if data.mock:
        add("data.fim.rate > 0 with data.mock: FIM cuts document text, mock data has none. Fix: set data.fim.rate=0 "
            "or train on a blend (data=demo-fim).")
    elif not data.tokenizer.path:
        add("data.fim.rate > 0 needs the tokenizer (FIM decodes and re-encodes documents). Fix: set "
            "data.tokenizer.path.")
    names = list(fim.sentinels().values())
    if any(not n for n in names) or len(set(names)) != len(names):
        add(f"data.fim sentinel tokens {names} must be four distinct non-empty strings.")
    if fim.split_sample is not None and fim.split_sample in names:
        add(f"data.fim.split_sample={fim.split_sample!r} is a FIM sentinel. Fix: a separator token of the data.")


def document_mask_problems(cfg, add) -> None:
    """Compose-time rules: which runs can honour data.document_mask (pretrain/data/packing.py), named with the fix."""
    if not cfg.data.document_mask:
        return
    m, p = cfg.model, cfg.parallel
    if cfg.cluster.gpu_type == "cpu":
        if m.transformer_impl == "transformer_engine":
            add("data.document_mask=true on cluster.gpu_type=cpu uses an explicit s x s mask in megatron-core's "
                "local attention; model.transformer_impl=transformer_engine has no CPU path. Fix: "
                "model.transformer_impl=local (or auto).")
        return
    if m.attention_backend in ("unfused", "local"):
        add(f"data.document_mask=true on GPUs with model.attention_backend={m.attention_backend}: the packed "
            "(thd) format runs in TE's flash/fused kernels or torch's (FlexAttention), not in an unfused "
            "attention. Fix: model.attention_backend=auto (or torch).")
    if p.context_parallel_size > 1:
        add(f"data.document_mask=true with parallel.context_parallel_size={p.context_parallel_size}: splitting "
            "packed (thd) sequences over CP ranks is not written. Fix: CP=1 (TP with sequence_parallel and "
            "recompute for long sequences), or data.document_mask=false.")

"""The objective chapter's config: what the model is trained to predict.

`causal_lm` is next-token prediction (GPT, Llama). The encoder objectives run on megatron-core's
BertModel (`masked_lm`: BERT's masked LM with a next-sentence or sentence-order head) and the
denoising objectives on its T5Model (`denoising`: T5 span corruption or BART text infilling, with
BART's sentence permutation and document rotation). Each model family has one objective
(`ARCH_OBJECTIVE`); the samples are built in pretrain/objectives/ from sentence-level indexed
datasets (preprocessing's `tokenize.split_sentences`), docs/objectives.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from common.config import doc

OBJECTIVES = ("causal_lm", "masked_lm", "denoising")
ARCH_OBJECTIVE = {"gpt": "causal_lm", "llama": "causal_lm", "bert": "masked_lm", "t5": "denoising"}
BINARY_HEADS = (None, "nsp", "sop")
DENOISING_STYLES = ("t5", "bart")


@dataclass
class MaskedLMConfig:
    mask_prob: float = doc(0.15, "Fraction of the tokens chosen for prediction (BERT: 0.15).")
    mask_token_fraction: float = doc(0.8, "Of the chosen tokens, the share replaced by [MASK] (BERT: 0.8).")
    random_token_fraction: float = doc(0.1, "Of the chosen tokens, the share replaced by a random token (BERT: 0.1); "
                                            "the rest stay as they are.")
    binary_head: Optional[str] = doc("nsp", "Sentence-pair task: 'nsp' (segment B follows A, or comes from another "
                                            "document, 50/50: BERT), 'sop' (A and B swapped 50%: ALBERT, Megatron-LM)"
                                            " or null (masked LM alone).")
    short_seq_prob: float = doc(0.1, "Probability that a sample's target length is drawn shorter than seq_length "
                                     "(BERT's short_seq_prob).")


@dataclass
class DenoisingConfig:
    style: str = doc("t5", "'t5': span corruption (each span -> one sentinel; target: sentinels and spans) or "
                           "'bart': text infilling (each span -> one [MASK]; target: the whole text).")
    noise_density: float = doc(0.15, "Fraction of the input tokens corrupted (T5: 0.15).")
    mean_span_length: float = doc(3.0, "Mean length of a corrupted span (T5: 3; BART: Poisson lambda 3).")
    sentence_permutation: bool = doc(False, "BART: shuffle the order of the sample's sentences before span noise.")
    document_rotation: bool = doc(False, "BART: rotate the sample to start at a uniformly drawn token.")


@dataclass
class ObjectiveConfig:
    name: str = doc("causal_lm", "'causal_lm' (GPT, Llama), 'masked_lm' (model.arch=bert) or 'denoising' "
                                 "(model.arch=t5).")
    masked_lm: MaskedLMConfig = doc(None, "BERT's masked LM and sentence-pair head.", factory=MaskedLMConfig)
    denoising: DenoisingConfig = doc(None, "T5 / BART denoising and BART's document noises.",
                                     factory=DenoisingConfig)

    @property
    def causal(self) -> bool:
        return self.name == "causal_lm"


def objective_problems(cfg, add) -> None:
    """What an objective cannot be combined with, each naming the field and the fix."""
    o, m, p = cfg.objective, cfg.model, cfg.parallel
    want = ARCH_OBJECTIVE.get(m.arch)
    if want and o.name != want:
        add(f"objective.name={o.name} with model.arch={m.arch}: {m.arch} trains on '{want}'. Fix: "
            f"objective.name={want}, or the model.arch of that objective "
            f"({', '.join(a for a, n in ARCH_OBJECTIVE.items() if n == o.name)}).")
    if o.masked_lm.binary_head not in BINARY_HEADS:
        add(f"objective.masked_lm.binary_head={o.masked_lm.binary_head!r}: choose nsp, sop or null.")
    if o.denoising.style not in DENOISING_STYLES:
        add(f"objective.denoising.style={o.denoising.style!r}: choose t5 or bart.")
    ml, dn = o.masked_lm, o.denoising
    if not 0 < ml.mask_prob < 1 or not 0 < dn.noise_density < 1:
        add("objective.masked_lm.mask_prob and objective.denoising.noise_density must be in (0, 1).")
    if ml.mask_token_fraction + ml.random_token_fraction > 1 or min(ml.mask_token_fraction,
                                                                    ml.random_token_fraction) < 0:
        add("objective.masked_lm.mask_token_fraction + random_token_fraction must be in [0, 1] (the rest are kept).")
    if dn.mean_span_length < 1:
        add(f"objective.denoising.mean_span_length={dn.mean_span_length}: a span has at least one token.")
    if o.causal:
        if m.num_decoder_layers is not None or m.decoder_seq_length is not None:
            add("model.num_decoder_layers / decoder_seq_length are T5's (model.arch=t5). Fix: remove them.")
        return
    # The encoder objectives use what megatron-core's BertModel and T5Model carry on one pipeline stage.
    refused = {"parallel.pipeline_model_parallel_size > 1": p.pipeline_model_parallel_size > 1,
               "parallel.context_parallel_size > 1": p.context_parallel_size > 1,
               "moe.num_experts": cfg.moe.enabled, "peft.method": cfg.peft.enabled,
               "distill.teacher": cfg.distill.enabled, "data.fim.rate > 0": cfg.data.fim.enabled,
               "data.document_mask": cfg.data.document_mask, "data.mix_phases": bool(cfg.data.mix_phases),
               "data.mock": cfg.data.mock, "eval.downstream_tasks": bool(cfg.eval.downstream_tasks),
               "model.z_loss_coeff": bool(m.z_loss_coeff), "model.qk_layernorm": m.qk_layernorm,
               "model.embedding_layernorm": m.embedding_layernorm, "parallel.sequence_parallel": p.sequence_parallel,
               "precision.fp8": bool(cfg.precision.fp8),
               "model.transformer_impl=transformer_engine": m.transformer_impl == "transformer_engine"}
    for field, on in refused.items():
        if on:
            add(f"{field} with objective.name={o.name}: not carried by the {m.arch} model as built here "
                "(megatron-core's local layer spec on one pipeline stage: dense, no q/k or embedding norm, no "
                "sequence parallel or Transformer Engine/FP8; sentence-level data: docs/objectives.md). Fix: remove "
                "it.")
    if o.name == "masked_lm" and p.engine == "deepspeed" and cfg.deepspeed.zero_stage == 3:
        add("deepspeed.zero_stage=3 with objective.name=masked_lm: BERT's first loss under ZeRO-3 differs from "
            "ZeRO-0..2's and megatron-core's (9.0737 vs 9.0643 on bert-tiny; docs/objectives.md), not yet "
            "explained. Fix: deepspeed.zero_stage<=2, or parallel.engine=megatron.")


def span_counts(raw_tokens: int, noise_density: float, mean_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a `raw_tokens` sample, as T5's random_spans_noise_mask counts them."""
    noise = min(max(int(round(raw_tokens * noise_density)), 1), raw_tokens - 1)
    return noise, max(int(round(noise / mean_span_length)), 1)


def denoising_lengths(seq_length: int, dn: DenoisingConfig) -> tuple[int, int]:
    """(raw tokens read per sample, decoder length). T5: the corrupted encoder input with its closing </s>
    fills `seq_length` (T5's random_spans_helper: 568 raw tokens and 114 targets for 512); the decoder
    writes sentinels and spans. BART: infilling shortens the text by a random amount (and a zero-length
    span lengthens it by one [MASK]), so the raw text is seq_length - 1 tokens, as BART's encoder and
    decoder share one length; the decoder writes it whole. Both with </s> (<s> in front as decoder input)."""
    if dn.style == "bart":
        return seq_length - 1, seq_length
    raw = seq_length
    while True:
        noise, spans = span_counts(raw + 1, dn.noise_density, dn.mean_span_length)
        if raw + 1 - noise + spans + 1 > seq_length:
            break
        raw += 1
    noise, spans = span_counts(raw, dn.noise_density, dn.mean_span_length)
    return raw, noise + spans + 1

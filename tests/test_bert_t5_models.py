"""megatron-core's BertModel and T5Model as the masked_lm / denoising objectives build them (pretrain/model/bert.py,
t5.py, pretrain/objectives/masked_lm.py, denoising.py), on CPU.

In-process at TP=1: the objectives' losses equal a hand-computed reference from the models' logits (masked-LM
token mean + the binary head's sample mean; the decoder's token mean), the T5 masks are megatron-core's
(T5MaskedWordPieceDataset.config_attention_mask, local form), and the BERT export, loaded by real transformers
(`MegatronBertForPreTraining` / `MegatronBertForMaskedLM.from_pretrained`), gives the same logits. On 2 gloo
processes: TP=2 computes TP=1's losses, before and after an SGD step (so the gradients, TP reductions included,
agree).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.functional as F

from tests import megatron_harness as mh

if TYPE_CHECKING:
    from pretrain.config.schema import JobConfig

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=200",
         "model.seq_length=32", "model.hidden_dropout=0.0", "model.attention_dropout=0.0"]
ARCH = {"bert": ["model.arch=bert", "objective.name=masked_lm"],
        "t5": ["model.arch=t5", "objective.name=denoising", "model.num_decoder_layers=1"]}
STEPS, LR = 1, 0.1


def model_config(arch: str, overrides=()) -> JobConfig:
    """gpt-tiny's shape as BERT / T5, derived but not validated: the objectives refuse mock data, and these
    tests feed the models their own batches."""
    # imported here, not at the top: the spawned ranks import this module and need no Hydra
    from omegaconf import OmegaConf

    from pretrain.config.compose import compose_recipe
    from pretrain.config.derive import derive
    cfg = compose_recipe("gpt-tiny", ["data=mock", *SMALL, *ARCH[arch], *overrides])
    cfg.name = "bert-t5-test"
    return derive(OmegaConf.to_object(cfg))


def build(cfg: JobConfig):
    from pretrain.model.init import layout_invariant_init
    from pretrain.objectives.registry import objective_for
    objective = objective_for(cfg)
    model = objective.build_model(None)
    layout_invariant_init(cfg, model, 0)
    return objective, model


def bert_batch(cfg: JobConfig, rows: int = 4, seed: int = 0) -> dict:
    """Random tokens, pads at the end of every other row, ~15 % of the real tokens predicted."""
    s, v = cfg.model.seq_length, cfg.model.vocab_size
    g = torch.Generator().manual_seed(seed)
    padding = torch.ones(rows, s)
    padding[1::2, s - 7:] = 0
    loss_mask = (torch.rand(rows, s, generator=g) < 0.15).float() * padding
    loss_mask[:, 1] = 1
    types = torch.zeros(rows, s, dtype=torch.long)
    types[:, s // 2:] = 1
    return {"tokens": torch.randint(0, v, (rows, s), generator=g) * padding.long(), "types": types * padding.long(),
            "labels": torch.where(loss_mask > 0, torch.randint(0, v, (rows, s), generator=g), -1),
            "loss_mask": loss_mask, "padding_mask": padding, "is_random": torch.tensor([0, 1, 1, 0][:rows])}


def t5_batch(cfg: JobConfig, rows: int = 4, seed: int = 0) -> dict:
    s, sd, v = cfg.model.seq_length, cfg.derived.decoder_seq_length, cfg.model.vocab_size
    g = torch.Generator().manual_seed(seed)
    enc, dec = torch.ones(rows, s), torch.ones(rows, sd)
    enc[1::2, s - 5:] = 0
    dec[1::2, sd - 2:] = 0
    return {"text_enc": torch.randint(1, v, (rows, s), generator=g) * enc.long(),
            "text_dec": torch.randint(1, v, (rows, sd), generator=g) * dec.long(),
            "labels": torch.randint(1, v, (rows, sd), generator=g) * dec.long(), "loss_mask": dec.clone(),
            "enc_mask": enc, "dec_mask": dec}


def losses_and_step(objective, model, batch: dict) -> list:
    """(loss, metrics) before and after `STEPS` SGD steps on the objective's loss (no sequence parallelism, which
    these models refuse: every replicated parameter's gradient is already whole on each TP rank)."""
    out = []
    for step in range(STEPS + 1):
        output, loss_func = objective.forward(model, batch)
        loss, metrics = loss_func(output)
        out.append({k: v.item() for k, v in metrics.items()})
        if step == STEPS:
            break
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
                    p.grad = None
    return out


@pytest.fixture(scope="module")
def tp1(single_rank_megatron):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(1234)


@pytest.mark.parametrize("binary", ["sop", "null"])
def test_masked_lm_loss_is_the_token_mean_plus_the_binary_mean(tp1, binary):
    cfg = model_config("bert", [f"objective.masked_lm.binary_head={binary}"])
    objective, model = build(cfg)
    model.eval()
    b = bert_batch(cfg)
    with torch.no_grad():
        output, loss_func = objective.forward(model, b)
        loss, metrics = loss_func(output)
        logits, binary_logits = model(b["tokens"], b["padding_mask"],
                                      tokentype_ids=b["types"] if binary == "sop" else None)
    picked = b["loss_mask"] > 0
    mlm = F.cross_entropy(logits[picked].float(), b["labels"][picked])
    assert abs(metrics["mlm loss"] - mlm.item()) < 1e-5
    if binary == "null":
        assert binary_logits is None and objective.metric_keys == ("mlm loss",)
        assert set(metrics) == {"lm loss", "mlm loss"} and abs(loss.item() - mlm.item()) < 1e-6
        return
    sop = F.cross_entropy(binary_logits, b["is_random"])
    assert abs(metrics["sop loss"] - sop.item()) < 1e-5 and objective.metric_keys == ("mlm loss", "sop loss")
    assert abs(loss.item() - (mlm + sop).item()) < 1e-5 and metrics["lm loss"] == loss.item()
    assert 4.5 < mlm.item() < 6.5           # about ln(vocab 200) = 5.3 at init


def test_denoising_loss_and_masks_are_megatrons(tp1):
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset

    from pretrain.model.t5 import t5_attention_masks
    cfg = model_config("t5")
    objective, model = build(cfg)
    model.eval()
    b = t5_batch(cfg)
    ours = t5_attention_masks(b["enc_mask"], b["dec_mask"])
    theirs = T5MaskedWordPieceDataset.config_attention_mask(b["text_enc"], b["text_dec"], b["enc_mask"],
                                                            b["dec_mask"], use_local=True)
    for mine, megatron in zip(ours, theirs, strict=True):
        assert torch.equal(mine, megatron)
    with torch.no_grad():
        output, loss_func = objective.forward(model, b)
        loss, metrics = loss_func(output)
        logits = model(b["text_enc"], b["text_dec"], *ours)
    picked = b["loss_mask"] > 0
    ce = F.cross_entropy(logits[picked].float(), b["labels"][picked])
    assert abs(loss.item() - ce.item()) < 1e-5 and set(metrics) == {"lm loss"}
    assert len(model.encoder.layers) == 2 and len(model.decoder.layers) == 1
    assert model.embedding.position_embeddings.weight.shape[0] == max(32, cfg.derived.decoder_seq_length)


@pytest.mark.parametrize("untie,binary", [("true", "nsp"), ("false", "null")])
def test_bert_export_has_megatrons_logits_in_transformers(tp1, tmp_path, untie, binary):
    import transformers

    from pretrain.hf.bert_export import architecture, hf_config, to_hf, unsupported
    cfg = model_config("bert", [f"model.untie_embeddings_and_output_weights={untie}",
                                f"objective.masked_lm.binary_head={binary}"])
    _, model = build(cfg)
    model.eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():      # norms and biases away from their 1/0 init, so a misplaced one shows
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    vocab = cfg.model.vocab_size - 3           # the tokenizer's size below the padded table
    assert unsupported(cfg) == []
    hf_class = getattr(transformers, architecture(cfg))
    hf = hf_class(hf_config(cfg, vocab, bos=2, eos=3))
    hf.load_state_dict(to_hf(model.state_dict(), cfg, vocab), strict=True)
    hf.save_pretrained(tmp_path)
    hf = hf_class.from_pretrained(tmp_path).eval()
    b = bert_batch(cfg)
    b["tokens"] = b["tokens"] % vocab
    types = b["types"] if binary == "nsp" else None
    with torch.no_grad():
        logits, binary_logits = model(b["tokens"], b["padding_mask"], tokentype_ids=types)
        out = hf(input_ids=b["tokens"], attention_mask=b["padding_mask"].long(), token_type_ids=types)
    real = b["padding_mask"] > 0     # megatron-core also masks pad queries; HF only pad keys: pad rows differ
    ours = logits[..., :vocab][real]
    theirs = (out.prediction_logits if binary == "nsp" else out.logits)[real]
    assert (theirs - ours).abs().max().item() < 1e-4
    assert ours.std() > 0.1        # not a comparison of near-zero outputs
    if binary == "nsp":
        assert architecture(cfg) == "MegatronBertForPreTraining"
        assert (out.seq_relationship_logits - binary_logits).abs().max().item() < 1e-4
    else:
        assert architecture(cfg) == "MegatronBertForMaskedLM" and binary_logits is None


def test_t5_export_is_refused_by_name():
    from pretrain.hf.bert_export import architecture, unsupported
    cfg = model_config("t5")
    assert architecture(cfg) == "T5ForConditionalGeneration" and "relative position buckets" in unsupported(cfg)[0]


def test_what_the_local_specs_lack_is_refused_by_name():
    from common.config import ConfigError
    from pretrain.model.bert import local_spec_config
    cfg = model_config("t5", ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true",
                              "model.qk_layernorm=true"])
    with pytest.raises(ConfigError, match=r"(?s)model\.qk_layernorm.*parallel\.sequence_parallel.*Fix: remove it"):
        local_spec_config(cfg)


def _layouts(rank: int, port: int, out: dict, cfgs: dict) -> None:
    torch.set_num_threads(1)        # 2 ranks on the 2 cores: a spinning second thread each only slows them
    for (arch, tp), cfg in cfgs.items():
        mh.init_ranks(rank, 2, port, tp)
        objective, model = build(cfg)
        model.eval()                # dropout is 0; eval keeps the comparison free of RNG streams
        batch = (bert_batch if arch == "bert" else t5_batch)(cfg, rows=2)
        out[(arch, tp, rank)] = losses_and_step(objective, model, batch)


@pytest.mark.slow           # 2 spawned processes importing megatron-core
@pytest.mark.beside_training
def test_tensor_parallel_equals_one_rank():
    cfgs = {(arch, tp): model_config(arch, [f"parallel.tensor_model_parallel_size={tp}"])
            for arch in ARCH for tp in (1, 2)}
    out = mh.spawn(_layouts, cfgs)
    for arch in ARCH:
        ref = out[(arch, 1, 0)]
        assert ref[0]["lm loss"] - ref[-1]["lm loss"] > 0.05, (arch, ref)      # the step lowered the loss
        for rank in (0, 1):
            for step, (mine, theirs) in enumerate(zip(out[(arch, 2, rank)], ref, strict=True)):
                assert mine.keys() == theirs.keys()
                for key in mine:
                    assert abs(mine[key] - theirs[key]) < 1e-5, (arch, rank, step, key, mine[key], theirs[key])

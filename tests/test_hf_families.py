"""Every Hugging Face family with an import (pretrain/hf/families/), one parametrised round trip with real transformers.

A tiny random model written by transformers from the family's own config (no hub; every norm and bias moved off its
init, so a misplaced one shows) imports through `make import-hf`'s code with logits equal to transformers' within
1e-4 in fp32, exports back through `make export`'s code to the same tensors, trains 10 steps in this process from the
import (continued pretraining, falling loss; the TRAINED families: all), and the trained checkpoint
exports to logits within 1e-4 of the trained model's own. Config fields a family cannot map are refused by name
(each one tried). Megatron-BERT trains on the demo sentences with their WordPiece (the demo_data fixture builds them;
the masked-LM objective reads sentence pairs, not mock tokens) and compares both heads: the LM's and the pair's."""
import json
from pathlib import Path

import pytest
import torch

from pretrain.config.compose import load_recipe

VOCAB = 512
SMALL = ["data=mock", "data.tokenizer.type=hf", f"model.vocab_size={VOCAB}", "model.seq_length=64",
         "cluster.devices_per_node=1", "parallel.expert_model_parallel_size=1", "batch.global_batch_size=8",
         "stability.watchdog_minutes=0"]
# family: (recipe, overrides). llama carries Llama-3.1's rope_scaling; ministral's window (32) is under the 48
# positions compared; gpt_oss's clamp at 1 bites (7, gpt-oss's, would not at this init: tests/test_hf_gpt_oss.py);
# deepseek_v3 at 3 layers with top-4 of 8 experts in 4 groups of which 2 are used (what
# transformers' group ranking needs) and no MTP layer (transformers' DeepseekV3 has none to import)
FAMILIES = {
    "gpt2": ("gpt-tiny", []),
    "llama": ("llama-tiny", ["model.rotary_base=500000", "model.rope_scaling=true"]),
    "ministral": ("llama-tiny-swa", []),
    "mixtral": ("moe-tiny", []),
    "qwen3": ("qwen3-tiny", []),
    "qwen3_moe": ("qwen3-moe-tiny", []),
    "gpt_oss": ("gpt-oss-tiny", ["model.glu_clamp=1.0"]),
    "deepseek_v3": ("deepseek-tiny", ["model.num_layers=3", "model.mtp_num_layers=0"]),
    "megatron_bert": ("bert-tiny", ["model.num_layers=2"]),
}
# the families that train on data/demo/wordpiece-sentences with its tokenizer (4096 ids) instead of mock data
SENTENCES = {"megatron_bert": ["cluster.devices_per_node=1", "model.seq_length=64", "batch.global_batch_size=8",
                               "stability.watchdog_minutes=0"]}
# the families whose import also trains 10 steps here (continued pretraining, then export of the trained run): all of
# them, ~4 s of CPU each on top of the import/export (deepseek_v3 the most); narrow this to cut make test's time
TRAINED = tuple(FAMILIES)


@pytest.mark.parametrize("recipe,family", [
    ("gpt-tiny", "gpt2"), ("llama-tiny", "llama"), ("llama-tiny-swa", "ministral"), ("moe-tiny", "mixtral"),
    ("qwen3-tiny", "qwen3"), ("qwen3-moe-tiny", "qwen3_moe"), ("gpt-oss-tiny", "gpt_oss"),
    ("deepseek-tiny", "deepseek_v3"), ("bert-tiny", "megatron_bert"), ("t5-tiny", "t5")])
def test_each_recipe_belongs_to_one_family(recipe, family):
    from pretrain.hf.exporters import all_exporters, for_recipe
    cfg = load_recipe(recipe)
    assert [e.name for e in all_exporters() if e.claims(cfg)] == [family] and for_recipe(cfg).name == family
    assert for_recipe(cfg).unsupported(cfg) == ([] if family != "t5" else for_recipe(cfg).unsupported(cfg))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from preprocessing.tokenizer_io import train_bpe
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_bpe([Path(__file__).read_text()], vocab_size=VOCAB, min_frequency=2, out_dir=out)
    return out


def recipe_of(family: str, tokenizer=None, extra=()):
    recipe, overrides = FAMILIES[family]
    if family in SENTENCES:
        return load_recipe(recipe, [*SENTENCES[family], *overrides, *extra])
    return load_recipe(recipe, [*SMALL, *overrides, *extra] + ([f"data.tokenizer.path={tokenizer}"] if tokenizer
                                                               else []))


def run_hf(hf, ids, types):
    """transformers' outputs: the logits, and for Megatron-BERT's pre-training model the pair head's too."""
    with torch.no_grad():
        if not type(hf).__name__.startswith("MegatronBert"):
            return [hf(ids).logits.float()]
        out = hf(input_ids=ids, token_type_ids=types)
        return [out.prediction_logits, out.seq_relationship_logits] if hasattr(out, "prediction_logits") else [
            out.logits]


def run_ours(state, cfg, ids, types):
    """Our model holding `state` (TP=1, fp32): its logits cut to the HF vocab, and BERT's pair head's."""
    from tests.test_export import our_logits, ours
    vocab = cfg.model.vocab_size
    if cfg.model.arch != "bert":
        return [our_logits(ours(state, cfg), ids)[..., :vocab]]
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    from pretrain.hf.convert import single_process
    from pretrain.model.bert import build_bert_model, local_spec_config
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(cfg.seed)
    single = single_process(cfg)
    model = build_bert_model(single, local_spec_config(single, on_gpu=False)).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    binary = cfg.objective.masked_lm.binary_head is not None
    with torch.no_grad():           # no padding: megatron-core masks pad queries too, transformers only pad keys
        logits, pair = model(ids, torch.ones_like(ids), tokentype_ids=types if binary else None)
    return [logits[..., :vocab].float()] + ([pair.float()] if binary else [])


def random_hf_model(cfg, exporter):
    """transformers' own model of the family's config, random, with norms, biases and expert biases moved off."""
    import transformers
    config = exporter.hf_config(cfg, cfg.model.vocab_size, bos=0, eos=0)
    config.initializer_range = 0.08              # attention sharp enough for positions and norms to show
    torch.manual_seed(0)
    model = getattr(transformers, exporter.architecture(cfg))(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if p.is_floating_point() and ("norm" in name or ".ln_" in name or name.endswith("correction_bias")
                                          or (name.endswith("bias") and isinstance(p, torch.nn.Parameter))):
                p.add_((0.3 if "correction" not in name else 0.05) * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_random_hf_model_imports_and_exports_with_transformers_logits(family, single_rank_megatron, tokenizer,
                                                                       tmp_path, request):
    from safetensors.torch import load_file

    from pretrain.checkpoint.store import resolve
    from pretrain.hf.convert import export, import_hf, mapping, model_state
    if family in SENTENCES:
        request.getfixturevalue("demo_data")
        tokenizer = None                         # the recipe's own (the sentences' WordPiece)
    cfg = recipe_of(family, tokenizer)
    exporter = mapping(cfg)
    assert exporter.name == family and exporter.unsupported(cfg) == []
    hf = random_hf_model(cfg, exporter)
    hf.save_pretrained(str(tmp_path / "hf"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 48), generator=g)
    types = (torch.arange(48) >= torch.randint(8, 40, (2, 1), generator=g)).long()      # BERT's: two segments
    theirs = run_hf(hf, ids, types)
    ckpt = import_hf(tmp_path / "hf", cfg, tmp_path / "imported")
    mine = run_ours(model_state(resolve(ckpt), cfg), cfg, ids, types)
    assert len(mine) == len(theirs) == (2 if exporter.architecture(cfg) == "MegatronBertForPreTraining" else 1)
    assert all((a - b).abs().max().item() < 1e-4 for a, b in zip(mine, theirs, strict=True))
    assert theirs[0].std().item() > 0.1

    out = export(ckpt, tmp_path / "out", str(tokenizer) if tokenizer else None)
    first, again = load_file(tmp_path / "hf" / "model.safetensors"), load_file(out / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    assert json.loads((out / "config.json").read_text())["architectures"] == [exporter.architecture(cfg)]
    if family in TRAINED:
        trains_and_exports(family, tokenizer, tmp_path, ids, types, theirs)


def trains_and_exports(family, tokenizer, tmp_path, ids, types, imported):
    """Continued pretraining from the import: 10 steps in this process with falling loss, then the trained
    checkpoint exports to logits within 1e-4 of the trained model's own."""
    import transformers

    from pretrain.checkpoint.store import resolve
    from pretrain.engines.megatron.checkpointing import unwrap
    from pretrain.hf.convert import architecture, export
    from pretrain.train import trainer_for
    from tests.training import records
    run = tmp_path / "run"
    job = recipe_of(family, tokenizer, ["schedule.train_iters=10", "schedule.lr_warmup=2", "logging.log_interval=1",
                                        "eval.eval_interval=0", "eval.final_test=false", "logging.tensorboard=false",
                                        f"run_dir={run}", f"checkpoint.load={tmp_path / 'imported'}",
                                        "checkpoint.load_weights_only=true"])
    trainer = trainer_for(job, run)
    trainer.train()
    losses = [r["loss"] for r in records(run)]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    trained = resolve(run / "checkpoints")
    assert trained.meta["step"] == 10
    # the trained model's own weights, as it holds them (not read back: the export below reads the checkpoint)
    live = {k: v.detach().clone() for k, v in unwrap(trainer.engine.model[0]).state_dict().items()
            if not k.endswith("_extra_state")}
    mine = run_ours(live, job, ids, types)
    assert (mine[0] - imported[0]).abs().max().item() > 1e-3          # training moved it
    exported = export(trained.path, tmp_path / "trained-hf")
    back = getattr(transformers, architecture(job)).from_pretrained(str(exported), dtype=torch.float32).eval()
    assert all((a - b).abs().max().item() < 1e-4 for a, b in zip(run_hf(back, ids, types), mine, strict=True))


# family, a field of its HF config set to what no recipe of it computes, the words the refusal must hold
REFUSALS = [
    ("gpt2", {"activation_function": "gelu_new"}, "activation_function=gelu_new: megatron-core's GELU"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true"),
    ("gpt2", {"layer_norm_epsilon": 1e-6}, "Fix: model.layernorm_epsilon=1e-06"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0}},
     "rope_parameters.rope_type='yarn'"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 4.0}},
     "rope_parameters.rope_type='dynamic'"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act=gelu"),
    ("llama", {"attention_bias": True}, "attention_bias=true"),
    ("llama", {"mlp_bias": True}, "mlp_bias=true"),
    ("ministral", {"layer_types": ["sliding_attention"] * 4}, "Fix: model.window_size=32 and model.global_layers=[]"),
    ("ministral", {"sliding_window": 17}, "Fix: model.window_size=16 and model.global_layers=[3]"),
    ("mixtral", {"num_experts_per_tok": 1}, "Fix: moe.router_topk=1"),
    ("mixtral", {"sliding_window": 4096}, "its windowed layers are [0, 1, 2, 3] with window 4095"),
    ("qwen3", {"use_sliding_window": True}, "use_sliding_window=true"),
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act=gelu: the recipe's SwiGLU is silu-gated"),
    ("qwen3_moe", {"norm_topk_prob": False}, "Fix: moe.pre_softmax=true"),
    ("qwen3_moe", {"num_experts_per_tok": 3}, "Fix: moe.router_topk=3"),
    ("gpt_oss", {"swiglu_limit": 5.0}, "Fix: model.glu_clamp=5.0"),
    ("gpt_oss", {"swiglu_alpha": 1.0}, "swiglu_alpha=1.0: megatron-core's quick_gelu gate"),
    ("gpt_oss", {"attention_bias": False}, "attention_bias=false"),
    ("gpt_oss", {"sliding_window": 33}, "Fix: model.window_size=32 and model.global_layers=[1, 3]"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "original_max_position_embeddings": 32}},
     "Fix: model.yarn.correction_range_round_to_int=true"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "truncate": False,
                                     "original_max_position_embeddings": 32}}, "Fix: model.yarn.factor=8.0"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
     "the recipe has YaRN. Fix: model.position_embedding_type=rope"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0}},
     "rope_parameters.rope_type='yarn'"),
    ("deepseek_v3", {"n_group": 8}, "n_group=8, the recipe's 4 (moe.num_groups)"),
    ("deepseek_v3", {"routed_scaling_factor": 1.0}, "routed_scaling_factor=1.0, the recipe's 2.5"),
    ("megatron_bert", {"architectures": ["MegatronBertForMaskedLM"]}, "Fix: objective.masked_lm.binary_head=null"),
    ("megatron_bert", {"hidden_act": "gelu_new"}, "hidden_act=gelu_new: megatron-core's GELU here is the exact"),
    ("megatron_bert", {"position_embedding_type": "relative_key"}, "position_embedding_type=relative_key"),
    ("megatron_bert", {"type_vocab_size": 3}, "type_vocab_size=3"),
    ("megatron_bert", {"layer_norm_eps": 1e-6}, "Fix: model.layernorm_epsilon=1e-06"),
]


@pytest.mark.parametrize("family,fields,named", REFUSALS, ids=[f"{f}-{next(iter(x))}" for f, x, _ in REFUSALS])
def test_what_a_family_cannot_map_is_refused_by_name(family, fields, named):
    from pretrain.hf.convert import mapping
    cfg = recipe_of(family)
    exporter = mapping(cfg)
    config = exporter.hf_config(cfg, cfg.model.vocab_size, bos=0, eos=0)
    assert exporter.mismatch(config, cfg) == ""
    for field, value in fields.items():
        setattr(config, field, value)
    assert named in exporter.mismatch(config, cfg)


def test_a_deepseek_v3_import_refuses_mtp_and_a_correction_bias_the_recipe_lacks(tmp_path):
    from pretrain.hf.convert import mapping
    cfg = recipe_of("deepseek_v3")
    hf = random_hf_model(cfg, mapping(cfg)).state_dict()
    with pytest.raises(ValueError, match=r"model.mtp_num_layers=1: transformers' DeepseekV3ForCausalLM holds no "
                                         r"multi-token prediction module to import\. Fix: model.mtp_num_layers=0"):
        mapping(cfg).from_hf(hf, recipe_of("deepseek_v3", extra=["model.mtp_num_layers=1"]))
    unbiased = recipe_of("deepseek_v3", extra=["moe.expert_bias=false"])
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.gate.e_score_correction_bias is non-zero, the recipe "
                                         r"has moe.expert_bias=false .* Fix: moe.expert_bias=true"):
        mapping(cfg).from_hf(hf, unbiased)
    zero = {k: (torch.zeros_like(v) if k.endswith("correction_bias") else v) for k, v in hf.items()}
    ours = mapping(cfg).from_hf(zero, unbiased)
    assert not any("expert_bias" in k for k in ours) and len(ours) == len(mapping(cfg).from_hf(hf, cfg)) - 2


def test_a_bert_import_without_the_pair_head_refuses_token_types_it_has_no_table_for():
    """binary_head=null builds no token-type table (MegatronBertForMaskedLM's one row is added to every position by
    transformers): a zero row imports, any other is refused with the fix."""
    from pretrain.hf.convert import mapping
    cfg = recipe_of("megatron_bert", extra=["objective.masked_lm.binary_head=null"])
    hf = random_hf_model(cfg, mapping(cfg)).state_dict()
    assert mapping(cfg).architecture(cfg) == "MegatronBertForMaskedLM" and hf[TYPES].abs().max() > 0
    with pytest.raises(ValueError, match=r"token_type_embeddings.weight holds token types, the recipe has none .* "
                                         r"Fix: objective.masked_lm.binary_head=nsp"):
        mapping(cfg).from_hf(hf, cfg)
    ours = mapping(cfg).from_hf({**hf, TYPES: torch.zeros_like(hf[TYPES])}, cfg)
    assert "embedding.tokentype_embeddings.weight" not in ours and "pooler.dense.weight" not in ours
    assert torch.equal(mapping(cfg).to_hf(ours, cfg, cfg.model.vocab_size)[TYPES], torch.zeros_like(hf[TYPES]))


TYPES = "bert.embeddings.token_type_embeddings.weight"


def test_what_docs_say_megatron_core_lacks_for_olmo2_and_gemma3_it_lacks():
    """docs/export-and-evals.md 'Families not built': each missing part, read from megatron-core 0.16.1 itself."""
    import inspect
    from dataclasses import fields

    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules
    slots = [f.name for f in fields(TransformerLayerSubmodules)]
    norms = [s for s in slots if "norm" in s]
    assert norms == ["input_layernorm", "pre_cross_attn_layernorm", "pre_mlp_layernorm"]   # no norm after a sublayer
    built = inspect.getsource(SelfAttention.__init__)
    assert built.count("hidden_size=self.hidden_size_per_attention_head") == 2 and "q_layernorm" in built
    config = [f.name for f in fields(TransformerConfig)]
    assert not [c for c in config if "softcap" in c or "logit_cap" in c]
    assert not [c for c in config if "local" in c and ("rope" in c or "rotary" in c)]
    assert "sqrt" not in inspect.getsource(LanguageModelEmbedding) and "scale" not in inspect.getsource(
        LanguageModelEmbedding.forward)


def test_gpt_oss_clamped_glu_is_megatron_cores_mlp_with_offset_and_clamp(single_rank_megatron):
    """gpt-oss's expert activation (transformers' GptOssExperts: gate, up clamped at 7, gate * sigmoid(1.702 gate) *
    (up + 1)) is megatron-core's MLP with quick_gelu, glu_linear_offset=1, activation_func_clamp_value=7, biases."""
    from typing import get_args

    from megatron.core.activations import quick_gelu
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from pretrain.engines import cpu_compat
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, ffn_hidden_size=16,
                               gated_linear_unit=True, activation_func=quick_gelu, glu_linear_offset=1.0,
                               activation_func_clamp_value=7.0, add_bias_linear=True, bias_activation_fusion=False,
                               use_cpu_initialization=True, init_method_std=3.0)
    mlp = MLP(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    x = 2 * torch.randn(5, 1, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        mine, bias = mlp(x)
        gate, up = (x @ mlp.linear_fc1.weight.t() + mlp.linear_fc1.bias).chunk(2, dim=-1)
        gate, up = gate.clamp(max=7.0), up.clamp(min=-7.0, max=7.0)
        theirs = (up + 1) * (gate * torch.sigmoid(gate * 1.702)) @ mlp.linear_fc2.weight.t()
    assert (gate == 7.0).any() and (up.abs() == 7.0).any()          # the clamps bite
    assert (mine + bias - (theirs + mlp.linear_fc2.bias)).abs().max().item() < 1e-4
    assert "learnable" in get_args(TransformerConfig.__dataclass_fields__["softmax_type"].type)     # attention sinks


def test_gpt_oss_yarn_is_megatron_cores_yarn_unrounded(single_rank_megatron):
    """gpt-oss's RoPE (transformers' GptOssRotaryEmbedding: YaRN, factor 32 over 4096 positions, theta 150000,
    truncate=false, cos/sin scaled by 0.1 ln 32 + 1) is megatron-core's YarnRotaryEmbedding with
    correction_range_round_to_int=false and SelfAttention's concentration factor, at 8192 positions; megatron-core's
    default rounding is another function."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb as megatron_rope
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
        _yarn_get_concentration_factor_from_config,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding, apply_rotary_pos_emb

    from pretrain.engines import cpu_compat
    cpu_compat.apply()
    p, n = GptOssConfig().rope_parameters, 8192
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1, use_cpu_initialization=True)
    # GPTModel and SelfAttention read these as attributes Megatron-LM sets; TransformerConfig 0.16.1 declares none
    config.yarn_rotary_scaling_factor, config.yarn_mscale, config.yarn_mscale_all_dim = p["factor"], None, None
    q = torch.randn(n, 1, 1, 64, generator=torch.Generator().manual_seed(0))
    cos, sin = GptOssRotaryEmbedding(GptOssConfig(head_dim=64))(q, torch.arange(n).unsqueeze(0))
    theirs = apply_rotary_pos_emb(q.permute(1, 2, 0, 3), q.permute(1, 2, 0, 3), cos, sin)[0].permute(2, 0, 1, 3)
    mine = {}
    for rounded in (False, True):
        rope = YarnRotaryEmbedding(64, rotary_base=p["rope_theta"], scaling_factor=p["factor"],
                                   original_max_position_embeddings=p["original_max_position_embeddings"],
                                   beta_fast=p["beta_fast"], beta_slow=p["beta_slow"],
                                   correction_range_round_to_int=rounded, use_cpu_initialization=True)
        mine[rounded] = megatron_rope(q, rope(n)[0], config=config,
                                      mscale=_yarn_get_concentration_factor_from_config(config))
    assert p["truncate"] is False and abs(_yarn_get_concentration_factor_from_config(config) - 1.3466) < 1e-4
    assert (mine[False] - theirs).abs().max().item() < 1e-5 and (mine[True] - theirs).abs().max().item() > 1

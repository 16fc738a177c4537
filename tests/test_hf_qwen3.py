"""Qwen3 and Qwen3-MoE (pretrain/hf/families/qwen3.py) and the HF exporter families (pretrain/hf/exporters.py).

A tiny random Qwen3 / Qwen3-MoE written by transformers (norms moved off 1, so a misplaced q/k norm shows)
imports through `make import-hf`'s code with logits equal to transformers' within 1e-4 in fp32, and exports
back through `make export`'s code to the same tensors and logits; the published sizes' parameter counts in
`make plan` equal transformers' own count of the same shapes (built on the meta device)."""
from pathlib import Path

import pytest
import torch

from pretrain.config.compose import load_recipe

VOCAB = 512
SMALL = ["data=mock", "data.tokenizer.type=hf", f"model.vocab_size={VOCAB}", "cluster.devices_per_node=1",
         "parallel.expert_model_parallel_size=1", "batch.global_batch_size=8", "stability.watchdog_minutes=0"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from preprocessing.tokenizer_io import train_bpe
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_bpe([Path(__file__).read_text()], vocab_size=VOCAB, min_frequency=2, out_dir=out)
    return out


@pytest.mark.parametrize("recipe,family", [
    ("gpt-tiny", "gpt2"), ("llama-tiny", "llama"), ("llama-tiny-swa", "ministral"), ("moe-tiny", "mixtral"),
    ("qwen3-tiny", "qwen3"), ("qwen3-moe-tiny", "qwen3_moe"), ("deepseek-tiny", "deepseek_v3"),
    ("bert-tiny", "megatron_bert"), ("t5-tiny", "t5")])
def test_each_recipe_belongs_to_one_family(recipe, family):
    from pretrain.hf.exporters import all_exporters, for_recipe
    cfg = load_recipe(recipe)
    assert [e.name for e in all_exporters() if e.claims(cfg)] == [family] and for_recipe(cfg).name == family
    assert for_recipe(cfg).unsupported(cfg) == ([] if family != "t5" else for_recipe(cfg).unsupported(cfg))


def perturbed(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("recipe", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_qwen3_imports_and_exports_with_transformers_logits(recipe, single_rank_megatron, tokenizer, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pretrain.checkpoint.store import resolve
    from pretrain.hf.convert import export, import_hf, mapping, model_state
    from tests.test_export import our_logits, ours
    cfg = load_recipe(recipe, [*SMALL, f"data.tokenizer.path={tokenizer}"])
    exporter = mapping(cfg)
    config = exporter.hf_config(cfg, VOCAB, bos=0, eos=0)
    config.initializer_range = 0.08              # attention sharp enough for positions and norms to show
    torch.manual_seed(0)
    cls = type(AutoModelForCausalLM.from_config(config))
    hf = perturbed(cls(config))
    hf.save_pretrained(str(tmp_path / "hf"))
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    ckpt = import_hf(tmp_path / "hf", cfg, tmp_path / "imported")
    mine = our_logits(ours(model_state(resolve(ckpt), cfg), cfg), ids)[..., :VOCAB]
    assert (mine - theirs).abs().max().item() < 1e-4 and theirs.std().item() > 0.1

    out = export(ckpt, tmp_path / "out", str(tokenizer))
    back = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(back).__name__ == exporter.architecture(cfg) == config.architectures[0]
    with torch.no_grad():
        assert (back(ids).logits.float() - mine).abs().max().item() < 1e-4
    first, again = load_file(tmp_path / "hf" / "model.safetensors"), load_file(out / "model.safetensors")
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    check_trains_and_exports(cfg, tmp_path, ids, tokenizer)
    if cfg.moe.enabled:
        assert (back.config.num_experts, back.config.num_experts_per_tok, back.config.norm_topk_prob,
                back.config.moe_intermediate_size) == (4, 2, True, 128)
    else:
        assert back.config.tie_word_embeddings and back.config.head_dim == 48


def check_trains_and_exports(cfg, tmp_path, ids, tokenizer):
    """Continued pretraining from the import: 10 steps in this process with falling loss, then the trained
    checkpoint exports to logits within 1e-4 of the trained model's own."""
    from transformers import AutoModelForCausalLM

    from pretrain.checkpoint.store import resolve
    from pretrain.config.compose import load_recipe
    from pretrain.hf.convert import export, model_state
    from pretrain.train import trainer_for
    from tests.test_export import our_logits, ours
    from tests.training import records
    run = tmp_path / "run"
    job = load_recipe(cfg.name, [*SMALL, f"data.tokenizer.path={tokenizer}", "schedule.train_iters=10",
                                 "schedule.lr_warmup=2", "logging.log_interval=1", "eval.eval_interval=0",
                                 "eval.final_test=false", "logging.tensorboard=false", f"run_dir={run}",
                                 f"checkpoint.load={tmp_path / 'imported'}", "checkpoint.load_weights_only=true"])
    trainer_for(job, run).train()
    losses = [r["loss"] for r in records(run)]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    trained = resolve(run / "checkpoints")
    assert trained.meta["step"] == 10
    mine = our_logits(ours(model_state(trained, job), job), ids)[..., :VOCAB]
    out = export(trained.path, tmp_path / "trained-hf")
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(ids).logits.float() - mine).abs().max().item() < 1e-4


def test_qwen3_fields_no_recipe_reproduces_are_refused_by_name(tmp_path):
    import json

    from pretrain.hf.convert import import_hf, mapping
    from pretrain.model.hf_mapping import from_hf
    cfg = load_recipe("qwen3-moe-tiny", SMALL)
    for recipe, override, named in (("qwen3-moe-tiny", ["moe.shared_expert_ffn_hidden_size=128"],
                                     "moe.shared_expert_ffn_hidden_size"),
                                    ("qwen3-moe-tiny", ["moe.topk_scaling_factor=2.5"], "moe.topk_scaling_factor=2.5"),
                                    ("qwen3-tiny", ["model.window_size=31"], "model.window_size"),
                                    ("qwen3-tiny", ["model.add_bias_linear=true"], "add_bias_linear")):
        other = load_recipe(recipe, SMALL + override)
        problems = mapping(other).unsupported(other)
        assert len(problems) == 1 and named in problems[0], (override, problems)
    config = mapping(cfg).hf_config(cfg, VOCAB, bos=0, eos=0)
    config.norm_topk_prob, config.attention_bias, config.rms_norm_eps = False, True, 1e-5
    assert mapping(cfg).mismatch(config, cfg).split("; ") == [
        "attention_bias=true: the recipe's attention has no biases (model.add_bias_linear=false, as Qwen3 needs for "
        "its MLP)", "rms_norm_eps=1e-05, the recipe's model.layernorm_epsilon=1e-06. Fix: model.layernorm_epsilon="
        "1e-05", "norm_topk_prob=false, the recipe has moe.pre_softmax=false. Fix: moe.pre_softmax=true"]
    config.mlp_only_layers = [0]
    assert "its dense layers are [0], the recipe's []" in mapping(cfg).mismatch(config, cfg)
    from transformers import Qwen3MoeForCausalLM
    config = mapping(cfg).hf_config(cfg, VOCAB, bos=0, eos=0)
    config.num_hidden_layers = 1
    Qwen3MoeForCausalLM(config).save_pretrained(str(tmp_path / "moe"))
    with pytest.raises(ValueError, match="holds Qwen3MoeForCausalLM, recipe llama-tiny is of the llama family "
                                         r"\(LlamaForCausalLM\). Fix: a recipe of the qwen3_moe family"):
        import_hf(tmp_path / "moe", load_recipe("llama-tiny", SMALL), tmp_path / "refused")
    one_layer = load_recipe("qwen3-moe-tiny", [*SMALL, "model.num_layers=1"])
    written = json.loads((tmp_path / "moe" / "config.json").read_text())
    quantized = {**written, "quantization_config": {"quant_method": "fp8"}}
    (tmp_path / "moe" / "config.json").write_text(json.dumps(quantized))
    with pytest.raises(ValueError, match="does not fit recipe qwen3-moe-tiny: quantization_config is set"):
        import_hf(tmp_path / "moe", one_layer, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    state = Qwen3MoeForCausalLM(config).state_dict()
    with pytest.raises(ValueError, match=r"1 tensors of the HF model have no place in the recipe's model: "
                                         r"\['model.layers.0.self_attn.q_proj.bias'\]"):
        from_hf({**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(288)}, one_layer)
    with pytest.raises(ValueError, match=r"the HF model lacks 1 tensors the recipe's model has: "
                                         r"\['model.layers.0.self_attn.k_norm.weight'\]"):
        from_hf({k: v for k, v in state.items() if "k_norm" not in k}, one_layer)


PUBLISHED = {"qwen3-0.6b": "Qwen3ForCausalLM", "qwen3-8b": "Qwen3ForCausalLM", "qwen3-30b-a3b": "Qwen3MoeForCausalLM"}


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_make_plan_counts_the_published_qwen3_sizes_as_transformers_does(recipe):
    """transformers' own model of the recipe's exported config, on the meta device: every parameter counted once
    (a tied head is one tensor); active = total less the unchosen experts' MLPs."""
    import transformers

    from pretrain.hf.convert import mapping
    from pretrain.plan.estimate import make_plan
    cfg = load_recipe(recipe)
    config = mapping(cfg).hf_config(cfg, cfg.model.vocab_size, bos=0, eos=0)
    with torch.device("meta"):
        model = getattr(transformers, PUBLISHED[recipe])(config)
    total = sum(p.numel() for p in model.parameters())
    plan = make_plan(cfg)
    assert plan["params"] == total
    if cfg.moe.enabled:
        unchosen = cfg.model.num_layers * (config.num_experts - config.num_experts_per_tok) * 3 * \
            config.hidden_size * config.moe_intermediate_size
        assert plan["moe"]["params_active"] == total - unchosen
    assert total == {"qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360, "qwen3-30b-a3b": 30_532_122_624}[recipe]

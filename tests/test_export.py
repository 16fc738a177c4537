"""Hugging Face export and import, in this process with real transformers (offline, from the
exported directory): logits equal ours within 1e-4 in fp32 and 20 greedy tokens are identical,
for a megatron-core TP=2 checkpoint, a DeepSpeed ZeRO-2 checkpoint (both trained on 2
processes by the session's runs) and a Llama-style model; import -> export is the identity."""
import json
from pathlib import Path

import pytest
import torch

from pretrain.checkpoint.store import resolve
from pretrain.hf.convert import config_of, export, import_hf, model_state, single_process
from tests.training import SAVE_AT

TOKENS = 24


def ours(state, cfg):
    """Our GPTModel (TP=1, fp32) holding `state`."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    from pretrain.model.gpt import build_gpt_model, transformer_config
    cpu_compat.apply()                       # megatron-core's CPU adaptations (no-op with CUDA)
    model_parallel_cuda_manual_seed(cfg.seed)     # the RNG tracker megatron-core's layers need at build
    single = single_process(cfg)
    model = build_gpt_model(single, transformer_config(single, on_gpu=False)).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing)
    return model


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits [b, s, vocab]. With MTP layers, megatron-core 0.16.1 runs the model only with labels and its
    cross-entropy works in place on the logits, so they are copied as the output layer returns them: its last call
    is the main model's, after the MTP depths'."""
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    with torch.no_grad():
        if not model.config.mtp_num_layers:
            return model(ids, positions, None).float()
        calls = []
        hook = model.output_layer.register_forward_hook(lambda mod, args, out: calls.append(out[0].detach().clone()))
        try:
            model(ids, positions, None, labels=ids)
        finally:
            hook.remove()
    assert len(calls) == 1 + model.config.mtp_num_layers
    return calls[-1].transpose(0, 1).float()


def our_greedy(model, ids: torch.Tensor, n: int, vocab: int) -> list:
    for _ in range(n):
        nxt = our_logits(model, ids)[:, -1, :vocab].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0].tolist()


def check_parity(ckpt, out_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    exported = export(ckpt, out_dir)
    cfg = config_of(resolve(ckpt))
    model = ours(model_state(resolve(ckpt), cfg), cfg)
    hf = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(exported))
    assert tok.model_max_length == cfg.derived.max_position_embeddings    # not transformers' 1e30 default
    vocab = hf.config.vocab_size
    text = "Now is the winter of our discontent made glorious summer by this sun of York"
    ids = torch.tensor([tok(text)["input_ids"][:TOKENS]])
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    mine = our_logits(model, ids)[..., :vocab]
    assert (theirs - mine).abs().max().item() < 1e-4
    prompt = ids[:, :8]
    generated = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=tok.eos_token_id)
    assert generated[0].tolist() == our_greedy(model, prompt, 20, vocab)
    return exported, cfg


@pytest.mark.slow
def test_megatron_tp2_checkpoint_exports_to_gpt2_with_equal_logits(layout_runs, single_rank_megatron, tmp_path):
    layout_runs("tp2")
    exported, _ = check_parity(layout_runs.root / "tp2" / "checkpoints" / f"step_{SAVE_AT:08d}", tmp_path / "hf")
    meta = json.loads((exported / "export.json").read_text())
    assert (meta["engine"], meta["layout"]["tp"], meta["step"]) == ("megatron", 2, SAVE_AT)
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]


@pytest.mark.slow
def test_deepspeed_zero2_checkpoint_exports_and_import_export_is_the_identity(ds_runs, single_rank_megatron, tmp_path):
    from safetensors.torch import load_file
    exported, cfg = check_parity(ds_runs["root"] / "zero2" / "checkpoints" / "step_00000004", tmp_path / "hf")
    imported = import_hf(exported, cfg, tmp_path / "imported")
    again = export(imported, tmp_path / "hf2")
    first, second = load_file(exported / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_llama_tiny_exports_to_llama_and_round_trips(single_rank_megatron, tmp_path):
    """RoPE, RMSNorm, SwiGLU, GQA (2 KV groups), untied output: two steps of training in process, saved, exported.
    Its tokenizer: a byte-level BPE as the demo pipeline trains (preprocessing.tokenizer_io.train_bpe), trained
    here on this file's text (a unit test: the demo pipeline's 45 s on a clean clone are not needed)."""
    from safetensors.torch import load_file

    from preprocessing.tokenizer_io import train_bpe
    from pretrain.config.compose import load_recipe
    from pretrain.train import trainer_for
    train_bpe([Path(__file__).read_text()], vocab_size=512, min_frequency=2, out_dir=tmp_path / "tokenizer")
    cfg = load_recipe("llama-tiny", ["data=mock", "data.tokenizer.type=hf",
                                     f"data.tokenizer.path={tmp_path / 'tokenizer'}", "cluster.devices_per_node=1",
                                     "batch.global_batch_size=8", "schedule.train_iters=2",
                                     "eval.eval_interval=0", "eval.final_test=false", "logging.tensorboard=false",
                                     "stability.watchdog_minutes=0", f"run_dir={tmp_path / 'run'}"])
    trainer_for(cfg, tmp_path / "run").train()
    exported, _ = check_parity(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    hf_config = json.loads((exported / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"] and hf_config["num_key_value_heads"] == 2
    again = export(import_hf(exported, cfg, tmp_path / "imported"), tmp_path / "hf2")
    first, second = load_file(exported / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    sharded_export_equals_the_single_file(tmp_path / "run" / "checkpoints", exported, tmp_path / "hf-sharded")


def sharded_export_equals_the_single_file(ckpt, single: Path, out: Path):
    """A shard size a quarter of the model: several shards and transformers' index; the tensors are the single
    file's, byte for byte, and from_pretrained gives the same logits. The single file is what save_pretrained of
    the HF model holding the same tensors writes (the export before it streamed), config files too."""
    import filecmp

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from pretrain.data.tokenizer import run_tokenizer
    from pretrain.hf.convert import hf_model_class, mapping, megatron_state
    from pretrain.hf.shards import INDEX
    cfg = config_of(resolve(ckpt))
    tok = run_tokenizer(cfg, "an export")
    model = hf_model_class(cfg)(mapping(cfg).hf_config(cfg, tok.vocab_size, bos=tok.eod, eos=tok.eod))
    model.load_state_dict(mapping(cfg).to_hf(megatron_state(resolve(ckpt), cfg)[0], cfg, tok.vocab_size))
    model.save_pretrained(str(out.with_name("saved")))
    assert all(filecmp.cmp(single / f, out.with_name("saved") / f, shallow=False)
               for f in ("model.safetensors", "config.json", "generation_config.json"))
    limit = (single / "model.safetensors").stat().st_size // 4
    sharded = export(ckpt, out, max_shard_size=limit)
    index = json.loads((sharded / INDEX).read_text())
    files = sorted({*index["weight_map"].values()})
    assert len(files) >= 4 and not (sharded / "model.safetensors").exists()
    assert set(json.loads((sharded / "export.json").read_text())["files"]) == {
        *files, INDEX, "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "export.json"}
    whole, parts = load_file(single / "model.safetensors"), {}
    for name in files:
        shard = load_file(sharded / name)
        assert set(shard) == {k for k, f in index["weight_map"].items() if f == name}
        assert len(shard) == 1 or sum(t.numel() * t.element_size() for t in shard.values()) <= limit
        parts.update(shard)
    assert parts.keys() == whole.keys() and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in whole.values())
    assert all(torch.equal(parts[k].view(torch.uint8), whole[k].view(torch.uint8)) for k in whole)
    assert (sharded / "config.json").read_text() == (single / "config.json").read_text()
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        a, b = (AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()(ids).logits
                for d in (single, sharded))
    assert torch.equal(a, b)


def test_export_refuses_what_the_architecture_cannot_express(tmp_path):
    from pretrain.config.compose import load_recipe
    from pretrain.model.hf_mapping import unsupported
    assert unsupported(load_recipe("gpt-tiny")) == []
    assert unsupported(load_recipe("llama-tiny")) == []
    problems = unsupported(load_recipe("gpt-tiny", ["model.qk_layernorm=true", "model.position_embedding_type=rope"]))
    assert any("qk_layernorm" in p for p in problems) and any("learned positions" in p for p in problems)


LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}      # Llama-3.1's config.json


def test_a_llama31_directory_imports_with_its_rope_scaling_or_is_refused_by_name(single_rank_megatron, tmp_path):
    """A tiny random Llama-3.1-style directory (rope_type llama3, theta 5e5): imported into a recipe with
    model.rope_scaling, its logits equal ours within 1e-4 over 96 positions (where llama3 scaling moves the low
    frequencies: the same weights without it differ by far more); a recipe without it, or a scaling megatron-core
    does not have, is refused naming the field and the fix."""
    from transformers import LlamaForCausalLM

    from pretrain.config.compose import load_recipe
    from pretrain.model.hf_mapping import hf_config, rope_mismatch
    small = ["data=mock", "cluster.devices_per_node=1", "model.num_layers=2"]
    plain = load_recipe("llama-tiny", small)
    config = hf_config(plain, plain.model.vocab_size, bos=0, eos=0)
    config.rope_parameters, config.max_position_embeddings = dict(LLAMA31_ROPE), 131072
    config.initializer_range = 0.08      # attention sharp enough for positions to show (0.02: nearly uniform)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(tmp_path / "llama31"))
    with pytest.raises(ValueError, match=r"rope_theta=500000, the recipe's model.rotary_base=10000\. Fix: "
                                         r"model.rotary_base=500000; rope_parameters rope_type=llama3 factor=8.0, the "
                                         r"recipe has model.rope_scaling=false model.rope_scaling_factor=8.0\. Fix: "
                                         r"model.rope_scaling=true model.rope_scaling_factor=8.0"):
        import_hf(tmp_path / "llama31", plain, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()

    cfg = load_recipe("llama-tiny", [*small, "model.rotary_base=500000", "model.rope_scaling=true"])
    assert hf_config(cfg, 4096, bos=0, eos=0).rope_parameters == LLAMA31_ROPE        # what export writes back
    state = model_state(resolve(import_hf(tmp_path / "llama31", cfg, tmp_path / "imported")), cfg)
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "llama31"), dtype=torch.float32).eval()
    ids = torch.randint(0, 4096, (1, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    assert (our_logits(ours(state, cfg), ids)[..., :4096] - theirs).abs().max().item() < 1e-4
    unscaled = load_recipe("llama-tiny", [*small, "model.rotary_base=500000"])
    assert (our_logits(ours(state, unscaled), ids)[..., :4096] - theirs).abs().max().item() > 1e-2

    from common.config import ConfigError
    with pytest.raises(ConfigError, match="model.rope_scaling=true scales megatron-core's RoPE, but the model has "
                                          "model.position_embedding_type=learned_absolute"):
        load_recipe("gpt-tiny", ["model.rope_scaling=true"])
    for other, named in (({"factor": 4.0, "original_max_position_embeddings": 4096}, "no recipe reproduces"),
                         ({"rope_type": "yarn"}, "rope_parameters.rope_type='yarn'")):
        config.rope_parameters = {**LLAMA31_ROPE, **other}
        assert named in rope_mismatch(config, cfg)

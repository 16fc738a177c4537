"""Export of multi-head latent attention models to transformers' DeepseekV3ForCausalLM (pretrain/hf/deepseek_export.py):
a tiny DeepSeek-V3-shaped model (MLA, one dense first layer then MoE with sigmoid group-limited routing, a non-zero
expert bias, a shared expert, one MTP layer), random weights with every norm and the expert bias moved off their
init, saved as a megatron checkpoint, exported by `make export`'s code, loaded by real transformers from the
directory (local files only): logits on tokenized text equal ours within 1e-4 in fp32.

Routing ties: a near-tie between the k-th and (k+1)-th expert (or group) could flip under float rounding and move a
logit by far more than 1e-4. The test checks that this seed's smallest margin is well above rounding, so a
failure is a mapping error, not a tie (a tie is measure-zero with random fp32 weights)."""
from pathlib import Path

import pytest
import torch

from pretrain.config.compose import load_recipe
from tests.test_export import our_logits

# recipes/deepseek-tiny.yaml at 3 layers, seq 32, top-4 of 8 experts in 4 groups of which 2 are used: groups
# ranked by their top 4 // 2 = 2 scores, what transformers hard-codes (top-2 would be refused)
TINY = ["data=mock", "model.seq_length=32", "model.num_layers=3", "moe.router_topk=4", "data.tokenizer.type=hf",
        "cluster.devices_per_node=1", "parallel.expert_model_parallel_size=1",
        "batch.global_batch_size=8", "stability.watchdog_minutes=0"]
TEXT = "Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds that lour'd"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from preprocessing.tokenizer_io import train_bpe
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_bpe([Path(__file__).read_text()], vocab_size=512, min_frequency=2, out_dir=out)
    return out


def perturb(model) -> None:
    """Norm weights off 1 and the routers' expert bias off 0, so a misplaced norm or bias shows in the logits."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def routing_margin(hf, ids: torch.Tensor) -> float:
    """The smallest gap, over tokens and MoE layers, between the last chosen and the first unchosen expert and group
    (scores with the correction bias, as the router chooses)."""
    gaps = []

    def hook(gate, args, out):
        x = args[0].reshape(-1, gate.hidden_dim).float()
        s = torch.sigmoid(x @ gate.weight.float().t()) + gate.e_score_correction_bias
        groups = s.view(len(s), gate.num_group, -1).topk(2, dim=-1)[0].sum(-1).sort(-1, descending=True)[0]
        gaps.append((groups[:, gate.topk_group - 1] - groups[:, gate.topk_group]).min())
        group_of = torch.arange(gate.num_experts) // (gate.num_experts // gate.num_group)
        kept = s.view(len(s), gate.num_group, -1).topk(2, dim=-1)[0].sum(-1).topk(gate.topk_group, dim=-1)[1]
        allowed = (group_of[None, :, None] == kept[:, None, :]).any(-1)
        rest = s.masked_fill(~allowed, float("-inf")).scatter(1, out[2], float("-inf"))
        gaps.append((s.gather(1, out[2]).min(-1)[0] - rest.max(-1)[0]).min())

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        hf(ids)
    for h in hooks:
        h.remove()
    return min(g.item() for g in gaps)


def test_mla_moe_mtp_checkpoint_exports_to_deepseek_v3_with_equal_logits(single_rank_megatron, tokenizer, tmp_path):
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pretrain.checkpoint.meta import LoopState, checkpoint_meta
    from pretrain.checkpoint.store import CheckpointStore
    from pretrain.engines.megatron.checkpointing import unwrap
    from pretrain.hf.convert import export, megatron_engine
    cfg = load_recipe("deepseek-tiny", TINY + [f"data.tokenizer.path={tokenizer}"])
    engine = megatron_engine(cfg)
    model = unwrap(engine.model[0])
    perturb(model)
    engine.optimizer.reload_model_params()
    store = CheckpointStore(tmp_path / "run" / "checkpoints", keep_last=0)
    engine.save_checkpoint(store.begin(0))
    store.commit(0, checkpoint_meta(engine.cfg, LoopState(), engine.checkpoint_meta()))

    out = export(tmp_path / "run" / "checkpoints", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    c = hf.config
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (96, 64, 32, 16, 32)
    assert (c.first_k_dense_replace, c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group,
            c.n_shared_experts, c.routed_scaling_factor, c.rope_interleave) == (1, 8, 4, 4, 2, 1, 2.5, True)
    assert json.loads((out / "export.json").read_text())["mtp"]["layers"] == 1      # dropped by name and count
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, model.decoder.layers[1].mlp.router.expert_bias) and bias.abs().min() > 0

    ids = torch.tensor([AutoTokenizer.from_pretrained(str(out))(TEXT)["input_ids"][:32]])
    assert ids.shape[1] >= 24
    with torch.no_grad():
        theirs = hf(ids).logits
    diff = (theirs - our_logits(model.eval(), ids)[..., :c.vocab_size]).abs().max().item()
    print(f"deepseek export max |logit diff| {diff:.2e}")
    assert diff < 1e-4
    assert routing_margin(hf, ids) > 1e-4        # no near-tie: the top-k and the groups cannot flip under rounding


def in_memory_diff(cfg, tmp_path, seed: int = 5):
    """Max |logit difference| of a GPTModel of `cfg` (random, perturbed) and the DeepseekV3 model it maps to,
    mapped in memory (to_hf does not check `unsupported`) and loaded from a saved directory; and the HF state."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from transformers import DeepseekV3ForCausalLM

    from pretrain.engines import cpu_compat
    from pretrain.hf import deepseek_export
    from pretrain.hf.mtp_export import drop_mtp
    from tests.megatron_harness import build_model
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(seed)
    model, _ = build_model(cfg)
    perturb(model)
    state, _ = drop_mtp({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")})
    hf_state = deepseek_export.to_hf(state, cfg, 500)
    DeepseekV3ForCausalLM(deepseek_export.hf_config(cfg, 500, 0, 0)).save_pretrained(tmp_path)
    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, local_files_only=True).eval()
    missing, unexpected = hf.load_state_dict(hf_state, strict=True)
    assert not missing and not unexpected
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (hf(ids).logits - our_logits(model.eval(), ids)[..., :500]).abs().max().item(), hf_state


def test_mla_without_a_query_latent_maps_to_q_proj(single_rank_megatron, tmp_path):
    """model.mla.q_lora_rank=null: queries straight from the hidden state (HF's q_proj)."""
    from pretrain.hf import deepseek_export
    cfg = load_recipe("deepseek-tiny", TINY + ["model.mla.q_lora_rank=null", "model.num_layers=2"])
    assert deepseek_export.unsupported(cfg) == []
    diff, hf_state = in_memory_diff(cfg, tmp_path)
    assert "model.layers.0.self_attn.q_proj.weight" in hf_state and not any("q_a_proj" in k for k in hf_state)
    print(f"deepseek export (q_lora_rank null) max |logit diff| {diff:.2e}")
    assert diff < 1e-4


def test_dense_mla_without_mtp_exports_with_every_layer_dense(single_rank_megatron, tmp_path):
    from pretrain.hf import deepseek_export
    cfg = load_recipe("deepseek-tiny", TINY + ["moe.num_experts=null", "model.mtp_num_layers=0", "model.num_layers=2"])
    assert deepseek_export.unsupported(cfg) == []
    assert deepseek_export.hf_config(cfg, 500, 0, 0).first_k_dense_replace == 2
    assert in_memory_diff(cfg, tmp_path)[0] < 1e-4


@pytest.mark.parametrize("override,at_least", [
    (["moe.router_topk=2"], 1e-2),                       # top-2 in 4 groups: a group ranked by its top 1
    (["model.layernorm_epsilon=1e-5"], 1e-5)])           # latent norms at 1e-5 here, 1e-6 in transformers
def test_what_is_refused_really_differs(single_rank_megatron, tmp_path, override, at_least):
    """The refusals below are not caution: mapped anyway, these settings move the logits (2 MoE layers)."""
    cfg = load_recipe("deepseek-tiny", TINY + override)
    diff = in_memory_diff(cfg, tmp_path)[0]
    print(f"deepseek export {override} max |logit diff| {diff:.2e}")
    assert diff > at_least


@pytest.mark.parametrize("override,field", [
    (["moe.router_topk=2"], "moe.group_topk"),               # top-2 in 4 groups: groups ranked by their top 1
    (["moe.router_topk=4", "model.layernorm_epsilon=1e-5"], "model.layernorm_epsilon"),
    (["moe.router_topk=4", "moe.score_function=softmax", "moe.expert_bias=false"], "moe.score_function"),
    (["moe.router_topk=4", "moe.shared_expert_ffn_hidden_size=null"], "moe.shared_expert_ffn_hidden_size"),
    (["moe.router_topk=4", "moe.shared_expert_ffn_hidden_size=192"], "moe.shared_expert_ffn_hidden_size"),
    (["moe.router_topk=4", "moe.layer_freq=2"], "moe.layer_freq")])
def test_what_deepseek_v3_cannot_express_is_refused_by_name(override, field):
    from pretrain.hf import convert
    cfg = load_recipe("deepseek-tiny", override)
    assert convert.architecture(cfg) == "DeepseekV3ForCausalLM" and convert.mapping(cfg).name == "deepseek_v3"
    problems = convert.mapping(cfg).unsupported(cfg)
    assert len(problems) == 1 and field in problems[0], problems


def test_every_group_chosen_is_plain_top_k_and_exports():
    from pretrain.hf import deepseek_export
    cfg = load_recipe("deepseek-tiny", ["moe.num_groups=2"])         # top-4 of both groups
    assert deepseek_export.unsupported(cfg) == [] and deepseek_export.routing_groups(cfg) == (1, 1)

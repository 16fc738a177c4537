"""Multi-token prediction (model.mtp_num_layers, model.mtp_loss_weight; pretrain/model/mtp.py, docs/mtp.md).

Unit tests build a tiny GPTModel with megatron-core's MTP block on CPU: the tracked MTP loss equals the
(i+2)-th token cross-entropy computed by hand from the MTP block's output, the gradient the model trains is that
of main + weight * MTP, the planner counts the built model, and the combinations that do not work are refused.
The slow tests train gpt-tiny with MTP at TP=2, at PP=2 and on one process and compare them step by step."""
import pytest
import torch
import torch.nn.functional as F

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from tests.training import FULL_DEPTH, shared_runs

MTP = ["model.mtp_num_layers=1"]


@pytest.fixture(scope="module")
def one_rank(single_rank_megatron):
    """The session's one-process parallel state (tests/conftest.py), with the CPU adaptations and the RNG tracker."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(1234)


def tiny(weight: float, depth: int = 1, recipe: str = "gpt-tiny"):
    from tests.megatron_harness import build_model, tiny_config
    cfg = tiny_config([f"model.mtp_num_layers={depth}", f"model.mtp_loss_weight={weight}",
                       "model.seq_length=32"], recipe=recipe)
    torch.manual_seed(0)
    return cfg, build_model(cfg)[0]


def main_and_mtp(cfg, model, batch):
    """The main token-mean loss (as token_mean_loss), the MTP block's output captured, the tracked MTP loss."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))     # one micro-batch, no fp16 scaling
    MTPLossLoggingHelper.tracker.pop("values", None)
    seen = {}
    hook = model.mtp.register_forward_hook(lambda mod, args, kwargs_out: seen.setdefault("h", kwargs_out))
    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"], loss_mask=batch["loss_mask"])
    hook.remove()
    mask = batch["loss_mask"]
    main = (out.float() * mask).sum() / mask.sum()
    return main, seen["h"], MTPLossLoggingHelper.tracker["values"].clone()


def hand_mtp_loss(model, hidden, batch, depth: int = 1):
    """The k-th MTP depth's loss from its hidden states: the shared output layer's logits at position i scored
    against token i+1+k (labels rolled k places, the last k positions masked out)."""
    k = depth
    h = torch.chunk(hidden, 1 + model.config.mtp_num_layers, dim=0)[k]
    logits, _ = model.output_layer(h, weight=model.shared_embedding_or_output_weight())
    labels, mask = batch["labels"][:, k:], batch["loss_mask"][:, k:]
    ce = F.cross_entropy(logits.transpose(0, 1)[:, :-k].float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         reduction="none")
    return (ce * mask.reshape(-1)).sum() / mask.sum()


def test_the_tracked_mtp_loss_is_the_next_but_one_token_cross_entropy(one_rank):
    from tests.megatron_harness import batch as make_batch
    cfg, model = tiny(0.3)
    batch = make_batch(cfg, rows=2)
    batch["loss_mask"][0, 5] = 0                          # a masked label: its rolled copy drops position 4
    _, hidden, tracked = main_and_mtp(cfg, model, batch)
    assert hidden.shape[0] == 2 * cfg.model.seq_length     # [main; depth 1] stacked along the sequence
    expected = hand_mtp_loss(model, hidden, batch)
    assert tracked[0].item() == pytest.approx(expected.item(), rel=1e-5)
    assert 7.0 < expected.item() < 9.0                       # ~ln(vocab) at init: a real cross-entropy


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_trained_loss_is_main_plus_weight_times_mtp(one_rank):
    """Backward of the main loss alone (the engine's) with weight 0.3 gives the gradient of main + 0.3 * MTP
    computed by hand on a weight-0 copy; with weight 0 the main model's gradient is a no-MTP model's."""
    from tests.megatron_harness import batch as make_batch
    from tests.megatron_harness import build_model, tiny_config
    cfg, weighted = tiny(0.3)
    batch = make_batch(cfg, rows=2)
    main, _, _ = main_and_mtp(cfg, weighted, batch)
    main.backward()
    trained = grads(weighted)

    _, zero = tiny(0.0)
    main0, hidden, _ = main_and_mtp(cfg, zero, batch)
    (main0 + 0.3 * hand_mtp_loss(zero, hidden, batch)).backward()
    by_hand = grads(zero)
    assert trained.keys() == by_hand.keys() and any("mtp." in n for n in trained)
    for name in trained:
        torch.testing.assert_close(trained[name], by_hand[name], rtol=1e-4, atol=1e-6, msg=name)

    zero.zero_grad()
    main_and_mtp(cfg, zero, batch)[0].backward()
    plain = build_model(tiny_config(["model.seq_length=32"]))[0]
    out = plain(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    ((out * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).backward()
    with_mtp, without = grads(zero), grads(plain)
    assert main0.item() == pytest.approx(((out * batch["loss_mask"]).sum() / batch["loss_mask"].sum()).item())
    for name, g in without.items():
        torch.testing.assert_close(with_mtp[name], g, rtol=0, atol=0, msg=name)
    assert all(with_mtp[n].abs().max() == 0 for n in with_mtp if n.startswith("mtp."))


@pytest.mark.parametrize("recipe,depth", [("gpt-tiny", 1), ("llama-tiny", 2)])
def test_the_planner_counts_the_built_mtp_layers(one_rank, recipe, depth):
    from pretrain.model.inventory import count_params
    cfg, model = tiny(0.3, depth, recipe)
    counts = count_params(cfg)
    assert sum(p.numel() for p in model.parameters()) == counts["total"]
    assert counts["mtp"] == sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
    base = count_params(load_recipe(recipe, ["data=mock", "model.seq_length=32"]))
    assert counts["total"] - counts["mtp"] == base["total"] and counts["mtp"] > 0


REFUSED = {
    "learned_positions_pp": (["parallel=pp2"], "parallel.pipeline_model_parallel_size=2 and "
                             "model.position_embedding_type=learned_absolute"),
    "embedding_norm_pp": (["parallel=pp2", "model.position_embedding_type=rope", "model.embedding_layernorm=true"],
                          "parallel.pipeline_model_parallel_size=2 and model.embedding_layernorm"),
    "vpp": (["parallel=pp2", "model.position_embedding_type=rope", "parallel.virtual_pipeline_model_parallel_size=2"],
            "with parallel.virtual_pipeline_model_parallel_size=2"),
    "deepspeed": (["parallel=ds-zero1"], "with parallel.engine=deepspeed"),
    "z_loss": (["model.z_loss_coeff=1e-4"], "with model.z_loss_coeff=0.0001"),
    "document_mask": (["data.document_mask=true"], "with data.document_mask=true"),
    "negative": (["model.mtp_num_layers=-1"], "model.mtp_num_layers=-1 must be >= 0"),
    "weight": (["model.mtp_loss_weight=-0.1"], "model.mtp_loss_weight=-0.1 must be >= 0"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_mtp_does_not_combine_with_is_refused_by_name(case):
    overrides, message = REFUSED[case]
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", ["data=mock", *MTP, *overrides])
    assert message in str(err.value) and "Fix:" in str(err.value)


def test_mtp_off_is_the_default_and_zero_is_off():
    for overrides in ([], ["model.mtp_num_layers=0"]):
        cfg = load_recipe("gpt-tiny", ["data=mock", *overrides])
        from pretrain.model.mtp import mtp_config
        assert mtp_config(cfg) == {}


ROPE = ["schedule.train_iters=8", "model.position_embedding_type=rope", "checkpoint.save_final=true", *MTP,
        *FULL_DEPTH]


@shared_runs(nproc=2)
def mtp_tp2(root, runs):
    """gpt-tiny with one MTP depth at TP=2, 8 steps; and at PP=2 (tied embeddings: the last stage's MTP holds
    the word-embedding copy) with RoPE (learned positions are refused at PP>1), saving its checkpoint. The recipe's
    4 layers (FULL_DEPTH), which docs/mtp.md's figures and per-stage parameter counts are of."""
    return {"tp2": ["parallel=tp2", "schedule.train_iters=8", *MTP, *FULL_DEPTH], "pp2": ["parallel=pp2", *ROPE]}


@shared_runs(nproc=1)
def mtp_single(root, runs):
    """The same 8 steps on one process, and without MTP (the main loss differs only through training)."""
    return {"one": ["schedule.train_iters=8", "checkpoint.save_final=true", *MTP, *FULL_DEPTH],
            "off": ["schedule.train_iters=8", *FULL_DEPTH], "rope": ROPE}


@pytest.mark.slow
def test_mtp_at_tp2_equals_one_process(mtp_tp2, mtp_single):
    tp2, one, off = mtp_tp2("tp2"), mtp_single("one"), mtp_single("off")
    assert len(tp2) == len(one) == 8 and "mtp_loss" in one[-1] and "mtp_loss" not in off[-1]
    for a, b in zip(tp2, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["mtp_loss"] == pytest.approx(b["mtp_loss"], abs=1e-5)
    assert one[0]["loss"] == pytest.approx(off[0]["loss"], abs=1e-6)   # `loss` is the main next-token loss
    assert one[-1]["mtp_loss"] < one[0]["mtp_loss"]                      # the MTP head learns


@pytest.mark.slow
def test_mtp_at_pp2_equals_one_process_and_its_checkpoint_holds_the_same_weights(mtp_tp2, mtp_single):
    """loss and mtp_loss (broadcast from the last stage, where the MTP layers are) match one process; the PP=2
    checkpoint (embedding copy on the last stage, no dead output weight) holds the one-process weights."""
    from pretrain.checkpoint.store import resolve
    from pretrain.hf.convert import config_of, model_state
    from pretrain.model.inventory import stage_tensors
    from pretrain.observability.banner import human

    def load_full_state(path):                # the export's load: any layout's checkpoint read at TP=PP=1
        ck = resolve(path)
        return model_state(ck, config_of(ck))
    pp2, one = mtp_tp2("pp2"), mtp_single("rope")
    assert len(pp2) == len(one) == 8 and one[-1]["mtp_loss"] < one[0]["mtp_loss"]
    for a, b in zip(pp2, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert a["mtp_loss"] == pytest.approx(b["mtp_loss"], abs=1e-5)
    cfg = load_recipe("gpt-tiny", ["data=mock", "parallel=pp2", *ROPE])     # the planner: MTP on the last stage
    stages = [human(sum(t.numel for t in stage)) for stage in stage_tensors(cfg)]
    banner = (mtp_tp2.root / "pp2.rank1.log").read_text()    # the last rank prints the built per-rank counts
    assert f"per rank {stages[0]} - {stages[1]}" in banner and stages == ["1.68M", "2.2M"]
    got, want = load_full_state(mtp_tp2.root / "pp2" / "checkpoints"), load_full_state(mtp_single.root / "rope" /
                                                                                          "checkpoints")
    assert got.keys() == want.keys() and any(k.startswith("mtp.") for k in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


def test_export_drops_the_mtp_layers_by_name_and_count(one_rank):
    from pretrain.hf.mtp_export import drop_mtp, note_text
    from pretrain.model.inventory import count_params
    cfg, model = tiny(0.3, 2, "llama-tiny")
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}   # as convert.py
    kept, note = drop_mtp(state)
    assert not any(k.startswith("mtp.") for k in kept) and len(kept) < len(state)
    assert note["layers"] == 2 and note["params"] == count_params(cfg)["mtp"]
    assert "dropped 2 MTP layer(s)" in note_text(note) and "model.mtp_num_layers" in note_text(note)
    assert drop_mtp(kept) == (kept, None)


@pytest.mark.slow
def test_make_export_of_an_mtp_run_is_the_main_model_and_says_what_it_dropped(mtp_single, tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    from pretrain.hf.convert import export
    out = export(mtp_single.root / "one" / "checkpoints", tmp_path / "hf")
    note = json.loads((out / "export.json").read_text())["mtp"]
    assert note["layers"] == 1 and note["params"] > 0 and "model.mtp_num_layers" in note["reason"]
    model = AutoModelForCausalLM.from_pretrained(str(out))
    assert type(model).__name__ == "GPT2LMHeadModel"

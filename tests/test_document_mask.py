"""data.document_mask / data.eod_mask_loss: packed samples where each document attends only to itself.

In-process: a tiny GPTModel built as the engine builds it (pretrain/model/gpt.py) on one packed sample
with megatron-core's own mask and position builder (the one GPTDataset calls) gives every document the
losses and gradients it gets alone. Multi-process: TP=2 and PP=2 with document masking equal one
process (tests/training.py shared runs), as does the DeepSpeed engine, and the default layout trains
through pretrain.train with validation.
"""
import json

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from pretrain.data.datasets import collate
from pretrain.data.packing import model_inputs, packed_seq_params
from tests.training import GLOBAL_BATCH, job_log, shared_runs

EOD = 0
DOCS = [5, 7, 5]            # document lengths, EOD included; 17 tokens = one sample of 16 plus its last label
ONE_RANK = ["parallel=single", "cluster=local", "cluster.devices_per_node=1", "batch.global_batch_size=8",
            "batch.micro_batch_size=1", "model.seq_length=16", "model.hidden_dropout=0", "model.attention_dropout=0"]


def packed_text(vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    docs = [torch.cat([torch.randint(1, vocab, (n - 1,), generator=gen), torch.tensor([EOD])]) for n in DOCS]
    return torch.cat(docs)


def sample(text: torch.Tensor, document_mask: bool, eod_mask_loss=False) -> dict:
    """One micro-batch as pretrain/data/datasets.py hands it to the engine (GPTDataset's masks, then collate)."""
    tokens, labels = text[:-1], text[1:]
    mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids=document_mask, reset_attention_mask=document_mask,
        eod_mask_loss=eod_mask_loss, create_attention_mask=True)
    return collate([{"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
                     "attention_mask": mask}])


def tiny_model(recipe):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    from pretrain.model.gpt import build_gpt_model, transformer_config
    cpu_compat.apply()
    cfg = load_recipe(recipe, ONE_RANK + ["data.document_mask=true"])
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    return cfg, build_gpt_model(cfg, transformer_config(cfg, on_gpu=False))


def losses_and_grads(model, batch):
    model.zero_grad()
    inputs = model_inputs(batch, thd=False)
    out = model(inputs["tokens"], inputs["position_ids"], inputs["attention_mask"], labels=inputs["labels"],
                packed_seq_params=inputs["packed_seq_params"])
    out.sum().backward()
    return out.detach()[0], {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe,positions", [("gpt-tiny", "learned_absolute"), ("llama-tiny", "rope")])
def test_packed_documents_get_the_losses_and_gradients_they_get_alone(single_rank_megatron, recipe, positions):
    cfg, model = tiny_model(recipe)
    assert cfg.model.position_embedding_type == positions
    text = packed_text(cfg.model.vocab_size)
    packed = sample(text, document_mask=True)
    assert packed["attention_mask"].shape == (1, 1, 16, 16) and packed["position_ids"][0].tolist() == \
        list(range(5)) + list(range(7)) + list(range(4))
    losses, grads = losses_and_grads(model, packed)

    alone_losses, alone_grads = [], {n: torch.zeros_like(g) for n, g in grads.items()}
    start = 0
    for n in DOCS:
        span = slice(start, min(start + n, 16))          # the last document is cut by the sample's end
        width = span.stop - span.start
        alone = {"tokens": packed["tokens"][:, span], "labels": packed["labels"][:, span],
                 "position_ids": torch.arange(width)[None], "loss_mask": torch.ones(1, width)}
        doc_losses, doc_grads = losses_and_grads(model, alone)
        alone_losses.append(doc_losses)
        for name, g in doc_grads.items():
            alone_grads[name] += g
        start += n
    alone_losses = torch.cat(alone_losses)
    assert (losses - alone_losses).abs().max() < 1e-5
    for name, g in grads.items():
        assert (g - alone_grads[name]).abs().max() < 1e-5, name
    assert sum(g.abs().sum() for g in grads.values()) > 1.0          # gradients that could differ

    crossing, crossing_grads = losses_and_grads(model, sample(text, document_mask=False))
    assert (crossing[:5] - alone_losses[:5]).abs().max() < 1e-5     # the first document sees nothing before it
    assert (crossing[5:] - alone_losses[5:]).abs().max() > 1e-2     # the others attend across EOD without masking
    assert max((g - alone_grads[n]).abs().max() for n, g in crossing_grads.items()) > 1e-4


def test_eod_mask_loss_drops_the_targets_after_each_eod():
    loss_mask = sample(packed_text(4096), document_mask=True, eod_mask_loss=True)["loss_mask"][0]
    assert torch.nonzero(loss_mask == 0).reshape(-1).tolist() == [4, 11]    # EOD inputs: next documents' firsts
    assert sample(packed_text(4096), document_mask=True)["loss_mask"].min() == 1.0


def test_thd_boundaries_come_from_the_reset_positions():
    """The GPU path's cu_seqlens (pretrain/data/packing.py) for two samples flattened into one row."""
    one = sample(packed_text(4096), document_mask=True)
    two = {k: torch.cat([v, v]) for k, v in one.items()}
    params = packed_seq_params(two["position_ids"])
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 5, 12, 16, 21, 28, 32] and params.max_seqlen_q == 7
    inputs = model_inputs(two, thd=True)
    assert inputs["tokens"].shape == inputs["labels"].shape == inputs["loss_mask"].shape == (1, 32)
    assert inputs["attention_mask"] is None


@pytest.mark.parametrize("overrides,message", [
    (["cluster.gpu_type=H100-SXM", "model.transformer_impl=local", "model.attention_backend=local"],
     "Fix: model.attention_backend=auto"),
    (["cluster.gpu_type=H100-SXM", "model.attention_backend=unfused"], "Fix: model.attention_backend=auto"),
    (["cluster.gpu_type=H100-SXM", "model.transformer_impl=transformer_engine", "parallel.context_parallel_size=2"],
     "data.document_mask=true with parallel.context_parallel_size=2"),
    (["model.transformer_impl=transformer_engine"], "Fix: model.transformer_impl=local"),
])
def test_document_mask_rules_fire_at_compose_time(overrides, message):
    with pytest.raises(ConfigError, match="data.document_mask=true") as err:
        load_recipe("gpt-tiny", ["data.document_mask=true"] + overrides)
    assert message in str(err.value)
    assert load_recipe("gpt-tiny", ["data.document_mask=true"]).data.document_mask      # CPU, local attention: fine
    # GPUs without TE: the packed (thd) form in torch's attention (pretrain/model/attention.py)
    assert load_recipe("gpt-tiny", ["data.document_mask=true", "cluster.gpu_type=H100-SXM",
                                    "model.transformer_impl=local"]).data.document_mask


def test_long_context_recipes_validate():
    tiny = load_recipe("llama-tiny-long")
    assert tiny.data.document_mask and tiny.model.seq_length > load_recipe("llama-tiny").model.seq_length
    assert tiny.checkpoint.load_weights_only and tiny.model.rotary_base != load_recipe("llama-tiny").model.rotary_base
    big = load_recipe("llama-8b-long")
    assert big.model.seq_length == 32768 and big.data.document_mask and big.cluster.gpu_type != "cpu"


def test_plan_counts_the_mask_and_the_scores_it_materialises():
    from pretrain.plan.memory import GIB, memory_per_gpu
    base = ONE_RANK + ["model.attention_backend=local"]
    off, on = (memory_per_gpu(load_recipe("gpt-tiny", base + [f"data.document_mask={v}"])) for v in ("false", "true"))
    assert (on["activations"] - off["activations"]) * GIB == pytest.approx(16 * 16 * 1)      # s x s x mbs bools
    # the default on a GPU (torch's module: FlexAttention on the packed documents) keeps neither mask nor scores
    gpu = ONE_RANK + ["cluster.gpu_type=H100-SXM"]
    auto_off, auto = (memory_per_gpu(load_recipe("gpt-tiny", gpu + [f"data.document_mask={v}"]))
                      for v in ("false", "true"))
    assert auto["activations"] == auto_off["activations"] < on["activations"]
    # on CPU torch's module computes in megatron-core's order (pretrain/model/attention.py): the unfused one's
    assert memory_per_gpu(load_recipe("gpt-tiny", ONE_RANK + ["data.document_mask=true"]))["activations"] == \
        on["activations"]


# ---- training: TP=2 and PP=2 equal one process; the default layout through pretrain.train ----------
N = 6                   # steps of the document-masked runs
DOC = ["data.document_mask=true", "data.eod_mask_loss=true", f"schedule.train_iters={N}", "schedule.lr_decay=20"]


@shared_runs(nproc=1)
def docmask_reference(root, runs):
    """gpt-tiny with document masking on one process, N steps; and on megatron-core's unfused attention."""
    return {"tp1": DOC, "unfused": DOC + ["model.attention_backend=unfused"]}


@shared_runs(nproc=2)
def docmask_runs(root, runs):
    """The same at TP=2 and PP=2 (every rank and stage needs the mask), and at DP=2 with validation."""
    return {"tp2": DOC + ["parallel=tp2"], "pp2": DOC + ["parallel=pp2"],
            "dp2": DOC + ["eval.eval_interval=4", "eval.eval_iters=2", "eval.final_test=true"]}


@shared_runs(nproc=2, late=True)
def docmask_ds_runs(root, runs):
    """The DeepSpeed engine (same GPTModel forward) with document masking, ZeRO-1 over DP=2."""
    return {"zero1": DOC + ["parallel=ds-zero1"]}


def valid_records(runs, name) -> list:
    lines = (runs.root / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "valid"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_document_masked_layouts_equal_one_process(docmask_reference, docmask_runs, layout):
    ref = [r["loss"] for r in docmask_reference["tp1"]]
    ours = [r["loss"] for r in docmask_runs(layout)]
    assert len(ours) == N and ref[-1] < ref[0] - 0.3                        # it learns
    for step, (a, b) in enumerate(zip(ours, ref, strict=True), start=1):
        assert abs(a - b) < 1e-5, (layout, step, a, b)
    if layout != "dp2":                                                      # the same validation window
        (valid,), (ref_valid,) = valid_records(docmask_runs, layout), valid_records(docmask_reference, "tp1")
        assert abs(valid["loss"] - ref_valid["loss"]) < 1e-5


@pytest.mark.slow
def test_torch_attention_gives_the_unfused_losses_with_documents(docmask_reference):
    ours, unfused = ([r["loss"] for r in docmask_reference[name]] for name in ("tp1", "unfused"))
    assert len(ours) == len(unfused) == N
    assert ours == unfused          # on CPU torch's module computes in megatron-core's order: bit for bit


@pytest.mark.slow
def test_deepspeed_engine_masks_documents_alike(docmask_reference, docmask_ds_runs):
    ref, ours = [r["loss"] for r in docmask_reference["tp1"]], [r["loss"] for r in docmask_ds_runs("zero1")]
    assert len(ours) == N
    for step, (a, b) in enumerate(zip(ours, ref, strict=True), start=1):
        assert abs(a - b) < 1e-5, (step, a, b)


@pytest.mark.slow
def test_document_masked_run_logs_what_it_scores_and_counts_every_token(docmask_runs):
    """The default layout (DP=2) through pretrain.train with validation and the final test."""
    log = job_log(docmask_runs.root / "dp2", 2)
    assert "[data] per-document attention and positions (s x s mask); loss over every target except the token " \
           "after each EOD (data.eod_mask_loss)" in log
    records = docmask_runs("dp2")
    assert all(r["consumed_tokens"] == GLOBAL_BATCH * 128 * r["step"] for r in records)    # samples x seq, masks or not
    assert "valid step 4: loss" in log and f"valid step {N}: loss" in log and f"test step {N}: loss" in log


def test_demo_batches_carry_each_documents_mask_and_positions(demo_data):
    """What the engine receives from pretrain/data/datasets.py on the demo corpus: per sample, token i may attend to
    token j iff j is at most position_ids[i] tokens back, and some samples hold several documents."""
    from pretrain.data.datasets import StepBatches, build_datasets
    cfg = load_recipe("gpt-tiny", ["data.document_mask=true", "data.eod_mask_loss=true"])
    train, _, _ = build_datasets(cfg, 64, 8, 8)
    batches = StepBatches(train, 8, 0, 1).micro_batches(0, 64)
    s, eod, several = cfg.model.seq_length, train.config.tokenizer.eod, 0
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    for batch in batches:
        assert batch["attention_mask"].shape == (8, 1, s, s) and batch["attention_mask"].dtype == torch.bool
        for b in range(8):
            pos = batch["position_ids"][b]
            allowed = (j <= i) & (j >= i - pos[:, None])
            assert torch.equal(batch["attention_mask"][b, 0], ~allowed)
            ends = batch["tokens"][b] == eod
            assert torch.equal(batch["loss_mask"][b] == 0, ends)
            assert torch.equal(pos[1:] == 0, ends[:-1])                     # a document starts after each EOD
            several += int(ends[:-1].any())
    assert several >= 4, several             # 6 of the first 64 demo samples hold a boundary: exercised

"""Compose-time rules of multi-token prediction (model.mtp_num_layers, model.mtp_loss_weight; docs/mtp.md).

megatron-core 0.16.1 computes the MTP loss inside GPTModel from the labels and loss mask it is given and adds
its gradient through MTPLossAutoScaler; every path that calls the model without labels, or reads MTP's
tracker from elsewhere than this repo's one place (pretrain/model/mtp.py), is refused here by name.
"""
from __future__ import annotations


def mtp_enabled(model) -> bool:
    return bool(model.mtp_num_layers)


def mtp_problems(cfg, add) -> None:
    m, p = cfg.model, cfg.parallel
    if m.mtp_num_layers is not None and m.mtp_num_layers < 0:
        add(f"model.mtp_num_layers={m.mtp_num_layers} must be >= 0. Fix: the MTP depth, or 0/null for off.")
    if m.mtp_loss_weight < 0:
        add(f"model.mtp_loss_weight={m.mtp_loss_weight} must be >= 0. Fix: DeepSeek-V3 used 0.3, then 0.1.")
    if not mtp_enabled(m):
        return
    why = f"model.mtp_num_layers={m.mtp_num_layers}"
    if m.arch not in ("gpt", "llama"):
        add(f"{why} with model.arch={m.arch}: MTP predicts later tokens of a causal decoder. Fix: "
            "model.mtp_num_layers=0, or a gpt/llama recipe.")
    if p.engine != "megatron":
        add(f"{why} with parallel.engine={p.engine}: only the megatron engine reads MTP's loss tracker and sets "
            "its gradient scale. Fix: parallel.engine=megatron, or model.mtp_num_layers=0.")
    if p.virtual_pipeline_model_parallel_size:
        add(f"{why} with parallel.virtual_pipeline_model_parallel_size={p.virtual_pipeline_model_parallel_size}: "
            "megatron-core 0.16.1 puts MTP in the last virtual chunk, which is not tested here. Fix: "
            "parallel.virtual_pipeline_model_parallel_size=null, or model.mtp_num_layers=0.")
    if p.pipeline_model_parallel_size > 1 and m.position_embedding_type == "learned_absolute":
        add(f"{why} with parallel.pipeline_model_parallel_size={p.pipeline_model_parallel_size} and "
            "model.position_embedding_type=learned_absolute: megatron-core 0.16.1 gives the last stage's MTP its "
            "own position-embedding table, tied to the first stage's neither in gradient nor in checkpoint (only "
            "the word embeddings are). Fix: position_embedding_type=rope, PP=1, or model.mtp_num_layers=0.")
    if p.pipeline_model_parallel_size > 1 and m.embedding_layernorm:
        add(f"{why} with parallel.pipeline_model_parallel_size={p.pipeline_model_parallel_size} and "
            "model.embedding_layernorm: the last stage's embedding copy that MTP uses has no embedding norm. "
            "Fix: PP=1, or model.mtp_num_layers=0.")
    if p.context_parallel_size > 1:
        add(f"{why} with parallel.context_parallel_size={p.context_parallel_size}: not tested here (CPU has no CP). "
            "Fix: CP=1, or model.mtp_num_layers=0.")
    if m.z_loss_coeff:
        add(f"{why} with model.z_loss_coeff={m.z_loss_coeff}: the z-loss calls the model without labels, and "
            "megatron-core's MTP needs them. Fix: model.z_loss_coeff=0, or model.mtp_num_layers=0.")
    if cfg.distill.teacher_recipe:
        add(f"{why} with distill.teacher_recipe: the student's logits are taken without labels, and "
            "megatron-core's MTP needs them. Fix: drop one of them.")
    if cfg.peft.method != "none":
        add(f"{why} with peft.method={cfg.peft.method}: the MTP layer is neither frozen base nor an adapter. Fix: "
            "model.mtp_num_layers=0 for PEFT.")
    if cfg.data.document_mask:
        add(f"{why} with data.document_mask=true: the MTP layer's shifted embeddings would cross document "
            "boundaries on the CPU path. Fix: data.document_mask=false, or model.mtp_num_layers=0.")
    if cfg.eval.downstream_tasks:
        add(f"{why} with eval.downstream_tasks: the scorer takes logits without labels, and megatron-core's MTP "
            "needs them. Fix: score the exported checkpoint with `make eval`, or drop eval.downstream_tasks.")

"""Compose-time validation: every rule names the field, the values and a fix.

All problems are collected and raised together as one ConfigError, so a user fixes a
recipe in one round trip, before anything reaches a cluster.
"""
from __future__ import annotations

from common.config import ConfigError
from common.slurm_values import sbatch_problems

from ..engines.deepspeed.ds_config import load_template, problems, template_path
from ..engines.registry import ENGINES
from ..optim.registry import OPTIMIZERS
from ..schedules import LR_SCHEDULES, WSD_SHAPES
from .attention import BACKENDS, attention_problems, backend_problems
from .blend_file import blend_problems
from .data import document_mask_problems, fim_problems
from .derive import batch_ramp, pipeline_stage_layers
from .fsdp2 import fsdp2_problems
from .gpt_oss_parts import gpt_oss_parts_problems
from .mla import mla_problems
from .moe import moe_problems
from .mtp import mtp_problems
from .objective import ARCH_OBJECTIVE, OBJECTIVES, objective_problems
from .observability import downstream_problems, straggler_problems, tracker_problems
from .optimizer import optim_problems
from .peft import peft_problems
from .precision import precision_problems
from .schema import DTYPES, DeepSpeedConfig, JobConfig
from .sentence_data import sentence_data_problems

CHOICES = {
    "model.arch": tuple(ARCH_OBJECTIVE),
    "objective.name": OBJECTIVES,
    "model.position_embedding_type": ("learned_absolute", "rope", "yarn"),
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "model.activation": ("gelu", "swiglu"),
    "model.attention_backend": BACKENDS,
    "model.transformer_impl": ("auto", "local", "transformer_engine"),
    "precision.dtype": DTYPES,
    "checkpoint.on_all_damaged": ("stop", "restart"),
    "parallel.engine": ENGINES.names,
    "parallel.recompute_granularity": (None, "selective", "full"),
    "parallel.recompute_method": ("uniform", "block"),
    "optim.name": OPTIMIZERS.names,
    "optim.muon_adjust_lr": ("match_rms_adamw", "original"),
    "schedule.lr_decay_style": LR_SCHEDULES.names,
    "schedule.unit": ("steps", "tokens"),
    "schedule.lr_wsd_decay_style": tuple(WSD_SHAPES),
    "batch.ramp_unit": ("samples", "tokens"),
    "data.tokenizer.type": ("gpt2", "hf", "sentencepiece"),
    "checkpoint.distrib_optim_sharding_type": ("fully_reshardable", "dp_reshardable"),
    "cluster.launcher": ("local", "srun", "srun-torchrun"),
    "stability.spike_policy": ("off", "skip", "rollback"),
    "stability.rollback_data": ("skip", "replay", "reshuffle"),
}   # a callable is a registry's names(): what is registered when the recipe is validated
NO_DECAY_KINDS = ("bias", "norm", "embedding")


def _get(cfg: JobConfig, dotted: str):
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: JobConfig, files: bool = True) -> None:
    """Every rule, all problems in one ConfigError. files=False leaves out the rules that read data files (the
    blend and its tokenizer): the layout search validates thousands of layouts of a recipe composed with them."""
    problems: list[str] = []
    add = problems.append
    m, p, b, s, o = cfg.model, cfg.parallel, cfg.batch, cfg.schedule, cfg.optim

    for key, allowed in CHOICES.items():
        value, allowed = _get(cfg, key), allowed() if callable(allowed) else allowed
        if value not in allowed:
            add(f"{key}={value!r} is not one of {list(allowed)}. Fix: pick one of those.")
    for kind in o.no_weight_decay_on:
        if kind not in NO_DECAY_KINDS:
            add(f"optim.no_weight_decay_on has {kind!r}; allowed {list(NO_DECAY_KINDS)}.")

    # Data-mix schedule
    phases = cfg.data.mix_phases
    if phases and cfg.stability.rollback_data == "reshuffle":
        add("stability.rollback_data=reshuffle with data.mix_phases: the phased mix hands out samples by running "
            "per-source counters, not by position, so a window cannot be re-ordered. Fix: rollback_data=skip or "
            "replay.")
    for i, ph in enumerate(phases):
        if not ph.weights or any(w < 0 for w in ph.weights) or sum(ph.weights) <= 0:
            add(f"data.mix_phases[{i}].weights={list(ph.weights)} needs non-negative weights with a positive sum.")
        if len(ph.weights) != len(phases[0].weights):
            add(f"data.mix_phases[{i}] has {len(ph.weights)} weights, data.mix_phases[0] has "
                f"{len(phases[0].weights)}. Fix: one weight per train source in every phase.")
        if i and ph.start_tokens <= phases[i - 1].start_tokens:
            add(f"data.mix_phases[{i}].start_tokens={ph.start_tokens} must exceed the previous phase's "
                f"{phases[i - 1].start_tokens}. Fix: list phases in order.")
    if phases and phases[0].start_tokens != 0:
        add(f"data.mix_phases[0].start_tokens={phases[0].start_tokens}: the first phase must start at 0.")
    if phases and cfg.data.mock:
        add("data.mix_phases needs a blend with train sources; data.mock has none. Fix: drop one of them.")

    # Shapes
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        if getattr(p, key) < 1:
            add(f"parallel.{key}={getattr(p, key)} must be >= 1.")
    if min(tp, pp, cp) < 1:
        raise ConfigError(problems)
    heads = m.num_attention_heads
    groups = m.num_query_groups or heads
    if m.kv_channels is None and m.hidden_size % heads:
        add(f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads={heads}. "
            "Fix: change either, or set model.kv_channels explicitly.")
    if heads % groups:
        add(f"model.num_attention_heads={heads} is not divisible by model.num_query_groups={groups}. "
            "Fix: choose query groups that divide the heads.")
    if heads % tp:
        add(f"parallel.tensor_model_parallel_size={tp} does not divide model.num_attention_heads={heads}. "
            f"Fix: use a TP that divides {heads}.")
    if groups % tp:
        add(f"parallel.tensor_model_parallel_size={tp} does not divide model.num_query_groups={groups}. "
            f"Fix: use TP <= and dividing {groups}, or more query groups.")
    seq_limit = m.max_position_embeddings or m.seq_length
    if m.seq_length > seq_limit:
        add(f"model.seq_length={m.seq_length} exceeds model.max_position_embeddings={seq_limit}. "
            "Fix: shorten seq_length or raise max_position_embeddings.")
    if m.rope_scaling and (m.position_embedding_type != "rope" or m.mla.enabled):
        add("model.rope_scaling=true scales megatron-core's RoPE, but the model has "
            + ("multi-head latent attention (its own rotary embedding)" if m.mla.enabled else
               f"model.position_embedding_type={m.position_embedding_type}") + ". Fix: model.rope_scaling=false.")
    if m.normalization == "LayerNorm" and m.arch == "llama":
        add("model.arch=llama with model.normalization=LayerNorm: the Llama export expects RMSNorm. Fix: use RMSNorm "
            "or arch=gpt.")

    if not m.layout_invariant_init and pp > 1:
        # megatron-core's own init draws from the RNG seeded with `seed` on every stage (the engines do not offset
        # it by the PP rank): each stage would start its layers from the same draws.
        add(f"model.layout_invariant_init=false with parallel.pipeline_model_parallel_size={pp}: megatron-core's "
            "own init seeds every pipeline stage alike, so the stages' layers would start as copies of each other. "
            "Fix: model.layout_invariant_init=true (the default).")

    # Pipeline split
    stages = pipeline_stage_layers(m.num_layers, pp, p.num_layers_in_first_pipeline_stage,
                                   p.num_layers_in_last_pipeline_stage)
    if pp == 1 and (p.num_layers_in_first_pipeline_stage or p.num_layers_in_last_pipeline_stage):
        add("parallel.num_layers_in_first/last_pipeline_stage set with pipeline_model_parallel_size=1. Fix: unset "
            "them.")
    elif min(stages) <= 0 or sum(stages) != m.num_layers:
        add(f"parallel.pipeline_model_parallel_size={pp} does not split model.num_layers={m.num_layers} "
            f"(stages would get {stages}). Fix: a PP that divides the layers, or set "
            "parallel.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage so the rest divide "
            "evenly.")
    vpp = p.virtual_pipeline_model_parallel_size
    if vpp is not None:
        if pp == 2 and cfg.cluster.gpu_type == "cpu":
            add(f"parallel.virtual_pipeline_model_parallel_size={vpp} with pipeline_model_parallel_size=2 on CPU: "
                "gloo pairs the interleaved schedule's simultaneous sends to the one neighbour wrongly (wrong "
                "gradients; NCCL is fine). Fix: PP>=4 for interleaving on CPU, or unset it.")
        if pp < 2:
            add(f"parallel.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size>1 (is {pp}).")
        elif min(stages) > 0 and any(n % vpp for n in stages):
            add(f"parallel.virtual_pipeline_model_parallel_size={vpp} does not divide the layers per stage {stages}.")

    if cfg.checkpoint.save_interval_minutes < 0:
        add(f"checkpoint.save_interval_minutes={cfg.checkpoint.save_interval_minutes} must be >= 0 (0: saves by steps "
            "only).")

    st = cfg.stability
    if st.step_timeout_minutes < 0 or st.distributed_timeout_minutes <= 0:
        add(f"stability.step_timeout_minutes={st.step_timeout_minutes} must be >= 0 (0: keep the start-up one) and "
            f"stability.distributed_timeout_minutes={st.distributed_timeout_minutes} > 0.")

    cl = cfg.cluster
    for problem in sbatch_problems("cluster", cl, {"name": cfg.name, "run_dir": cfg.run_dir}):
        add(problem)
    if cl.launcher != "local" and (cl.max_restarts < 0 or cl.chain_jobs < 0 or cl.restart_backoff_s < 0):
        add(f"cluster.max_restarts={cl.max_restarts}, cluster.chain_jobs={cl.chain_jobs} and cluster.restart_backoff_s="
            f"{cl.restart_backoff_s} must be >= 0.")

    # World and batch
    world = cfg.cluster.nodes * cfg.cluster.devices_per_node
    if world % (tp * pp * cp):
        add(f"world size {world} (cluster.nodes={cfg.cluster.nodes} x cluster.devices_per_node="
            f"{cfg.cluster.devices_per_node}) is not divisible by TP*PP*CP={tp}*{pp}*{cp}={tp * pp * cp}. "
            "Fix: change the node count or the parallel degrees.")
    else:
        dp = world // (tp * pp * cp)
        unit = b.micro_batch_size * dp
        ramp_ok = True
        if b.ramp_start is not None:
            ramp_ok = False
            if b.ramp_increment <= 0 or b.ramp_over <= 0:
                add(f"batch.ramp_start={b.ramp_start} needs batch.ramp_increment>0 and batch.ramp_over>0 "
                    f"(are {b.ramp_increment}, {b.ramp_over}).")
            elif b.ramp_start > b.global_batch_size or (b.global_batch_size - b.ramp_start) % b.ramp_increment:
                add(f"batch ramp {b.ramp_start} -> {b.global_batch_size} in steps of {b.ramp_increment} does not land "
                    "on global_batch_size. Fix: (global_batch_size - ramp_start) must be a multiple of ramp_increment.")
            else:
                ramp_ok = True
        sizes = batch_ramp(cfg).sizes() if ramp_ok else [b.global_batch_size]
        bad = [size for size in sizes if size % unit]
        if bad:
            add(f"global batch {bad[:5]} (batch.global_batch_size / ramp) not divisible by batch.micro_batch_size="
                f"{b.micro_batch_size} x data-parallel size {dp} = {unit}. Fix: make every ramp size a multiple of "
                f"{unit}.")
    if p.sequence_parallel and tp == 1:
        add("parallel.sequence_parallel=true requires parallel.tensor_model_parallel_size>1. Fix: set TP>1 or "
            "sequence_parallel=false.")
    if cp > 1 and m.transformer_impl != "transformer_engine":
        add(f"parallel.context_parallel_size={cp} needs model.transformer_impl=transformer_engine (megatron-core's CP "
            "attention is TE's).")
    if p.recompute_granularity == "full" and min(stages) > 0 and p.recompute_num_layers > max(stages):
        add(f"parallel.recompute_num_layers={p.recompute_num_layers} exceeds the layers per pipeline stage "
            f"{max(stages)}.")

    moe_problems(cfg, world, add)
    precision_problems(cfg, add)
    tracker_problems(cfg, add)
    straggler_problems(cfg, add)
    fim_problems(cfg, add)
    if files:
        blend_problems(cfg, add)    # data.blend is a blend, tokenized with data.tokenizer (blend.json's record)
    document_mask_problems(cfg, add)
    attention_problems(cfg, add)
    backend_problems(cfg, add)
    mla_problems(cfg, add)
    gpt_oss_parts_problems(cfg, add)
    downstream_problems(cfg, add)
    peft_problems(cfg, add)
    mtp_problems(cfg, add)          # model.mtp_* (multi-token prediction)
    fsdp2_problems(cfg, add)        # parallel.data_parallel_sharding=fsdp2 (docs/fsdp2.md)
    objective_problems(cfg, add)
    sentence_data_problems(cfg, add)

    # Engines
    if p.engine == "deepspeed":
        _deepspeed_problems(cfg, add)
    else:
        changed = [f"deepspeed.{k}={v!r}" for k, v in vars(cfg.deepspeed).items() if v != getattr(DeepSpeedConfig(), k)]
        if changed:
            add(f"{', '.join(changed)}: DeepSpeed settings, but parallel.engine={p.engine}. Fix: set "
                "parallel.engine=deepspeed (or parallel=ds-zero1 ...), or drop them; on megatron-core "
                "parallel.use_distributed_optimizer=true is ZeRO-1.")

    # Optimizer and schedule
    if o.name == "muon":
        _muon_problems(cfg, add)
    elif (o.name in OPTIMIZERS and not OPTIMIZERS.get(o.name).distributed_optimizer and p.engine == "megatron"
            and p.use_distributed_optimizer):
        add(f"optim.name={o.name} with parallel.use_distributed_optimizer=true: megatron-core's distributed-optimizer "
            "checkpoints hold Adam's state only, so this run could not be resumed. Fix: optim=adamw, or a parallel "
            "option without the distributed optimizer.")
    optim_problems(cfg, add)        # optim.lr, min_lr, weight_decay, betas, eps, clip_grad
    if (s.train_iters is None) == (s.train_tokens is None):
        add("exactly one of schedule.train_iters and schedule.train_tokens must be set "
            f"(are {s.train_iters}, {s.train_tokens}).")
    if s.lr_decay is not None and s.lr_warmup > s.lr_decay:
        add(f"schedule.lr_warmup={s.lr_warmup} exceeds schedule.lr_decay={s.lr_decay}.")
    if s.lr_decay_style == "wsd" and s.lr_wsd_decay <= 0:
        add("schedule.lr_decay_style=wsd needs schedule.lr_wsd_decay>0 (length of the final decay).")
    if cfg.profile.steps and (len(cfg.profile.steps) != 2 or cfg.profile.steps[0] > cfg.profile.steps[1]):
        add(f"profile.steps={cfg.profile.steps} must be [start, end] with start <= end.")
    if cfg.logging.log_interval < 1:
        add(f"logging.log_interval={cfg.logging.log_interval} must be >= 1.")
    if problems:
        raise ConfigError(problems)


def _muon_problems(cfg: JobConfig, add) -> None:
    """Muon orthogonalises whole matrices (docs/muon.md): no TP slices, no flat ZeRO-1 shards."""
    p = cfg.parallel
    if p.tensor_model_parallel_size > 1:
        add(f"optim.name=muon with parallel.tensor_model_parallel_size={p.tensor_model_parallel_size}: each rank holds "
            "a slice of every matrix and Muon's Newton-Schulz needs the whole one. Fix: "
            "parallel.tensor_model_parallel_size=1, or optim=adamw.")
    elif cfg.moe.num_experts and (p.expert_tensor_parallel_size or 1) > 1:
        add(f"optim.name=muon with parallel.expert_tensor_parallel_size={p.expert_tensor_parallel_size}: each rank "
            "holds a slice of every expert matrix and Muon's Newton-Schulz needs the whole one. Fix: "
            "parallel.expert_tensor_parallel_size=1, or optim=adamw.")
    if p.engine == "megatron" and p.use_distributed_optimizer:
        add("optim.name=muon with parallel.use_distributed_optimizer=true: megatron-core's distributed optimizer "
            "shards flat fp32 buffers across data-parallel ranks, so no rank holds a matrix to orthogonalise. "
            "Fix: parallel.use_distributed_optimizer=false, or optim=adamw.")


def _deepspeed_problems(cfg: JobConfig, add) -> None:
    """engine=deepspeed: megatron-core GPTModel with TP, under ZeRO; what it does not combine with."""
    p, o, ds = cfg.parallel, cfg.optim, cfg.deepspeed
    if ds.zero_stage not in (0, 1, 2, 3):
        add(f"deepspeed.zero_stage={ds.zero_stage} must be 0, 1, 2 or 3.")
    if p.pipeline_model_parallel_size > 1 or p.virtual_pipeline_model_parallel_size:
        add(f"parallel.pipeline_model_parallel_size={p.pipeline_model_parallel_size} with engine=deepspeed: "
            "DeepSpeed's "
            "pipeline needs a PipelineModule (the model as a flat layer list), a fork of the GPTModel both engines and "
            "the export share. Fix: PP=1 (ZeRO-3 for memory), or engine=megatron for PP.")
    if p.context_parallel_size > 1 or p.sequence_parallel:
        add("parallel.context_parallel_size>1 / sequence_parallel=true with engine=deepspeed: their gradient "
            "reductions live in megatron-core's DDP, which this engine replaces. Fix: engine=megatron.")
    if p.use_distributed_optimizer:
        add("parallel.use_distributed_optimizer is the megatron engine's ZeRO-1. Fix: with engine=deepspeed use "
            "deepspeed.zero_stage=1.")
    for flag in ("overlap_grad_reduce", "overlap_param_gather"):
        if getattr(p, flag):
            add(f"parallel.{flag} is a megatron-core DDP setting and does nothing under DeepSpeed. Fix: remove it "
                "(ZeRO stage and the template's overlap_comm cover it).")
    if ds.offload_optimizer and ds.zero_stage < 1:
        add("deepspeed.offload_optimizer=true needs deepspeed.zero_stage>=1.")
    if ds.offload_param and ds.zero_stage != 3:
        add("deepspeed.offload_param=true needs deepspeed.zero_stage=3.")
    if cfg.checkpoint.async_save:
        add("checkpoint.async_save=true with engine=deepspeed: the DeepSpeed engine saves synchronously. Fix: remove "
            "it.")
    if o.name != "adamw":
        add(f"optim.name={o.name} with engine=deepspeed: the DeepSpeed engine builds AdamW from the template's "
            "optimizer section. Fix: optim=adamw, or engine=megatron.")
    path = template_path(cfg)
    try:
        for problem in problems(cfg, load_template(path), path):
            add(problem)
    except ValueError as err:
        add(str(err))

"""The typed job config: one dataclass section per playbook decision.

Every field carries a one-line doc in its metadata (``doc(...)``); `tests/test_config.py`
fails if one is missing, and `python -m pretrain.config --describe` prints them. Field
names follow megatron-core / Megatron-LM where one exists so Megatron users recognise them.
Values that follow from others (DP size, padded vocab, FFN width, iterations from a token
budget, ...) are never typed by hand: `derive.py` computes them into `JobConfig.derived`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from common.config import doc
from common.slurm_values import JobStepConfig
from preprocessing.config import TokenizerConfig

from .data import FimConfig
from .gpt_oss_parts import YarnConfig
from .mla import MLAConfig
from .moe import MoEConfig
from .objective import ObjectiveConfig
from .observability import StragglerConfig
from .peft import DistillConfig, PeftConfig
from .resilience import CheckpointConfig, FaultConfig, StabilityConfig


@dataclass
class ModelConfig:
    arch: str = doc("gpt", "Architecture family: 'gpt' (GPT-2/3), 'llama', 'bert' (encoder) or 't5' (encoder-decoder); "
                           "the objective and the HF export target follow it.")
    num_layers: int = doc(MISSING, "Number of transformer layers.")
    hidden_size: int = doc(MISSING, "Model width d_model.")
    num_attention_heads: int = doc(MISSING, "Number of query attention heads.")
    num_query_groups: Optional[int] = doc(None, "Key/value heads for GQA; null means multi-head attention (= heads).")
    kv_channels: Optional[int] = doc(None, "Per-head dimension; null means hidden_size / num_attention_heads.")
    ffn_hidden_size: Optional[int] = doc(None, "MLP width; null derives 4*h (GELU) or 8h/3 rounded up to "
                                               "ffn_multiple_of (SwiGLU).")
    ffn_multiple_of: int = doc(256, "Rounding multiple for the derived SwiGLU FFN width (Llama convention).")
    seq_length: int = doc(MISSING, "Training sequence length in tokens (T5: the encoder's).")
    num_decoder_layers: Optional[int] = doc(None, "T5: decoder layers; null means num_layers.")
    decoder_seq_length: Optional[int] = doc(None, "T5: decoder (target) length in tokens; null derives what the "
                                                  "denoising objective needs for seq_length.")
    max_position_embeddings: Optional[int] = doc(None, "Position table size / RoPE limit; null means seq_length.")
    position_embedding_type: str = doc("learned_absolute", "'learned_absolute' (GPT), 'rope' (Llama) or 'yarn' "
                                                           "(RoPE by model.yarn; gpt-oss).")
    rotary_base: int = doc(10000, "RoPE theta.")
    rotary_percent: float = doc(1.0, "Fraction of each head's dimensions that RoPE rotates.")
    rope_scaling: bool = doc(False, "Llama 3.x RoPE frequency scaling (megatron-core's: low_freq_factor 1, "
                                    "high_freq_factor 4, original context 8192; `make import-hf` of a Llama 3.1 "
                                    "directory needs it).")
    rope_scaling_factor: float = doc(8.0, "Its factor (Llama 3.1: 8, Llama 3.2: 32).")
    yarn: YarnConfig = doc(None, "YaRN RoPE with position_embedding_type=yarn (config/gpt_oss_parts.py).",
                           factory=YarnConfig)
    normalization: str = doc("LayerNorm", "'LayerNorm' or 'RMSNorm'.")
    layernorm_epsilon: float = doc(1e-5, "Epsilon of every norm layer.")
    activation: str = doc("gelu", "MLP activation: 'gelu' or 'swiglu' (gated, two fc1 projections).")
    glu_activation: str = doc("silu", "Gate of the gated MLP (activation=swiglu): 'silu', or 'quick_gelu' "
                                      "(x * sigmoid(1.702 x), gpt-oss).")
    glu_linear_offset: float = doc(0.0, "Added to the gated MLP's linear half before the product (gpt-oss: 1).")
    glu_clamp: Optional[float] = doc(None, "Clamp the gate above at c and the linear half to [-c, c] before the "
                                           "product (gpt-oss: 7); null: none.")
    add_bias_linear: bool = doc(True, "Biases in all linear layers (GPT: true, Llama: false; with MoE also the "
                                      "router's and the experts').")
    untie_embeddings_and_output_weights: bool = doc(False, "Separate output layer instead of reusing the input "
                                                           "embedding.")
    vocab_size: int = doc(MISSING, "Tokenizer vocabulary size before padding (must be >= the tokenizer's).")
    make_vocab_size_divisible_by: int = doc(128, "Pad the vocab to a multiple of this times TP (Megatron convention).")
    init_method_std: float = doc(0.02, "Std of the normal init of weights.")
    scaled_output_init: bool = doc(True, "Init output projections with std/sqrt(2*num_layers) (GPT-2 scaled init).")
    hidden_dropout: float = doc(0.0, "Dropout after attention/MLP outputs.")
    attention_dropout: float = doc(0.0, "Dropout on attention probabilities.")
    qk_layernorm: bool = doc(False, "Normalise queries and keys before the dot product (stability).")
    attention_sinks: bool = doc(False, "A learned logit per head in every softmax's denominator (gpt-oss's sinks; "
                                       "megatron-core softmax_type=learnable).")
    mla: MLAConfig = doc(None, "Multi-head latent attention (DeepSeek-V2/V3; pretrain/config/mla.py).",
                         factory=MLAConfig)
    embedding_layernorm: bool = doc(False, "Normalise the embedding output before the first layer (BLOOM; stability).")
    z_loss_coeff: float = doc(0.0, "PaLM z-loss: add coeff * logsumexp(logits)^2 per token (1e-4 in PaLM/OLMo); 0 off.")
    mtp_num_layers: Optional[int] = doc(None, "Multi-token prediction depth D (DeepSeek-V3: 1; pretrain/model/mtp.py); "
                                              "0/null off.")
    mtp_loss_weight: float = doc(0.3, "MTP loss weight lambda: trained loss = main + lambda/D * sum of MTP losses "
                                      "(DeepSeek-V3: 0.3, then 0.1).")
    attention_backend: str = doc("auto", "Core attention: 'torch' (SDPA/FlexAttention), 'te' (TE's flash/fused; "
                                         "'flash'/'fused' force one), 'unfused'/'local' (s x s scores); 'auto': te "
                                         "on TE's spec, else torch. pretrain/model/attention.py.")
    layout_invariant_init: bool = doc(True, "Draw each weight from a generator seeded by its global name, so every "
                                            "TP/PP layout starts equal; false (megatron-core's own init) is refused "
                                            "with PP>1, where it seeds every stage alike.")
    fusions_required: list[str] = doc(None, "Fusion flags this recipe insists on (model/fusions.py names them); "
                                            "refused where their kernel is missing.", factory=list)
    init_on_cpu: bool = doc(False, "Draw the layout-invariant init on the host's generator: the same weights on CPU "
                                   "and GPU runs (CUDA's stream differs), at host speed.")
    transformer_impl: str = doc("auto", "Layer spec: 'local' (megatron-core modules), 'transformer_engine', or 'auto' "
                                        "(TE when importable).")
    window_size: Optional[int] = doc(None, "Sliding-window layers: a query sees itself and the window_size tokens "
                                           "before it (megatron-core (w, 0); HF sliding_window w+1); null: all global.")
    global_every: Optional[int] = doc(None, "With window_size: layers k, 2k, ... (1-based) attend globally, the rest "
                                            "in the window (Gemma 3: 6); null: see global_layers.")
    global_layers: list[int] = doc(None, "With window_size: 0-based indices (decoder.layers.<i>) of the global layers "
                                         "(OLMo 3 style); empty and no global_every: every layer windowed.",
                                   factory=list)


DTYPES = ("fp32", "bf16", "fp16")   # precision.dtype: the one place these names are spelled


@dataclass
class PrecisionConfig:
    dtype: str = doc("fp32", "Params/activations dtype: 'fp32', 'bf16' (fp32 main params and grads in the "
                     "optimizer) or 'fp16' (the same, with loss scaling).")
    loss_scale: Optional[float] = doc(None, "Static fp16 loss scale; null means dynamic loss scaling.")
    initial_loss_scale: float = doc(2.0**32, "Starting value of the dynamic fp16 loss scale.")
    min_loss_scale: float = doc(1.0, "Floor of the dynamic fp16 loss scale.")
    loss_scale_window: int = doc(1000, "Overflow-free steps before the dynamic loss scale doubles.")
    hysteresis: int = doc(2, "Overflows tolerated before the dynamic loss scale halves.")
    grad_reduce_in_fp32: bool = doc(True, "Accumulate and all-reduce gradients in fp32 (4 bytes/param) under "
                                          "bf16/fp16.")
    attention_softmax_in_fp32: bool = doc(True, "Compute attention softmax in fp32 under bf16/fp16.")
    fp8: Optional[str] = doc(None, "FP8 GEMMs through Transformer Engine on top of bf16: null (off), 'e4m3' (all FP8 "
                                   "tensors e4m3) or 'hybrid' (e5m2 gradients).")
    fp8_recipe: str = doc("tensorwise", "FP8 scaling: 'tensorwise' (current scaling), 'delayed' (amax history), "
                                        "'blockwise' (128x128 blocks) or 'mxfp8' (Blackwell only).")
    fp8_bf16_layers: int = doc(1, "Transformer layers kept in bf16 under FP8: the first N and the last N of the whole "
                                  "model (megatron-core counts global layer numbers, whatever the pipeline split); "
                                  "0: all FP8; the delayed recipe needs 0. make plan times every layer as FP8.")
    fp8_amax_history_len: int = doc(1024, "Amax history of the delayed recipe (its max is used).")

    @property
    def bf16(self) -> bool:
        return self.dtype == "bf16"

    @property
    def fp16(self) -> bool:
        return self.dtype == "fp16"

    @property
    def torch_dtype(self):
        import torch  # here, so composing and validating a recipe does not import torch
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    @property
    def half(self) -> bool:
        """bf16 or fp16: 2-byte params with fp32 main params in the optimizer."""
        return self.dtype != "fp32"


@dataclass
class ParallelConfig:
    engine: str = doc("megatron", "Training engine: 'megatron' (megatron-core) or 'deepspeed'.")
    tensor_model_parallel_size: int = doc(1, "TP degree: shards attention heads and MLP columns.")
    pipeline_model_parallel_size: int = doc(1, "PP degree: splits layers into stages (1F1B schedule).")
    virtual_pipeline_model_parallel_size: Optional[int] = doc(None, "Model chunks per PP stage for the interleaved "
                                                                    "schedule; null disables.")
    num_layers_in_first_pipeline_stage: Optional[int] = doc(None, "Uneven PP split: layers on the first stage (rest "
                                                                  "split evenly).")
    num_layers_in_last_pipeline_stage: Optional[int] = doc(None, "Uneven PP split: layers on the last stage (rest "
                                                                 "split evenly).")
    context_parallel_size: int = doc(1, "CP degree: splits the sequence across ranks in attention.")
    expert_model_parallel_size: int = doc(1, "EP degree: MoE experts spread over this many ranks (moe.num_experts).")
    expert_tensor_parallel_size: Optional[int] = doc(None, "TP degree inside each expert; null: the same as "
                                                           "tensor_model_parallel_size.")
    sequence_parallel: bool = doc(False, "Shard norm/dropout activations along the sequence over TP ranks (needs "
                                         "TP>1).")
    use_distributed_optimizer: bool = doc(False, "Shard optimizer states over DP ranks (ZeRO-1) in megatron-core.")
    overlap_grad_reduce: bool = doc(False, "Overlap the DP gradient reduce with backward compute.")
    overlap_param_gather: bool = doc(False, "Overlap the distributed-optimizer param all-gather with forward.")
    recompute_granularity: Optional[str] = doc(None, "Activation checkpointing: null, 'selective' (core attention) or "
                                                     "'full'.")
    recompute_method: str = doc("uniform", "For full recompute: 'uniform' (groups of layers) or 'block' (first N "
                                           "layers).")
    recompute_num_layers: int = doc(1, "For full recompute: layers per group (uniform) or layers recomputed (block).")
    data_parallel_sharding: str = doc("ddp", "DP wrapper: 'ddp' (whole params and grads per rank) or 'fsdp2' (torch "
                                             "fully_shard: params, grads, optimizer states over DP; docs/fsdp2.md).")


@dataclass
class DeepSpeedConfig:
    """Settings of the DeepSpeed engine alone (parallel.engine=deepspeed); refused with megatron."""
    zero_stage: int = doc(0, "ZeRO stage 0-3: shard nothing, optimizer states, + gradients, + parameters.")
    offload_optimizer: bool = doc(False, "Keep optimizer states (and the update) on the CPU (ZeRO>=1).")
    offload_param: bool = doc(False, "Keep parameters on the CPU (ZeRO-3 only).")
    config_template: Optional[str] = doc(None, "DeepSpeed JSON template; null picks ds_configs/ by zero_stage and "
                                         "offload.")
    flops_profile_step: int = doc(0, "FLOPs/latency per module at this step into <run_dir>/flops_profile.txt "
                                  "(DeepSpeed's flops profiler); 0 disables.")


@dataclass
class OptimConfig:
    name: str = doc("adamw", "Optimizer: 'adamw', 'adafactor', 'lion' or 'muon' (Muon on hidden matrices, AdamW on "
                             "the rest).")
    lr: float = doc(MISSING, "Peak learning rate.")
    min_lr: float = doc(0.0, "Learning rate at the end of decay (GPT-3: 10% of lr).")
    weight_decay: float = doc(0.1, "Decoupled weight decay.")
    adam_beta1: float = doc(0.9, "First-moment decay (AdamW, Lion beta1).")
    adam_beta2: float = doc(0.95, "Second-moment decay (AdamW, Lion beta2).")
    adam_eps: float = doc(1e-8, "AdamW epsilon.")
    clip_grad: float = doc(1.0, "Clip gradients to this global L2 norm; 0 disables.")
    no_weight_decay_on: list[str] = doc(None, "Parameter kinds exempt from weight decay: any of 'bias', 'norm', "
                                              "'embedding'.",
                                        factory=lambda: ["bias", "norm"])
    muon_momentum: float = doc(0.95, "Muon: momentum of its matrices' update (Moonlight, Kimi K2).")
    muon_nesterov: bool = doc(True, "Muon: Nesterov momentum.")
    muon_ns_steps: int = doc(5, "Muon: Newton-Schulz iterations that orthogonalise the update.")
    muon_adjust_lr: str = doc("match_rms_adamw", "Muon: per-matrix LR scale, torch's adjust_lr_fn: 'match_rms_adamw' "
                                                 "(Moonlight: 0.2*sqrt(max(fan_out, fan_in)), AdamW's lr carries over) "
                                                 "or 'original' (Keller Jordan: sqrt(max(1, fan_out/fan_in))).")


@dataclass
class ScheduleConfig:
    lr_decay_style: str = doc("cosine", "'cosine', 'linear', 'wsd' (warmup-stable-decay) or 'constant'.")
    unit: str = doc("steps", "Unit of warmup/decay/train lengths below: 'steps' or 'tokens'.")
    lr_warmup: int = doc(0, "Linear warmup length from 0 to lr.")
    lr_decay: Optional[int] = doc(None, "Length of warmup+decay to min_lr; null means the whole run.")
    lr_wsd_decay: int = doc(0, "WSD: length of the final decay phase.")
    lr_wsd_decay_style: str = doc("linear", "WSD decay shape: 'linear', 'cosine' or 'exponential'.")
    train_iters: Optional[int] = doc(None, "Optimizer steps to train; exclusive with train_tokens.")
    train_tokens: Optional[int] = doc(None, "Token budget; iterations derived through the batch ramp.")


@dataclass
class BatchConfig:
    micro_batch_size: int = doc(MISSING, "Sequences per rank per forward/backward.")
    global_batch_size: int = doc(MISSING, "Sequences per optimizer step after the ramp.")
    ramp_start: Optional[int] = doc(None, "Global batch at step 0 when ramping (Megatron --rampup-batch-size start); "
                                          "null: no ramp.")
    ramp_increment: int = doc(0, "Global batch increment per ramp stage.")
    ramp_over: int = doc(0, "Consumed amount over which the ramp runs, in ramp_unit.")
    ramp_unit: str = doc("samples", "Unit of ramp_over: 'samples' or 'tokens'.")


@dataclass
class MixPhase:
    start_tokens: int = doc(0, "The phase applies to training samples from this token position on (the first phase: "
                               "0).")
    weights: list[float] = doc(None, "Weight per train source, in the blend file's order (normalised).", factory=list)


@dataclass
class DataConfig:
    blend: Optional[str] = doc(None, "Data-mix file from preprocessing (per-split paths and weights); null means mock "
                                     "data.")
    mock: bool = doc(False, "Train on megatron-core's synthetic tokens (throughput tests only).")
    tokenizer: TokenizerConfig = doc(None, "Tokenizer used for the data (and saved with exports).",
                                     factory=TokenizerConfig)
    cache_dir: Optional[str] = doc(None, "Where the GPT and BERT/T5 sample index caches live (keyed also by the "
                                         "size and mtime of the .bin/.idx files); null means <blend dir>/cache.")
    preprocess: str = doc("demo", "Preprocessing pipeline config that produces the blend "
                                  "(preprocessing/conf/<name>.yaml, or a YAML file).")
    mix_phases: list[MixPhase] = doc(None, "Data-mix schedule: train-source weights per phase, replacing the blend's "
                                     "train weights; empty keeps them fixed.", factory=list)
    fim: FimConfig = doc(None, "Fill-in-the-middle transform of the samples (pretrain/data/fim.py).", factory=FimConfig)
    document_mask: bool = doc(False, "Each document in a packed sample attends only to itself, positions restart "
                                     "after EOD (CPU: s x s mask; GPUs: packed thd). pretrain/data/packing.py.")
    eod_mask_loss: bool = doc(False, "Do not score the target predicted from an EOD token (the next document's "
                                     "first token).")
    quarantine: Optional[str] = doc(None, "File of documents to leave out (record ids or file:lines, as make "
                                          "explain-step prints them): make preprocess RECIPE=... drops them; a "
                                          "training run masks their loss. null: none.")
    max_epochs: float = doc(100.0, "Refuse a run that reads any train source of the blend more often than this "
                                   "(pretrain/config/epochs.py; warned above 4); raise it to repeat data on purpose.")


@dataclass
class LoggingConfig:
    log_interval: int = doc(10, "Steps between metric lines, TensorBoard points and metrics.jsonl records.")
    tensorboard: bool = doc(True, "TensorBoard in <run_dir>/tensorboard; false drops 'tensorboard' from trackers "
                                  "(the older switch).")
    trackers: list[str] = doc(None, "Experiment trackers: any of 'tensorboard', 'wandb', 'mlflow' "
                                    "(docs/observability.md).", factory=lambda: ["tensorboard"])
    project: str = doc("pretrain", "W&B project and MLflow experiment of the run.")
    group: Optional[str] = doc(None, "W&B group / MLflow tag 'group' (make ablate: the sweep); null: none.")
    mlflow_tracking_uri: Optional[str] = doc(None, "MLflow tracking URI; null: file store <run_dir>/mlruns.")
    log_memory: bool = doc(True, "Log max allocated GPU memory (RSS on CPU).")


@dataclass
class EvalConfig:
    eval_interval: int = doc(1000, "Steps between validation runs; 0 disables in-loop validation.")
    eval_iters: int = doc(10, "Batches per validation run.")
    final_test: bool = doc(True, "Report test-split perplexity at the end of training.")
    downstream_tasks: list[str] = doc(None, "In-loop lm-eval multiple-choice tasks (pretrain/observability/"
                                      "downstream.py), e.g. [bigbench_hyperbaton]; empty: none.", factory=list)
    downstream_interval: int = doc(0, "Steps between downstream evals (and at the end); 0: at each validation.")
    downstream_limit: Optional[int] = doc(None, "First N documents of each task (lm-eval's --limit); null: all.")
    downstream_tasks_dir: str = doc("data/evals/tasks", "Where `make eval-data` wrote the task YAML + JSONL.")


@dataclass
class ProfileConfig:
    steps: list[int] = doc(None, "Profile steps [start, end] with torch.profiler into <run_dir>/profile; empty "
                                 "disables.",
                           factory=list)


@dataclass
class ClusterConfig(JobStepConfig):
    name: str = doc("local", "Cluster profile name (conf/cluster/<name>.yaml).")
    launcher: str = doc("local", "'local' (torchrun here), 'srun' (one task per GPU) or 'srun-torchrun' (one task per "
                                 "node).")
    nodes: int = doc(1, "Nodes in the job.")
    devices_per_node: int = doc(1, "GPUs per node (CPU ranks per node when running without GPUs).")
    gpu_type: str = doc("H100-SXM", "Accelerator model; picks the peak TFLOP/s for MFU (pretrain/config/hardware.py).")
    partition: Optional[str] = doc(None, "SLURM partition.")
    account: Optional[str] = doc(None, "SLURM account.")
    qos: Optional[str] = doc(None, "SLURM QOS.")
    cpus_per_task: Optional[int] = doc(None, "CPUs per rank (per GPU); srun-torchrun asks this x devices_per_node for "
                                             "its one task per node. OMP_NUM_THREADS is this.")
    mem: Optional[str] = doc(None, "SLURM --mem (e.g. '0' for all).")
    time: str = doc("04:00:00", "SLURM time limit.")
    exclusive: bool = doc(True, "Ask for whole nodes.")
    constraint: Optional[str] = doc(None, "SLURM --constraint.")
    exclude: list[str] = doc(None, "Hosts never to use.", factory=list)
    setup: list[str] = doc(None, "Shell lines run before launch (modules, container); trusted cluster config.",
                           factory=list)
    env: dict[str, str] = doc(None, "Environment variables for every rank (NCCL settings, ...).", factory=dict)
    signal_lead_s: int = doc(300, "Seconds before the time limit when SLURM sends USR1 to checkpoint and requeue.")
    max_restarts: int = doc(10, "Requeue at most this many times (SLURM_RESTART_COUNT, failures and preemptions "
                                "alike), then stop with the step's exit code.")
    restart_backoff_s: int = doc(60, "A requeue after a failure (not a preemption) begins this long after it, "
                                     "doubling with each restart up to an hour.")
    requeue: bool = doc(True, "`scontrol requeue` the job after a preemption's checkpoint (exit 75) or any failure "
                              "but a refusal (stability/exit_codes.py); false where the cluster forbids it.")
    chain_jobs: int = doc(0, "Also submit this many follow-up jobs, each --dependency=afterany on the one before "
                             "(resume).")
    health_check: bool = doc(True, "Before training, one task per node checks devices, an all-reduce and free disk.")
    health_min_free_gb: Optional[float] = doc(None, "Free space the health check needs where checkpoints go; null: "
                                                    "make plan's checkpoint size x (checkpoint.keep_last + 1).")
    nccl_debug: bool = doc(False, "NCCL_DEBUG=INFO (init and collectives) in every rank's log.")
    flight_recorder: bool = doc(False, "torch's NCCL flight recorder: each rank dumps its last collectives to "
                                       "<run_dir>/nccl-trace/ when a collective times out.")
    bad_nodes_file: str = doc("runs/bad_nodes.txt", "Hosts that failed a health check; every later submission excludes "
                                                    "them.")


@dataclass
class DerivedConfig:
    """Filled by derive.py; any value typed here by hand is overwritten."""
    world_size: int = doc(0, "nodes * devices_per_node.")
    data_parallel_size: int = doc(0, "world_size / (TP * PP * CP).")
    padded_vocab_size: int = doc(0, "vocab_size padded to make_vocab_size_divisible_by * TP.")
    ffn_hidden_size: int = doc(0, "MLP width used.")
    kv_channels: int = doc(0, "Per-head dimension used.")
    num_query_groups: int = doc(0, "KV heads used.")
    max_position_embeddings: int = doc(0, "Position limit used.")
    num_microbatches: int = doc(0, "Micro-batches per rank per step after the ramp (gradient accumulation).")
    tokens_per_step: int = doc(0, "Tokens per optimizer step after the ramp.")
    train_iters: int = doc(0, "Optimizer steps of the run.")
    train_tokens: int = doc(0, "Tokens the run consumes.")
    ramp_batch_sizes: list[int] = doc(None, "Every global batch size the ramp passes through.", factory=list)
    num_decoder_layers: int = doc(0, "T5: decoder layers used (0: no decoder).")
    decoder_seq_length: int = doc(0, "T5: decoder length used (0: no decoder).")


@dataclass
class JobConfig:
    name: str = doc(MISSING, "Run name; the recipe name unless overridden.")
    seed: int = doc(1234, "Seed for init, data order and dropout.")
    run_dir: str = doc("runs/${name}", "Directory for logs, config, checkpoints and metrics.")
    imports: list[str] = doc(None, "Python modules imported before the recipe is validated (on the login node and "
                             "in every rank), so the optimizers, LR schedules and engines they register can be "
                             "named in it.", factory=list)
    model: ModelConfig = doc(None, "Model shape and layer choices.", factory=ModelConfig)
    objective: ObjectiveConfig = doc(None, "What the model learns to predict: next token, masked LM, denoising.",
                                     factory=ObjectiveConfig)
    moe: MoEConfig = doc(None, "Mixture of Experts: experts, router, dispatcher (null num_experts: dense).",
                         factory=MoEConfig)
    precision: PrecisionConfig = doc(None, "Numeric precision.", factory=PrecisionConfig)
    parallel: ParallelConfig = doc(None, "Engine and parallel layout.", factory=ParallelConfig)
    deepspeed: DeepSpeedConfig = doc(None, "DeepSpeed engine settings (ZeRO stage, offload, template).",
                                     factory=DeepSpeedConfig)
    peft: PeftConfig = doc(None, "Parameter-efficient training on a frozen base: LoRA, adapters, P-tuning.",
                           factory=PeftConfig)
    distill: DistillConfig = doc(None, "Knowledge distillation from a frozen teacher recipe and checkpoint.",
                                 factory=DistillConfig)
    optim: OptimConfig = doc(None, "Optimizer.", factory=OptimConfig)
    schedule: ScheduleConfig = doc(None, "LR schedule and run length.", factory=ScheduleConfig)
    batch: BatchConfig = doc(None, "Batch sizes and ramp.", factory=BatchConfig)
    data: DataConfig = doc(None, "Data mix and tokenizer.", factory=DataConfig)
    checkpoint: CheckpointConfig = doc(None, "Checkpointing.", factory=CheckpointConfig)
    stability: StabilityConfig = doc(None, "Hang detection and timeouts.", factory=StabilityConfig)
    fault: FaultConfig = doc(None, "Injected faults for tests and fire drills (off by default).", factory=FaultConfig)
    straggler: StragglerConfig = doc(None, "Slow-rank detection (pretrain/observability/straggler.py).",
                                     factory=StragglerConfig)
    logging: LoggingConfig = doc(None, "Metrics and TensorBoard.", factory=LoggingConfig)
    eval: EvalConfig = doc(None, "Validation and test evaluation.", factory=EvalConfig)
    profile: ProfileConfig = doc(None, "torch.profiler capture.", factory=ProfileConfig)
    cluster: ClusterConfig = doc(None, "Where and how the job runs.", factory=ClusterConfig)
    derived: DerivedConfig = doc(None, "Values computed from the above (read-only).", factory=DerivedConfig)

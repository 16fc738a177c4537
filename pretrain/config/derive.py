"""Every value that follows from others is computed here, and only here."""
from __future__ import annotations

import math

from ..schedules import BatchRamp
from .objective import denoising_lengths
from .schema import JobConfig


def ceil_to(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple) * multiple)


def swiglu_ffn_size(hidden: int, multiple_of: int) -> int:
    """Llama's FFN width: 2/3 of 4h, rounded up to a multiple (Touvron et al. 2023)."""
    return ceil_to(int(2 * 4 * hidden / 3), multiple_of)


def batch_ramp(cfg: JobConfig) -> BatchRamp:
    b = cfg.batch
    if b.ramp_start is None:
        return BatchRamp(b.global_batch_size)
    over = b.ramp_over
    if b.ramp_unit == "tokens":
        over = over // cfg.model.seq_length
    return BatchRamp(b.global_batch_size, b.ramp_start, b.ramp_increment, over)


def schedule_length_in_steps(cfg: JobConfig, amount: int) -> int:
    """Convert a schedule length (warmup, decay, ...) given in `schedule.unit` to steps."""
    if cfg.schedule.unit == "steps":
        return amount
    return batch_ramp(cfg).steps_for_samples(math.ceil(amount / cfg.model.seq_length))


def pipeline_stage_layers(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Layers per PP stage, honouring an explicit uneven first/last stage."""
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle_stages <= 0:
        per = 0 if rest == 0 else -1
    else:
        per = rest // middle_stages if rest % middle_stages == 0 else -1
    layers = [per] * pp
    if first is not None:
        layers[0] = first
    if last is not None:
        layers[-1] = last
    return layers


def derive(cfg: JobConfig) -> JobConfig:
    """Fill `cfg.derived` in place (validation runs first; see compose.finalize)."""
    m, p, d = cfg.model, cfg.parallel, cfg.derived
    d.world_size = cfg.cluster.nodes * cfg.cluster.devices_per_node
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    d.data_parallel_size = d.world_size // model_parallel
    d.padded_vocab_size = ceil_to(m.vocab_size, m.make_vocab_size_divisible_by * p.tensor_model_parallel_size)
    d.kv_channels = m.kv_channels or m.hidden_size // m.num_attention_heads
    d.num_query_groups = m.num_query_groups or m.num_attention_heads
    d.max_position_embeddings = m.max_position_embeddings or m.seq_length
    if m.ffn_hidden_size:
        d.ffn_hidden_size = m.ffn_hidden_size
    elif m.activation == "swiglu":
        d.ffn_hidden_size = swiglu_ffn_size(m.hidden_size, m.ffn_multiple_of)
    else:
        d.ffn_hidden_size = 4 * m.hidden_size
    if m.arch == "t5":
        d.num_decoder_layers = m.num_decoder_layers or m.num_layers
        d.decoder_seq_length = m.decoder_seq_length or denoising_lengths(m.seq_length, cfg.objective.denoising)[1]
    ramp = batch_ramp(cfg)
    d.ramp_batch_sizes = ramp.sizes()
    d.num_microbatches = cfg.batch.global_batch_size // (cfg.batch.micro_batch_size * d.data_parallel_size)
    d.tokens_per_step = cfg.batch.global_batch_size * m.seq_length
    s = cfg.schedule
    if s.train_iters is not None:
        d.train_iters = s.train_iters
        d.train_tokens = ramp.samples_after_steps(s.train_iters) * m.seq_length
    else:
        d.train_iters = ramp.steps_for_samples(math.ceil(s.train_tokens / m.seq_length))
        d.train_tokens = s.train_tokens
    return cfg

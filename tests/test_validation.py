"""Each compose-time rule fires with a message naming the field, the values and a fix."""
import pytest

from pretrain.config import ConfigError, load_recipe

CASES = {
    "tp_divides_heads": (["parallel=tp2", "model.num_attention_heads=3", "model.hidden_size=192"],
                         "tensor_model_parallel_size=2 does not divide model.num_attention_heads=3"),
    "tp_divides_query_groups": (["parallel=tp2", "model.num_query_groups=3"],
                                "does not divide model.num_query_groups=3"),
    "heads_divide_by_groups": (["model.num_query_groups=4"], "num_attention_heads=6 is not divisible by model.num_query_groups=4"),
    "hidden_divides_heads": (["model.num_attention_heads=5", "parallel=single"], "hidden_size=192 is not divisible"),
    "pp_divides_layers": (["parallel=pp2", "model.num_layers=3"], "does not split model.num_layers=3"),
    "uneven_split_must_add_up": (["parallel=pp2", "model.num_layers=5", "parallel.num_layers_in_first_pipeline_stage=5"],
                                 "does not split model.num_layers=5"),
    "vpp_needs_pp": (["parallel.virtual_pipeline_model_parallel_size=2"], "needs pipeline_model_parallel_size>1"),
    "vpp_pp2_on_gloo": (["parallel=pp2", "parallel.virtual_pipeline_model_parallel_size=2"],
                        "gloo pairs the interleaved schedule's simultaneous sends"),
    "vpp_divides_stage_layers": (["parallel=pp2", "parallel.virtual_pipeline_model_parallel_size=3",
                                  "cluster.gpu_type=H100-SXM"], "does not divide the layers per stage [2, 2]"),
    "world_divisible_by_model_parallel": (["parallel.tensor_model_parallel_size=3", "model.num_attention_heads=6"],
                                          "world size 2 (cluster.nodes=1 x cluster.devices_per_node=2) is not divisible by TP*PP*CP"),
    "batch_divisible_by_micro_dp": (["batch.global_batch_size=24"], "not divisible by batch.micro_batch_size=8 x data-parallel size 2 = 16"),
    "every_ramp_step_divisible": (["batch.ramp_start=16", "batch.ramp_increment=8", "batch.ramp_over=1000"],
                                  "global batch [24]"),
    "ramp_lands_on_global": (["batch.ramp_start=16", "batch.ramp_increment=24", "batch.ramp_over=1000"],
                             "does not land on global_batch_size"),
    "seq_within_positions": (["model.max_position_embeddings=64"], "model.seq_length=128 exceeds model.max_position_embeddings=64"),
    "fp16_bf16_exclusive": (["precision.fp16=true", "precision.bf16=true"], "are exclusive"),
    "zero23_with_pp_on_deepspeed": (["parallel=pp2", "parallel.engine=deepspeed", "parallel.zero_stage=2"],
                                    "does not combine ZeRO-2/3 with pipeline parallelism"),
    "sp_requires_tp": (["parallel.sequence_parallel=true"], "sequence_parallel=true requires parallel.tensor_model_parallel_size>1"),
    "deepspeed_knobs_need_deepspeed": (["parallel.zero_stage=2"], "are DeepSpeed settings but parallel.engine=megatron"),
    "offload_param_needs_zero3": (["parallel.engine=deepspeed", "parallel.zero_stage=2", "parallel.offload_param=true"],
                                  "offload_param=true needs parallel.zero_stage=3"),
    "dist_opt_is_megatron_only": (["parallel.engine=deepspeed", "parallel.use_distributed_optimizer=true"],
                                  "use_distributed_optimizer is the megatron engine's ZeRO-1"),
    "cp_needs_te": (["parallel.context_parallel_size=2"], "context_parallel_size=2 needs model.transformer_impl=transformer_engine"),
    "choices": (["model.activation=relu"], "model.activation='relu' is not one of"),
    "train_length_exactly_one": (["schedule.train_tokens=1000"], "exactly one of schedule.train_iters and schedule.train_tokens"),
    "min_lr_below_lr": (["optim.min_lr=1.0"], "optim.min_lr=1.0 is above optim.lr"),
    "wsd_needs_decay": (["schedule=wsd"], "needs schedule.lr_wsd_decay>0"),
    "warmup_within_decay": (["schedule.lr_decay=10"], "schedule.lr_warmup=20 exceeds schedule.lr_decay=10"),
    "recompute_layers_within_stage": (["parallel.recompute_granularity=full", "parallel.recompute_num_layers=9"],
                                      "recompute_num_layers=9 exceeds the layers per pipeline stage 4"),
    "profile_steps_shape": (["profile.steps=[5,2]"], "profile.steps=[5, 2] must be [start, end]"),
    "no_decay_kinds": (["optim.no_weight_decay_on=[bias,gamma]"], "optim.no_weight_decay_on has 'gamma'"),
    "non_adam_without_dist_opt": (["optim=lion", "parallel=dist-opt"], "distributed-optimizer checkpoints hold Adam's"),
    "mix_phases_in_order": (["+data.mix_phases=[{start_tokens:0,weights:[1,1]},{start_tokens:0,weights:[1,2]}]"],
                            "data.mix_phases[1].start_tokens=0 must exceed"),
    "mix_phases_start_at_zero": (["+data.mix_phases=[{start_tokens:5,weights:[1]}]"], "the first phase must start at 0"),
    "mix_phase_weights": (["+data.mix_phases=[{start_tokens:0,weights:[1,-1]}]"], "needs non-negative weights"),
    "mix_phase_lengths": (["+data.mix_phases=[{start_tokens:0,weights:[1,1]},{start_tokens:9,weights:[1]}]"],
                          "data.mix_phases[1] has 1 weights"),
    "llama_needs_rmsnorm": (["model.arch=llama"], "model.arch=llama with model.normalization=LayerNorm"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rule_fires_with_a_clear_message(name):
    overrides, message = CASES[name]
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", overrides)
    text = str(err.value)
    assert message in text, text
    assert text.startswith("recipes/gpt-tiny.yaml:")


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", ["precision.fp16=true", "precision.bf16=true", "parallel.sequence_parallel=true"])
    assert len(err.value.problems) == 2


def test_uneven_pipeline_split_is_accepted():
    cfg = load_recipe("gpt-tiny", ["parallel=pp2", "model.num_layers=5", "parallel.num_layers_in_first_pipeline_stage=2"])
    assert cfg.model.num_layers == 5


def test_gpt_7b_layout_is_valid_and_deepspeed_zero1_with_pp_is_allowed():
    load_recipe("gpt-7b")
    load_recipe("gpt-tiny", ["parallel=pp2", "parallel.engine=deepspeed", "parallel.zero_stage=1"])

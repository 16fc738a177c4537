"""Each compose-time rule fires with a message naming the field, the values and a fix."""
import json

import pytest

from common.config import ConfigError
from pretrain.config.compose import load_recipe
from tests.conftest import REPO

CASES = {
    "tp_divides_heads": (["parallel=tp2", "model.num_attention_heads=3", "model.hidden_size=192"],
                         "tensor_model_parallel_size=2 does not divide model.num_attention_heads=3"),
    "tp_divides_query_groups": (["parallel=tp2", "model.num_query_groups=3"],
                                "does not divide model.num_query_groups=3"),
    "heads_divide_by_groups": (["model.num_query_groups=4"], "num_attention_heads=6 is not divisible by "
                                                             "model.num_query_groups=4"),
    "hidden_divides_heads": (["model.num_attention_heads=5", "parallel=single"], "hidden_size=192 is not divisible"),
    "pp_divides_layers": (["parallel=pp2", "model.num_layers=3"], "does not split model.num_layers=3"),
    "uneven_split_must_add_up": (["parallel=pp2", "model.num_layers=5",
                                  "parallel.num_layers_in_first_pipeline_stage=5"],
                                 "does not split model.num_layers=5"),
    "vpp_needs_pp": (["parallel.virtual_pipeline_model_parallel_size=2"], "needs pipeline_model_parallel_size>1"),
    "vpp_pp2_on_gloo": (["parallel=pp2", "parallel.virtual_pipeline_model_parallel_size=2"],
                        "gloo pairs the interleaved schedule's simultaneous sends"),
    "vpp_divides_stage_layers": (["parallel=pp2", "parallel.virtual_pipeline_model_parallel_size=3",
                                  "cluster.gpu_type=H100-SXM"], "does not divide the layers per stage [2, 2]"),
    "world_divisible_by_model_parallel": (["parallel.tensor_model_parallel_size=3", "model.num_attention_heads=6"],
                                          "world size 2 (cluster.nodes=1 x cluster.devices_per_node=2) is not "
                                          "divisible by TP*PP*CP"),
    "batch_divisible_by_micro_dp": (["batch.global_batch_size=24"], "not divisible by batch.micro_batch_size=8 x "
                                                                    "data-parallel size 2 = 16"),
    "every_ramp_step_divisible": (["batch.ramp_start=16", "batch.ramp_increment=8", "batch.ramp_over=1000"],
                                  "global batch [24]"),
    "ramp_lands_on_global": (["batch.ramp_start=16", "batch.ramp_increment=24", "batch.ramp_over=1000"],
                             "does not land on global_batch_size"),
    "seq_within_positions": (["model.max_position_embeddings=64"], "model.seq_length=128 exceeds "
                                                                   "model.max_position_embeddings=64"),
    "precision_dtype": (["precision.dtype=fp8"], "precision.dtype='fp8' is not one of ['fp32', 'bf16', 'fp16']"),
    "old_precision_key_names_the_new_one": (["precision.bf16=true"], "precision.bf16 was replaced by precision.dtype"),
    "old_deepspeed_key_names_the_new_one": (["parallel.zero_stage=1"], "parallel.zero_stage was replaced by "
                                            "deepspeed.zero_stage"),
    "pp_on_deepspeed": (["parallel=pp2", "parallel.engine=deepspeed", "deepspeed.zero_stage=1"],
                        "pipeline_model_parallel_size=2 with engine=deepspeed: DeepSpeed's pipeline needs a "
                        "PipelineModule"),
    "sp_on_deepspeed": (["parallel=tp2-sp", "parallel.engine=deepspeed"], "sequence_parallel=true with "
                                                                          "engine=deepspeed"),
    "ddp_knobs_on_deepspeed": (["parallel=ds-zero2", "parallel.overlap_grad_reduce=true"],
                               "parallel.overlap_grad_reduce is a megatron-core DDP setting"),
    "adamw_only_on_deepspeed": (["parallel=ds-zero1", "optim=lion"], "optim.name=lion with engine=deepspeed"),
    "offload_optimizer_needs_zero": (["parallel=ds-zero0", "deepspeed.offload_optimizer=true"],
                                     "offload_optimizer=true needs deepspeed.zero_stage>=1"),
    "missing_ds_template": (["parallel=ds-zero1", "deepspeed.config_template=nowhere.json"],
                            "nowhere.json: no such DeepSpeed template"),
    "sp_requires_tp": (["parallel.sequence_parallel=true"], "sequence_parallel=true requires "
                                                            "parallel.tensor_model_parallel_size>1"),
    "deepspeed_knobs_need_deepspeed": (["deepspeed.zero_stage=2"],
                                       "deepspeed.zero_stage=2: DeepSpeed settings, but parallel.engine=megatron"),
    "flops_profile_is_deepspeed_only": (["deepspeed.flops_profile_step=2"],
                                        "deepspeed.flops_profile_step=2: DeepSpeed settings, but "
                                        "parallel.engine=megatron"),
    "offload_param_needs_zero3": (["parallel.engine=deepspeed", "deepspeed.zero_stage=2",
                                   "deepspeed.offload_param=true"],
                                  "offload_param=true needs deepspeed.zero_stage=3"),
    "dist_opt_is_megatron_only": (["parallel.engine=deepspeed", "parallel.use_distributed_optimizer=true"],
                                  "use_distributed_optimizer is the megatron engine's ZeRO-1"),
    "cp_needs_te": (["parallel.context_parallel_size=2"], "context_parallel_size=2 needs "
                                                          "model.transformer_impl=transformer_engine"),
    "choices": (["model.activation=relu"], "model.activation='relu' is not one of"),
    "train_length_exactly_one": (["schedule.train_tokens=1000"], "exactly one of schedule.train_iters and "
                                                                 "schedule.train_tokens"),
    "min_lr_below_lr": (["optim.min_lr=1.0"], "optim.min_lr=1.0 is above optim.lr"),
    "lr_positive": (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    "min_lr_not_negative": (["optim.min_lr=-1e-4"], "optim.min_lr=-0.0001 must be >= 0"),
    "weight_decay_not_negative": (["optim.weight_decay=-1"], "optim.weight_decay=-1.0 must be >= 0"),
    "beta_below_one": (["optim.adam_beta2=1.0"], "optim.adam_beta2=1.0 is a decay rate and must be in [0, 1)"),
    "eps_positive": (["optim.adam_eps=0"], "optim.adam_eps=0.0 must be > 0"),
    "clip_grad_not_negative": (["optim.clip_grad=-1"], "optim.clip_grad=-1.0 must be >= 0"),
    "wsd_needs_decay": (["schedule=wsd"], "needs schedule.lr_wsd_decay>0"),
    "warmup_within_decay": (["schedule.lr_decay=10"], "schedule.lr_warmup=20 exceeds schedule.lr_decay=10"),
    "recompute_layers_within_stage": (["parallel.recompute_granularity=full", "parallel.recompute_num_layers=9"],
                                      "recompute_num_layers=9 exceeds the layers per pipeline stage 4"),
    "profile_steps_shape": (["profile.steps=[5,2]"], "profile.steps=[5, 2] must be [start, end]"),
    "no_decay_kinds": (["optim.no_weight_decay_on=[bias,gamma]"], "optim.no_weight_decay_on has 'gamma'"),
    "non_adam_without_dist_opt": (["optim=lion", "parallel=dist-opt"], "distributed-optimizer checkpoints hold Adam's"),
    "mix_phases_in_order": (["+data.mix_phases=[{start_tokens:0,weights:[1,1]},{start_tokens:0,weights:[1,2]}]"],
                            "data.mix_phases[1].start_tokens=0 must exceed"),
    "mix_phases_start_at_zero": (["+data.mix_phases=[{start_tokens:5,weights:[1]}]"], "the first phase must start at "
                                                                                      "0"),
    "mix_phase_weights": (["+data.mix_phases=[{start_tokens:0,weights:[1,-1]}]"], "needs non-negative weights"),
    "mix_phase_lengths": (["+data.mix_phases=[{start_tokens:0,weights:[1,1]},{start_tokens:9,weights:[1]}]"],
                          "data.mix_phases[1] has 1 weights"),
    "reshuffle_needs_positional_data": (["stability.rollback_data=reshuffle",
                                         "+data.mix_phases=[{start_tokens:0,weights:[1]}]"],
                                        "stability.rollback_data=reshuffle with data.mix_phases"),
    "async_save_is_megatron_only": (["parallel=ds-zero1", "checkpoint.async_save=true"],
                                    "checkpoint.async_save=true with engine=deepspeed"),
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
        load_recipe("gpt-tiny", ["optim.min_lr=1.0", "parallel.sequence_parallel=true"])
    assert len(err.value.problems) == 2


def test_a_negative_lr_is_blamed_on_lr_not_on_min_lr():
    """Issue 50: `optim.lr=-1e-3` alone was refused as "min_lr above lr"; with min_lr negative too it passed."""
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", ["optim.lr=-1e-3"])
    assert [p for p in err.value.problems if p.startswith("optim.")] == [
        "optim.lr=-0.001 must be > 0 (the peak learning rate). Fix: a positive value, e.g. optim.lr=3e-4."]
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", ["optim.lr=-1e-3", "optim.min_lr=-2e-3"])
    assert sorted(p.split("=")[0] for p in err.value.problems) == ["optim.lr", "optim.min_lr"]


def test_uneven_pipeline_split_is_accepted():
    cfg = load_recipe("gpt-tiny", ["parallel=pp2", "model.num_layers=5",
                                   "parallel.num_layers_in_first_pipeline_stage=2"])
    assert cfg.model.num_layers == 5


def test_gpt_7b_layout_is_valid_and_deepspeed_zero1_with_tp_is_allowed():
    big = load_recipe("gpt-7b")                     # 2 nodes x 8 GPUs, TP=2: DP=8, 1024 = 1 x 128 x 8
    assert (big.derived.world_size, big.derived.data_parallel_size, big.derived.num_microbatches) == (16, 8, 128)
    ds = load_recipe("gpt-tiny", ["parallel=ds-zero1", "parallel.tensor_model_parallel_size=2"])
    assert (ds.parallel.engine, ds.deepspeed.zero_stage, ds.derived.data_parallel_size) == ("deepspeed", 1, 1)


def test_a_deepspeed_template_that_contradicts_the_recipe_is_refused_naming_file_and_key(tmp_path):
    template = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    template["gradient_clipping"] = 0.5
    template["zero_optimization"]["stage"] = 3
    template["scheduler"] = {"type": "WarmupLR"}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(template))
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", ["parallel=ds-zero2", f"deepspeed.config_template={path}"])
    problems = err.value.problems
    assert f'{path}: "gradient_clipping" is 0.5 but the recipe gives 1.0' in problems[0] or any(
        f'{path}: "gradient_clipping" is 0.5 but the recipe gives 1.0' in p for p in problems), problems
    assert any(f'{path}: "zero_optimization.stage" is 3 but the recipe gives 2' in p for p in problems), problems
    assert any(f'{path}: "scheduler" section: the loop sets the LR' in p for p in problems), problems
    (tmp_path / "broken.json").write_text('{"train_batch_size": "auto",\n  oops}')
    with pytest.raises(ConfigError) as err:
        load_recipe("gpt-tiny", ["parallel=ds-zero2", f"deepspeed.config_template={tmp_path / 'broken.json'}"])
    assert f"{tmp_path / 'broken.json'}:2:3: not valid JSON" in str(err.value)


def test_every_shipped_template_renders_with_no_auto_left():
    from pretrain.engines.deepspeed.ds_config import render
    for overrides in (["parallel=ds-zero0"], ["parallel=ds-zero1", "precision=bf16"], ["parallel=ds-zero2"],
                      ["parallel=ds-zero3", "precision=fp16"], ["parallel=ds-zero2-offload"],
                      ["parallel=ds-zero3-offload"], ["parallel=ds-zero3-offload-param"]):
        cfg = load_recipe("gpt-tiny", overrides)
        for on_cpu in (True, False):
            config = render(cfg, on_cpu)
            assert "auto" not in json.dumps(config), overrides
            assert config["train_batch_size"] == config["train_micro_batch_size_per_gpu"] * \
                config["gradient_accumulation_steps"] * cfg.derived.data_parallel_size
            assert config["optimizer"]["params"]["torch_adam"] is on_cpu
            assert config["zero_force_ds_cpu_optimizer"] is not on_cpu
            assert config["zero_optimization"]["stage"] == cfg.deepspeed.zero_stage
            assert config["fp16"]["enabled"] == cfg.precision.fp16 and config["bf16"]["enabled"] == cfg.precision.bf16


@pytest.mark.parametrize("text, words", [
    ("optim:\n  lr: 1e-3\n  lr: 2e-3\n", ["found duplicate key lr", "line 3, column 3"]),
    ("optim:\n  lr: [1e-3\nschedule: {}\n", ["expected ',' or ']'", "line 2, column 7"]),
    ("optim:\n  lr: 1e-3\n   min_lr: 1e-4\n", ["mapping values are not allowed here", "line 3, column 10"]),
])
def test_a_recipe_that_is_not_yaml_is_a_config_error_naming_its_file_and_line(tmp_path, text, words):
    """A user's edited recipe with a key given twice, an unclosed bracket or a stray indent: a ConfigError naming
    the file, line and column and what to fix, not PyYAML's traceback out of Hydra."""
    from common.config import compose_dir
    (tmp_path / "mine.yaml").write_text(text)
    with pytest.raises(ConfigError) as err:
        compose_dir(tmp_path, "mine")
    message = str(err.value)
    assert f"{tmp_path}/mine.yaml: 1 problem(s)" in message and f'"{tmp_path}/mine.yaml"' in message
    assert all(w in message for w in words) and "Fix: correct that YAML file" in message, message

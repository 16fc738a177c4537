"""The GPU path's decisions, checked here on CPU: fusions follow their kernels (model/fusions.py), a run
launched with another process count than its config is refused, DeepSpeed's op builder gets an arch list it
can parse, `make doctor` and `make gpu-check DRY_RUN=1` answer. The GPU runs themselves: docs/gpu-check.md."""
import re
import subprocess

import pytest
import torch

from pretrain.config.compose import load_recipe
from pretrain.model import fusions
from tests.conftest import REPO

ALL = {f.flag: True for f in fusions.FUSIONS}
NONE = {f.flag: False for f in fusions.FUSIONS}


def test_each_fusion_follows_its_kernel_and_what_it_serves():
    gpt = load_recipe("gpt-125m")                       # GeLU with biases, LayerNorm, bf16, megatron engine
    assert fusions.decide(gpt, on_gpu=True, have=ALL) == {
        "masked_softmax_fusion": True, "bias_activation_fusion": False,   # megatron's fused GeLU is tanh-approx
        "bias_dropout_fusion": True, "gradient_accumulation_fusion": True, "persist_layer_norm": True,
        "apply_rope_fusion": False, "cross_entropy_loss_fusion": True}
    llama = load_recipe("llama-tiny", ["precision=fp32", "parallel=ds-zero2"])   # SwiGLU, RMSNorm, RoPE, fp32
    assert fusions.decide(llama, on_gpu=True, have=ALL) == {
        "masked_softmax_fusion": False, "bias_activation_fusion": True, "bias_dropout_fusion": True,
        "gradient_accumulation_fusion": False,            # DeepSpeed keeps no main_grad buffers
        "persist_layer_norm": False, "apply_rope_fusion": True,
        "cross_entropy_loss_fusion": False}               # its backward casts the gradient to bf16
    fsdp2 = load_recipe("gpt-125m", ["parallel=fsdp2", "precision=fp32"])     # no main_grad buffers under FSDP2
    assert not fusions.decide(fsdp2, on_gpu=True, have=ALL)["gradient_accumulation_fusion"]
    assert fusions.decide(fsdp2, on_gpu=True, have=ALL)["bias_dropout_fusion"]
    for cfg in (gpt, llama):
        assert not any(fusions.decide(cfg, on_gpu=True, have=NONE).values())
        assert not any(fusions.decide(cfg, on_gpu=False, have=ALL).values())


def test_gpu_decisions_without_kernels_build_and_train_a_125m_shaped_model(monkeypatch, single_rank_megatron):
    """gpt-125m's shape (12 x 768, 12 heads) in bf16 with the decisions a GPU node without Apex, TE or Triton
    takes: megatron-core must not reach for a missing kernel (the first H100 run's probable crash, before
    model/fusions.py). The sequence (256) keeps the fused-softmax path's 16 < seq <= 4096 window."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from pretrain.engines import cpu_compat
    from pretrain.model import gpt
    cpu_compat.apply()
    model_parallel_cuda_manual_seed(1234)
    monkeypatch.setattr(fusions, "kernels_present", lambda te_spec=False: dict(NONE))
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):   # left by CPU configs (backend local)
        # set, then deleted: monkeypatch records the value before (or its absence) and restores it at teardown,
        # also over what the model build below writes (megatron-core sets them process-wide); a bare delenv of
        # an absent variable records nothing, and the build's values leaked into later tests
        monkeypatch.setenv(name, "unset by this test")
        monkeypatch.delenv(name)
    cfg = load_recipe("gpt-125m", ["model.seq_length=256", "model.vocab_size=4096"])
    config = gpt.transformer_config(cfg, on_gpu=True)
    assert not any(getattr(config, f.flag) for f in fusions.FUSIONS)
    config.use_cpu_initialization = True               # the one GPU decision a CPU cannot take
    model = gpt.build_gpt_model(cfg, config).to(torch.bfloat16)
    tokens = torch.randint(0, 4096, (1, 256))
    position_ids = torch.arange(256).unsqueeze(0)
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss) and 7.0 < loss.item() < 10.0          # ~ln(4096) = 8.3 at init
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) == len(list(model.parameters())) and all(torch.isfinite(g).all() for g in grads)


def test_deepspeed_gets_an_arch_list_its_op_builder_parses(monkeypatch):
    """DeepSpeed 0.19.8 int()s every dotted part of TORCH_CUDA_ARCH_LIST: the H100 image's '9.0a' raised
    ValueError inside FusedAdamBuilder().load() (first gpu-check run); the engine rewrites it first. Shown with
    DeepSpeed's own CUDA builder class (its arch parsing needs no GPU)."""
    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

    from pretrain.engines.deepspeed.engine import arch_list_for_op_builder
    assert arch_list_for_op_builder("8.0;9.0a+PTX 10.0f") == "8.0;9.0+PTX 10.0"
    assert arch_list_for_op_builder("7.5 8.6") == "7.5 8.6"
    builder = FusedAdamBuilder()
    builder.jit_mode = True
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    with pytest.raises(ValueError, match="0a"):
        builder.compute_capability_args()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list_for_op_builder("9.0a"))
    builder.compute_capability_args()


def test_a_launch_with_another_process_count_is_refused(single_rank_megatron):
    from pretrain.engines.common import init_distributed
    init_distributed(expected_world_size=1)
    with pytest.raises(RuntimeError, match="cluster.devices_per_node"):
        init_distributed(expected_world_size=2)


def test_doctor_and_the_gpu_check_dry_run_answer_on_cpu(monkeypatch, capsys):
    """What `make doctor RECIPE=llama-8b` and `make gpu-check DRY_RUN=1` run (the Makefile calls these mains)."""
    from launch import doctor, gpu_check
    monkeypatch.setenv("RECIPE", "llama-8b")
    assert doctor.main() == 0
    out = capsys.readouterr().out
    assert "| torch |" in out and "recipe llama-8b" in out and "| apply_rope_fusion | off | GPU only |" in out
    # the attention the job would build: torch's (no TE here), its kernel picked on the GPU node
    assert "| attention | torch SDPA; its kernel is picked on the GPU node (run make doctor there) | " \
           "TorchDotProductAttention (pretrain/model/attention.py); model.attention_backend=auto |" in out
    monkeypatch.setenv("DRY_RUN", "1")
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    for step in ("bf16-gpt-125m", "fp32-vs-cpu", "kill-resume", "ds-zero2", "dist-opt-overlap", "te-spec", "speed"):
        assert step in out
    # every speed row composes here; the unfused rows are planned slower than torch's at the same shape
    speed = dict(re.findall(r"speed (\S+)\s.*plan \(H100\): step (\d+) ms", out))
    assert len(speed) == 12
    for shape in ("gpt-125m/2048", "gpt-125m/8192", "llama-1b/2048", "llama-1b/8192"):
        assert int(speed[f"{shape}/unfused"]) > int(speed[f"{shape}/torch"])
    make = subprocess.run(["make", "-n", "doctor", "gpu-check"], cwd=REPO, capture_output=True, text=True)
    assert "-m launch.doctor" in make.stdout and "launch/gpu_check.sh" in make.stdout


def refusals(recipe: str, overrides: list[str]) -> str:
    from common.config import ConfigError
    with pytest.raises(ConfigError) as err:
        load_recipe(recipe, overrides)
    return str(err.value)


def test_fp8_is_a_precision_decision_refused_where_it_cannot_run():
    """Here (no Transformer Engine) FP8 is refused naming it; in a container the job's own environment decides,
    so compose maps it; the GPU, the recipe and the bf16 layers are checked either way."""
    from pretrain.model.gpt import transformer_config
    assert "needs Transformer Engine" in refusals("llama-8b", ["precision.fp8=e4m3"])
    image = ["cluster.container_image='nvcr.io#nvidia/pytorch:25.09-py3'", "model.transformer_impl=transformer_engine"]
    text = refusals("llama-8b", [*image, "precision.fp8=e4m3", "cluster.gpu_type=A100-SXM",
                                 "precision.fp8_recipe=delayed", "precision=fp16"])
    assert "no FP8 tensor cores" in text and "delayed scaling cannot keep layers in bf16" in text
    assert "precision.dtype=fp16" in text
    assert "Blackwell" in refusals("llama-8b", [*image, "precision.fp8=hybrid", "precision.fp8_recipe=mxfp8"])
    assert "transformer_impl=local" in refusals("llama-8b", [*image[:1], "precision.fp8=e4m3",
                                                             "model.transformer_impl=local"])
    cfg = load_recipe("llama-8b-fp8")                   # the documented FP8 recipe: its container decides
    tc = transformer_config(cfg, on_gpu=False)
    assert (tc.fp8, tc.fp8_recipe, tc.first_last_layers_bf16, tc.num_layers_at_start_in_bf16,
            tc.num_layers_at_end_in_bf16) == ("hybrid", "tensorwise", True, 1, 1)


def test_a_required_fusion_without_its_kernel_is_refused_at_compose_naming_the_package(monkeypatch):
    text = refusals("gpt-125m", ["model.fusions_required=[masked_softmax_fusion,no_such_fusion]"])
    assert "masked_softmax_fusion needs NVIDIA Apex" in text and "unknown fusion 'no_such_fusion'" in text
    in_container = ["model.fusions_required=[masked_softmax_fusion]",
                    "cluster.container_image='nvcr.io#nvidia/pytorch:25.09-py3'"]
    load_recipe("gpt-125m", in_container)              # on the login node: the image decides
    monkeypatch.setenv("IN_JOB_ENVIRONMENT", "1")      # in the job (sbatch.j2 sets it): this environment decides
    assert "needs NVIDIA Apex" in refusals("gpt-125m", in_container)

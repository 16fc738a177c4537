"""The Mixture-of-Experts decision: the `moe` config section and its compose-time rules.

A recipe with `moe.num_experts` set replaces the dense MLP of the chosen layers with
megatron-core's `MoELayer` (router, token dispatcher, experts); `parallel.expert_model_parallel_size`
spreads the experts over ranks. Names follow Megatron-LM's `--moe-*` flags without the prefix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from common.config import doc

DISPATCHERS = ("alltoall", "allgather", "flex")
LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
CUDA_ONLY = ("grouped_gemm", "permute_fusion", "router_fusion")


@dataclass
class MoEConfig:
    num_experts: Optional[int] = doc(None, "Routed experts per MoE layer; null: a dense model.")
    router_topk: int = doc(2, "Experts each token is sent to (Mixtral 2, OLMoE 8).")
    ffn_hidden_size: Optional[int] = doc(None, "Width of each expert's MLP; null: model.ffn_hidden_size (derived).")
    layer_freq: int = doc(1, "Every layer_freq-th layer is MoE, counting from the first MoE layer (1: all).")
    first_dense_layers: int = doc(0, "The first N layers keep a dense MLP (DeepSeek keeps 1-3).")
    shared_expert_ffn_hidden_size: Optional[int] = doc(None, "Width of the always-on shared experts together "
                                                             "(DeepSeek/Qwen-MoE); null: none.")
    load_balancing: str = doc("aux_loss", "'aux_loss' (Switch/GShard, per micro-batch), 'seq_aux_loss', "
                                          "'global_aux_loss', 'sinkhorn' or 'none'.")
    aux_loss_coeff: float = doc(1e-2, "Weight of the load-balancing loss (Switch: 1e-2; Mixtral/OLMoE: 1e-2).")
    z_loss_coeff: float = doc(0.0, "Router z-loss (ST-MoE: 1e-3): coeff * logsumexp(router logits)^2; 0 off.")
    capacity_factor: Optional[float] = doc(None, "Tokens an expert takes, as a multiple of an even share; the rest "
                                                 "are dropped (counted); null: no dropping (dropless).")
    pad_to_capacity: bool = doc(False, "With capacity_factor: pad every expert's input to its capacity (fixed "
                                       "shapes).")
    drop_policy: str = doc("probs", "Which tokens go over capacity: 'probs' (lowest router probability) or "
                                    "'position' (latest in the sequence).")
    score_function: str = doc("softmax", "Router scores: 'softmax' (Mixtral, OLMoE) or 'sigmoid' (DeepSeek-V3).")
    pre_softmax: bool = doc(False, "Softmax over all experts before top-k (OLMoE, Switch); false: over the "
                                   "chosen k (Mixtral).")
    expert_bias: bool = doc(False, "Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias on the sigmoid "
                                   "scores, used only to choose the top-k, moved toward an even load every step.")
    expert_bias_update_rate: float = doc(1e-3, "Step of the expert bias per optimizer step: +rate for an underloaded "
                                               "expert, -rate for an overloaded one (DeepSeek-V3: 1e-3; 0 freezes it).")
    num_groups: Optional[int] = doc(None, "Group-limited routing: the experts in this many equal groups (DeepSeek-V3: "
                                          "8, one per node); null: off.")
    group_topk: Optional[int] = doc(None, "Groups each token may use, ranked by the sum of their top "
                                          "router_topk/group_topk scores (DeepSeek-V3: 4).")
    topk_scaling_factor: Optional[float] = doc(None, "Multiplies the chosen experts' weights (DeepSeek-V3: 2.5); "
                                                     "null: 1.")
    dispatcher: str = doc("alltoall", "Token dispatcher: 'alltoall' (EP>1), 'allgather', or 'flex' (DeepEP; "
                                      "CUDA only).")
    grouped_gemm: bool = doc(False, "All local experts in one grouped GEMM (TE/cutlass; CUDA only).")
    permute_fusion: bool = doc(False, "Fused token permutation kernels (TE; CUDA only).")
    router_fusion: bool = doc(False, "Fused router top-k/softmax kernels (TE; CUDA only).")

    @property
    def enabled(self) -> bool:
        return self.num_experts is not None


def moe_layer_pattern(moe: MoEConfig, num_layers: int) -> list[int]:
    """1 for each MoE layer, 0 for a dense one (megatron-core's `moe_layer_freq` as a list)."""
    return [int(i >= moe.first_dense_layers and (i - moe.first_dense_layers) % moe.layer_freq == 0)
            for i in range(num_layers)]


def moe_problems(cfg, world: int, add) -> None:
    """The rules of the `moe` section and expert parallelism; `add` collects each problem."""
    moe, p, m = cfg.moe, cfg.parallel, cfg.model
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    if not moe.enabled:
        if ep > 1 or p.expert_tensor_parallel_size is not None:
            add(f"parallel.expert_model_parallel_size={ep} / expert_tensor_parallel_size set without moe.num_experts. "
                "Fix: set moe.num_experts (an MoE model) or drop the expert parallel sizes.")
        return
    n = moe.num_experts
    for key, allowed in (("dispatcher", DISPATCHERS), ("load_balancing", LOAD_BALANCING),
                         ("drop_policy", ("probs", "position")), ("score_function", ("softmax", "sigmoid"))):
        if getattr(moe, key) not in allowed:
            add(f"moe.{key}={getattr(moe, key)!r} is not one of {list(allowed)}.")
    if n < 1 or not 1 <= moe.router_topk <= n:
        add(f"moe.router_topk={moe.router_topk} must be between 1 and moe.num_experts={n}.")
    if moe.router_topk == 1 and moe.score_function == "softmax" and not moe.pre_softmax \
            and moe.load_balancing != "sinkhorn":
        add("moe.router_topk=1 with a softmax over the chosen expert gives every token weight 1 and the router no "
            "gradient. Fix: moe.pre_softmax=true (Switch Transformer).")
    routing_problems(moe, add)
    if moe.layer_freq < 1 or not 0 <= moe.first_dense_layers < m.num_layers:
        add(f"moe.layer_freq={moe.layer_freq} must be >= 1 and moe.first_dense_layers={moe.first_dense_layers} "
            f"between 0 and model.num_layers-1={m.num_layers - 1}.")
    if ep < 1 or n % ep:
        add(f"parallel.expert_model_parallel_size={ep} does not divide moe.num_experts={n}. Fix: an EP that divides "
            f"{n}.")
    pp = p.pipeline_model_parallel_size
    if ep >= 1 and etp >= 1 and world % (etp * ep * pp):
        add(f"world size {world} is not divisible by expert TP x EP x PP = {etp}*{ep}*{pp}: the experts' layout must "
            "tile the ranks of every pipeline stage. Fix: change EP, expert_tensor_parallel_size or the world.")
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        add(f"moe.num_experts with parallel.tensor_model_parallel_size={p.tensor_model_parallel_size} needs "
            "parallel.sequence_parallel=true: megatron-core 0.16.1's MoELayer refuses to train under TP without it "
            "(its dispatch works on sequence-parallel tokens). Fix: parallel.sequence_parallel=true.")
    if moe.capacity_factor is not None and moe.load_balancing == "sinkhorn":
        add("moe.capacity_factor with moe.load_balancing=sinkhorn: token dropping works with the aux-loss kinds "
            "or none. Fix: load_balancing=aux_loss, or capacity_factor=null.")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        add(f"moe.capacity_factor={moe.capacity_factor} must be > 0 (null: dropless).")
    if moe.pad_to_capacity and moe.capacity_factor is None:
        add("moe.pad_to_capacity=true needs moe.capacity_factor.")
    if p.engine != "megatron":
        add(f"moe.num_experts with parallel.engine={p.engine}: experts are megatron-core's MoELayer, whose gradients "
            "are reduced over expert-data-parallel groups by megatron-core's DDP; DeepSpeed has its own MoE layer and "
            "groups. Fix: parallel.engine=megatron (dist-opt for ZeRO-1).")
    on_cpu = cfg.cluster.gpu_type == "cpu"
    for flag in CUDA_ONLY:
        if getattr(moe, flag) and on_cpu:
            add(f"moe.{flag}=true needs CUDA kernels (Transformer Engine); cluster.gpu_type=cpu. Fix: "
                f"moe.{flag}=false on CPU (a GPU recipe may keep it).")
    if on_cpu and moe.dispatcher == "alltoall" and etp > 1:
        add(f"expert tensor parallel {etp} (parallel.expert_tensor_parallel_size, default: the TP degree) with "
            "moe.dispatcher=alltoall on CPU: its all-gather of the experts' tokens over expert TP has uneven sizes, "
            "which gloo refuses ('ProcessGroupGloo::allgather: invalid tensor size'). Fix: "
            "parallel.expert_tensor_parallel_size=1 (experts whole on each rank; TP=2 x EP=2 measured equal to "
            "one process), or a GPU cluster.")
    if moe.dispatcher == "flex" and on_cpu:
        add("moe.dispatcher=flex is DeepEP's CUDA kernels; cluster.gpu_type=cpu. Fix: alltoall or allgather.")


def routing_problems(moe: MoEConfig, add) -> None:
    """DeepSeek-V3's routing options: megatron-core 0.16.1's TransformerConfig asserts (expert bias, groups), and the
    settings it accepts but silently ignores or routes wrongly with."""
    n, k = moe.num_experts, moe.router_topk
    if moe.expert_bias and moe.score_function != "sigmoid":
        add(f"moe.expert_bias=true with moe.score_function={moe.score_function!r}: megatron-core adds the expert bias "
            "to sigmoid scores only. Fix: moe.score_function=sigmoid (DeepSeek-V3).")
    if moe.expert_bias_update_rate < 0:
        add(f"moe.expert_bias_update_rate={moe.expert_bias_update_rate} must be >= 0 (0 freezes the bias).")
    if moe.load_balancing == "sinkhorn" and (moe.expert_bias or moe.num_groups or moe.topk_scaling_factor):
        add("moe.load_balancing=sinkhorn routes without top-k scores: moe.expert_bias, moe.num_groups/group_topk and "
            "moe.topk_scaling_factor would be ignored. Fix: load_balancing=none or seq_aux_loss (DeepSeek-V3).")
    if (moe.num_groups is None) != (moe.group_topk is None):
        unset = "moe.group_topk" if moe.group_topk is None else "moe.num_groups"
        add(f"{unset} is null but the other is set: group-limited routing needs moe.num_groups and moe.group_topk "
            "(DeepSeek-V3: 8 and 4). Fix: set both, or both null.")
    elif moe.num_groups is not None:
        g, gk = moe.num_groups, moe.group_topk
        if g < 1 or n % g:
            add(f"moe.num_groups={g} does not divide moe.num_experts={n}: groups are equal slices of the experts. "
                f"Fix: a divisor of {n}.")
        elif not 1 <= gk <= min(g, k):
            add(f"moe.group_topk={gk} must be between 1 and min(moe.num_groups={g}, moe.router_topk={k}): a group "
                f"is ranked by its top router_topk // group_topk scores (0 ranks nothing). Fix: group_topk <= "
                f"{min(g, k)}.")
        elif k > gk * (n // g):
            add(f"moe.router_topk={k} is more than the {gk} chosen groups hold ({gk} x {n // g} experts): top-k would "
                "pick masked experts outside them. Fix: a larger moe.group_topk or a smaller moe.router_topk.")
    if moe.topk_scaling_factor is not None and moe.topk_scaling_factor <= 0:
        add(f"moe.topk_scaling_factor={moe.topk_scaling_factor} must be > 0 (null: 1).")

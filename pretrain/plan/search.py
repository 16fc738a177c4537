"""`make plan RECIPE=... GPUS=N SEARCH=1`: every valid layout on N GPUs, ranked by modelled step time.

The recipe is composed with Hydra once; each candidate layout is written into one scratch copy
of the typed config and put through the same `validate` + `derive` that `load_recipe` runs
(pretrain/config/), so a layout the search prints is one the recipe accepts. Layouts whose
modelled memory (memory.py) exceeds MEMORY_MARGIN of the device are dropped; the rest are
ranked by perf.step_time.

Enumerated: engine megatron (TP, PP, virtual PP, CP, SP, distributed optimizer with overlapped
grad reduce / param gather) and deepspeed (ZeRO 0-3, PP=CP=1, no SP: what that engine runs),
micro-batch 1-8, recompute none / selective / full (1 layer per group). Not enumerated: TP
across nodes (TP divides the GPUs per node), uneven PP splits, CP with a sequence not
divisible by 2 x CP (Transformer Engine's load-balanced split) or leaving a rank < 1024 tokens,
micro-batches that do not divide the global batch over DP (the validator's own rule, applied
early), offload. MoE recipes (moe.num_experts): megatron only (the validator's rule, applied early), EP every
divisor of the experts and expert TP = TP or 1, kept where the validator accepts them (EP x expert TP x PP tiling
the world); timed as perf.py says (active expert weights, token exchange not overlapped), memory as memory.py.
Where the recipe sets an uneven PP split (num_layers_in_first / last_pipeline_stage), its PP with that split is
searched too (without VPP), beside the PPs dividing the layers. With distillation, only the layouts the
`distill` rules allow (megatron, PP = CP = 1, TP dividing the teacher's heads). With peft.method=lora, no
CP: LoRA wraps megatron-core's local linears (pretrain/peft/lora.py), CP needs Transformer Engine's layers.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Iterator, Optional

from common.config import ConfigError

from ..config.derive import derive
from ..config.hardware import device
from ..config.peft import distill_problems
from ..config.schema import JobConfig
from ..config.validate import validate
from ..model.inventory_encdec import ENCDEC_ARCHS
from .memory import memory_per_gpu, stage_param_bytes
from .peft import composed_teacher
from .perf import rates, shape, step_time

MEMORY_MARGIN = 0.90      # keep 10% of device memory for the allocator's fragmentation, CUDA context, NCCL buffers
MICRO_BATCHES = (1, 2, 4, 8)
RECOMPUTE = (None, "selective", "full")
MIN_CP_CHUNK = 1024       # CP only while each rank keeps >= 1024 tokens of the sequence
FIELDS = ("engine", "tp", "pp", "vpp", "cp", "sp", "dist_opt", "zero", "mbs", "recompute", "ep", "etp")


@dataclass(frozen=True)
class Layout:
    engine: str
    tp: int
    pp: int
    vpp: Optional[int]
    cp: int
    sp: bool
    dist_opt: bool
    zero: int
    mbs: int
    recompute: Optional[str]
    ep: int = 1
    etp: Optional[int] = None      # expert TP; None: the TP degree
    first: Optional[int] = None    # layers of the first / last pipeline stage (an uneven split), None: even
    last: Optional[int] = None

    def apply(self, cfg: JobConfig, dp_overlap: bool = True) -> None:
        """Write this layout into a config (in place); `dp_overlap`: megatron overlaps the DP collectives."""
        p = cfg.parallel
        p.engine = self.engine
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size = self.tp, self.pp
        p.virtual_pipeline_model_parallel_size, p.context_parallel_size = self.vpp, self.cp
        p.sequence_parallel, p.use_distributed_optimizer = self.sp, self.dist_opt
        p.overlap_grad_reduce = self.engine == "megatron" and dp_overlap
        p.overlap_param_gather = self.dist_opt and dp_overlap
        p.recompute_granularity, p.recompute_method, p.recompute_num_layers = self.recompute, "uniform", 1
        p.num_layers_in_first_pipeline_stage, p.num_layers_in_last_pipeline_stage = self.first, self.last
        p.expert_model_parallel_size, p.expert_tensor_parallel_size = self.ep, self.etp
        cfg.deepspeed.zero_stage = self.zero
        cfg.batch.micro_batch_size = self.mbs
        if self.cp > 1:
            cfg.model.transformer_impl = "transformer_engine"


@dataclass
class Result:
    layout: Layout
    time: dict
    memory: dict
    dp: int
    overrides: list[str] = field(default_factory=list)


def world(cfg: JobConfig, gpus: Optional[int]) -> tuple[int, int]:
    """(nodes, devices_per_node) for `gpus` devices of the recipe's node size."""
    per_node = cfg.cluster.devices_per_node
    if not gpus:
        return cfg.cluster.nodes, per_node
    if gpus < per_node:
        return 1, gpus
    if gpus % per_node:
        raise ConfigError([f"GPUS={gpus} is not a whole number of nodes of cluster.devices_per_node={per_node}. "
                           f"Fix: a multiple of {per_node}, or fewer than {per_node}."], source="GPUS")
    return gpus // per_node, per_node


def candidates(cfg: JobConfig, gpus: int, uneven: Optional[tuple] = None) -> Iterator[Layout]:
    """`uneven`: the recipe's (PP, first-stage layers, last-stage layers), searched beside the even splits."""
    m = cfg.model
    per_node = cfg.cluster.devices_per_node
    layers, gbs = m.num_layers, cfg.batch.global_batch_size
    experts = cfg.moe.num_experts if cfg.moe.enabled else 0
    eps = [x for x in range(1, experts + 1) if experts % x == 0] if experts else [1]
    splits = [(x, None, None) for x in range(1, layers + 1) if layers % x == 0] + ([uneven] if uneven else [])
    for tp in (t for t in range(1, per_node + 1) if per_node % t == 0):
        etps = [None] + ([1] if experts and tp > 1 else [])
        for pp, first, last in (x for x in splits if tp * x[0] <= gpus):
            vpps = [None] + ([v for v in range(2, layers // pp + 1) if (layers // pp) % v == 0]
                             if pp > 1 and first is None else [])
            cp = 1
            while tp * pp * cp <= gpus:
                dp = gpus // (tp * pp * cp)
                if gpus % (tp * pp * cp) == 0 and (cp == 1 or (m.seq_length % (2 * cp) == 0
                                                                and m.seq_length // cp >= MIN_CP_CHUNK)):
                    for vpp in vpps:
                        for sp in ((False, True) if tp > 1 else (False,)):
                            for mbs in (x for x in MICRO_BATCHES if gbs % (x * dp) == 0):   # validate() checks
                                for rc in RECOMPUTE:
                                    for dist_opt in (False, True):
                                        for ep in (x for x in eps if gpus % (x * pp) == 0):
                                            for etp in etps:
                                                yield Layout("megatron", tp, pp, vpp, cp, sp, dist_opt, 0, mbs, rc,
                                                             ep, etp, first, last)
                                    if pp == 1 and cp == 1 and not sp and not experts:
                                        for zero in (0, 1, 2, 3):
                                            yield Layout("deepspeed", tp, 1, None, 1, False, False, zero, mbs, rc)
                cp *= 2


def _value(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def overrides(base: JobConfig, cfg: JobConfig) -> list[str]:
    """Hydra overrides that turn the composed recipe `base` into `cfg` (layout fields only)."""
    keys = ["cluster.nodes", "cluster.devices_per_node", "parallel.engine", "parallel.tensor_model_parallel_size",
            "parallel.pipeline_model_parallel_size", "parallel.virtual_pipeline_model_parallel_size",
            "parallel.context_parallel_size", "parallel.sequence_parallel", "parallel.use_distributed_optimizer",
            "parallel.overlap_grad_reduce", "parallel.overlap_param_gather", "parallel.recompute_granularity",
            "parallel.recompute_method", "parallel.recompute_num_layers",
            "parallel.num_layers_in_first_pipeline_stage", "parallel.num_layers_in_last_pipeline_stage",
            "parallel.expert_model_parallel_size", "parallel.expert_tensor_parallel_size", "deepspeed.zero_stage",
            "batch.micro_batch_size", "model.transformer_impl"]
    out = []
    for key in keys:
        section, name = key.split(".")
        new, old = getattr(getattr(cfg, section), name), getattr(getattr(base, section), name)
        if new != old:
            out.append(f"{key}={_value(new)}")
    return out


def search(base: JobConfig, gpus: Optional[int] = None, *, fp8: bool = False, tp_overlap: bool = False,
           p2p_overlap: bool = False, dp_overlap: bool = True, margin: float = MEMORY_MARGIN, keep_all: bool = False,
           top: int = 5, allow: Optional[dict] = None) -> dict:
    """Enumerate, validate, fit and rank. Returns counts, the device budget and the ranked results
    (`top` of them, or all that fit with keep_all). `allow` ({field: [values]}) restricts the space,
    e.g. to what a published system's software offered. `fp8` / `tp_overlap` / `p2p_overlap`: time GEMMs in FP8,
    TP collectives overlapped with GEMMs, interleaved-PP sends overlapped with compute (published systems only;
    the engines here run none of them); `dp_overlap`
    False: gradients reduced after the backward pass (Megatron-LM's local DDP of 2021)."""
    arch = getattr(getattr(base, "model", None), "arch", None)
    if arch in ENCDEC_ARCHS:
        raise ConfigError([f"model.arch={arch}: the layout search times decoder-only layers at one sequence "
                           "length (perf.py), and the BERT / T5 recipes run on one pipeline stage. Fix: plan it "
                           "without SEARCH=1 (make plan RECIPE=... GPUS=N)."], source="SEARCH")
    nodes, per_node = world(base, gpus)
    gpus = nodes * per_node
    dev = device(base.cluster.gpu_type)
    budget = dev["memory_gib"] * margin
    scratch = copy.deepcopy(base)
    scratch.cluster.nodes, scratch.cluster.devices_per_node = nodes, per_node
    # The run length is layout-independent and was validated with the recipe; a 1-step run keeps
    # derive() from walking a batch ramp over the whole token budget for every layout.
    scratch.schedule.train_iters, scratch.schedule.train_tokens = 1, None
    derive(scratch)
    rate = rates(scratch, fp8=fp8 or bool(base.precision.fp8), tp_overlap=tp_overlap, p2p_overlap=p2p_overlap)
    sh = shape(scratch)
    cache: dict = {}
    counts = {"enumerated": 0, "valid": 0, "fit": 0}
    rejected: dict[str, int] = {}
    results: list[Result] = []
    model_impl = base.model.transformer_impl
    teacher = composed_teacher(base)
    p = base.parallel
    uneven = (p.pipeline_model_parallel_size, p.num_layers_in_first_pipeline_stage,
              p.num_layers_in_last_pipeline_stage) if p.num_layers_in_first_pipeline_stage or \
        p.num_layers_in_last_pipeline_stage else None
    for layout in candidates(scratch, gpus, uneven):
        if allow and any(getattr(layout, k) not in v for k, v in allow.items()):
            continue
        counts["enumerated"] += 1
        if layout.cp > 1 and base.peft.method == "lora":
            rejected["peft.method=lora (local layers, no CP)"] = rejected.get("peft.method=lora (local layers, no CP)",
                                                                              0) + 1
            continue
        scratch.model.transformer_impl = model_impl
        layout.apply(scratch, dp_overlap)
        try:
            validate(scratch, files=False)         # the recipe's blend was checked when it was composed
            if teacher is not None:       # what compose checks against the teacher: PP = CP = 1, TP dividing its heads
                problems: list[str] = []
                distill_problems(scratch, teacher, problems.append)
                if problems:
                    raise ConfigError(problems)
        except ConfigError as err:
            reason = err.problems[0].split("=")[0].split(" ")[0]
            rejected[reason] = rejected.get(reason, 0) + 1
            continue
        derive(scratch)
        counts["valid"] += 1
        mem = memory_per_gpu(scratch, cache)
        if mem["total"] > budget:
            continue
        counts["fit"] += 1
        t = step_time(scratch, rate, sh, stage_param_bytes(scratch, cache))     # memoised by memory_per_gpu
        results.append(Result(layout, t, mem, scratch.derived.data_parallel_size))
    results.sort(key=lambda r: (r.time["step"], r.layout.tp * r.layout.pp * r.layout.cp, r.layout.recompute or ""))
    shown = results if keep_all else results[:top]
    for r in shown[:top]:
        r.layout.apply(scratch, dp_overlap)
        scratch.model.transformer_impl = model_impl if r.layout.cp == 1 else "transformer_engine"
        r.overrides = overrides(base, scratch)
    return {"gpus": gpus, "gpu_type": base.cluster.gpu_type, "memory_budget_gib": round(budget, 2),
            "margin": margin, "counts": counts, "rejected": rejected, "results": shown}


def as_dict(r: Result) -> dict:
    lay = {k: getattr(r.layout, k) for k in FIELDS}
    lay["dp"] = r.dp
    return {"layout": lay, "step_s": round(r.time["step"], 4), "mfu": round(r.time["mfu"], 4),
            "tflops_per_gpu": round(r.time["tflops_per_gpu"], 1),
            "breakdown_s": {k: round(v, 4) for k, v in r.time.items()
                            if k not in ("step", "mfu", "tflops_per_gpu", "hw_tflops_per_gpu")},
            "memory_gib": {k: round(v, 2) for k, v in r.memory.items() if k != "stage"},
            "overrides": " ".join(r.overrides)}


def describe(lay: Layout, dp: int) -> str:
    opt = f"ZeRO-{lay.zero}" if lay.engine == "deepspeed" else ("dist-opt" if lay.dist_opt else "DDP")
    split = f" ({lay.first}+...+{lay.last} layers)" if lay.first or lay.last else ""
    etp = f" ETP={lay.etp}" if lay.etp is not None else ""
    return (f"{lay.engine} TP={lay.tp} PP={lay.pp}{split} VPP={lay.vpp or '-'} CP={lay.cp} DP={dp} EP={lay.ep}{etp} "
            f"SP={'on' if lay.sp else 'off'} {opt} mbs={lay.mbs} recompute={lay.recompute or 'none'}")


def render(recipe: str, found: dict) -> str:
    c = found["counts"]
    lines = [f"layout search for {recipe} on {found['gpus']} x {found['gpu_type']}: {c['enumerated']:,} layouts "
             f"enumerated, {c['valid']:,} pass the recipe validation, {c['fit']:,} fit in "
             f"{found['memory_budget_gib']} GiB ({found['margin']:.0%} of the device)"]
    if not found["results"]:
        lines.append("  no layout fits; rejections: " + ", ".join(f"{k} {v}" for k, v in found["rejected"].items()))
    for i, r in enumerate(found["results"], 1):
        t = r.time
        lines.append(f"{i}. {describe(r.layout, r.dp)}")
        lines.append(f"   step {t['step']:.3f} s, MFU {t['mfu']:.1%} ({t['tflops_per_gpu']:.0f} TFLOP/s/GPU), "
                     f"memory {r.memory['total']:.1f} GiB (weights {r.memory['weights']:.1f}, grads "
                     f"{r.memory['grads']:.1f}, optimizer {r.memory['optimizer']:.1f}, activations "
                     f"{r.memory['activations']:.1f})")
        parts = ("gemm", "attention", "elementwise", "head", "tp_comm", "cp_comm") + \
            (("ep_comm",) if t["ep_comm"] else ()) + ("pp_p2p", "bubble", "dp_comm", "optimizer")
        lines.append("   " + ", ".join(f"{k} {t[k]:.3f}" for k in parts) + f" s (recompute share {t['recompute']:.3f})")
        lines.append(f"   OVERRIDES='{' '.join(r.overrides)}'")
    return "\n".join(lines)

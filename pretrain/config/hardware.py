"""Peak dense throughput per device type, for MFU and time-to-budget estimates.

Values are the vendors' dense (no sparsity) tensor-core peaks in TFLOP/s. fp32 training
uses TF32 tensor cores on NVIDIA (torch's default for matmuls in megatron-core); the
`fp32` column is the TF32 peak there. CPU has no meaningful peak: MFU is not reported.
"""
from __future__ import annotations

from typing import Optional

#                 bf16/fp16, tf32/fp32  (TFLOP/s, dense)
PEAK_TFLOPS = {
    "H100-SXM":  (989.0, 494.5),
    "H100-PCIe": (756.0, 378.0),
    "H200":      (989.0, 494.5),
    "GH200":     (989.0, 494.5),
    "B200":      (2250.0, 1100.0),
    "A100-SXM":  (312.0, 156.0),
    "A100-PCIe": (312.0, 156.0),
    "A10G":      (125.0, 62.5),
    "L40S":      (362.0, 183.0),
    "V100":      (125.0, 15.7),
    "MI300X":    (1307.0, 653.7),
    "cpu":       (None, None),
}


# Tensor cores with FP8 (Transformer Engine's FP8 GEMMs): Hopper (sm_90), Ada (sm_89), Blackwell; MXFP8 (block
# scales in hardware): Blackwell only (TE docs, "FP8 recipes"; megatron-core TransformerConfig.fp8_recipe).
FP8_TYPES = frozenset({"H100-SXM", "H100-PCIe", "H200", "GH200", "B200", "L40S"})
MXFP8_TYPES = frozenset({"B200"})


def peak_tflops(gpu_type: str, half_precision: bool) -> Optional[float]:
    if gpu_type not in PEAK_TFLOPS:
        raise KeyError(f"cluster.gpu_type={gpu_type!r} is not in pretrain/config/hardware.py "
                       f"({', '.join(PEAK_TFLOPS)}); add its peak TFLOP/s there.")
    return PEAK_TFLOPS[gpu_type][0 if half_precision else 1]


def device_name_to_type(name: str) -> str:
    """Map torch.cuda.get_device_name() to a table key (best effort)."""
    upper = name.upper()
    for key in ("H200", "GH200", "H100", "B200", "A100", "A10G", "L40S", "V100", "MI300X"):
        if key in upper:
            if key == "H100":
                return "H100-PCIe" if "PCIE" in upper else "H100-SXM"
            if key == "A100":
                return "A100-PCIe" if "PCIE" in upper else "A100-SXM"
            return key
    return "cpu"


# Attainable rates for the step-time model of `make plan SEARCH=1` (pretrain/plan/perf.py).
# Each figure is a vendor spec or a published measurement; where none exists the entry is None and the
# search refuses the device type (it never guesses).
#   mamf_tflops  bf16 matmul throughput actually reached by cuBLAS at the best shape ("maximum achievable
#                matmul FLOPS", measured with mamf-finder.py: S. Bekman, ml-engineering,
#                compute/accelerator/README.md, MAMF table: A100 SXM 267.9, H100 SXM 792.1, GH200 821.0)
#   hbm_tbps     HBM bandwidth, vendor datasheets (same README's memory table: A100 80GB 2.0, H100 SXM 3.35,
#                H200 4.8)
#   memory_gib   device memory as the driver reports it (80 GB parts: 81,559 MiB = 79.6 GiB; H200 141 GB)
#   nvlink_gbps  intra-node bandwidth per GPU per direction, GB/s: NVLink3 (A100) 600 GB/s and NVLink4 (H100)
#                900 GB/s total bidirectional (NVIDIA A100 / H100 datasheets), halved
#   ib_gbps      inter-node bandwidth per GPU per direction, GB/s: DGX A100 8x HDR 200 Gb/s and DGX H100
#                8x NDR 400 Gb/s ConnectX adapters, one per GPU (DGX user guides): 25 and 50 GB/s
DEVICES = {
    "A100-SXM":  {"mamf_tflops": 267.9, "hbm_tbps": 2.0, "memory_gib": 79.6, "nvlink_gbps": 300.0,
                  "ib_gbps": 25.0, "sms": 108},
    "H100-SXM":  {"mamf_tflops": 792.1, "hbm_tbps": 3.35, "memory_gib": 79.6, "nvlink_gbps": 450.0,
                  "ib_gbps": 50.0, "sms": 132},
    "H200":      {"mamf_tflops": 792.1, "hbm_tbps": 4.8, "memory_gib": 139.8, "nvlink_gbps": 450.0,
                  "ib_gbps": 50.0, "sms": 132},
    "GH200":     {"mamf_tflops": 821.0, "hbm_tbps": 4.0, "memory_gib": 94.5, "nvlink_gbps": 450.0,
                  "ib_gbps": 50.0, "sms": 132},
}
#   sms          streaming multiprocessors: A100 108, H100 SXM 132 (NVIDIA A100 / H100 architecture whitepapers)
# H200 is an H100 with more and faster HBM (same tensor cores): its MAMF is taken as the H100 SXM's.
# Stated assumptions and their sources:
LINK_EFFICIENCY = 0.8        # NCCL reaches ~80% of a link's per-direction rate: "450 GB/s is the line rate. With the
#                              protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370 GB/s" (NCCL
#                              maintainer, NVIDIA/nccl-tests#212); A100 8-GPU all-reduce busbw ~200-210 GB/s of 300
#                              (nccl-tests#149, #178), so 0.8 is optimistic there
COLLECTIVE_LATENCY_S = 5e-6  # per dependent hop of a ring collective, and per p2p call (NCCL latency order)
ATTENTION_FRACTION = {       # flash attention (FlashAttention-2: flash-attn, TE) fwd+bwd as a share of dense peak:
    "A100-SXM": 0.5,         # FlashAttention-2 (Dao 2023) reaches 50-73% of peak forward on A100, backward lower
    "H100-SXM": 0.35, "H200": 0.35, "GH200": 0.35,   # FlashAttention-3 (Shah et al. 2024, abstract): "FlashAttention-2
}                            # achieving only 35% utilization on the H100"; FA3 / cuDNN kernels reach ~75% forward
SUSTAINED_FRACTION = {       # calibrated, not derived: share of the kernel rates above (MAMF GEMMs, attention) a full
    "H100-SXM": 0.69, "H200": 0.69, "GH200": 0.69,   # training step sustains: the median published / modelled
    "A100-SXM": 1.0,         # throughput of the 9 Megatron-LM README H100 cases (calibration subset; docs/planner.md);
}                            # A100: not calibrated (one source). Candidates: power-capped clocks, NCCL SMs, host time
ATTENTION_MATMULS = (2, 5)   # flash attention: QK^T, PV forward; backward recomputes QK^T and adds dV, dP, dQ, dK
#                              (FlashAttention-2, Dao 2023: backward = 2.5x forward FLOPs)
FP8_GEMM_SPEEDUP = 2.0       # FP8 dense peak is 2x bf16 (H100 datasheet: 1,979 vs 989 TFLOP/s), same attainable
#                              fraction; the casts (+ transposes for wgrad) are charged as HBM traffic in perf.py
#                              (published FP8 cases and recipes with precision.fp8)
GEMM_TILE = (128, 256)       # output tile (tokens x features) of cuBLAS's large bf16 kernels, one per SM per wave:
#                              wave quantization as in NVIDIA's "Matrix Multiplication Background" guide, sec. 3.2
KERNEL_GAP_S = 1e-6          # idle GPU time per kernel launch in a stream of dependent kernels (~1 us: NVIDIA
#                              developer blog "Getting Started with CUDA Graphs", 2019: 3.8 us per 2.9 us kernel)
HOST_SYNC_S = 6e-6           # GPU idle per host synchronisation (a device-to-host read such as .tolist(): the queue
#                              drains, the host reads, then launches again): same blog, 9.6 us per kernel when the
#                              host synchronises after each launch against 3.8 us when it does not (its first example)
KERNELS_PER_LAYER = 36       # TE transformer layer: ~12 kernels forward (norms, 4 GEMMs, RoPE, attention, bias-
#                              dropout-adds, activation), ~24 backward (dgrad + wgrad per GEMM)


def device(gpu_type: str) -> dict:
    """The attainable-rate row of a GPU type, or a clear error naming the field and the fix."""
    if gpu_type not in DEVICES:
        raise KeyError(f"cluster.gpu_type={gpu_type!r} has no attainable rates in pretrain/config/hardware.py DEVICES "
                       f"(have {', '.join(DEVICES)}); the layout search needs them. Fix: set cluster.gpu_type to "
                       "one of those, or add a row with its sources.")
    return DEVICES[gpu_type]


def this_device_peak_tflops(half_precision: bool) -> Optional[float]:
    """The dense peak of the device this process trains on (its first CUDA device; None on CPU)."""
    import torch
    gpu = device_name_to_type(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"
    return peak_tflops(gpu, half_precision)

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


def peak_tflops(gpu_type: str, half_precision: bool) -> Optional[float]:
    if gpu_type not in PEAK_TFLOPS:
        raise KeyError(f"cluster.gpu_type={gpu_type!r} is not in pretrain/plan/hardware.py "
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
                  "ib_gbps": 25.0},
    "H100-SXM":  {"mamf_tflops": 792.1, "hbm_tbps": 3.35, "memory_gib": 79.6, "nvlink_gbps": 450.0,
                  "ib_gbps": 50.0},
    "H200":      {"mamf_tflops": 792.1, "hbm_tbps": 4.8, "memory_gib": 139.8, "nvlink_gbps": 450.0,
                  "ib_gbps": 50.0},
    "GH200":     {"mamf_tflops": 821.0, "hbm_tbps": 4.0, "memory_gib": 94.5, "nvlink_gbps": 450.0,
                  "ib_gbps": 50.0},
}
# H200 is an H100 with more and faster HBM (same tensor cores): its MAMF is taken as the H100 SXM's.
# Stated assumptions (no measurement in the sources above):
LINK_EFFICIENCY = 0.8        # NCCL reaches ~80% of the link's per-direction rate in large collectives
COLLECTIVE_LATENCY_S = 5e-6  # per dependent hop of a ring collective, and per p2p call (NCCL latency order)
ATTENTION_FRACTION = 0.5     # flash attention fwd+bwd at 50% of dense peak: FlashAttention-2 (Dao 2023)
#                              reaches 50-73% of peak forward on A100, backward lower; FlashAttention-3
#                              (Shah et al. 2024) reaches 75% forward on H100
FP8_GEMM_SPEEDUP = 2.0       # FP8 dense peak is 2x bf16 (H100 datasheet: 1,979 vs 989 TFLOP/s); the same
#                              attainable fraction is assumed (published FP8 cases only; recipes run bf16)


def device(gpu_type: str) -> dict:
    """The attainable-rate row of a GPU type, or a clear error naming the field and the fix."""
    if gpu_type not in DEVICES:
        raise KeyError(f"cluster.gpu_type={gpu_type!r} has no attainable rates in pretrain/plan/hardware.py DEVICES "
                       f"(have {', '.join(DEVICES)}); the layout search needs them. Fix: set cluster.gpu_type to "
                       "one of those, or add a row with its sources.")
    return DEVICES[gpu_type]

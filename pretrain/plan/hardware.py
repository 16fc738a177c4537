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

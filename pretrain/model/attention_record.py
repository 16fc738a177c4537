"""Which core attention a run builds and which kernel runs it: decided here once, printed in the run banner,
shown by `make doctor RECIPE=...`, and returned by `attention_record(cfg)` for the checkpoint's meta.json.

No megatron-core import (make doctor reads it on a bare node). The decision:

* layer spec: Transformer Engine's where model.transformer_impl=transformer_engine, or auto with TE importable
  on a CUDA machine; else megatron-core's local spec;
* core attention: 'unfused' / 'local' -> megatron-core's DotProductAttention (s x s scores, only by name; TE's
  unfused one on TE's spec); 'te' / 'flash' / 'fused' / 'auto' -> TEDotProductAttention on TE's spec;
  'torch', and every non-unfused backend on the local spec -> TorchDotProductAttention (model/attention.py).
  MLA layers keep their own unfused attention on the local spec (model/mla_attention.py);
* kernel: for torch's on a GPU, what torch's SDPA dispatcher picks for the run's per-rank head shape and dtype on
  this machine (flash / cuDNN / efficient / math), FlexAttention for windows and packed documents; on CPU, the
  module's own computation in megatron-core's order (model/attention.py says why). TE picks
  among its own kernels at run time (NVTE_* settings, its version and the shape): named as TE's.
"""
from __future__ import annotations

import torch

from common.config import ConfigError

from ..config.attention import TE_ONLY, UNFUSED, window_pattern
from ..config.environment import importable


def has_transformer_engine() -> bool:
    return importable("transformer_engine")


def te_spec(cfg) -> bool:
    """Transformer Engine's layer spec (model.transformer_impl; auto: TE importable on a CUDA machine)."""
    impl = cfg.model.transformer_impl
    return impl == "transformer_engine" or (impl == "auto" and has_transformer_engine() and torch.cuda.is_available())


def require_transformer_engine(cfg) -> None:
    """Refuses, before any model is built, a run whose recipe asks for TE where it is not installed."""
    m = cfg.model
    asked = [f for f, on in (("model.transformer_impl=transformer_engine", m.transformer_impl == "transformer_engine"),
                             (f"model.attention_backend={m.attention_backend}", m.attention_backend in TE_ONLY
                              and torch.cuda.is_available())) if on]
    if asked and not has_transformer_engine():
        raise ConfigError([f"{' and '.join(asked)}, but the Python package transformer_engine is not importable "
                           "here. Fix: install the GPU extra on a node with CUDA (pip install '.[gpu]', docs/gpu.md) "
                           "or run in the NGC container (cluster.container_image); or model.transformer_impl=auto "
                           "and model.attention_backend=auto, which run torch's flash attention."])


def core_attention(cfg, on_te_spec: bool) -> str:
    """'torch', 'unfused' (megatron-core's, or TE's unfused on TE's spec) or 'te'."""
    backend = cfg.model.attention_backend
    if backend in UNFUSED or (cfg.model.mla.enabled and not on_te_spec):
        return "unfused"
    # TE's backends on the local spec: a GPU recipe's CPU run (TE is CUDA-only; require_transformer_engine
    # refuses it on a CUDA machine without TE)
    return "te" if on_te_spec and backend != "torch" else "torch"


SDPA_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cuDNN", 4: "overrideable"}   # torch's SDPBackend values


def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, *, mask: bool, causal: bool, dropout: float) -> str:
    """The SDPA kernel torch's dispatcher picks for these inputs (torch._fused_sdp_choice: what
    scaled_dot_product_attention itself calls), e.g. 'flash', 'cuDNN', 'efficient', 'math'."""
    keep = torch.ones(q.size(0), 1, q.size(2), k.size(2), dtype=torch.bool, device=q.device) if mask else None
    choice = torch._fused_sdp_choice(q, k, k, keep, dropout, causal and not mask, scale=None,
                                     enable_gqa=q.size(1) != k.size(1))
    return SDPA_NAMES.get(int(choice), f"SDPBackend {int(choice)}")


def _probe(cfg, device: str, causal: bool, mask: bool) -> str:
    m, d, tp = cfg.model, cfg.derived, cfg.parallel.tensor_model_parallel_size
    dtype = cfg.precision.torch_dtype
    heads, groups = m.num_attention_heads // tp, max(1, d.num_query_groups // tp)
    s = min(m.seq_length, 256)         # the choice depends on head dim, dtype, mask and dropout, not on s
    q = torch.zeros(1, heads, s, d.kv_channels, dtype=dtype, device=device)
    k = torch.zeros(1, groups, s, d.kv_channels, dtype=dtype, device=device)
    return sdpa_kernel(q, k, mask=mask, causal=causal, dropout=m.attention_dropout)


CPU_KERNEL = ("torch on CPU: megatron-core's unfused order, op for op (b x heads x s x s scores; CPU runs give its "
              "losses bit for bit); SDPA and FlexAttention run on CUDA")


def torch_kernels(cfg) -> str:
    """One line: the kernel of each kind of layer TorchDotProductAttention runs for this recipe here."""
    m = cfg.model
    if cfg.cluster.gpu_type == "cpu":
        return CPU_KERNEL
    if not torch.cuda.is_available():
        return "torch SDPA; its kernel is picked on the GPU node (run make doctor there)"
    device = "cuda"
    if m.attention_sinks:               # every mask on FlexAttention, its lse giving the sinks (model/attention.py)
        return "torch FlexAttention with attention sinks (every layer: " + (
            "packed documents)" if cfg.data.document_mask else "causal and windowed masks)")
    flex = m.attention_dropout == 0
    causal = cfg.objective.name in ("causal_lm",)
    parts = []
    if cfg.data.document_mask:
        parts.append("documents: " + ("FlexAttention (packed thd)" if flex else
                                      f"SDPA {_probe(cfg, device, True, True)} with the s x s document mask"))
    else:
        parts.append(f"{'causal' if causal else 'masked'}: SDPA {_probe(cfg, device, causal, not causal)}")
    if window_pattern(m):
        parts.append("windowed layers: " + ("FlexAttention (block-sparse)" if flex else
                                            f"SDPA {_probe(cfg, device, True, True)} with the window mask"))
    return "torch " + "; ".join(parts)


def attention_record(cfg) -> dict:
    """What meta.json (and the banner) records: backend asked, layer spec, core attention module and kernel."""
    spec = te_spec(cfg)
    core = core_attention(cfg, spec)
    if core == "torch":
        kernel = torch_kernels(cfg)
    elif core == "te":
        forced = {"flash": "TE flash", "fused": "TE fused (cuDNN)"}.get(cfg.model.attention_backend)
        kernel = forced or "TE flash or fused (TE picks per shape at run time)"
    else:
        kernel = "unfused: b x heads x s x s scores materialised" + (" (MLA)" if cfg.model.mla.enabled else "")
    module = {"torch": "TorchDotProductAttention (pretrain/model/attention.py)", "te": "TEDotProductAttention",
              "unfused": "TE unfused" if spec else "megatron-core DotProductAttention"}[core]
    return {"attention_backend": cfg.model.attention_backend, "layer_spec": "transformer_engine" if spec else "local",
            "core_attention": module, "kernel": kernel}


def attention_line(cfg) -> str:
    r = attention_record(cfg)
    return f"{r['kernel']} [{r['core_attention']}, {r['layer_spec']} spec, model.attention_backend=" \
           f"{r['attention_backend']}]"

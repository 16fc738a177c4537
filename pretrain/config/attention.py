"""Local (sliding-window) / global attention layers: the per-layer pattern and its compose-time rules.

`model.window_size` w follows megatron-core's `window_size=(w, 0)`: in a windowed layer the query at
position i attends to keys i-w .. i, i.e. itself and the w tokens before it (w+1 keys; Hugging Face's
`sliding_window` counts the same keys as w+1). Global layers are plain causal attention. Which layers
are global: every k-th (`model.global_every`, Gemma 3's 5 local : 1 global is k=6) or an explicit list
of 0-based layer indices (`model.global_layers`, as in `decoder.layers.<i>`); neither means every layer
is windowed (Mistral 7B). megatron-core takes the pattern as `window_attn_skip_freq`, a list with 1 for
windowed layers indexed by its 1-based global layer number, so it holds over pipeline stages too.
"""
from __future__ import annotations

from typing import Optional

BACKENDS = ("auto", "torch", "te", "flash", "fused", "unfused", "local")   # model.attention_backend
UNFUSED = ("unfused", "local")      # the backends that materialise b x heads x s x s scores
TE_ONLY = ("te", "flash", "fused")  # Transformer Engine's attention: its layer spec only


def window_pattern(model) -> Optional[list[bool]]:
    """Per layer (0-based): True where the layer attends within the window; None without windows."""
    if model.window_size is None:
        return None
    n = model.num_layers
    if model.global_every:
        return [(i + 1) % model.global_every != 0 for i in range(n)]
    chosen = set(model.global_layers)
    return [i not in chosen for i in range(n)]


def windowed_layers(model) -> int:
    pattern = window_pattern(model)
    return sum(pattern) if pattern else 0


def key_span(model, windowed: bool) -> int:
    """Keys one query of a layer is charged with in the PaLM FLOPs count (no causal discount): the
    sequence for a global layer, the window's w+1 keys for a windowed one."""
    s = model.seq_length
    return min(model.window_size + 1, s) if windowed else s


def causal_pairs(seq: int, window: Optional[int]) -> float:
    """(query, key) pairs a causal kernel that skips masked blocks computes: s^2/2 for plain causal
    attention (the planner's flash-attention convention), s(w+1) - w(w+1)/2 inside a window of w."""
    if window is None or window + 1 >= seq:
        return seq * seq / 2
    return seq * (window + 1) - window * (window + 1) / 2


def attention_problems(cfg, add) -> None:
    """Compose-time rules for model.window_size / global_every / global_layers, each with the fix."""
    m, p = cfg.model, cfg.parallel
    n, w = m.num_layers, m.window_size
    if w is None:
        if m.global_every is not None or m.global_layers:
            add("model.global_every / model.global_layers set without model.window_size: every layer is global "
                "already. Fix: set model.window_size, or drop them.")
        return
    if w < 1:
        add(f"model.window_size={w} must be >= 1 (tokens before the query that it sees). Fix: a positive window, "
            "or null for global attention everywhere.")
    elif w >= m.seq_length - 1:
        add(f"model.window_size={w} with model.seq_length={m.seq_length}: a query sees itself and {w} tokens "
            "before it, so the window masks nothing and every layer is global. Fix: window_size < seq_length - 1, "
            "or null.")
    if m.global_every is not None and m.global_layers:
        add(f"model.global_every={m.global_every} and model.global_layers={list(m.global_layers)} both set. "
            "Fix: keep one (every k-th layer, or the explicit 0-based list).")
    if m.global_every is not None and not 2 <= m.global_every <= n:
        add(f"model.global_every={m.global_every} with model.num_layers={n}: needs 2..{n} (1 makes every layer "
            "global, more than the layers none). Fix: a value in range, or null for every layer windowed.")
    bad = [i for i in m.global_layers if not 0 <= i < n]
    if bad:
        add(f"model.global_layers has {bad}, outside 0..{n - 1} (0-based layer indices, as in decoder.layers.<i>). "
            "Fix: indices below model.num_layers.")
    if len(set(m.global_layers)) != len(m.global_layers):
        add(f"model.global_layers={list(m.global_layers)} repeats a layer. Fix: list each once.")
    elif not bad and len(m.global_layers) == n:
        add(f"model.global_layers lists all {n} layers: nothing is windowed. Fix: drop model.window_size, or list "
            "fewer layers.")
    if cfg.objective.name != "causal_lm":
        add(f"model.window_size with objective.name={cfg.objective.name}: megatron-core's window mask is causal "
            "(keys i-w..i), which would hide the encoder's right context. Fix: drop model.window_size.")
    if p.context_parallel_size > 1:
        add(f"model.window_size with parallel.context_parallel_size={p.context_parallel_size}: which of Transformer "
            "Engine's CP communication types carry a sliding window depends on its version, and this project has "
            "not run one. Fix: CP=1 (a window bounds attention's cost already), or drop model.window_size.")
    if cfg.data.document_mask:
        add("model.window_size with data.document_mask=true: megatron-core's local attention replaces the given "
            "mask by the sliding-window mask (fused_softmax.py), so document boundaries would be lost, and TE's "
            "packed (thd) path with a window is not run here. Fix: drop one of them.")


def materialises_scores(cfg) -> bool:
    """Whether core attention keeps b x heads x s x s scores: megatron-core's (or TE's) unfused attention, asked
    for by name, MLA on the local spec (its own DotProductAttention, model/mla_attention.py), or any run on CPU
    (torch's module computes in megatron-core's order there: model/attention.py). Every other path runs a fused
    kernel (TE's, torch's SDPA / FlexAttention)."""
    m = cfg.model
    return m.attention_backend in UNFUSED or (m.mla.enabled and m.transformer_impl == "local") or \
        cfg.cluster.gpu_type == "cpu"


def assumed_attention(cfg) -> str:
    """What the planner times and sizes (plan/memory.py, plan/perf.py), in the words `make plan` prints."""
    if materialises_scores(cfg):
        why = ("CPU: torch's module in megatron-core's order" if cfg.cluster.gpu_type == "cpu" and
               cfg.model.attention_backend not in UNFUSED else f"model.attention_backend={cfg.model.attention_backend}")
        return f"unfused ({why}): b x heads x s x s scores kept, full-square matmuls"
    return ("fused flash-style kernel (TE's on its spec, else torch's SDPA/FlexAttention): no s x s scores, causal "
            "half of the matmuls")


def backend_problems(cfg, add) -> None:
    """Compose-time rules for model.attention_backend, each with the fix."""
    m = cfg.model
    if m.attention_backend in TE_ONLY and m.transformer_impl == "local":
        add(f"model.attention_backend={m.attention_backend} is Transformer Engine's attention, and "
            "model.transformer_impl=local builds no TE layer. Fix: model.attention_backend=torch (torch's flash "
            "kernels on the local spec) or model.transformer_impl=transformer_engine.")
    elif m.attention_backend == "te" and cfg.cluster.gpu_type == "cpu":
        add("model.attention_backend=te on cluster.gpu_type=cpu: Transformer Engine's attention is CUDA-only. "
            "Fix: model.attention_backend=auto (torch's CPU flash kernel).")
    if m.attention_backend == "torch" and m.mla.enabled:
        add("model.attention_backend=torch with model.mla.enabled: MLA's queries and values differ in width, "
            "which the local spec's MLA attention handles unfused. Fix: model.attention_backend=auto.")

"""Compose-time rules of the optimizer's numbers (`optim.*`): each names the field, its value and the fix.

A negative or zero learning rate, a negative weight decay or a beta of 1 compose and train without an
error: the run then climbs the loss, never moves, or grows its weights, and the first sign is a curve
hours later. The LR pair is checked in order, so `lr` is blamed when `lr` is wrong (a negative lr makes
any min_lr look "above" it).
"""
from __future__ import annotations

from .schema import JobConfig

BETAS = {"adam_beta1": 0.9, "adam_beta2": 0.95, "muon_momentum": 0.95}     # decay rates, in [0, 1): the defaults


def optim_problems(cfg: JobConfig, add) -> None:
    """`add` collects each problem of `cfg.optim`'s values."""
    o = cfg.optim
    if not o.lr > 0:
        add(f"optim.lr={o.lr} must be > 0 (the peak learning rate). Fix: a positive value, e.g. optim.lr=3e-4.")
    if not o.min_lr >= 0:
        add(f"optim.min_lr={o.min_lr} must be >= 0 (the learning rate at the end of decay). Fix: optim.min_lr=0, or "
            "10% of optim.lr as GPT-3.")
    elif o.lr > 0 and o.min_lr > o.lr:
        add(f"optim.min_lr={o.min_lr} is above optim.lr={o.lr}: the schedule would raise the LR while it decays. Fix: "
            f"optim.min_lr <= {o.lr} (GPT-3: 10% of lr).")
    if not o.weight_decay >= 0:
        add(f"optim.weight_decay={o.weight_decay} must be >= 0 (decoupled decay pulls weights towards 0; a negative "
            "one pushes them away). Fix: optim.weight_decay=0.1, or 0 for none.")
    for key, default in BETAS.items():
        value = getattr(o, key)
        if not 0 <= value < 1:
            add(f"optim.{key}={value} is a decay rate and must be in [0, 1). Fix: the default {default}, or another "
                "value in [0, 1).")
    if not o.adam_eps > 0:
        add(f"optim.adam_eps={o.adam_eps} must be > 0 (it keeps the update finite where the second moment is 0). "
            "Fix: optim.adam_eps=1e-8.")
    if not o.clip_grad >= 0:
        add(f"optim.clip_grad={o.clip_grad} must be >= 0 (a global L2 norm; 0 disables clipping). Fix: "
            "optim.clip_grad=1.0, or 0.")
    if o.muon_ns_steps < 1:
        add(f"optim.muon_ns_steps={o.muon_ns_steps} must be >= 1 (Newton-Schulz iterations). Fix: 5.")

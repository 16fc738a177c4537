"""`make plan RECIPE=... [OVERRIDES=...] [JSON=1] [GPUS=N] [MFU=0.4] [SEARCH=1 [TOP=5]]`."""
from __future__ import annotations

import argparse
import json
import os
import sys

from common.cli import add_recipe_args, command, env_flag, recipe_and_overrides
from common.config import ConfigError
from common.text import human

from ..config.compose import load_recipe
from ..config.epochs import data_epochs, epoch_lines
from .estimate import make_plan
from .search import as_dict, search
from .search import render as render_search


def render(plan: dict) -> str:
    mem = plan["memory_per_gpu_gib"]
    lay = plan["layout"]
    hours = plan["time_to_budget_hours"]
    # the attention term as model/inventory.py counts it: MLA's heads a at its own head dims (mla_attention_flops)
    attention = "6*L*s*a*(d_qk + d_rope + d_v)" if "mla" in plan else "12*L*s*H*Q"
    formula = f"4N + 6N_added + {attention}: no weight grads of the frozen base" if "peft" in plan else \
        f"6N + {attention}"
    if "distill" in plan:
        formula += " + the teacher's forward"
    if plan.get("windowed_layers"):     # a sliding-window layer is charged its w+1 keys per query, not s
        formula = formula.replace("L*s", "(L_global*s + L_window*(w+1))")
    if "encdec" in plan:
        formula = plan["encdec"]["formula"]
    teacher = (f" + teacher weights {mem['teacher_weights']:.2f} + teacher activations {mem['teacher_activations']:.2f}"
               if "distill" in plan else "")
    lines = [
        f"plan for {plan['recipe']}",
        f"  parameters        {plan['params']:,} ({human(plan['params'])}; non-embedding "
        f"{plan['params_non_embedding']:,}" + (f"; the main model {plan['params'] - plan['params_mtp']:,} "
                                               f"({human(plan['params'] - plan['params_mtp'])}) + MTP layers "
                                               f"{plan['params_mtp']:,}" if plan.get("params_mtp") else "") + ")",
        f"  layout            {lay['engine']} TP={lay['tp']} PP={lay['pp']} CP={lay['cp']} DP={lay['dp']} "
        f"SP={lay['sp']} " + ("FSDP2 (params, grads, optimizer states / DP)" if lay.get("sharding") == "fsdp2"
                              else f"ZeRO={lay['zero']}") + f" recompute={lay['recompute']} {lay['precision']}",
        f"  batch             micro {lay['micro_batch']} x {lay['num_microbatches']} micro-batches x DP "
        f"{lay['dp']} = {lay['global_batch']} sequences",
        f"  tokens per step   {plan['tokens_per_step']:,}",
        f"  FLOPs per token   {plan['flops_per_token']:.4g} ({formula}; with recompute "
        f"{plan['flops_per_token_hardware']:.4g})",
        f"  FLOPs per step    {plan['flops_per_step']:.4g}",
        f"  attention         {plan['attention']}",
        f"  memory per GPU    {mem['total']:.2f} GiB = weights {mem['weights']:.2f} + grads {mem['grads']:.2f} "
        f"+ optimizer {mem['optimizer']:.2f} + activations {mem['activations']:.2f}{teacher}"
        + (f" + gathered {mem['gathered']:.2f} " if "gathered" in mem else " ") +
        f"(PP stage {plan['memory_stage']})",
        f"  Chinchilla tokens {human(plan['chinchilla_tokens'])} (20 x params); budget {human(plan['train_tokens'])} "
        f"tokens in {plan['train_iters']:,} steps",
    ]
    if "gathered" in mem:      # FSDP2 (plan/fsdp2.py): in the total above
        lines.insert(-1, f"  FSDP2 gathered    {mem['gathered']:.2f} GiB (in the total): the root's parameters and 2 "
                         "layers' parameters and gradients, whole")
    if "encdec" in plan:
        ed = plan["encdec"]
        share = f"; decoder {ed['decoder_flops_share']:.1%} of the FLOPs" if ed["decoder_tokens"] else ""
        lines.insert(2, f"  {ed['arch']:<17} {ed['stacks']}; tokens are encoder tokens{share}")
    if "moe" in plan:
        moe = plan["moe"]
        lines.insert(2, f"  MoE               {moe['experts']} experts, top-{moe['router_topk']}, "
                        f"{moe['moe_layers']} MoE layers; {moe['params_active']:,} active per token "
                        f"({human(moe['params_active'])}"
                        + (f"; the main model {human(moe['params_active_main'])}"
                           if moe["params_active_main"] != moe["params_active"] else "")
                        + f"; {human(moe['params_active_main_without_embedding'])} without the input embedding, "
                        f"a lookup); EP="
                        f"{moe['expert_parallel']} ({moe['dispatcher']}): "
                        f"{moe['token_exchange_bytes_per_rank_per_step'] / 2**30:.2f} GiB exchanged per rank per step")
    if "mla" in plan:
        ml = plan["mla"]
        lines.insert(2, f"  MLA               q latent {ml['q_lora_rank']}, kv latent {ml['kv_lora_rank']}, head dims "
                        f"{ml['qk_head_dim']}+{ml['qk_pos_emb_head_dim']} (qk) / {ml['v_head_dim']} (v); attention "
                        f"{ml['attention_params']:,} params; KV cache {ml['kv_cache_bytes_per_token'] / 2**10:.1f} "
                        f"KiB/token in bf16 (multi-head: {ml['mha_kv_cache_bytes_per_token'] / 2**10:.1f} KiB)")
    if "peft" in plan:
        pe = plan["peft"]
        lines.insert(2, f"  PEFT              {pe['method']} {pe['detail']}: {pe['trainable_params']:,} trained "
                        f"({pe['trainable_fraction']:.3%} of the base; {human(pe['trainable_params_per_gpu'])} per "
                        f"GPU) on a frozen base (weights only: no grads, fp32 master or optimizer state); "
                        f"{pe['frozen_wgrad_flops_per_token_skipped']:.4g} weight-grad FLOPs/token skipped")
    if "distill" in plan:
        di = plan["distill"]
        lines.insert(2, f"  distillation      teacher {di['teacher_recipe']} ({di['teacher_params']:,} params, "
                        f"{di['teacher_layers']} layers) at the student's layout, forward only: "
                        f"{di['teacher_forward_flops_per_token']:.4g} FLOPs/token, weights "
                        f"{di['teacher_weights_gib']:.2f} GiB + activations {di['teacher_activations_gib']:.2f} "
                        "GiB per GPU")
    if hours is not None:
        lines.append(f"  time to budget    {hours:,.1f} h ({hours / 24:,.1f} days) on {plan['gpus']} x "
                     f"{plan['gpu_type']} at {plan['mfu']:.1%} MFU, {plan['mfu_source']} "
                     f"({plan['peak_tflops_per_gpu']} TFLOP/s peak)")
    else:
        lines.append(f"  time to budget    n/a on {plan['gpu_type']} (no peak FLOP/s; set cluster.gpu_type)")
    if "saves" in plan:
        sv = plan["saves"]
        steps = (f"every {sv['save_interval']} steps (~{sv['minutes_between_saves_by_steps']:,.0f} min at "
                 f"{sv['step_seconds']:.2f} s/step: time to budget / steps)" if sv["save_interval"]
                 else "no step interval")
        timed = (f"every {sv['save_interval_minutes']:g} min of wall time" if sv["save_interval_minutes"]
                 else "no wall-time interval")
        gap = (f"a fault loses at most ~{sv['minutes_between_saves']:,.0f} min" if sv["minutes_between_saves"]
               else "no periodic saves: a fault loses the run since its start")
        lines.append(f"  saves             {steps}, or {timed}, whichever first: {gap}")
        if sv["host_gib"]:
            h = sv["host_gib"]
            other = "fully_reshardable" if h["format"] == "dp_reshardable" else "dp_reshardable"
            lines.append(f"  save host memory  {h[h['format']]:,.2f} GiB per rank of optimizer state ({h['format']}; "
                         f"{other}: {h[other]:,.2f} GiB)")
    return "\n".join(lines)


@command
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.plan", description=__doc__)
    add_recipe_args(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object (default $JSON)")
    parser.add_argument("--gpus", type=int, default=int(os.environ.get("GPUS") or 0) or None,
                        help="GPU count for the time estimate (default: the recipe's world size)")
    parser.add_argument("--mfu", type=float, default=float(os.environ["MFU"]) if os.environ.get("MFU") else None,
                        help="MFU for the time estimate (default $MFU, else the step-time model's for this layout)")
    parser.add_argument("--search", action="store_true", help="rank every valid layout on GPUS devices (default "
                        "$SEARCH)")
    parser.add_argument("--top", type=int, default=int(os.environ.get("TOP") or 5), help="layouts to print")
    args = parser.parse_args(argv)
    recipe, overrides = recipe_and_overrides(args)
    cfg = load_recipe(recipe, overrides)
    as_json = args.json or env_flag("JSON")
    if args.search or env_flag("SEARCH"):
        try:
            found = search(cfg, args.gpus, top=args.top)
        except (ConfigError, KeyError) as err:
            print(err if isinstance(err, ConfigError) else err.args[0], file=sys.stderr)
            return 2
        if as_json:
            print(json.dumps({"recipe": recipe, **{k: v for k, v in found.items() if k != "results"},
                              "layouts": [as_dict(r) for r in found["results"]]}))
        else:
            print(render_search(recipe, found))
        return 0
    plan = make_plan(cfg, gpus=args.gpus, mfu=args.mfu)
    sources, skipped = data_epochs(cfg)
    plan["data_epochs"] = {s.name: round(s.epochs, 4) for s in sources} if not skipped else {"skipped": skipped}
    print(json.dumps(plan) if as_json else "\n".join([render(plan), *(f"  data epochs       {line}"
                                                                        for line in epoch_lines(cfg))]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

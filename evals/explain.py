"""`make explain-step RUN=<run_dir> STEP=N [TOP=10]`: the documents of step N's global batch, ranked by their loss
under the checkpoint before the step, with where each came from.

In this process, on one rank: the run's config from the newest checkpoint before step N; the step's first sample
from metrics.jsonl (its record's consumed_samples minus its global batch; the first record of N when a rollback
ran it twice), else from the checkpoint's consumed_samples and the batch ramp; the train split built as the run
built it (pretrain/data/datasets.py, the checkpoint's reshuffled windows applied); the samples' documents and
provenance (pretrain/data/attribution.py); the checkpoint exported to transformers (<run_dir>/hf/, reused) and run
forward on the batch, token losses summed per document. Written to <run_dir>/explain/step_<N>.json (the spike
guard writes the same file without losses when it fires); `make report` lists the top documents.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from evals.harness import exported
from pretrain.checkpoint.store import resolve
from pretrain.config.derive import batch_ramp
from pretrain.data import attribution


def checkpoint_before(run_dir: Path, step: int):
    """The newest intact checkpoint of the run saved before `step`."""
    root = run_dir / "checkpoints"
    steps = sorted((int(p.name.removeprefix("step_")) for p in root.glob("step_*")
                    if p.name.removeprefix("step_").isdigit() and (p / "meta.json").exists()), reverse=True)
    for saved in steps:
        if saved < step:
            return resolve(root / f"step_{saved:08d}")
    raise FileNotFoundError(f"{root}: no checkpoint before step {step} (saved: {sorted(steps) or 'none'}). Fix: "
                            "STEP=<a step after a saved checkpoint>, or save more often (checkpoint.save_interval).")


def step_start(run_dir: Path, step: int, ck, cfg) -> Tuple[int, int, str]:
    """(consumed samples before `step`, its global batch, how they were found)."""
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("kind") == "train" and rec.get("step") == step:
                return rec["consumed_samples"] - rec["global_batch"], rec["global_batch"], "metrics.jsonl"
    ramp, consumed = batch_ramp(cfg), ck.meta["loop"]["consumed_samples"]
    for _ in range(ck.meta["step"] + 1, step):
        consumed += ramp.global_batch(consumed)
    return consumed, ramp.global_batch(consumed), f"checkpoint step {ck.meta['step']} + the batch ramp"


def token_losses(hf_dir: Path, samples: list) -> Tuple[np.ndarray, np.ndarray]:
    """Per-token cross-entropy of the exported model on the samples (tokens -> labels), and their loss masks."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32).eval()
    out, masks = [], []
    with torch.no_grad():
        for sample in samples:
            tokens = torch.as_tensor(np.asarray(sample["tokens"]), dtype=torch.long)[None]
            labels = torch.as_tensor(np.asarray(sample["labels"]), dtype=torch.long)[None]
            logits = model(input_ids=tokens).logits.float()
            out.append(torch.nn.functional.cross_entropy(logits[0], labels[0], reduction="none").numpy())
            masks.append(np.asarray(sample["loss_mask"], dtype=np.float32))
    return np.stack(out), np.stack(masks)


def explain_step(run_dir: str | Path, step: int, with_loss: bool = True) -> Path:
    from pretrain.data.datasets import StepBatches, build_datasets, split_sizes
    from pretrain.hf.convert import config_of
    run_dir = Path(run_dir)
    ck = checkpoint_before(run_dir, step)
    cfg = config_of(ck)
    if not cfg.objective.causal or cfg.data.mix_phases:
        raise ValueError(f"{ck.path}: objective.name={cfg.objective.name}"
                         f"{', data.mix_phases' if cfg.data.mix_phases else ''}: step attribution reads the causal "
                         "objective's single-blend samples (pretrain/data/attribution.py).")
    consumed, global_batch, found = step_start(run_dir, step, ck, cfg)
    train = build_datasets(cfg, *split_sizes(cfg))[0]
    source = StepBatches(train, cfg.batch.micro_batch_size, 0, 1)
    source.load_state(ck.meta["loop"].get("data") or {})
    positions = attribution.step_positions(consumed, global_batch)
    indices = [source.index(p) for p in positions]
    layout = [attribution.segments(train, i) for i in indices]
    losses = None
    if with_loss:
        per_token, masks = token_losses(exported(run_dir, ck), [train[i] for i in indices])
        losses = attribution.document_losses(layout, per_token, masks)
        batch_loss = float((per_token * masks).sum() / max(masks.sum(), 1))
    return attribution.write(run_dir, step, {
        "step": step, "consumed_samples": consumed, "global_batch": global_batch, "position_from": found,
        "checkpoint": str(ck.path), "checkpoint_step": ck.meta["step"],
        "batch_loss": batch_loss if with_loss else None,
        "ranked_by": "mean loss per document under the checkpoint" if with_loss else "batch order",
        "documents": attribution.explain(layout, positions, losses)})


def main(argv: Optional[list] = None) -> int:
    env = os.environ
    if not env.get("RUN") or not env.get("STEP", "").isdigit():
        print("usage: make explain-step RUN=<run_dir> STEP=N [TOP=10]", file=sys.stderr)
        return 2
    try:
        out = explain_step(env["RUN"], int(env["STEP"]))
    except (FileNotFoundError, ValueError) as err:
        print(err, file=sys.stderr)
        return 2
    print(attribution.table(out, int(env.get("TOP") or 10)))
    print(f">> {out}\n>> to leave documents out: list their ids (or file:line) in a file, set data.quarantine "
          "(make preprocess honours it) and resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())

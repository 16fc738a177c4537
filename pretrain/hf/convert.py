"""Checkpoints of either engine <-> Hugging Face directories.

    make export RUN=<run_dir> OUTPUT=<dir> [STEP=N]      # or CKPT=<checkpoint root | step dir>
    make import-hf INPUT=<hf dir> RECIPE=<recipe> OUTPUT=<checkpoint dir>

Export reads the checkpoint into one TP=1 fp32 model in this process, whatever layout wrote
it: megatron-core checkpoints through dist_checkpointing's resharding load (weights only; a
bf16/fp16 run's fp32 masters are taken, not the rounded copies), DeepSpeed ones through
zero_to_fp32 / the universal merge (pretrain/engines/deepspeed/consolidate.py). That read holds the
whole model in host memory once (plus the megatron engine's gradient buffers and optimizer wrappers); the
HF side then streams: one layer's HF tensors at a time into safetensors shards of SHARD_SIZE (default 5GB,
pretrain/hf/shards.py), the HF class built on the meta device for its names and shapes only. The
tokenizer the run trained with is saved beside the weights; export.json says where they
came from. Recipe features the target architecture cannot express are refused by name.

Import writes a megatron-engine checkpoint (step 0) from an HF directory of a family with an import
(GPT-2, Llama, Ministral, Mixtral, Qwen3, Qwen3-MoE, GptOss, DeepseekV3,
Megatron-BERT); start a run from it at any layout with
`checkpoint.load=<dir> checkpoint.load_weights_only=true`. Each family is an `Exporter` in pretrain/hf/families/
(pretrain/hf/exporters.py); this file holds none of them.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

from omegaconf import OmegaConf

from common.cli import command, overrides_from_env, required_recipe
from common.files import check_output_dir, update_dir

from ..checkpoint.meta import LoopState, checkpoint_meta
from ..checkpoint.store import Checkpoint, CheckpointStore, resolve
from ..config.compose import finalize, load_recipe
from ..config.schema import JobConfig
from ..data.tokenizer import run_tokenizer
from ..engines import cpu_compat_jit, deferred_imports
from ..model.hf_mapping import State
from ..peft.registry import PEFT_METHODS
from .exporters import Exporter, for_directory, for_recipe
from .mtp_export import drop_mtp, note_text
from .shards import DEFAULT_MAX_SHARD_SIZE, ShardWriter, tied_copies

REFUSED_FIELDS = ("quantization_config",)       # HF config fields no import reproduces: refused by name

cpu_compat_jit.install()      # before megatron-core is imported (engines/cpu_compat_jit.py)
deferred_imports.install()    # megatron-core's and DeepSpeed's wandb, mlflow: at first use


def mapping(cfg: JobConfig) -> Exporter:
    """The exporter of the recipe's model family (pretrain/hf/families/)."""
    return for_recipe(cfg)


def config_of(ck: Checkpoint) -> JobConfig:
    return finalize(OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.create(ck.meta["config"])),
                    owned=True)


def single_process(cfg: JobConfig) -> JobConfig:
    """`cfg` on one process and the megatron engine: TP=PP=CP=1, fp32, plain optimizer; the vocab padded
    as the run padded it."""
    d = OmegaConf.structured(cfg)
    tp = cfg.parallel.tensor_model_parallel_size
    d.model.make_vocab_size_divisible_by = cfg.model.make_vocab_size_divisible_by * tp
    d.parallel = OmegaConf.structured(type(cfg.parallel)())
    d.precision = OmegaConf.structured(type(cfg.precision)())
    d.deepspeed = OmegaConf.structured(type(cfg.deepspeed)())
    d.distill = OmegaConf.structured(type(cfg.distill)())      # the student alone: no teacher is built
    d.cluster.nodes, d.cluster.devices_per_node, d.cluster.launcher = 1, 1, "local"
    d.batch.global_batch_size, d.batch.ramp_start = d.batch.micro_batch_size, None
    d.stability.watchdog_minutes = 0
    d.derived = OmegaConf.structured(type(cfg.derived)())
    return finalize(d, owned=True)


def single_rank() -> None:
    """A 1-process gloo group and TP=PP=1 parallel state in this process (export/import are not launched)."""

    import torch.distributed as dist
    from megatron.core import parallel_state
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group("gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def megatron_engine(cfg: JobConfig):
    """The megatron engine of `cfg` in this one process: the student alone (single_process), adapters attached."""
    from ..engines.megatron.engine import MegatronEngine
    from ..objectives.task import build_task
    single_rank()
    job = single_process(cfg)
    return MegatronEngine(job, build_task(job).objective)


def model_state(ck: Checkpoint, cfg: JobConfig) -> State:
    """Whole fp32 tensors under GPTModel keys from a checkpoint of either engine and any layout; a PEFT run's
    added parameters folded into its base where they can be (pretrain/peft/)."""
    if ck.meta["engine_state"]["engine"] == "deepspeed":
        from ..engines.deepspeed.consolidate import consolidated_state_dict
        return consolidated_state_dict(ck.path)
    state, peft = megatron_state(ck, cfg)
    return peft.merge(state) if peft is not None else state


def megatron_state(ck: Checkpoint, cfg: JobConfig):
    """(whole state, the run's PEFT method or None) of a megatron-engine checkpoint. A PEFT run's engine loads
    its frozen base from peft.base_checkpoint, then the checkpoint's added parameters on top; the state holds both."""
    from ..engines.megatron.checkpointing import unwrap
    engine = megatron_engine(cfg)
    engine.load_checkpoint(ck.engine_dir, ck.meta, weights_only=True)
    state = {k: v for k, v in unwrap(engine.model[0]).state_dict().items() if not k.endswith("_extra_state")}
    return state, PEFT_METHODS.get(cfg.peft.method)(cfg) if cfg.peft.enabled else None


def hf_model_class(cfg: JobConfig):
    import transformers
    return getattr(transformers, architecture(cfg))


def architecture(cfg: JobConfig) -> str:
    """The transformers class a recipe exports to."""
    return for_recipe(cfg).architecture(cfg)


def write_model(cfg: JobConfig, state: State, tok, directory: Path, max_shard_size: int | str) -> None:
    """save_pretrained's files of `state` (config, generation config, safetensors shards: pretrain/hf/shards.py), the
    weights one layer's HF tensors at a time. The HF class is built on the meta device (names and shapes, no
    memory); every tensor it holds must be written once at its shape, but those tied to another (shards.tied_copies)."""
    import torch
    from transformers.core_model_loading import revert_weight_conversion
    exporter = mapping(cfg)
    with torch.device("meta"):
        model = hf_model_class(cfg)(exporter.hf_config(cfg, tok.vocab_size, bos=tok.eod, eos=tok.eod))
    expected, copies = {k: tuple(v.shape) for k, v in model.state_dict().items()}, tied_copies(model)
    groups = exporter.hf_groups(state, cfg, tok.vocab_size) if exporter.hf_groups else \
        iter([exporter.to_hf(state, cfg, tok.vocab_size)])
    writer, written = ShardWriter(directory, max_shard_size), {}
    for group in groups:
        written.update((k, tuple(v.shape)) for k, v in group.items())
        group = {k: v for k, v in group.items() if k not in copies}
        writer.add_all(revert_weight_conversion(model, group).items())     # on-disk names, as save_pretrained
    missing = [k for k in expected if k not in written and k not in copies]
    unexpected = [k for k in written if k not in expected]
    shapes = [f"{k} {written[k]} (HF {expected[k]})" for k in written if k in expected and written[k] != expected[k]]
    if missing or unexpected or shapes:
        raise RuntimeError(f"export mapping incomplete: missing {missing[:5]}, unexpected {unexpected[:5]}, "
                           f"shapes {shapes[:5]}")
    writer.close(model.num_parameters())
    model.config.dtype = str(model.dtype).split(".")[1]          # what save_pretrained records
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(str(directory))
    if model.can_generate():
        model.generation_config.save_pretrained(str(directory))


def export(ckpt: str | Path, output: str | Path, tokenizer_path: str | None = None,
           max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> Path:
    """`ckpt` -> an HF directory at `output`, its weights in safetensors shards of at most `max_shard_size`."""
    check_output_dir(output, ours="export.json")          # before the conversion: OUTPUT=$HOME stops here
    ck = resolve(ckpt)
    cfg = config_of(ck)
    if tokenizer_path:
        cfg.data.tokenizer.path = tokenizer_path
    problems = mapping(cfg).unsupported(cfg)
    if problems:
        raise ValueError(f"{ck.path}: cannot export to {architecture(cfg)}: " + "; ".join(problems))
    tok = run_tokenizer(cfg, "an export")
    state, peft = megatron_state(ck, cfg) if ck.meta["engine_state"]["engine"] == "megatron" else (
        model_state(ck, cfg), None)
    whole, mtp_note = drop_mtp(state)          # the HF architectures have no MTP module: named, counted, dropped
    if mtp_note:
        print(note_text(mtp_note))
    output = Path(output)
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_model(cfg, peft.merge(whole) if peft is not None else whole, tok, tmp, max_shard_size)
    tok.save(tmp, max_length=cfg.derived.max_position_embeddings)
    beside = [p.name for p in peft.side_files(whole, tmp)] if peft is not None else []
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()) + ["export.json"]
    (tmp / "export.json").write_text(json.dumps({
        "checkpoint": str(ck.path), "step": ck.meta["step"], "recipe": ck.meta["recipe"],
        "engine": ck.meta["engine_state"]["engine"], "layout": ck.meta["engine_state"]["layout"],
        "vocab_size": tok.vocab_size, "versions": ck.meta.get("versions", {}),
        "peft": {"method": cfg.peft.method, "base": ck.meta["engine_state"].get("peft_base"), "beside": beside}
        if peft is not None else None, "mtp": mtp_note, "files": files}, indent=1))
    update_dir(tmp, output, ours="export.json")      # the directory's other files stay; the last export's go
    return output


def import_hf(hf_dir: str | Path, cfg: JobConfig, output: str | Path) -> Path:
    """An HF directory of the recipe's family -> a megatron-engine checkpoint (step 0) of recipe `cfg`."""

    import transformers
    from transformers import AutoConfig

    from ..engines.megatron.checkpointing import unwrap
    config = AutoConfig.from_pretrained(str(hf_dir))
    try:
        exporter = for_directory(config, cfg)
    except ValueError as err:
        raise ValueError(f"{hf_dir}: {err}") from None
    refused = [f for f in REFUSED_FIELDS if getattr(config, f, None)]
    mismatch = "; ".join(filter(None, [f"{f} is set (no import reproduces it: load the unquantised weights)"
                                       for f in refused] + [exporter.mismatch(config, cfg)]))
    if mismatch:
        raise ValueError(f"{hf_dir} does not fit recipe {cfg.name}: {mismatch}")
    # the class the directory names, one of the family's (for_directory): a causal LM, or Megatron-BERT with its heads
    hf = getattr(transformers, config.architectures[0]).from_pretrained(str(hf_dir), dtype="float32")
    engine = megatron_engine(cfg)
    model = unwrap(engine.model[0])
    try:
        ours = exporter.from_hf(hf.state_dict(), engine.cfg)
    except ValueError as err:
        raise ValueError(f"{hf_dir} does not fit recipe {cfg.name}: {err}") from None
    expected = {k for k in model.state_dict() if not k.endswith("_extra_state")}
    if set(ours) != expected:
        raise ValueError(f"{hf_dir} does not fit recipe {cfg.name}: keys differ "
                         f"(missing {sorted(expected - set(ours))[:4]}, extra {sorted(set(ours) - expected)[:4]})")
    for key, value in ours.items():
        target = model.state_dict()[key]
        if target.shape != value.shape:
            raise ValueError(f"{hf_dir}: {key} has shape {tuple(value.shape)}, recipe {cfg.name} needs "
                             f"{tuple(target.shape)}. Fix: a recipe with the checkpoint's sizes.")
    model.load_state_dict(ours, strict=False)
    engine.optimizer.reload_model_params()
    store = CheckpointStore(output, keep_last=0)
    directory = store.begin(0)
    engine.save_checkpoint(directory)
    meta = checkpoint_meta(engine.cfg, LoopState(), engine.checkpoint_meta(), imported_from=str(hf_dir))
    return store.commit(0, meta)


@command(also=(FileNotFoundError, FileExistsError, ValueError))
def main() -> int:
    action = sys.argv[1] if len(sys.argv) > 1 else ""
    env = os.environ
    if action == "export":
        source = env.get("CKPT") or (str(Path(env["RUN"]) / "checkpoints") if env.get("RUN") else "")
        if env.get("STEP"):
            source = str(Path(source) / f"step_{int(env['STEP']):08d}")
        if not source or not env.get("OUTPUT"):
            print("usage: make export RUN=<run_dir> | CKPT=<checkpoint> OUTPUT=<dir> [STEP=N] [TOKENIZER=...] "
                  "[SHARD_SIZE=5GB]",
                  file=sys.stderr)
            return 2
        out = export(source, env["OUTPUT"], env.get("TOKENIZER") or None,
                     env.get("SHARD_SIZE") or DEFAULT_MAX_SHARD_SIZE)
        loader = "AutoModelForPreTraining" if "Bert" in json.loads((out / "config.json").read_text())[
            "architectures"][0] else "AutoModelForCausalLM"
        print(f">> exported {source} -> {out} ({loader}.from_pretrained('{out}'))")
        return 0
    if action == "import":
        if not env.get("INPUT") or not env.get("OUTPUT"):
            print("usage: make import-hf INPUT=<hf dir> RECIPE=<recipe> OUTPUT=<checkpoint dir>", file=sys.stderr)
            return 2
        cfg = load_recipe(required_recipe("import-hf"), overrides_from_env())
        out = import_hf(env["INPUT"], cfg, env["OUTPUT"])
        print(f">> imported {env['INPUT']} -> {out}; start from it with checkpoint.load={env['OUTPUT']} "
              "checkpoint.load_weights_only=true")
        return 0
    print("usage: python -m pretrain.hf.convert export|import", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

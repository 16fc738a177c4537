"""Knowledge distillation (pretrain/distill/): the vocabulary-parallel KL against ModelOpt's LogitsKLLoss and a
plain full-vocabulary torch computation, at TP=1 in this process and at TP=2 on 2 gloo ranks; the Distiller's
loss on real gpt-tiny models; the pruned student; the teacher's config and checkpoint checks."""
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.transformer import TransformerConfig

from common.config import ConfigError
from pretrain.checkpoint.meta import LoopState, checkpoint_meta
from pretrain.checkpoint.store import FORMAT
from pretrain.config.compose import teacher_of
from pretrain.distill.loss import Distiller, kd_loss
from pretrain.distill.teacher import build_teacher, checkpoint_shape_problems, prune_into, teacher_config
from tests import megatron_harness as mh
from tests.conftest import free_port

VOCAB = 4000        # padded to 4096 at TP=1 and TP=2: 96 padding rows, all on the last TP rank
T = 2.0


@pytest.fixture(scope="module")
def tp1():
    """This process as a 1-rank gloo group at TP=1, megatron-core's CPU adaptations on (the harness's)."""
    mh.init_ranks(0, 1, free_port(), tp=1)


def _plain_kl(student: torch.Tensor, teacher: torch.Tensor, vocab: int, temperature: float) -> torch.Tensor:
    """Full-vocabulary T^2 KL(teacher || student) per token, padded rows cut off."""
    s = F.log_softmax(student[..., :vocab].float() / temperature, dim=-1)
    t = F.log_softmax(teacher[..., :vocab].float() / temperature, dim=-1)
    return (t.exp() * (t - s)).sum(-1) * temperature ** 2


def _logits(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


def _modelopt_kl(student: torch.Tensor, teacher: torch.Tensor, tp: int) -> torch.Tensor:
    """ModelOpt's LogitsKLLoss (inputs [s, b, v/tp]) x T^2, its per-rank partial sums added over TP."""
    from modelopt.torch.distill.plugins.megatron import LogitsKLLoss
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=tp,
                               tensor_model_parallel_size=tp)
    loss, tp_reduce, _ = LogitsKLLoss(config, temperature=T)(student.transpose(0, 1), teacher.transpose(0, 1))
    assert tp_reduce
    if tp > 1:
        dist.all_reduce(loss, group=ps.get_tensor_model_parallel_group())
    return loss * T ** 2


def test_kl_matches_modelopt_and_plain_torch_with_padding_rows_left_out(tp1):
    student = _logits((2, 5, 4096), 0).requires_grad_(True)
    teacher = _logits((2, 5, 4096), 1)
    unpadded = kd_loss(student, teacher, 4096, T)
    assert unpadded.shape == (2, 5) and unpadded.min() > 0.1
    assert torch.allclose(unpadded, _modelopt_kl(student.detach(), teacher, 1), rtol=1e-5, atol=1e-5)
    assert torch.allclose(unpadded, _plain_kl(student, teacher, 4096, T), rtol=1e-5, atol=1e-6)

    padded = kd_loss(student, teacher, VOCAB, T)
    reference = student.detach().clone().requires_grad_(True)
    expected = _plain_kl(reference, teacher, VOCAB, T)
    assert torch.allclose(padded, expected, rtol=1e-5, atol=1e-6)
    assert (padded - unpadded).abs().max() > 1e-3          # the 96 padding rows would have counted
    weights = torch.rand(2, 5, generator=torch.Generator().manual_seed(2))
    (padded * weights).sum().backward()
    (expected * weights).sum().backward()
    assert torch.allclose(student.grad, reference.grad, atol=1e-6)
    assert student.grad[..., VOCAB:].abs().max() == 0      # no gradient into padding rows


def _tiny(overrides=()):
    return mh.tiny_config([f"model.vocab_size={VOCAB}", "model.seq_length=32", *overrides])


def test_identical_teacher_gives_zero_kd_and_the_distiller_loss_is_the_rest(tp1):
    cfg = _tiny(["distill.alpha=0.7", "distill.temperature=2.0", "distill.hidden_loss_coeff=0.5"])
    student, _ = mh.build_model(cfg)
    teacher = mh.build_model(cfg)[0].requires_grad_(False).eval()        # the same layout-invariant weights
    batch = mh.batch(cfg)
    batch["loss_mask"][0, :10] = 0
    distiller = Distiller(cfg, teacher, student)
    distiller.teacher_forward({**batch, "attention_mask": None})
    teacher_logits = distiller._teacher_logits
    logits = student(batch["tokens"], batch["position_ids"], None)
    loss, reported = distiller.loss(batch["loss_mask"], batch["labels"], logits)
    distiller.remove_hooks()
    assert reported["kd loss"].abs() < 1e-7 and reported["hidden loss"] == 0
    assert reported["lm loss"] == reported["teacher loss"] and 7 < reported["lm loss"] < 10   # ~ln 4000
    assert torch.allclose(loss, 0.3 * reported["lm loss"], rtol=1e-6)
    kd = kd_loss(logits, teacher_logits, VOCAB, 2.0)
    assert kd.abs().max() < 1e-7
    kd_grad, = torch.autograd.grad(kd.sum(), logits, retain_graph=True)
    loss_grad, = torch.autograd.grad(loss, logits, retain_graph=True)
    assert kd_grad.abs().max() < 1e-8
    mask = batch["loss_mask"]
    plain = torch.autograd.grad(0.3 * (_plain_ce(logits, batch) * mask).sum() / mask.sum(), logits)[0]
    assert torch.allclose(loss_grad, plain, atol=1e-7)


def _plain_ce(logits, batch):
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="none").view(2, -1)


def test_pruned_student_takes_every_other_teacher_layer(tp1):
    teacher, _ = mh.build_model(_tiny(["seed=7"]))
    student, _ = mh.build_model(_tiny(["model.num_layers=2"]))
    weights = [key for key in student.state_dict() if not key.endswith("_extra_state")]
    embedding = "embedding.word_embeddings.weight"
    assert not torch.equal(student.state_dict()[embedding], teacher.state_dict()[embedding])     # seeds differ
    assert prune_into(student, teacher, 2) == len(weights) == 4 + 2 * 12
    theirs = teacher.state_dict()
    for key in weights:
        source = key.replace("layers.1.", "layers.2.") if key.startswith("decoder.layers.1.") else key
        assert torch.equal(student.state_dict()[key], theirs[source]), key


def test_a_teacher_of_another_vocabulary_is_refused_at_compose_time():
    with pytest.raises(ConfigError, match=r"vocabulary \(model.vocab_size=8192"):
        mh.tiny_config(["distill.teacher_recipe=gpt-tiny", "distill.teacher_checkpoint=/nowhere",
                        "distill.teacher_overrides=['model.vocab_size=8192']"])


def test_the_teacher_recipe_is_composed_once_per_process(monkeypatch):
    """Validation, the run's task (objective, FLOPs per token) and the planner read one composition of
    distill.teacher_recipe: compose.teacher_of memoises it (it was composed 3 times per process before)."""
    from pretrain.config import compose
    from pretrain.objectives.task import build_task
    from pretrain.plan.estimate import make_plan
    overrides = ["distill.teacher_checkpoint=/nowhere", "distill.teacher_overrides=['model.num_layers=6']"]
    real, composed = compose.load_recipe, []

    def counting(name, extra=()):
        composed.append(name) if name == "gpt-tiny" else None
        return real(name, extra)
    monkeypatch.setattr(compose, "load_recipe", counting)
    compose._composed_teacher.cache_clear()
    cfg = compose.load_recipe("gpt-tiny-distill", overrides)
    task = build_task(cfg)
    plan = make_plan(cfg)
    assert composed == ["gpt-tiny"] and task.teacher is compose.teacher_of(cfg)
    assert task.teacher.model.num_layers == 6 and task.flops_per_token == plan["flops_per_token"]


def test_teacher_takes_the_students_layout_and_its_checkpoint_must_match(tp1, tmp_path):
    cfg = _tiny(["model.num_layers=2", "parallel=tp2", "cluster.devices_per_node=2", "precision=bf16",
                 f"run_dir={tmp_path / 'run'}", "distill.teacher_recipe=gpt-tiny",
                 f"distill.teacher_checkpoint={tmp_path}",
                 f"distill.teacher_overrides=['data=mock','model.vocab_size={VOCAB}','model.num_layers=4']"])
    teacher = teacher_config(cfg, mh.tiny_config([f"model.vocab_size={VOCAB}"]))
    assert teacher.model.num_layers == 4 and teacher.parallel.tensor_model_parallel_size == 2
    assert teacher.precision.dtype == "bf16" and teacher.derived.padded_vocab_size == cfg.derived.padded_vocab_size
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by"):
        teacher_config(cfg, mh.tiny_config([f"model.vocab_size={VOCAB}", "model.make_vocab_size_divisible_by=384"]))

    other = mh.tiny_config([f"model.vocab_size={VOCAB}", "model.hidden_size=96"])
    meta = checkpoint_meta(other, LoopState(), {"precision": "fp32"})
    assert checkpoint_shape_problems(teacher, meta) == ["model.hidden_size: checkpoint 96, recipe 192",
                                                        "derived.kv_channels: checkpoint 16, recipe 32",
                                                        "derived.ffn_hidden_size: checkpoint 384, recipe 768"]
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "format": FORMAT, "files": {}}))
    with pytest.raises(ConfigError, match="holds another model.*model.hidden_size: checkpoint 96, recipe 192"):
        build_teacher(cfg, teacher_of(cfg), on_cpu=True)


@pytest.mark.slow           # dist_checkpointing's writer starts a helper process (its results queue) at the first save
@pytest.mark.beside_training
def test_build_teacher_loads_the_checkpoint_frozen(tp1, tmp_path):
    from megatron.core import dist_checkpointing
    saved_cfg = _tiny(["seed=11"])
    saved, _ = mh.build_model(saved_cfg)
    (tmp_path / "model_optim_rng").mkdir()
    dist_checkpointing.save({"model": saved.sharded_state_dict()}, str(tmp_path / "model_optim_rng"))
    meta = checkpoint_meta(saved_cfg, LoopState(), {"precision": "fp32", "layout": {"distributed_optimizer": False}})
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "format": FORMAT, "files": {}}))
    cfg = _tiny(["model.num_layers=2", f"run_dir={tmp_path / 'run'}", "distill.teacher_recipe=gpt-tiny",
                 f"distill.teacher_checkpoint={tmp_path}",
                 f"distill.teacher_overrides=['data=mock','model.vocab_size={VOCAB}','model.seq_length=32']"])
    teacher = build_teacher(cfg, teacher_of(cfg), on_cpu=True)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    for key, value in saved.state_dict().items():
        if not key.endswith("_extra_state"):
            assert torch.equal(teacher.state_dict()[key], value), key


# ---- TP=2 on 2 gloo ranks ---------------------------------------------------------------------------------

def _distill_step(cfg, teacher_cfg) -> dict:
    """One micro-batch of the Distiller on gpt-tiny student and teacher models at the current TP: the reported
    means, the per-token KD loss, and the gradients of the loss at the logits and at a row-parallel weight."""
    student, _ = mh.build_model(cfg)
    teacher = mh.build_model(teacher_cfg)[0].requires_grad_(False).eval()
    batch = mh.batch(cfg)
    batch["loss_mask"][1, 20:] = 0
    distiller = Distiller(cfg, teacher, student)
    distiller.teacher_forward({**batch, "attention_mask": None})
    teacher_logits = distiller._teacher_logits
    logits = student(batch["tokens"], batch["position_ids"], None)
    kd = kd_loss(logits, teacher_logits, VOCAB, T)
    loss, reported = distiller.loss(batch["loss_mask"], batch["labels"], logits)
    fc2 = student.decoder.layers[0].mlp.linear_fc2.weight
    logits_grad, fc2_grad = torch.autograd.grad(loss, [logits, fc2])
    return {"kd": kd.detach(), "reported": {k: v.item() for k, v in reported.items()}, "grad": logits_grad,
            "fc2_grad": fc2_grad, "logits": logits.detach(), "teacher_logits": teacher_logits}


def _options(tp: int) -> list:
    layout = ["parallel=tp2-sp", "cluster.devices_per_node=2"] if tp == 2 else []
    return [*layout, "distill.hidden_loss_coeff=1.0", "distill.alpha=0.5", f"distill.temperature={T}"]


def _tp2_rank(rank: int, port: int, out: dict) -> None:
    mh.init_ranks(rank, 2, port, tp=2)
    step = _distill_step(_tiny(_options(2)), _tiny([*_options(2), "seed=7", "model.num_layers=3"]))
    out[rank] = {k: v for k, v in step.items() if k not in ("logits", "teacher_logits")}


@pytest.mark.slow           # 2 spawned processes importing megatron-core (ModelOpt's parity: at TP=1, in-process;
@pytest.mark.beside_training   # importing it in the ranks would cost each ~4 s more)
def test_tp2_kl_and_distiller_equal_tp1(tp1):
    out = mh.spawn(_tp2_rank)
    step = _distill_step(_tiny(_options(1)), _tiny([*_options(1), "seed=7", "model.num_layers=3"]))
    reported = step["reported"]
    assert reported["kd loss"] > 0.01 and reported["hidden loss"] > 0.1
    for rank in (0, 1):
        assert torch.allclose(out[rank]["kd"], step["kd"], atol=1e-5)
        for name, value in reported.items():
            assert abs(out[rank]["reported"][name] - value) < 1e-5, name
    assert torch.allclose(torch.cat([out[0]["grad"], out[1]["grad"]], dim=-1), step["grad"], atol=1e-5)
    fc2_grad = torch.cat([out[0]["fc2_grad"], out[1]["fc2_grad"]], dim=1)         # row-parallel: input dim split
    assert torch.allclose(fc2_grad, step["fc2_grad"], atol=1e-5)

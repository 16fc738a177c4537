"""The loss under context parallelism (pretrain/objectives/losses.py: context_parallel_loss), on 2 gloo processes.

CP itself needs Transformer Engine (GPUs), so the engine's CP path is not run here; what can run is the loss
formula: two ranks each holding the chunks get_batch_on_this_cp_rank gives them must report the whole
sequence's masked mean, and their gradients, averaged as megatron-core's DDP averages over DP x CP, must be the
gradient of that mean (token_mean_loss on the whole sequence in one process)."""
import pytest
import torch
import torch.distributed as dist

from pretrain.objectives.losses import context_parallel_loss, token_mean_loss
from tests.megatron_harness import spawn

SEQ = 16


def _rank(rank: int, port: int, out: dict) -> None:
    if not dist.is_initialized():           # the session's ranks keep their group between tests
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core.utils import get_batch_on_this_cp_rank
    gen = torch.Generator().manual_seed(0)
    losses = torch.rand(2, SEQ, generator=gen)                        # per-token losses of 2 sequences
    mask = (torch.rand(2, SEQ, generator=gen) > 0.3).float()          # uneven across the chunks
    ids = torch.arange(SEQ).expand(2, SEQ)                            # which positions this rank holds
    mine = get_batch_on_this_cp_rank({"loss": losses, "mask": mask, "ids": ids}, cp_group=dist.group.WORLD)
    output = mine["loss"].clone().requires_grad_(True)
    loss, reported = context_parallel_loss(dist.group.WORLD, 0.0, mine["mask"], None, output)
    loss.backward()
    grad = torch.zeros(2, SEQ)
    grad.scatter_(1, mine["ids"], output.grad)
    dist.all_reduce(grad)
    grad /= 2                                                         # DDP's average over DP x CP
    out[rank] = (reported["lm loss"].item(), grad, sorted(mine["ids"][0].tolist()))


@pytest.mark.slow           # 2 spawned processes importing megatron-core: ~8 s
@pytest.mark.beside_training
def test_context_parallel_loss_is_the_whole_sequences_mean_and_its_gradient():
    out = spawn(_rank)
    gen = torch.Generator().manual_seed(0)
    losses = torch.rand(2, SEQ, generator=gen)
    mask = (torch.rand(2, SEQ, generator=gen) > 0.3).float()
    whole = losses.clone().requires_grad_(True)
    expected, _ = token_mean_loss(0.0, mask, None, whole)
    expected.backward()
    assert out[0][2] == [0, 1, 2, 3, 12, 13, 14, 15] and out[1][2] == [4, 5, 6, 7, 8, 9, 10, 11]   # balanced chunks
    for rank in (0, 1):
        assert abs(out[rank][0] - expected.item()) < 1e-6
        assert torch.allclose(out[rank][1], whole.grad, atol=1e-7)

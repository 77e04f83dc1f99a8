"""DDP and FSDP2 learner workers (2 gloo ranks, no Ray) against the single-process Learner.

Two spawned processes each run ``LearnerWorker`` (the Ray actor's class, used here as a plain object)
on their shard of the same mini-batches, for every (strategy, LoRA) case. The single-process
``Learner`` with the trainer's token loss runs the same mini-batches whole in this process. Checked:

- the per-update loss, grad norm and token statistics and the exported weights (LoRA merged) match;
- a rank whose shard is empty (one micro-batch, two ranks) runs a zero-weight pass and the update
  still matches;
- a non-finite loss on one rank only makes both ranks skip the step, and the next one applies;
- a checkpoint written by rank 0 and loaded by every rank restores the optimizer exactly (the update
  after loading repeats the update after saving);
- ``logprobs`` on shards (one of them empty) add up to the single-process log-probs.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_learner import _trajectories

from agent_r1.algos import aggregation_weights
from agent_r1.distributed.learner_group import LearnerWorker, shard_micro_batches
from agent_r1.distributed.parts import TrainerParts
from agent_r1.train.batching import build_sequences, make_micro_batches, step_rows
from agent_r1.train.config import config_from_dict
from agent_r1.train.learner import Learner, MiniBatch, load_policy
from agent_r1.train.trainer import export_weights

pytestmark = pytest.mark.ray  # the learner group's worker class (no cluster is started)

WORLD = 2
CASES = {
    "ddp": ("ddp", 0),
    "fsdp2": ("fsdp2", 0),
    "ddp-lora": ("ddp", 4),
    "fsdp2-lora": ("fsdp2", 4),
}
METRICS = ("loss/policy", "grad_norm", "lr", "update/skipped", "entropy/mean", "clip_fraction")


def _config(checkpoint: str, strategy: str, lora_rank: int):
    return config_from_dict(
        {
            "model": {"path": checkpoint, "lora": {"rank": lora_rank, "alpha": 8}},
            "trainer": {"lr": 1e-2, "steps": 4, "torch_threads": 1},
            "algorithm": {"loss_aggregation": "seq-mean-token-mean"},
            "distributed": {"backend": "ray", "strategy": strategy, "num_learner_workers": WORLD},
        }
    )


def _mini_batch(seed: int, budget: int) -> MiniBatch:
    """The trainer's per-token fields for a few random trajectories, cut into micro-batches."""
    trajectories = _trajectories(seed, count=4)
    rows = step_rows(trajectories)
    n = rows.num_tokens
    seq_ids = torch.tensor([r for r, s in enumerate(rows.steps) for _ in s.response_ids])
    mask = torch.ones(n)
    tokens = {
        "mask": mask,
        "seq_ids": seq_ids,
        "sampler_logprobs": torch.full((n,), -5.0),
        "old_logprobs": torch.full((n,), -5.6),  # some ratios leave the clip range
        "advantages": torch.linspace(-1, 1, n),
    }
    weights = aggregation_weights(mask, "seq-mean-token-mean", seq_ids=seq_ids)
    return MiniBatch(make_micro_batches(build_sequences(trajectories), rows, budget), weights, tokens)


def _shard(mini: MiniBatch, rank: int) -> MiniBatch:
    return MiniBatch(shard_micro_batches(mini.micro_batches, WORLD)[rank], mini.weights, mini.tokens)


def _poisoned_on_rank_1(token_loss, rank: int):
    def loss(logprobs_K, entropy_K, tokens):
        loss_K, stats = token_loss(logprobs_K, entropy_K, tokens)
        return (loss_K * float("nan") if rank == 1 else loss_K), stats

    return loss


def _script(update, export, logprobs, save=None, load=None) -> dict:
    """The sequence both sides run; ``update(mini, token_loss | None)`` with None = the trainer's."""
    out: dict = {"metrics": []}
    out["metrics"].append(update(_mini_batch(0, 24), None))  # several micro-batches per rank
    out["metrics"].append(update(_mini_batch(1, 10_000), None))  # one micro-batch: rank 1 pads
    out["metrics"].append(update(_mini_batch(2, 24), "poison"))  # non-finite on rank 1: all skip
    if save is not None:
        save()
    out["metrics"].append(update(_mini_batch(3, 24), None))
    out["weights"] = export()
    if load is not None:
        load()
        out["metrics"].append(update(_mini_batch(3, 24), None))  # repeats the update after the save
        out["reloaded"] = export()
    out["logprobs"] = logprobs(_mini_batch(4, 10_000))
    return out


def _rank_main(rank: int, port: int, checkpoint: str, out_dir: str) -> None:
    results = {}
    for index, (case, (strategy, lora_rank)) in enumerate(CASES.items()):
        worker = LearnerWorker(_config(checkpoint, strategy, lora_rank), rank, WORLD)
        worker.setup("127.0.0.1", port + index)
        checkpoints = str(Path(out_dir) / case)

        def update(mini, loss, worker=worker):
            if loss == "poison":
                token_loss = _poisoned_on_rank_1(worker.parts.token_loss, rank)
                return worker.learner.update(_shard(mini, rank), token_loss, with_entropy=True)
            return worker.update(_shard(mini, rank), True)

        def logprobs(mini, worker=worker):
            part = worker.logprobs(_shard(mini, rank).micro_batches, mini.weights.numel(), False)
            dist.all_reduce(part)  # shards score disjoint tokens
            return part

        def save(worker=worker, checkpoints=checkpoints):
            worker.save_checkpoint(checkpoints, 3, {"note": "test"})

        def load(worker=worker, checkpoints=checkpoints):
            assert worker.load_checkpoint(str(Path(checkpoints) / "step_000003"))["note"] == "test"

        def export(worker=worker):
            weights = worker.export_weights()
            return None if weights is None else dict(weights)

        results[case] = _script(update, export, logprobs, save, load)
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def group_results(tiny_checkpoint, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("strategy")
    port = _free_port()  # the cases use port .. port + 3
    mp.start_processes(
        _rank_main, args=(port, str(tiny_checkpoint), str(out_dir)), nprocs=WORLD, start_method="spawn"
    )
    return torch.load(out_dir / "results.pt", weights_only=False)


def _single(tiny_checkpoint, lora_rank: int) -> dict:
    config = _config(str(tiny_checkpoint), "ddp", lora_rank)
    torch.manual_seed(config.trainer.seed)
    model = load_policy(config.model)
    trainer = config.trainer
    learner = Learner(model, trainer, temperature=1.0, total_optimizer_steps=trainer.steps)
    token_loss = TrainerParts(config).token_loss

    def update(mini, loss):
        if loss == "poison":  # rank 1's half of the group's poisoned update, whole here
            return learner.update(mini, _poisoned_on_rank_1(token_loss, 1), with_entropy=True)
        return learner.update(mini, token_loss, with_entropy=True)

    def logprobs(mini):
        return learner.logprobs(mini.micro_batches, mini.weights.numel())

    return _script(update, lambda: dict(export_weights(model)), logprobs)


@pytest.mark.parametrize("case", list(CASES))
def test_data_parallel_updates_match_the_single_process_learner(group_results, tiny_checkpoint, case):
    strategy, lora_rank = CASES[case]
    ours, theirs = group_results[case], _single(tiny_checkpoint, lora_rank)
    for k, (mine, single) in enumerate(zip(ours["metrics"][:4], theirs["metrics"], strict=True)):
        if not single["update/skipped"]:  # a skipped update's statistics are partial
            assert set(mine) == set(single), k
        for key in METRICS:
            if key in single:
                assert mine[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6, nan_ok=True), (k, key)
    assert [m["update/skipped"] for m in ours["metrics"]] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert 0 < ours["metrics"][0]["clip_fraction"] < 1  # the comparison covers clipped tokens
    assert set(ours["weights"]) == set(theirs["weights"])
    moved = 0
    first = dict(export_weights(load_policy(_config(str(tiny_checkpoint), strategy, 0).model)))
    for name, tensor in theirs["weights"].items():
        # Adam moves each weight by ~lr * g / |g|: summation-order noise in a near-zero gradient
        # entry shows at ~1e-5 after three steps of lr 1e-2 (the weights moved by ~1e-2).
        torch.testing.assert_close(ours["weights"][name], tensor, atol=1e-4, rtol=1e-4, msg=name)
        moved += not torch.equal(first[name], tensor)
    assert moved > 0  # training changed the exported weights (LoRA deltas merged)
    torch.testing.assert_close(ours["logprobs"], theirs["logprobs"], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_written_by_rank_0_restores_every_rank_exactly(group_results, case):
    ours = group_results[case]
    after_save, after_load = ours["metrics"][3], ours["metrics"][4]
    for key in METRICS:
        if key in after_save:
            assert after_load[key] == pytest.approx(after_save[key], rel=1e-6, abs=1e-8), key
    for name, tensor in ours["weights"].items():
        torch.testing.assert_close(ours["reloaded"][name], tensor, atol=1e-6, rtol=1e-6, msg=name)

"""DDP and FSDP2 learner workers (2 gloo ranks, no Ray) against the single-process Learner.

Two spawned processes each run ``LearnerWorker`` (the Ray actor's class, used here as a plain object)
on their shard of the same mini-batches, for every (strategy, LoRA) case. The single-process
``Learner`` with the trainer's token loss runs the same mini-batches whole in this process. Checked:

- the per-update loss, grad norm and token statistics and every applied step's gradients match, and
  the exported weights (LoRA merged) lie within what AdamW makes of the gradients' rounding
  differences (``update_parity``);
- a rank whose shard is empty (one micro-batch, two ranks) runs a zero-weight pass and the update
  still matches;
- a non-finite loss on one rank only makes both ranks skip the step, and the next one applies;
- a checkpoint written by rank 0 and loaded by every rank restores the optimizer exactly (the update
  after loading repeats the update after saving), also one saved before the optimizer's first step
  (the critic's, in the policy's checkpoint);
- ``logprobs`` on shards (one of them empty) add up to the single-process log-probs (and, with LoRA,
  the adapter-disabled reference log-probs);
- the critic each worker holds for ``gae_token`` trains like the single-process critic, and the
  checkpoint restores it exactly.
"""

from __future__ import annotations

import functools
import random
import socket
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from batching_support import random_trajectories
from update_parity import (
    adam_difference_bound,
    assert_gradients_match,
    lora_merged_bound,
    record_optimizer_steps,
)

from agent_r1.algos import TokenFields, aggregation_weights, clipped_value_loss
from agent_r1.distributed.learner_group import LearnerWorker, shard_micro_batches
from agent_r1.train.backends import export_weights
from agent_r1.train.batch import batch_of
from agent_r1.train.builders import policy_objective
from agent_r1.train.config import config_from_dict
from agent_r1.train.critic import load_critic, micro_batch_values
from agent_r1.train.learner import Learner, MiniBatch, load_policy
from agent_r1.types import Step, Trajectory

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
            "trainer": {"lr": 1e-2, "critic_lr": 1e-2, "steps": 4, "torch_threads": 1},
            "algorithm": {"loss_aggregation": "seq-mean-token-mean", "advantage": "gae_token"},
            "distributed": {"backend": "ray", "strategy": strategy, "num_learner_workers": WORLD},
        }
    )


def _group(seed: int, size: int = 3) -> list[Trajectory]:
    """``size`` one-step trajectories answering the same prompt (a GRPO group)."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 250) for _ in range(6)]
    responses = [[rng.randrange(3, 250) for _ in range(rng.randint(2, 5))] for _ in range(size)]
    return [Trajectory("g", (Step(prompt, r, logprobs=[-5.0] * len(r)),)) for r in responses]


def _mini_batch(seed: int, budget: int) -> MiniBatch:
    """The trainer's per-token fields for a few random trajectories and a group sharing its prompt
    (laid out as a prefix tree), cut into micro-batches."""
    trajectories = random_trajectories(seed, count=4) + _group(seed)
    batch = batch_of(trajectories, micro_batch_tokens=budget, pair_cost=1e-3)
    rows = batch.rows
    n = rows.num_tokens
    seq_ids = torch.tensor([r for r, s in enumerate(rows.steps) for _ in s.response_ids])
    mask = torch.ones(n)
    tokens = TokenFields(
        mask=mask,
        step_ids=seq_ids,
        traj_ids=torch.zeros(n, dtype=torch.long),
        sampler_logprobs=torch.full((n,), -5.0),
        old_logprobs=torch.full((n,), -5.6),  # some ratios leave the clip range
        advantages=torch.linspace(-1, 1, n),
        old_values=torch.zeros(n),
        returns=torch.linspace(1, -0.5, n),
        value_mask=mask,
    )
    weights = aggregation_weights(mask, "seq-mean-token-mean", seq_ids=seq_ids)
    micro_batches = batch.micro_batches[0]
    assert any(mb.attention_BTT is not None for mb in micro_batches)
    return MiniBatch(micro_batches, weights, tokens)


def _shard(mini: MiniBatch, rank: int) -> MiniBatch:
    return MiniBatch(shard_micro_batches(mini.micro_batches, WORLD)[rank], mini.weights, mini.tokens)


def _poisoned_on_rank_1(token_loss, rank: int):
    def loss(logprobs_K, entropy_K, tokens):
        loss_K, stats = token_loss(logprobs_K, entropy_K, tokens)
        return (loss_K * float("nan") if rank == 1 else loss_K), stats

    return loss


def _value_loss(values_K, _, tokens):
    loss_K, stats = clipped_value_loss(
        values_K, tokens.old_values, tokens.returns, tokens.value_mask, clip=0.2
    )
    return loss_K, {name: float(v) for name, v in stats.items()}


def _critic_script(update, values, save=None, load=None) -> dict:
    """The critic's sequence: two updates (one with an empty shard), values, a checkpoint round trip."""
    out = {"metrics": [update(_mini_batch(5, 24)), update(_mini_batch(6, 10_000))]}
    if save is not None:
        save()
    out["metrics"].append(update(_mini_batch(7, 24)))
    out["values"] = values(_mini_batch(8, 10_000))
    if load is not None:
        load()
        out["metrics"].append(update(_mini_batch(7, 24)))  # repeats the update after the save
        out["reloaded_values"] = values(_mini_batch(8, 10_000))
    return out


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
    out["logprobs"] = logprobs(_mini_batch(4, 10_000), False)
    out["reference"] = logprobs(_mini_batch(4, 10_000), True)
    return out


def _rank_main(rank: int, ports: list[int], checkpoint: str, out_dir: str) -> None:
    results = {}
    for index, (case, (strategy, lora_rank)) in enumerate(CASES.items()):
        worker = LearnerWorker(_config(checkpoint, strategy, lora_rank), rank, WORLD)
        worker.setup("127.0.0.1", ports[index])
        steps = record_optimizer_steps(worker.learner, worker.learner.model)  # on every rank (FSDP2)
        checkpoints = str(Path(out_dir) / case)

        def update(mini, loss, worker=worker, objective=policy_objective(worker.config)):
            if loss == "poison":
                return worker.update(_shard(mini, rank), _poisoned_on_rank_1(objective, rank), True)
            return worker.update(_shard(mini, rank), objective, True)

        def logprobs(mini, reference, worker=worker, lora_rank=lora_rank):
            if reference and not lora_rank:
                return None
            part = worker.logprobs(_shard(mini, rank).micro_batches, mini.weights.numel(), reference)
            dist.all_reduce(part)  # shards score disjoint tokens
            return part

        def save(step=3, worker=worker, checkpoints=checkpoints):
            worker.save_checkpoint(checkpoints, step, {"note": "test"})

        def load(step=3, worker=worker, checkpoints=checkpoints):
            trainer_state = worker.load_checkpoint(str(Path(checkpoints) / f"step_{step:06d}"))
            assert trainer_state["note"] == "test" and "critic" not in trainer_state

        def critic_update(mini, worker=worker):
            return worker.update_critic(_shard(mini, rank), _value_loss)

        def values(mini, worker=worker):
            part = worker.values(_shard(mini, rank).micro_batches, mini.weights.numel())
            dist.all_reduce(part)
            return part

        def export(worker=worker):
            weights = worker.export_weights()
            return None if weights is None else dict(weights)

        results[case] = _script(update, export, logprobs, save, load)
        results[case]["steps"] = steps
        critic_steps = record_optimizer_steps(worker.critic, worker.critic.model)
        results[case]["critic"] = _critic_script(
            critic_update, values, lambda save=save: save(4), lambda load=load: load(4)
        )
        results[case]["critic"]["steps"] = critic_steps
        dist.destroy_process_group()
    if rank == 0:
        torch.save(results, Path(out_dir) / "results.pt")


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now (bound together, then released). Consecutive ports after
    one free port are not: an earlier test's Ray workers may hold one (EADDRINUSE in the full suite)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@pytest.fixture(scope="module")
def group_results(tiny_checkpoint, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("strategy")
    ports = _free_ports(len(CASES))  # one process group per case
    mp.start_processes(
        _rank_main, args=(ports, str(tiny_checkpoint), str(out_dir)), nprocs=WORLD, start_method="spawn"
    )
    return torch.load(out_dir / "results.pt", weights_only=False)


@functools.cache
def _single(tiny_checkpoint, lora_rank: int) -> dict:
    config = _config(str(tiny_checkpoint), "ddp", lora_rank)
    torch.manual_seed(config.trainer.seed)
    model = load_policy(config.model)
    trainer = config.trainer
    learner = Learner(model, trainer, temperature=1.0, total_optimizer_steps=trainer.steps)
    token_loss = policy_objective(config)

    def update(mini, loss):
        if loss == "poison":  # rank 1's half of the group's poisoned update, whole here
            return learner.update(mini, _poisoned_on_rank_1(token_loss, 1), with_entropy=True)
        return learner.update(mini, token_loss, with_entropy=True)

    def logprobs(mini, reference):
        if reference and not lora_rank:
            return None
        return learner.logprobs(mini.micro_batches, mini.weights.numel(), reference=reference)

    steps = record_optimizer_steps(learner, model)
    out = _script(update, lambda: dict(export_weights(model)), logprobs)
    out["steps"] = steps
    critic = Learner(
        load_critic(config.model),
        replace(trainer, lr=trainer.critic_lr),
        temperature=1.0,
        total_optimizer_steps=trainer.steps,
        forward=micro_batch_values,
    )
    critic_steps = record_optimizer_steps(critic, critic.model)
    out["critic"] = _critic_script(
        lambda mini: critic.update(mini, _value_loss),
        lambda mini: critic.logprobs(mini.micro_batches, mini.weights.numel()),
    )
    out["critic"]["steps"] = critic_steps
    return out


def _single_critic_values(tiny_checkpoint, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The single-process critic's values on the script's value batch, at ``weights``."""
    config = _config(str(tiny_checkpoint), "ddp", 0)
    model = load_critic(config.model)
    model.load_state_dict(weights, strict=False)
    critic = Learner(
        model, config.trainer, temperature=1.0, total_optimizer_steps=1, forward=micro_batch_values
    )
    mini = _mini_batch(8, 10_000)
    return critic.logprobs(mini.micro_batches, mini.weights.numel())


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
    # The update_parity module's argument: the gradients of each applied step (updates 1, 2 and 4;
    # 3 is skipped) match, and the weights differ by at most what AdamW makes of their differences.
    applied, single_steps = ours["steps"][:3], theirs["steps"]
    assert len(single_steps) == 3
    assert_gradients_match(applied, single_steps)
    trained = single_steps[-1]["params"]  # the trainable parameters the exported weights came from
    bounds = adam_difference_bound(applied, single_steps, trained)
    if lora_rank:
        bounds = lora_merged_bound(bounds, trained, 8 / lora_rank, theirs["weights"])  # alpha / rank
    else:
        bounds["lm_head.weight"] = bounds["model.embed_tokens.weight"]  # tied: one parameter
    moved = 0
    first = dict(export_weights(load_policy(_config(str(tiny_checkpoint), strategy, 0).model)))
    for name, tensor in theirs["weights"].items():
        if name not in bounds:  # frozen under LoRA
            assert torch.equal(ours["weights"][name], tensor), name
            continue
        excess = (ours["weights"][name].double() - tensor.double()).abs() - bounds[name]
        assert excess.max() <= 0, (name, int(excess.argmax()), float(bounds[name].max()))
        moved += not torch.equal(first[name], tensor)
    assert moved > 0  # training changed the exported weights (LoRA deltas merged)
    # Not vacuous: the bound is tighter than a flat 1e-5 on almost every weight (measured: all but a
    # few in 10^5, entries whose gradients are rounding-sized).
    tight = sum(int((b <= 1e-5).sum()) for b in bounds.values())
    assert tight >= 0.99 * sum(b.numel() for b in bounds.values())
    torch.testing.assert_close(ours["logprobs"], theirs["logprobs"], atol=2e-5, rtol=1e-4)
    if lora_rank:
        torch.testing.assert_close(ours["reference"], theirs["reference"], atol=2e-5, rtol=1e-4)
        assert (ours["reference"] - ours["logprobs"]).abs().max() > 1e-3  # the adapter is on


@pytest.mark.parametrize("case", ["ddp", "fsdp2"])
def test_the_critic_beside_the_policy_trains_like_the_single_process_critic(
    group_results, tiny_checkpoint, case
):
    ours, theirs = group_results[case]["critic"], _single(tiny_checkpoint, 0)["critic"]
    for k, (mine, single) in enumerate(zip(ours["metrics"][:3], theirs["metrics"], strict=True)):
        assert mine["update/skipped"] == 0.0 and set(mine) == set(single), k
        for key in ("loss/policy", "grad_norm", "value_clip_fraction"):
            assert mine[key] == pytest.approx(single[key], rel=1e-4, abs=1e-6), (k, key)
    # As for the policy (update_parity): the applied steps' gradients match, and the critic's
    # weights lie within what AdamW makes of their differences. (A flat tolerance on the values
    # after three steps of lr 1e-2 is not sound: rounding-sized gradient entries become ~lr steps.)
    applied, single_steps = ours["steps"][:3], theirs["steps"]
    assert len(single_steps) == 3
    assert_gradients_match(applied, single_steps)
    trained = single_steps[-1]["params"]
    bounds = adam_difference_bound(applied, single_steps, trained)
    for name, tensor in trained.items():
        excess = (applied[-1]["params"][name].double() - tensor.double()).abs() - bounds[name]
        assert excess.max() <= 0, (name, int(excess.argmax()), float(bounds[name].max()))
    # The sharded values are the single-process critic's at the same weights, to rounding.
    at_ours = _single_critic_values(tiny_checkpoint, applied[-1]["params"])
    torch.testing.assert_close(ours["values"], at_ours, atol=1e-6, rtol=1e-5)
    assert ours["values"].abs().max() > 1e-3  # the zero-initialised head learned
    assert ours["metrics"][3]["loss/policy"] == pytest.approx(ours["metrics"][2]["loss/policy"], rel=1e-6)
    torch.testing.assert_close(ours["reloaded_values"], ours["values"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_a_checkpoint_written_by_rank_0_restores_every_rank_exactly(group_results, case):
    ours = group_results[case]
    after_save, after_load = ours["metrics"][3], ours["metrics"][4]
    for key in METRICS:
        if key in after_save:
            assert after_load[key] == pytest.approx(after_save[key], rel=1e-6, abs=1e-8), key
    for name, tensor in ours["weights"].items():
        torch.testing.assert_close(ours["reloaded"][name], tensor, atol=1e-6, rtol=1e-6, msg=name)

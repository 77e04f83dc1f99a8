"""The learner group: M Ray actors, one torch.distributed rank each, that train one policy data-parallel.

Each worker holds a full replica of the policy and a ``agent_r1.train.learner.Learner`` (optimizer,
schedule, log-probs). The driver splits a mini-batch's packed micro-batches into M shards of about
equal tokens; every worker runs forward/backward on its shard with the mini-batch's *global*
aggregation weights (``agent_r1.algos.aggregation``), so the per-worker losses sum to exactly the
single-process loss, and gradients are all-reduced with SUM (not DDP's mean) before clipping.

Deviation from ``torch.nn.parallel.DistributedDataParallel``: gradients are reduced once per optimizer
step, flattened into one all-reduce, instead of in buckets during each backward. Shards hold different
numbers of micro-batches (a shard may hold none), and DDP requires every rank to run the same number
of backward passes; a single reduction after accumulation is what DDP's ``no_sync`` accumulation does,
without that constraint. Parameters are broadcast from rank 0 at start, as DDP does.

A worker that dies takes the run down cleanly: the driver kills the others and raises
``LearnerFailure`` (continue with ``--resume`` from the last checkpoint).
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from agent_r1.train.batching import MicroBatch
from agent_r1.train.config import TrainConfig
from agent_r1.train.learner import Learner, MiniBatch, load_policy
from agent_r1.train.trainer import Trainer, export_weights

__all__ = ["LearnerFailure", "LearnerGroup", "LearnerWorker", "shard_micro_batches"]

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=5)


class LearnerFailure(RuntimeError):
    """A learner worker died; the run stops (continue it with ``--resume``)."""


def shard_micro_batches(micro_batches: Sequence[MicroBatch], shards: int) -> list[list[MicroBatch]]:
    """Greedy longest-first assignment of micro-batches to ``shards`` by token count."""
    out: list[list[MicroBatch]] = [[] for _ in range(shards)]
    load = [0] * shards
    for mb in sorted(micro_batches, key=lambda m: -m.num_tokens):
        k = load.index(min(load))
        out[k].append(mb)
        load[k] += mb.num_tokens
    return out


class LearnerWorker:
    """One rank: builds its policy replica, Learner and token loss from the config."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        if config.trainer.torch_threads:
            torch.set_num_threads(config.trainer.torch_threads)

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: the rendezvous of the group (asked of rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> int:
        import torch.distributed as dist

        from agent_r1.distributed.parts import TrainerParts, load_driver_tokenizer

        config = self.config
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        dist.init_process_group(
            config.distributed.torch_backend,
            rank=self.rank,
            world_size=self.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        torch.manual_seed(config.trainer.seed)
        model = load_policy(config.model)
        if config.distributed.torch_backend == "nccl":
            model = model.to(f"cuda:{torch.cuda.current_device()}")
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)
        reference = None
        if config.algorithm.kl_coef > 0 and not hasattr(model, "peft_config"):
            reference = Trainer._load_reference(self)
        trainer = config.trainer
        self.learner = Learner(
            model,
            trainer,
            temperature=config.rollout.temperature,
            total_optimizer_steps=trainer.steps * trainer.ppo_epochs * trainer.mini_batches,
            reference=reference,
        )
        self.tokenizer = load_driver_tokenizer(config)
        self.parts = TrainerParts(config, self.tokenizer)
        return self.rank

    def _base_path(self) -> str:  # read by Trainer._load_reference
        return self.config.model.path

    def logprobs(self, micro_batches: Sequence[MicroBatch], num_tokens: int, reference: bool) -> torch.Tensor:
        return self.learner.logprobs(micro_batches, num_tokens, reference=reference)

    def update(self, mini_batch: MiniBatch, with_entropy: bool) -> dict[str, float]:
        """``Learner.update`` over this rank's shard, with gradients, loss and the finite check
        reduced over the group so that every rank takes the same optimizer step."""
        import torch.distributed as dist

        learner, model = self.learner, self.learner.model
        device = next(model.parameters()).device
        learner.optimizer.zero_grad(set_to_none=True)
        if learner.gradient_checkpointing:
            model.train()
        loss_sum = 0.0
        non_finite = 0.0
        stat_sums: dict[str, float] = {}
        stat_weight = 0.0
        try:
            for mb in mini_batch.micro_batches:
                weights_K = mini_batch.weights[mb.flat_index_K].to(device)
                if not bool((weights_K != 0).any()):
                    continue
                logprobs_K, entropy_K = learner.forward(
                    model, mb, learner.temperature, with_entropy=with_entropy
                )
                tokens = {name: t[mb.flat_index_K].to(device) for name, t in mini_batch.tokens.items()}
                loss_K, stats = self.parts.token_loss(logprobs_K, entropy_K, tokens)
                loss = (weights_K * loss_K).sum()
                if not torch.isfinite(loss):
                    non_finite = 1.0
                    break
                loss.backward()
                loss_sum += float(loss.detach())
                active = float((weights_K != 0).sum())
                stat_weight += active
                for name, value in stats.items():
                    stat_sums[name] = stat_sums.get(name, 0.0) + value * active
        finally:
            model.eval()
        totals = torch.tensor([loss_sum, non_finite], dtype=torch.float64, device=device)
        dist.all_reduce(totals)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, (stat_sums, stat_weight))
        finite = totals[1].item() == 0
        grad_norm = float("nan")
        params = learner.trainable_parameters
        if finite:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for p, g in zip(params, grads, strict=True):
                p.grad = flat[offset : offset + g.numel()].view_as(p).clone()
                offset += g.numel()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, learner.config.max_grad_norm))
            finite = math.isfinite(grad_norm)
        lr = learner.scheduler.get_last_lr()[0]
        if finite:
            learner.optimizer.step()
            learner.scheduler.step()
            learner.optimizer_steps += 1
        else:
            learner.skipped_updates += 1
            logger.warning("rank %d: skipped a non-finite update (grad norm %s)", self.rank, grad_norm)
        learner.optimizer.zero_grad(set_to_none=True)
        all_sums: dict[str, float] = {}
        all_weight = 0.0
        for sums, weight in gathered:
            all_weight += weight
            for name, value in sums.items():
                all_sums[name] = all_sums.get(name, 0.0) + value
        metrics = {
            "loss/policy": float(totals[0]) if finite else float("nan"),
            "grad_norm": grad_norm,
            "lr": lr,
            "update/skipped": 0.0 if finite else 1.0,
        }
        metrics.update({name: s / max(all_weight, 1.0) for name, s in all_sums.items()})
        return metrics

    def export_weights(self) -> list[tuple[str, torch.Tensor]]:
        """The policy's weights under Hugging Face names (LoRA merged), on the CPU, for the engines."""
        return [(name, t.cpu()) for name, t in export_weights(self.learner.model)]

    def save_checkpoint(self, directory: str, step: int, trainer_state: dict) -> str:
        from agent_r1.train.checkpoint import save_checkpoint

        path = save_checkpoint(
            directory,
            step,
            self.learner.model,
            self.learner.state_dict(),
            trainer_state,
            keep=self.config.trainer.keep_checkpoints,
            tokenizer=self.tokenizer,
        )
        return str(path)

    def load_checkpoint(self, path: str) -> dict:
        from agent_r1.train.checkpoint import load_checkpoint

        learner_state, trainer_state = load_checkpoint(path, self.learner.model)
        self.learner.load_state_dict(learner_state)
        return trainer_state


class LearnerGroup:
    """The driver's handle on the workers, with the ``Learner`` methods the trainer's phases call
    (``logprobs``, ``update``)."""

    def __init__(self, config: TrainConfig, runtime_env: dict | None = None) -> None:
        dist = config.distributed
        remote = ray.remote(LearnerWorker).options(
            num_cpus=dist.learner_num_cpus,
            num_gpus=dist.learner_num_gpus,
            max_restarts=0,
            runtime_env=runtime_env,
        )
        size = dist.num_learner_workers
        self.workers = [remote.remote(config, rank, size) for rank in range(size)]
        addr, port = self._get([self.workers[0].address.remote()])[0]
        self._get([w.setup.remote(addr, port) for w in self.workers])

    def _get(self, refs: list) -> list:
        """``ray.get`` that turns the death of any worker into a clean stop of the whole group."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except RayActorError as error:
                rank = refs.index(done[0])  # calls go to workers in rank order (single calls: rank 0)
                self.shutdown()
                raise LearnerFailure(
                    f"learner worker {rank} died ({type(error).__name__}); the run stops here. "
                    "Continue it from the last checkpoint with --resume."
                ) from error
        return ray.get(refs)

    def logprobs(self, micro_batches: Sequence[MicroBatch], num_tokens: int, *, reference: bool = False):
        shards = shard_micro_batches(micro_batches, len(self.workers))
        parts = self._get(
            [w.logprobs.remote(s, num_tokens, reference) for w, s in zip(self.workers, shards, strict=True)]
        )
        return torch.stack(parts).sum(0)  # shards score disjoint tokens; the rest are zeros

    def update(self, mini_batch: MiniBatch, token_loss, *, with_entropy: bool = False) -> dict[str, float]:
        """One data-parallel optimizer step. ``token_loss`` must be the trainer's own: each worker
        computes it from the config (a bound method of the driver cannot travel)."""
        if getattr(token_loss, "__func__", None) is not Trainer._token_loss:
            raise TypeError(
                "the Ray learner group computes Trainer._token_loss in each worker; got another loss"
            )
        shards = shard_micro_batches(mini_batch.micro_batches, len(self.workers))
        results = self._get(
            [
                w.update.remote(MiniBatch(s, mini_batch.weights, mini_batch.tokens), with_entropy)
                for w, s in zip(self.workers, shards, strict=True)
            ]
        )
        return results[0]

    def export_weights_ref(self):
        """An object ref of rank 0's weights (handed to the rollout actors without a driver copy)."""
        ref = self.workers[0].export_weights.remote()
        self._get([ref])
        return ref

    def save_checkpoint(self, directory: str, step: int, trainer_state: dict) -> str:
        return self._get([self.workers[0].save_checkpoint.remote(directory, step, trainer_state)])[0]

    def load_checkpoint(self, path: str) -> dict:
        return self._get([w.load_checkpoint.remote(path) for w in self.workers])[0]

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []

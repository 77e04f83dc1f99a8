"""The learner group: M Ray actors, one torch.distributed rank each, that train one policy data-parallel.

Each worker holds the policy under a data-parallel strategy (``distributed.strategy``, see
``agent_r1.distributed.strategy``: ``ddp`` wraps a full replica in ``DistributedDataParallel``,
``fsdp2`` shards it with ``fully_shard``) and an ``agent_r1.train.learner.Learner`` built with that
strategy as its ``GradientSync``, so the update loop is the single-process one. The driver splits a
mini-batch's packed micro-batches into M shards of about equal tokens; every worker runs
forward/backward on its shard with the mini-batch's *global* aggregation weights
(``agent_r1.algos.aggregation``), so the per-worker losses and gradients sum to exactly the
single-process ones.

Exports and checkpoints are asked of every worker (FSDP2 gathers the shards collectively) and
produced by rank 0.

Recovery. A worker that dies (``RayActorError``: killed, OOM, its node lost) loses the group's
collective state, so the driver kills the other workers and rebuilds the group in-process: new workers
(a new rendezvous), the last checkpoint saved or loaded loaded on every rank (or ``model.path`` when
there is none yet), then the optimizer steps taken since it *replayed* (``update`` /
``update_critic`` with the same mini-batches and objectives, which the driver keeps in a journal
that each checkpoint empties), and finally the call that failed is made again. An update that failed
took no step (every rank is rebuilt), so each mini-batch, hence every (task, sample) of the rollout,
is trained exactly once; the group ends up in the state it had before the death, so the rollout
actors, which keep their engines and the weights of the last sync, need nothing new and the run
continues where it was. ``distributed.max_learner_restarts`` bounds the rebuilds of a run (``0``: no
journal is kept and the first death stops the run); past it the run stops with ``LearnerFailure``
(continue with ``--resume``). ``learner/restarts`` in the metrics counts the rebuilds.

``LearnerGroup`` is the Ray learner backend (``agent_r1.train.backends.LearnerBackend``): the
objective of each update (a picklable per-token loss, e.g. ``agent_r1.algos.PolicyObjective`` or a
user's own) travels to the workers with the mini-batch.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError

from agent_r1.distributed.placement import scheduling
from agent_r1.train.backends import export_weights, local_learner
from agent_r1.train.batching import MicroBatch
from agent_r1.train.builders import estimator_needs, load_config_tokenizer
from agent_r1.train.config import TrainConfig
from agent_r1.train.learner import Learner, MiniBatch, TokenLoss, load_policy
from agent_r1.train.policies import policy_model
from agent_r1.train.process import apply_process_settings

__all__ = ["LearnerFailure", "LearnerGroup", "LearnerWorker", "PolicyGroup", "shard_micro_batches"]

logger = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
PEER_DEATH_WAIT_S = 30.0  # how long an error waits for the other ranks' outcome (a peer's death)


class LearnerFailure(RuntimeError):
    """Learner workers died more often than ``distributed.max_learner_restarts`` allows; the run
    stops (continue it with ``--resume``)."""


class _WorkerDied(Exception):
    """A worker of the group died during a call (internal: ``LearnerGroup`` recovers or stops)."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(rank, error)
        self.rank, self.error = rank, error


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
    """One rank: builds its learners (``agent_r1.train.backends.local_learner``: the policy's, the
    critic's, the teacher, as in one process) from the config, each ``Learner`` synchronised by the
    data-parallel strategy; its methods are the learner backend's, on this rank's shard."""

    def __init__(self, config: TrainConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        apply_process_settings(config.trainer)

    def address(self) -> tuple[str, int]:
        """This node's IP and a free port: the rendezvous of the group (asked of rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int) -> int:
        from agent_r1.distributed.strategy import Strategy, make_strategy

        config = self.config
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)
        dist.init_process_group(
            config.distributed.torch_backend,
            rank=self.rank,
            world_size=self.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        device = torch.device("cpu")
        if config.distributed.torch_backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(config.trainer.seed)

        def data_parallel(model, replica) -> Strategy:
            return make_strategy(config.distributed.strategy, model, device, replica)

        tokenizer = load_config_tokenizer(config)
        # several policies (agent_r1.train.policies): every policy's adapter on the base
        model = policy_model(config) if config.policies else load_policy(config.model)
        self.learners = local_learner(config, tokenizer, model, device, data_parallel=data_parallel)
        return self.rank

    @property
    def learner(self) -> Learner:
        """The policy's ``Learner``."""
        return self.learners.policy

    @property
    def critic(self) -> Learner | None:
        return self.learners.critic

    def logprobs(
        self, micro_batches: Sequence[MicroBatch], num_tokens: int, reference: bool, policy: str | None = None
    ) -> torch.Tensor:
        learner = self.learners.for_policy(policy)
        return learner.logprobs(micro_batches, num_tokens, reference=reference)

    def update(
        self, mini_batch: MiniBatch, objective: TokenLoss, with_entropy: bool, policy: str | None = None
    ) -> dict[str, float]:
        """``Learner.update`` of ``policy`` (None: the run's one policy) over this rank's shard with the
        driver's ``objective``; the strategy makes every rank take the same step."""
        return self.learners.for_policy(policy).update(mini_batch, objective, with_entropy=with_entropy)

    def teacher_logprobs(self, micro_batches: Sequence[MicroBatch], num_tokens: int) -> torch.Tensor:
        return self.learners.teacher_logprobs(micro_batches, num_tokens)

    def values(self, micro_batches: Sequence[MicroBatch], num_tokens: int) -> torch.Tensor:
        return self.learners.values(micro_batches, num_tokens)

    def update_critic(self, mini_batch: MiniBatch, objective: TokenLoss) -> dict[str, float]:
        """The critic's ``Learner.update`` over this rank's shard with the driver's value objective."""
        return self.learners.update_critic(mini_batch, objective)

    def export_weights(self) -> list[tuple[str, torch.Tensor]] | dict | None:
        """The policy's weights under Hugging Face names (LoRA merged), on the CPU, for the engines;
        with several policies every trained policy's adapter (``{adapter: LoraWeights}``, all of them,
        so that an actor started later gets the whole set). Rank 0; the other ranks take part in
        gathering sharded weights and return None."""
        model, _ = self.learner.sync.full_state(self.learner, optimizer=False)
        if model is None:
            return None
        if self.config.policies:
            from agent_r1.rollout.base import LoraWeights
            from agent_r1.train.policies import export_adapters, trained_policies

            adapters = export_adapters(model, trained_policies(self.config))
            return {
                name: LoraWeights(w.config, {k: t.cpu() for k, t in w.tensors.items()})
                for name, w in adapters.items()
            }
        return [(name, t.cpu()) for name, t in export_weights(model)]

    def save_checkpoint(self, directory: str, step: int, trainer_state: dict) -> str | None:
        """Rank 0 writes the checkpoint (the other ranks take part in gathering sharded state)."""
        path = self.learners.save_checkpoint(Path(directory), step, trainer_state)
        return None if path is None else str(path)

    def load_checkpoint(self, path: str) -> dict:
        """Every rank loads checkpoint ``path`` (verified against its manifest); returns the trainer
        state (without the critic's)."""
        return self.learners.load_checkpoint(Path(path), verify=True)


class LearnerGroup:
    """The driver's handle on the workers: the learner backend's methods, each run data-parallel, and
    the recovery of the group when a worker dies (see the module docstring).

    ``owns_ray``: this group's ``close`` also stops the local Ray cluster (started for the run)."""

    def __init__(
        self, config: TrainConfig, runtime_env: dict | None = None, *, owns_ray: bool = False
    ) -> None:
        dist = config.distributed
        self.config = config
        self._remote = ray.remote(LearnerWorker)
        self._options = dict(
            num_cpus=dist.learner_num_cpus,
            num_gpus=dist.learner_num_gpus,
            max_restarts=0,
            runtime_env=runtime_env,
        )
        self.owns_ray = owns_ray
        self.has_critic = estimator_needs(config).critic is not None
        self.restarts = 0
        # What a rebuilt group starts from: the last checkpoint saved or loaded (None: model.path),
        # and the updates taken since, in order (kept only when a rebuild is allowed).
        self._checkpoint: str | None = None
        self._journal: list[tuple[str, MiniBatch, tuple]] = []
        self.workers: list = []
        try:
            self._start()
        except _WorkerDied as died:
            raise LearnerFailure(
                f"learner worker {died.rank} died while the group started: {died.error}"
            ) from died.error

    def _start(self) -> None:
        size = self.config.distributed.num_learner_workers
        self.workers = [
            self._remote.options(
                **self._options, **scheduling(self.config, rank, self._options["num_gpus"])
            ).remote(self.config, rank, size)
            for rank in range(size)
        ]
        addr, port = self._wait([self.workers[0].address.remote()])[0]
        self._wait([w.setup.remote(addr, port) for w in self.workers])

    def _wait(self, refs: list) -> list:
        """``ray.get`` that turns the death of any worker into ``_WorkerDied`` after killing the others.

        A rank whose collective fails because a peer died raises its own error, which may arrive
        before the peer's death is reported: an error is checked against the other calls' outcomes
        (for up to ``PEER_DEATH_WAIT_S``) before it is taken for the call's own failure."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except RayActorError as error:
                self._died(refs, done[0], error)
            except Exception:
                finished, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_WAIT_S)
                for ref in finished:
                    try:
                        ray.get(ref)
                    except RayActorError as error:
                        self._died(refs, ref, error)
                    except Exception:
                        pass
                raise
        return ray.get(refs)

    def _died(self, refs: list, ref, error: RayActorError):
        rank = refs.index(ref)  # calls go to workers in rank order (single calls: rank 0)
        self._kill_workers()
        raise _WorkerDied(rank, error) from error

    def _get(self, submit: Callable[[], list]) -> list:
        """The results of the calls ``submit()`` sends to the workers; when a worker dies, the group is
        rebuilt (``_recover``) and the calls are sent again."""
        while True:
            try:
                return self._wait(submit())
            except _WorkerDied as died:
                self._recover(died)

    def _recover(self, died: _WorkerDied) -> None:
        """Rebuild the group in the state it had before ``died``, or raise ``LearnerFailure`` once
        ``distributed.max_learner_restarts`` rebuilds have been spent."""
        limit = self.config.distributed.max_learner_restarts
        while True:
            if self.restarts >= limit:
                self._kill_workers()
                raise LearnerFailure(
                    f"learner worker {died.rank} died ({type(died.error).__name__}) after {self.restarts} "
                    f"rebuilds of the learner group (distributed.max_learner_restarts = {limit}); the run "
                    "stops here. Continue it from the last checkpoint with --resume."
                ) from died.error
            self.restarts += 1
            base = self._checkpoint or f"model.path {self.config.model.path}"
            logger.warning(
                "learner worker %d died (%s): rebuilding the learner group (%d of at most %d) from %s and "
                "replaying the %d optimizer steps taken since",
                died.rank,
                type(died.error).__name__,
                self.restarts,
                limit,
                base,
                len(self._journal),
            )
            try:
                self._start()
                if self._checkpoint is not None:
                    self._wait([w.load_checkpoint.remote(self._checkpoint) for w in self.workers])
                for method, mini_batch, args in self._journal:
                    self._wait(self._update_refs(method, mini_batch, args))
                return
            except _WorkerDied as again:
                died = again

    def _sharded(self, method: str, micro_batches: Sequence[MicroBatch], *args) -> list:
        def submit() -> list:
            shards = shard_micro_batches(micro_batches, len(self.workers))
            return [getattr(w, method).remote(s, *args) for w, s in zip(self.workers, shards, strict=True)]

        return self._get(submit)

    def for_policy(self, name: str | None):
        """The learners that train policy ``name`` (``agent_r1.train.policies``): the group itself with
        one policy (None); else a view whose calls name the policy (``PolicyGroup``)."""
        return self if name is None else PolicyGroup(self, name)

    def logprobs(
        self,
        micro_batches: Sequence[MicroBatch],
        num_tokens: int,
        *,
        reference: bool = False,
        policy: str | None = None,
    ):
        parts = self._sharded("logprobs", micro_batches, num_tokens, reference, policy)
        return torch.stack(parts).sum(0)  # shards score disjoint tokens; the rest are zeros

    def values(self, micro_batches: Sequence[MicroBatch], num_tokens: int) -> torch.Tensor:
        parts = self._sharded("values", micro_batches, num_tokens)
        return torch.stack(parts).sum(0)

    def teacher_logprobs(self, micro_batches: Sequence[MicroBatch], num_tokens: int) -> torch.Tensor:
        parts = self._sharded("teacher_logprobs", micro_batches, num_tokens)
        return torch.stack(parts).sum(0)

    def _update_refs(self, method: str, mini_batch: MiniBatch, args: tuple) -> list:
        shards = shard_micro_batches(mini_batch.micro_batches, len(self.workers))
        return [
            getattr(w, method).remote(MiniBatch(s, mini_batch.weights, mini_batch.tokens), *args)
            for w, s in zip(self.workers, shards, strict=True)
        ]

    def _update(self, method: str, mini_batch: MiniBatch, *args) -> dict[str, float]:
        results = self._get(lambda: self._update_refs(method, mini_batch, args))
        if self.config.distributed.max_learner_restarts > 0:
            self._journal.append((method, mini_batch, args))
        return results[0]

    def update(
        self,
        mini_batch: MiniBatch,
        objective: TokenLoss,
        *,
        with_entropy: bool = False,
        policy: str | None = None,
    ) -> dict[str, float]:
        """One data-parallel optimizer step of ``policy`` (None: the run's one) on ``objective``; the
        journal keeps the policy's name for a replay."""
        return self._update("update", mini_batch, objective, with_entropy, policy)

    def update_critic(self, mini_batch: MiniBatch, objective: TokenLoss) -> dict[str, float]:
        return self._update("update_critic", mini_batch, objective)

    def weights(self):
        """An object ref of rank 0's weights (handed to the rollout actors without a driver copy)."""
        refs: list = []

        def submit() -> list:
            refs[:] = [w.export_weights.remote() for w in self.workers]
            return refs

        self._get(submit)
        return refs[0]

    def save_checkpoint(self, directory, step: int, trainer_state: dict) -> str:
        path = self._get(
            lambda: [w.save_checkpoint.remote(str(directory), step, trainer_state) for w in self.workers]
        )[0]
        self._checkpoint, self._journal = path, []
        return path

    def load_checkpoint(self, path) -> dict:
        state = self._get(lambda: [w.load_checkpoint.remote(str(path)) for w in self.workers])[0]
        self._checkpoint, self._journal = str(path), []
        return state

    def metrics(self) -> dict[str, float]:
        return {"learner/restarts": float(self.restarts)}

    def _kill_workers(self) -> None:
        for worker in self.workers:
            ray.kill(worker)
        self.workers = []

    def close(self) -> None:
        self._kill_workers()
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


class PolicyGroup:
    """One policy's view of the learner group (several policies, ``LearnerGroup.for_policy``): its
    log-probs and updates name the policy, on every rank (whose ``LocalLearner.for_policy`` makes its
    adapter active); everything else is the group's."""

    def __init__(self, group: LearnerGroup, name: str) -> None:
        self.group, self.name = group, name

    def logprobs(self, micro_batches: Sequence[MicroBatch], num_tokens: int, *, reference: bool = False):
        return self.group.logprobs(micro_batches, num_tokens, reference=reference, policy=self.name)

    def update(
        self, mini_batch: MiniBatch, objective: TokenLoss, *, with_entropy: bool = False
    ) -> dict[str, float]:
        return self.group.update(mini_batch, objective, with_entropy=with_entropy, policy=self.name)

    def __getattr__(self, name: str):
        if name in ("group", "name"):  # not set yet (copy, pickle)
            raise AttributeError(name)
        return getattr(self.group, name)

"""Data-parallel strategies of the learner group: DDP and FSDP2 behind ``Learner``'s ``GradientSync``.

Both train with the exactness property of the single-process learner: every rank's loss uses the
mini-batch's *global* aggregation weights (``agent_r1.algos.aggregation``), so the SUM over ranks of
their gradients is the single-process gradient; every rank then clips and steps identically.

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (gloo on CPU, NCCL on GPUs). DDP broadcasts
  rank 0's parameters when it wraps the model and all-reduces gradients in buckets during the last
  backward pass of an update; the others run under ``no_sync()`` and accumulate locally.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every decoder layer and on the root (PyTorch's
  FSDP2): parameters, gradients and optimizer state are sharded; each forward all-gathers a layer's
  parameters and the last backward of an update reduce-scatters its gradients
  (``set_requires_gradient_sync(False)`` for the others). Exported weights and checkpoints are
  gathered to full tensors (``get_model_state_dict`` / ``get_optimizer_state_dict`` with
  ``StateDictOptions(full_state_dict=True)``), so checkpoints keep the single-process format.

Deviations, and why:

- **SUM, not mean.** DDP and FSDP2 average gradients over ranks; here each rank's loss is already its
  share of the global loss, so gradients are summed instead (a DDP communication hook that all-reduces
  without dividing; FSDP2's ``set_gradient_divide_factor(1.0)`` with sum-only collectives, since gloo
  has no pre-multiplied sum).
- **Equal pass counts.** DDP needs exactly one synchronised backward per rank and update, FSDP2 the
  same number of forward and backward passes on every rank (each one is collective). Shards are cut
  by tokens and may hold different numbers of micro-batches, or none: a rank short of micro-batches
  runs zero-weight padding passes (one token, loss ``0 * output``), which add nothing to the sum.
- **No early stop on a non-finite loss.** The single-process learner stops at the first non-finite
  loss; a rank in a group runs all its passes (the others wait for them in collectives), then the
  summed finite flag makes every rank skip the step.
- **FSDP2 export.** Rank 0 keeps a full, unsharded CPU replica of the model and loads the gathered
  weights into it to export them (LoRA merged) or save a checkpoint with the unchanged single-process
  code: one extra copy of the weights in rank 0's host memory. FSDP2 optimizer state is saved in the
  gathered, name-keyed form of ``get_optimizer_state_dict``, so an FSDP2 checkpoint resumes under
  FSDP2 (its model folder loads anywhere). An optimizer that has not stepped yet is saved as ``{}``:
  gathering its state would first initialise it with a zero-learning-rate step, which AdamW counts
  (bias correction) and would change the rest of the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from agent_r1.train.learner import GradientSync, Learner, combine

__all__ = ["DDPStrategy", "FSDP2Strategy", "STRATEGIES", "Strategy", "decoder_layers", "make_strategy"]


class Strategy(GradientSync):
    """A ``GradientSync`` for one rank of a process group: ``full_state`` gives rank 0 the full
    weights it exports and checkpoints, the others (None, None)."""

    stops_early = False

    def __init__(self, model) -> None:
        self.model = model

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sums)
        return combine(gathered)


def _sum_allreduce(process_group, bucket):  # DDP rejects a string annotation (future import)
    """DDP communication hook: all-reduce a gradient bucket with SUM (DDP's default divides by the
    world size); returns a ``torch.futures.Future`` of the reduced bucket."""
    work = dist.all_reduce(bucket.buffer(), group=process_group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


class DDPStrategy(Strategy):
    """Full replica per rank, wrapped in ``DistributedDataParallel`` (which broadcasts rank 0's
    parameters on construction)."""

    def __init__(self, model, device: torch.device) -> None:
        super().__init__(model)
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            forward_sync_buffers=False,  # the only buffers (rotary frequencies) are computed, not trained
            find_unused_parameters=False,  # every trainable parameter reaches the loss
        )
        self.ddp.register_comm_hook(None, _sum_allreduce)

    def training_module(self, model):
        return self.ddp

    def num_passes(self, local: int, *, backward: bool) -> int:
        # Only the synchronised backward is collective: one per rank and update.
        return max(local, 1) if backward else local

    def accumulating(self, module) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync()

    def full_state(self, learner: Learner, *, optimizer: bool) -> tuple[Any, dict | None]:
        """Every rank holds a full replica: rank 0 gives its own (and every rank loads a checkpoint
        as one process does)."""
        if dist.get_rank() != 0:
            return None, None
        return super().full_state(learner, optimizer=optimizer)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules whose class Hugging Face lists in ``_no_split_modules``
    (``Qwen2DecoderLayer``, ``LlamaDecoderLayer``, ...), found through peft and value-head wrappers."""
    names = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__}: no decoder layers to shard (no module class is listed in "
            "_no_split_modules)"
        )
    return layers


class FSDP2Strategy(Strategy):
    """Parameters sharded over the ranks with ``fully_shard`` per decoder layer and on the root.

    ``replica``: on rank 0, ``() -> model``, an unsharded copy built like ``model`` (kept on the CPU
    to receive the gathered weights); None on the other ranks.
    """

    def __init__(self, model, device: torch.device, replica: Callable[[], Any] | None) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        model.to(device)
        for tensor in model.state_dict().values():
            dist.broadcast(tensor, src=0)  # fully_shard keeps each rank's own values: start from rank 0's
        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):  # both settings are per module: sum, never average
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        super().__init__(model)
        self.replica = replica() if replica is not None else None
        if self.replica is not None:
            for p in self.replica.parameters():
                p.requires_grad_(False)

    def num_passes(self, local: int, *, backward: bool) -> int:
        counts = torch.tensor([local], dtype=torch.long, device=_comm_device())
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        return int(counts.item())

    @contextlib.contextmanager
    def accumulating(self, module) -> Iterator[None]:
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def _reshard(self) -> None:
        """Free the parameters a forward pass left gathered (FSDP2 keeps the root's after a forward
        without backward); state dicts are read and loaded shard by shard."""
        self.model.reshard()

    def grad_norm(self, parameters: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)  # a DTensor over the shards
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def full_state(self, learner: Learner, *, optimizer: bool) -> tuple[Any, dict | None]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        self._reshard()
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        weights = get_model_state_dict(self.model, options=options)
        optimizer_state = None
        if optimizer:
            # {} for an optimizer that never stepped: gathering would first initialise its state
            # with a zero-lr step, which counts as an AdamW step (bias correction) and changes the run.
            stepped = bool(learner.optimizer.state)
            optimizer_state = {}
            if stepped:
                optimizer_state = get_optimizer_state_dict(self.model, learner.optimizer, options=options)
        if self.replica is None:
            return None, None
        self.replica.load_state_dict(weights)
        return self.replica, optimizer_state

    def load_checkpoint(self, path, learner: Learner, *, verify: bool = True) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from agent_r1.train.checkpoint import load_checkpoint

        self._reshard()
        weights, optimizer_state, rest = {}, {}, [None]
        if self.replica is not None:
            learner_state, trainer_state = load_checkpoint(path, self.replica, verify=verify)
            weights = self.replica.state_dict()
            optimizer_state = learner_state.pop("optimizer")
            rest = [(learner_state, trainer_state, bool(optimizer_state))]
        dist.broadcast_object_list(rest, src=0)
        learner_state, trainer_state, stepped = rest[0]
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, weights, options=options)
        self._load_optimizer(learner, optimizer_state, stepped, options)
        _load_schedule(learner, learner_state)
        return trainer_state

    def _load_optimizer(self, learner: Learner, optimizer_state: dict, stepped: bool, options) -> None:
        """``set_optimizer_state_dict``, or an empty state for an optimizer saved before its first step
        (``full_state``)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if stepped:
            set_optimizer_state_dict(self.model, learner.optimizer, optimizer_state, options=options)
        else:
            learner.optimizer.state.clear()

    def load_state(self, learner: Learner, weights: dict, learner_state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self._reshard()
        options = StateDictOptions(full_state_dict=True)  # every rank keeps its own shard of each
        set_model_state_dict(self.model, weights, options=options)
        optimizer_state = learner_state["optimizer"]
        self._load_optimizer(learner, optimizer_state, bool(optimizer_state), options)
        _load_schedule(learner, learner_state)


def _load_schedule(learner: Learner, learner_state: dict) -> None:
    """The learner state besides the optimizer: schedule and counters."""
    learner.scheduler.load_state_dict(learner_state["scheduler"])
    learner.optimizer_steps = learner_state["optimizer_steps"]
    learner.skipped_updates = learner_state["skipped_updates"]


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


STRATEGIES = ("ddp", "fsdp2")


def make_strategy(name: str, model, device: torch.device, replica: Callable[[], Any]) -> Strategy:
    """The strategy ``name`` (``distributed.strategy``) for ``model`` on this rank; ``replica`` builds
    an unsharded copy of the model (FSDP2 calls it on rank 0 only)."""
    if name == "ddp":
        return DDPStrategy(model.to(device), device)
    if name == "fsdp2":
        return FSDP2Strategy(model, device, replica if dist.get_rank() == 0 else None)
    raise ValueError(f"unknown distributed.strategy {name!r}; choose one of {', '.join(STRATEGIES)}")

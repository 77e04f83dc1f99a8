"""Supervised warm start on demonstrations, tokenised exactly as the RL environment presents them.

A demonstration is the list of assistant responses (text) of one episode. ``replay_demonstrations``
plays each one through a fresh environment: the environment builds every prompt (chat template,
system prompt, tool results, context policy) exactly as it will during RL, and each response becomes
``encode(text) + [eos]``, the tokens a model must produce to say it. The result is ordinary
``Trajectory`` records, so the training-data builder (``agent_r1.train.batch.batch_of``) packs each
episode into one sequence with a span per response, and ``train_sft`` minimises the negative
log-likelihood of the response tokens only (assistant tokens; prompts and tool results are context,
never targets).

Behaviour cloning (Pomerleau 1991): loss = mean over all response tokens of a batch of
``-log p(token | prefix)``, AdamW, linear warm-up then linear decay.

The demonstrations of a batch share their system prompt and tool schema (the quickstart's: 154
tokens of ~387). With ``SFTConfig.share_prefixes`` (default) a forward lays a batch's sequences out
as the RL learner does (``agent_r1.train.batching``: one prefix trie, shared tokens computed once,
attention segment by segment under SDPA on the CPU) and scores only the response tokens through the
learner's chunked LM head; the loss is that of right-padded batches to float rounding. The quickstart's
warm start forwards 0.54x the padded tokens that way.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from agent_r1.envs.base import AgentEnv
from agent_r1.flows.base import by_role, reported_success
from agent_r1.models.tokens import observation_ids
from agent_r1.train.batch import batch_of, kernel_pair_cost
from agent_r1.train.batching import StepRows, TrainSequence, count_tokens, pack_trees, share_prefixes
from agent_r1.train.learner import attention_implementation, micro_batch_logprobs
from agent_r1.types import Action, Step, StepResult, Task, Trajectory

__all__ = [
    "SFTConfig",
    "replay_demonstration",
    "replay_demonstrations",
    "sft_loss",
    "sft_sequences",
    "train_sft",
]


@dataclass(frozen=True)
class SFTConfig:
    epochs: int = 2
    lr: float = 3e-3  # peak learning rate (a tiny model from scratch; use ~1e-5 for a pretrained one)
    batch_size: int = 32  # sequences per optimizer step
    micro_batch_size: int = 32  # sequences per forward pass (gradients are accumulated)
    warmup_fraction: float = 0.1
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 0
    share_prefixes: bool = True  # a forward computes its sequences' shared prefixes once (module docstring)

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "micro_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"SFTConfig.lr must be > 0, got {self.lr}")


async def replay_demonstration(
    env: AgentEnv, tokenizer: PreTrainedTokenizerBase, task: Task, responses: Sequence[str]
) -> Trajectory | list[Trajectory]:
    """Play ``responses`` through ``env`` as the model's actions; return the episode as a Trajectory,
    or, when its observations name roles, one Trajectory per role (``agent_r1.flows.base.by_role``,
    as ``AgentEnvLoop`` splits an episode: each response is a step of the role its observation names,
    each role with its own outcome when the env reports ``{role: reward}``).

    The env's own policy calls (``StepResult.policy_steps``, e.g. summaries written by a policy lent
    to it with ``AgentEnv.lend_policy``) follow the step that caused them, as in ``AgentEnvLoop``.

    Raises ValueError (naming the task) when the episode ends before the last response or does not
    end after it: the demonstration does not fit the environment.
    """
    eos = tokenizer.eos_token_id
    where = f"demonstration of task {task.get('id', '(no id)')!r}"
    steps: list[Step] = []
    roles: list[str | None] = []  # the role of each step
    outcome: float | dict[str, float] = 0.0
    info: dict[str, Any] = {}
    try:
        observation = await env.reset(task)
        if isinstance(observation, StepResult):  # over before any action: nothing to demonstrate
            if responses:
                raise ValueError(f"{where}: the environment ended at reset, before response 1")
            return Trajectory(
                str(task.get("id", "")), (), outcome_reward=float(observation.outcome_reward or 0.0)
            )
        for i, text in enumerate(responses):
            prompt_ids = observation_ids(observation, tokenizer)
            response_ids = [*tokenizer.encode(text, add_special_tokens=False), eos]
            result = await env.step(Action(text + tokenizer.eos_token, response_ids))
            steps.append(
                Step(
                    prompt_ids,
                    response_ids,
                    logprobs=[0.0] * len(response_ids),
                    reward=result.reward,
                    terminated=result.terminated,
                    truncated=result.truncated,
                    response_text=text,
                    info=dict(result.info),
                )
            )
            # Calls the env made to the policy it was lent (a demonstrated summary) are demonstrated too.
            steps.extend(result.policy_steps)
            roles += [observation.role] * (1 + len(result.policy_steps))
            if isinstance(result.outcome_reward, dict):
                outcome = dict(result.outcome_reward)
            elif result.outcome_reward is not None:
                outcome = float(result.outcome_reward)
            if "success" in result.info:
                info["success"] = reported_success(result.info["success"])
            ended = result.terminated or result.truncated
            if ended != (i == len(responses) - 1):
                state = "ended" if ended else "did not end"
                raise ValueError(
                    f"{where}: the environment {state} after response {i + 1} of {len(responses)}"
                )
            observation = result.observation
    finally:
        await env.close()
    return by_role(Trajectory(str(task.get("id", "")), (), info=info), steps, roles, outcome)


def replay_demonstrations(
    env_factory: Callable[[], AgentEnv],
    tokenizer: PreTrainedTokenizerBase,
    tasks: Sequence[Task],
    demonstrate: Callable[[Task, random.Random], list[str]],
    *,
    seed: int = 0,
) -> list[Trajectory]:
    """One demonstration per task (``demonstrate(task, rng)``), each replayed through a fresh env:
    its trajectory, or one per role for an episode of several roles (``replay_demonstration``)."""
    rng = random.Random(seed)
    demos = [(task, demonstrate(task, rng)) for task in tasks]

    async def replay_all() -> list[Trajectory]:
        episodes = await asyncio.gather(
            *(replay_demonstration(env_factory(), tokenizer, t, r) for t, r in demos)
        )
        return [t for e in episodes for t in (e if isinstance(e, list) else [e])]

    return asyncio.run(replay_all())


def sft_sequences(trajectories: Sequence[Trajectory]) -> list[TrainSequence]:
    """Training sequences (prefix-extending steps merged) whose spans mark the assistant tokens."""
    # ``train_sft`` pads its own batches from the sequences: the packed micro-batches go unused, so
    # one budget holds them all.
    return list(batch_of(trajectories, micro_batch_tokens=2**31).sequences)


def _padded_batch(sequences: Sequence[TrainSequence], pad_id: int):
    """Right-padded ids and target mask, both (B, T).

    No attention mask goes with them: under causal attention a real token never sees the padding
    after it, and positions count from 0 either way, so the padding changes no real token's logits
    and none of it is a target. Without a mask the forward takes the plain causal kernel: the
    quickstart's warm start steps took 308 ms instead of 334 (2 idle cores)."""
    T = max(len(s) for s in sequences)
    ids_BT = torch.full((len(sequences), T), pad_id, dtype=torch.long)
    target_BT = torch.zeros(len(sequences), T, dtype=torch.bool)
    for i, s in enumerate(sequences):
        ids_BT[i, : len(s)] = torch.tensor(s.token_ids)
        for span in s.spans:
            target_BT[i, span.start : span.start + span.length] = True
    return ids_BT, target_BT


def sft_loss(model, sequences: Sequence[TrainSequence], *, pad_token_id: int, share: bool = True) -> Tensor:
    """The summed negative log-likelihood of ``sequences``' span tokens under ``model`` (one forward).

    ``share``: as one packed micro-batch of prefix tries, scored at the span tokens only, where the
    model's attention kernel takes a custom mask (else, and without ``share``, right-padded)."""
    return _loss(model, sequences, pad_token_id, _pair_cost(model) if share else None)


def _pair_cost(model) -> float | None:
    """The prefix-tree cost model's attention weight for ``model``'s kernel and device; None where
    the kernel takes no custom mask (the warm start then pads)."""
    device = next(model.parameters()).device
    return kernel_pair_cost(attention_implementation(model), model.config, device)


def _loss(model, sequences: Sequence[TrainSequence], pad_token_id: int, pair_cost: float | None) -> Tensor:
    """``sft_loss`` with the cost model's weight given (None: right-padded)."""
    if pair_cost is None:
        ids_BT, target_BT = _padded_batch(sequences, pad_token_id)
        device = next(model.parameters()).device
        ids_BT, target_BT = ids_BT.to(device), target_BT.to(device)
        logits_BTV = model(input_ids=ids_BT).logits[:, :-1].float()
        nll_BT = F.cross_entropy(logits_BTV.transpose(1, 2), ids_BT[:, 1:], reduction="none")
        return (nll_BT * target_BT[:, 1:]).sum()
    trees = share_prefixes(sequences, pair_cost=pair_cost, max_width=sum(map(len, sequences)))
    # a budget that holds every row: one micro-batch (rows <= trees, each at most count_tokens wide)
    (micro_batch,) = pack_trees(trees, _span_rows(sequences), token_budget=count_tokens(trees) * len(trees))
    logprobs_K, _ = micro_batch_logprobs(model, micro_batch, temperature=1.0)
    return -logprobs_K.sum()


def _span_rows(sequences: Sequence[TrainSequence]) -> StepRows:
    """Flat offsets for the steps the spans name (``pack_trees`` numbers the scored tokens by them;
    the warm start reads none): the spans' tokens in step order."""
    lengths = {span.row: span.length for s in sequences for span in s.spans}
    offsets, offset = [0] * (max(lengths) + 1), 0
    for row in sorted(lengths):
        offsets[row], offset = offset, offset + lengths[row]
    return StepRows((), (), tuple(offsets))


def train_sft(
    model,
    sequences: Sequence[TrainSequence],
    config: SFTConfig = SFTConfig(),
    *,
    pad_token_id: int,
    log: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Minimise the NLL of the spans' tokens; returns the loss of every optimizer step.

    ``log(step, loss)`` is called after each optimizer step when given.
    """
    if not sequences:
        raise ValueError("train_sft: no sequences to train on (are the demonstrations empty?)")
    order = list(sequences)
    rng = random.Random(config.seed)
    steps_per_epoch = max(1, len(order) // config.batch_size)
    total = config.epochs * steps_per_epoch
    warmup = max(1, int(total * config.warmup_fraction))

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 1.0 - (1.0 - config.final_lr_fraction) * (step - warmup) / max(1, total - warmup)

    pair_cost = _pair_cost(model) if config.share_prefixes else None  # once (and its log line)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model.train()
    losses: list[float] = []
    for _ in range(config.epochs):
        rng.shuffle(order)
        for b in range(steps_per_epoch):
            batch = order[b * config.batch_size : (b + 1) * config.batch_size]
            n_targets = sum(span.length for s in batch for span in s.spans)
            optimizer.zero_grad(set_to_none=True)
            total_loss = 0.0
            for m in range(0, len(batch), config.micro_batch_size):
                loss = (
                    _loss(model, batch[m : m + config.micro_batch_size], pad_token_id, pair_cost) / n_targets
                )
                loss.backward()
                total_loss += loss.item()
            torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(total_loss)
            if log is not None:
                log(len(losses), total_loss)
    model.eval()
    return losses

"""One typed configuration tree for training: model, data, rollout, env, algorithm, trainer, logging.

Load it from YAML with dotted command-line overrides::

    config = load_config("configs/arithmetic_grpo.yaml", ["trainer.steps=50", "algorithm.kl_coef=0.01"])

Every field is documented once, here (``metadata["doc"]``). An unknown key or an invalid value raises
``ConfigError`` naming the dotted key and the reason (with a "did you mean" for near-miss keys).
The ``algorithm`` sections are the options dataclasses of ``agent_r1.algos`` themselves (documented
there), so every option of every estimator, loss, KL estimator and aggregation is settable from YAML
(``algorithm.policy_loss: {name: gspo, gspo_clip_high: 5e-4}``) and the command line
(``algorithm.policy_loss.dual_clip=3``). Defaults follow the papers: GRPO advantages (Shao et al. 2024,
arXiv 2402.03300) with the PPO clipped objective (Schulman et al. 2017) and DAPO's asymmetric clip
range and token-level loss (Yu et al. 2025, arXiv 2503.14476); ``kl.coef = 0`` as in DAPO and Dr. GRPO
(Liu et al. 2025, arXiv 2503.20783), which both drop the KL term for verifiable-reward training — so no
reference model is loaded by default.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from agent_r1.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    POLICY_LOSSES,
    AdvantageConfig,
    AggregationConfig,
    InvalidOption,
    KLConfig,
    OffPolicyConfig,
    PolicyLossConfig,
)

__all__ = [
    "MOVED_KEYS",
    "PATH_KEYS",
    "AlgorithmConfig",
    "ConfigError",
    "DataConfig",
    "DistillConfig",
    "DistributedConfig",
    "EnvConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "PolicyConfig",
    "RolloutConfig",
    "TrainConfig",
    "TrainerConfig",
    "add_import_dirs",
    "apply_overrides",
    "config_from_dict",
    "config_to_dict",
    "dump_config",
    "load_config",
    "resolve_paths",
]


class ConfigError(ValueError):
    """A configuration problem, always naming the dotted key and why."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"config key '{key}': {why}")
        self.key = key
        self.why = why


Check = Callable[[Any], str | None]  # returns the reason the value is invalid, or None


def _positive(x: Any) -> str | None:
    return None if x > 0 else f"must be > 0, got {x!r}"


def _non_negative(x: Any) -> str | None:
    return None if x >= 0 else f"must be >= 0, got {x!r}"


def _unit_interval(x: Any) -> str | None:
    return None if 0 <= x <= 1 else f"must be in [0, 1], got {x!r}"


def _optional(check: Check) -> Check:
    return lambda x: None if x is None else check(x)


def _opt(default: Any, doc: str, check: Check | None = None) -> Any:
    """A config field: its default, its one-line documentation and an optional value check."""
    metadata = {"doc": doc, "check": check}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    if is_dataclass(default):
        return field(default_factory=lambda: replace(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class LoraConfig:
    rank: int = _opt(
        0,
        "LoRA rank; 0 trains all weights. With LoRA the reference policy is the base model "
        "with the adapter disabled (no second copy).",
        _non_negative,
    )
    alpha: float = _opt(16.0, "LoRA scaling numerator (scale = alpha / rank).", _positive)
    dropout: float = _opt(0.0, "Dropout on the LoRA input.", _unit_interval)
    target_modules: list[str] = _opt(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Module names that receive adapters.",
    )


@dataclass(frozen=True)
class ModelConfig:
    path: str = _opt(
        "",
        "Hugging Face model folder or hub name of the policy (required). A folder holding a saved LoRA "
        "adapter (adapter_config.json and its weights, as save_model or a LoRA checkpoint's model/ "
        "writes it) means that adapter on its base: model.path becomes the base its "
        "adapter_config.json names, and model.adapter the folder.",
    )
    adapter: str | None = _opt(
        None,
        "A saved LoRA adapter folder the policy starts from, on the base model.path, trained on with its "
        "own rank and target modules (model.lora, when unset, takes its settings). Set for you when "
        "model.path is an adapter folder. With policies: every trained policy on the shared base that "
        "names no adapter of its own starts from it. The KL reference (algorithm.kl.coef > 0) is then "
        "the base with this adapter merged, a second copy, not the bare base.",
    )
    tokenizer: str | None = _opt(
        None, "Tokenizer folder; defaults to model.adapter when it holds one, else model.path."
    )
    dtype: Literal["float32", "bfloat16"] = _opt("float32", "Parameter and compute dtype of the learner.")
    gradient_checkpointing: bool = _opt(False, "Recompute activations in the backward pass to save memory.")
    lora: LoraConfig = _opt(LoraConfig(), "LoRA adapter (peft).")
    device: str = _opt(
        "auto",
        "Where the learner (policy, reference, critic) and an in-process HF engine run: 'auto' (the "
        "first CUDA device when there is one, else the CPU), 'cpu', 'cuda' or 'cuda:N'. Ray learner "
        "workers and rollout actors use the GPU Ray gives them.",
        lambda x: (
            None
            if x in ("auto", "cpu", "cuda") or (x.startswith("cuda:") and x[5:].isdigit())
            else f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {x!r}"
        ),
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = _opt(
        None,
        "Attention kernel of the policy, reference and critic (Hugging Face's attn_implementation); "
        "None keeps the model's default (sdpa). Prefix trees (trainer.share_prefixes) need a kernel "
        "that takes a custom mask (sdpa, eager) and switch off under flash_attention_2.",
    )


@dataclass(frozen=True)
class DataConfig:
    train: str = _opt(
        "",
        "Training tasks: a .parquet / .jsonl / .json file, or a Hugging Face dataset "
        "name or saved folder (required unless tasks are passed in Python).",
    )
    val: str | None = _opt(None, "Validation tasks (same formats); evaluation is skipped when unset.")
    split: str = _opt("train", "Split to read from a Hugging Face dataset.")
    val_split: str = _opt("test", "Split to read from a Hugging Face validation dataset.")
    required_fields: list[str] = _opt(
        [], "Fields every row must have; a row without one is an error naming the row and the field."
    )
    shuffle: bool = _opt(True, "Reshuffle the training tasks every epoch (seeded: resume-exact).")
    max_val_tasks: int | None = _opt(
        None, "Evaluate on at most this many validation tasks.", _optional(_positive)
    )


@dataclass(frozen=True)
class RolloutConfig:
    n: int = _opt(8, "Samples per task (the group size of GRPO / RLOO baselines).", _positive)
    temperature: float = _opt(
        1.0, "Sampling temperature; the learner uses the same one for its log-probs.", _positive
    )
    top_p: float = _opt(
        1.0,
        "Nucleus sampling (keep 1.0 for unbiased on-policy log-probs).",
        lambda x: None if 0 < x <= 1 else f"must be in (0, 1], got {x!r}",
    )
    top_k: int = _opt(
        -1,
        "Top-k sampling; -1 disables it.",
        lambda x: None if x == -1 or x >= 1 else f"must be -1 or >= 1, got {x!r}",
    )
    max_tokens: int = _opt(256, "Maximum response tokens per step.", _positive)
    max_steps: int = _opt(
        8,
        "Maximum agent steps (turns) per trajectory, enforced by the flow whatever the env; an env's own "
        "limit (ToolEnv's max_turns) applies too, so the smaller one ends the episode.",
        _positive,
    )
    max_prompt_tokens: int = _opt(
        2048, "Longest prompt shown to the model; longer ones are truncated.", _positive
    )
    max_batch_size: int = _opt(64, "Concurrent sequences in the HF engine's continuous batch.", _positive)
    share_model: bool = _opt(
        True,
        "HF engine and learner share one model object (weight sync is a "
        "version bump); False gives the engine its own copy synced by update_weights.",
    )
    eval_temperature: float = _opt(0.0, "Temperature for evaluation rollouts (0 = greedy).", _non_negative)
    eval_n: int = _opt(1, "Samples per validation task.", _positive)
    engine: Literal["hf", "vllm"] = _opt(
        "hf",
        "Rollout engine, in this process and in each Ray rollout actor alike: 'hf' (continuous "
        "batching over the Hugging Face model; in one process it shares the learner's model) or "
        "'vllm' (vLLM over model.path, weights pushed after every update).",
    )
    engine_kwargs: dict[str, Any] = _opt(
        {},
        "Extra keyword arguments for the engine: vLLM's (gpu_memory_utilization, max_model_len, "
        "enable_sleep_mode: the engine sleeps during each update on one GPU, ...) or HFEngine's.",
    )


@dataclass(frozen=True)
class EnvConfig:
    name: str = _opt(
        "",
        "Environment name in the env registry, or 'package.module:Factory' (required "
        "unless an env factory is passed in Python).",
    )
    kwargs: dict[str, Any] = _opt({}, "Keyword arguments for the environment factory.")


def _teacher_device(x: str) -> str | None:
    if x in ("learner", "cpu", "cuda") or (x.startswith("cuda:") and x[5:].isdigit()):
        return None
    return f"must be 'learner', 'cpu', 'cuda' or 'cuda:N', got {x!r}"


@dataclass(frozen=True)
class DistillConfig:
    """On-policy distillation (``agent_r1.algos.distill``; docs/algorithms.md): each action token the
    policy sampled gets ``-coef * (log p_student - log p_teacher)`` added to its advantage."""

    teacher: str = _opt(
        "",
        "The teacher: a local Hugging Face model folder sharing the policy's tokenizer (any size or "
        "architecture), or the base URL (http://host:port/v1) of an OpenAI-compatible server that "
        "returns prompt log-probs on /v1/completions (vLLM's prompt_logprobs, agent-r1 serve). "
        "Empty: no distillation.",
    )
    teacher_model: str | None = _opt(
        None, "Server teacher: the model name sent with each request; None: the server's first model."
    )
    api_key_env: str | None = _opt(
        None, "Server teacher: the environment variable holding its API key (sent as a Bearer token)."
    )
    device: str = _opt(
        "learner",
        "Local teacher: 'learner' (the learner's device, like the reference model; on Ray each learner "
        "worker's) or a device of its own ('cpu', 'cuda', 'cuda:N'; in one process only).",
        _teacher_device,
    )
    coef: float = _opt(
        1.0,
        "Weight of the per-token reverse-KL advantage -(log p_student - log p_teacher). It sets the "
        "balance with the env's advantages (reward_weight) and any KL or entropy term; distilling alone "
        "it only scales the loss, which Adam's update all but ignores (raise trainer.lr instead).",
        _positive,
    )
    reward_weight: float = _opt(
        0.0,
        "Weight of the estimator's advantages from the env's rewards, to which the distillation term "
        "is added: 0 distils alone, 1 adds it to the RL advantage.",
        _non_negative,
    )


@dataclass(frozen=True)
class AlgorithmConfig:
    """Each algorithm concept is one section whose fields are documented once, in the dataclass of
    ``agent_r1.algos`` that owns them and receives them unchanged; a bare name is short for
    ``{name: ...}`` (``advantage: grpo``). Any registered name works, a custom one included."""

    advantage: AdvantageConfig = _opt(
        AdvantageConfig(), "Advantage estimator and its settings (agent_r1.algos.AdvantageConfig)."
    )
    policy_loss: PolicyLossConfig = _opt(
        PolicyLossConfig(), "Policy loss and its settings (agent_r1.algos.PolicyLossConfig)."
    )
    loss_aggregation: AggregationConfig = _opt(
        AggregationConfig(), "How per-token losses become one scalar (agent_r1.algos.AggregationConfig)."
    )
    kl: KLConfig = _opt(KLConfig(), "KL to the reference policy (agent_r1.algos.KLConfig).")
    off_policy: OffPolicyConfig = _opt(
        OffPolicyConfig(),
        "Correction for tokens the sampler drew with other probabilities than the learner's old policy: "
        "TIS, masked IS, IcePop (agent_r1.algos.OffPolicyConfig).",
    )
    entropy_coef: float = _opt(0.0, "Entropy bonus weight.", _non_negative)
    value_coef: float = _opt(0.5, "Value loss weight (critic estimators only).", _non_negative)
    value_clip: float | None = _opt(
        0.2, "Value clipping range (critic estimators only); null = unclipped.", _optional(_positive)
    )
    dynamic_filter: bool = _opt(
        False, "DAPO dynamic sampling: drop groups whose rewards all agree (zero advantage, no gradient)."
    )
    resample_rounds: int = _opt(
        0,
        "With dynamic_filter: up to this many extra rollouts per step, each of fresh tasks, until "
        "trainer.tasks_per_step groups survive the filter (DAPO's over-sampling); 0 trains on the survivors.",
        _non_negative,
    )
    old_logprobs: Literal["learner", "sampler"] = _opt(
        "learner",
        "Where PPO's old log-probs come from: the learner's recomputation before the update, or "
        "the sampler's own log-probs.",
    )
    distill: DistillConfig = _opt(DistillConfig(), "On-policy distillation from a teacher (DistillConfig).")


@dataclass(frozen=True)
class TrainerConfig:
    steps: int = _opt(100, "Training steps (one rollout batch + update each).", _positive)
    tasks_per_step: int = _opt(8, "Tasks sampled per step (each rolled out rollout.n times).", _positive)
    ppo_epochs: int = _opt(1, "Passes over each rollout batch.", _positive)
    mini_batches: int = _opt(1, "Optimizer steps per epoch (the batch is split into this many).", _positive)
    micro_batch_tokens: int = _opt(
        8192, "Token budget of one forward/backward micro-batch (packed).", _positive
    )
    share_prefixes: bool = _opt(
        True,
        "Compute a prefix shared by several training sequences (a group's prompt) once, as a prefix "
        "tree: on the CPU under sdpa every shared prefix, attention run segment by segment; elsewhere "
        "with a tree attention mask, where the cost model says it pays. Needs an attention kernel "
        "that takes a custom mask (sdpa, eager), so it is off under flash-attention.",
    )
    lr: float = _opt(1e-6, "Peak learning rate (AdamW).", _positive)
    critic_lr: float = _opt(1e-5, "Critic (value head) learning rate.", _positive)
    weight_decay: float = _opt(0.0, "AdamW weight decay.", _non_negative)
    betas: list[float] = _opt([0.9, 0.999], "AdamW betas.")
    warmup_steps: int = _opt(0, "Linear learning-rate warmup, in optimizer steps.", _non_negative)
    lr_schedule: Literal["cosine", "constant"] = _opt("constant", "Decay after warmup.")
    min_lr_ratio: float = _opt(0.0, "Cosine floor as a fraction of the peak lr.", _unit_interval)
    max_grad_norm: float = _opt(1.0, "Gradient clipping norm.", _positive)
    seed: int = _opt(0, "Seed of data order, sampling and initialisation.")
    eval_every: int = _opt(
        0,
        "Evaluate on the validation tasks every k steps, and before the first and after the last; 0 = "
        "no evaluation at all, even when validation tasks are given.",
        _non_negative,
    )
    checkpoint_every: int = _opt(
        0, "Checkpoint every k steps (and at the end); 0 = only at the end.", _non_negative
    )
    keep_checkpoints: int = _opt(2, "Keep the last k checkpoints.", _positive)
    run_dir: str = _opt("runs/agent-r1", "Run directory (config, metrics, tb, trajectories, checkpoints).")
    mode: Literal["sync", "async"] = _opt(
        "sync",
        "'sync': roll out, then update (on-policy). 'async': the rollout of step k+1 runs while step "
        "k trains, in this process (a rollout thread and an engine copy: rollout.share_model: false, "
        "or vLLM) or on Ray; needs an off-policy correction (algorithm.off_policy).",
    )
    max_staleness: int = _opt(
        1,
        "Async mode: the most policy versions a trained step may lag the policy its update starts "
        "from. Sampling waits for the learner (it is never run further ahead and nothing finished is "
        "dropped); without partial rollouts, engine weights are refreshed only when the next rollout "
        "would exceed it.",
        _positive,
    )
    partial_rollouts: bool = _opt(
        True,
        "Async mode: push each update into the rollout in flight; its trajectories continue with the "
        "new weights from their next step (each step records the version that sampled it). False: "
        "the rollout in flight finishes on the weights it started with.",
    )
    torch_threads: int | None = _opt(
        None, "torch.set_num_threads; None keeps torch's default.", _optional(_positive)
    )
    retain_freed_memory: bool = _opt(
        False,
        "Keep freed memory in the process (glibc's mallopt: allocations up to 32 MiB from the heap, "
        "never trimmed, one arena) instead of returning it to the kernel: on the CPU every reused "
        "large tensor otherwise pays a page fault per 4 KiB (the quickstart race's iteration ran 12% "
        "faster, its update 18%). The resident set stays at its peak. No effect, with a warning, without glibc.",
    )
    deterministic: bool = _opt(
        False,
        "Bitwise-reproducible runs: a rerun with the same seed, and a run killed anywhere and resumed, "
        "give the same metrics (timings aside), trajectories and weights on the same machine and "
        "software. The HF engine then decodes batch-invariantly (each request's result does not depend on "
        "which requests share its batch; one request at a time with no prefix reuse on a GPU or at more "
        "than one thread), torch runs deterministic algorithms with "
        "a fixed thread count (trainer.torch_threads, default 1 here), MKL in its reproducible mode "
        "(MKL_CBWR, default AUTO) and, on CUDA, CUBLAS_WORKSPACE_CONFIG=:4096:8 without cuDNN "
        "benchmarking. Slower: docs/training.md gives the cost.",
    )
    preemption_grace_s: float = _opt(
        30.0,
        "On SIGTERM or SIGINT the run stops sampling, checkpoints at the last consistent point and "
        "exits with code 4 (docs/training.md, Preemption); if that checkpoint cannot be written within "
        "this many seconds of the signal, it exits with code 5 and the previous checkpoint stands. Set "
        "it below the scheduler's own grace (Kubernetes' terminationGracePeriodSeconds, SLURM's KillWait).",
        _positive,
    )
    max_error_fraction: float = _opt(
        1.0,
        "Error budget: the run stops (TrainingHalted, exit code 3) naming the first error when more "
        "than this fraction of a rollout's trajectories (a step's, an evaluation's) end in ERROR, and "
        "always when every one does; 1.0 stops only then, 0 at the first error.",
        _unit_interval,
    )


@dataclass(frozen=True)
class LoggingConfig:
    progress: bool = _opt(True, "Show a rich progress bar.")
    tensorboard: bool = _opt(True, "Write TensorBoard event files under RUN_DIR/tb.")
    wandb_project: str | None = _opt(None, "Log to Weights & Biases under this project (needs wandb).")
    wandb_name: str | None = _opt(None, "W&B run name.")
    dump_trajectories: bool = _opt(True, "Write each step's trajectories to RUN_DIR/trajectories/.")
    report: bool = _opt(True, "Write RUN_DIR/report.html (as `agent-r1 report`) when training ends.")


@dataclass(frozen=True)
class DistributedConfig:
    backend: Literal["none", "ray"] = _opt(
        "none", "'none' trains in this process; 'ray' places rollout actors and learner workers on Ray."
    )
    address: str | None = _opt(
        None, "Ray cluster address ('auto' joins a running cluster); None starts a local one."
    )
    num_rollout_actors: int = _opt(2, "Rollout engine actors (each holds one engine).", _positive)
    num_learner_workers: int = _opt(1, "torch.distributed learner workers (data parallel).", _positive)
    torch_backend: Literal["gloo", "nccl"] = _opt(
        "gloo", "torch.distributed backend of the learner group (gloo on CPU, nccl on GPUs)."
    )
    strategy: Literal["ddp", "fsdp2"] = _opt(
        "ddp",
        "Data parallelism of the learner group: 'ddp' (DistributedDataParallel, a full replica per "
        "worker) or 'fsdp2' (fully_shard per decoder layer: parameters, gradients and optimizer state "
        "sharded over the workers).",
    )
    rollout_num_cpus: float = _opt(0.0, "Ray CPUs reserved per rollout actor.", _non_negative)
    rollout_num_gpus: float = _opt(0.0, "Ray GPUs reserved per rollout actor.", _non_negative)
    learner_num_cpus: float = _opt(0.0, "Ray CPUs reserved per learner worker.", _non_negative)
    learner_num_gpus: float = _opt(0.0, "Ray GPUs reserved per learner worker.", _non_negative)
    max_actor_restarts: int = _opt(
        3,
        "Rollout actor deaths tolerated per step (each restarts the actor and re-queues its work).",
        _non_negative,
    )
    max_learner_restarts: int = _opt(
        3,
        "Learner group rebuilds tolerated per run: a dead learner worker makes the driver start a new "
        "group from the last checkpoint and replay the optimizer steps taken since (their mini-batches "
        "are kept in the driver until the next checkpoint), so the run continues in-process with every "
        "sample trained exactly once; past the bound the run stops with LearnerFailure (then --resume). "
        "0 keeps no mini-batches and stops at the first death.",
        _non_negative,
    )
    placement: Literal["default", "spread"] = _opt(
        "default",
        "How Ray places the rollout actors and learner workers: 'default' (Ray's: the driver's node "
        "first, while it has room) or 'spread' (actor k of each kind is pinned to the k-th node alive "
        "when it is created, the driver's first; a restarted actor goes to the nodes alive then; "
        "GPU actors only prefer that node, so one without the GPUs passes them on).",
    )


@dataclass(frozen=True)
class PolicyConfig:
    """How one policy of ``policies`` is held (docs/multi_agent.md): a LoRA adapter of its name on
    the shared base, trained unless ``frozen``; or a model of its own (``path``); frozen, it is the
    base model with every adapter off, the adapter saved in ``adapter``, the model in ``path``, or the
    model of an OpenAI-compatible ``server``."""

    frozen: bool = _opt(
        False,
        "Not trained, sampled as it is (a fixed partner or opponent): the base model with every adapter "
        "off, or the adapter in `adapter`, or the model of `server`.",
    )
    lr: float | None = _opt(None, "This policy's learning rate; default trainer.lr.", _optional(_positive))
    adapter: str | None = _opt(
        None,
        "A LoRA adapter folder that peft saved (save_pretrained: adapter_config.json and its weights; "
        "a checkpoint's model/<policy>/, or model/ of a one-policy run), loaded onto the shared base "
        "under this policy's name with its own rank and target modules. Frozen: sampled as it is; "
        "trained: the adapter starts from these weights, with a fresh optimizer.",
    )
    path: str | None = _opt(
        None,
        "A model of its own (a Hugging Face model folder) instead of an adapter on the shared base: "
        "trained, a LoRA adapter of this policy's name on it (model.lora's settings) with its own "
        "optimizer; frozen, sampled as it is. It must share the run's tokenizer (vocabulary and chat "
        "template: an episode is tokenized once for every role). The HF engine samples it, in sync mode.",
    )
    server: str | None = _opt(
        None,
        "Frozen only: the base URL (http://host:port/v1) of an OpenAI-compatible server (vllm serve, "
        "agent-r1 serve) that samples this policy's roles instead of the local engine. Prompts go as "
        "token ids and responses come back as token ids: the server must share the policy's tokenizer.",
    )
    model: str | None = _opt(
        None, "Server policy: the model name sent with each request; None: the server's first model."
    )
    api_key_env: str | None = _opt(
        None, "Server policy: the environment variable holding its API key (sent as a Bearer token)."
    )


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = _opt(ModelConfig(), "The policy model.")
    data: DataConfig = _opt(DataConfig(), "Training and validation tasks.")
    rollout: RolloutConfig = _opt(RolloutConfig(), "Sampling.")
    env: EnvConfig = _opt(EnvConfig(), "The environment.")
    algorithm: AlgorithmConfig = _opt(AlgorithmConfig(), "Advantages, losses, KL.")
    trainer: TrainerConfig = _opt(TrainerConfig(), "Optimisation and run bookkeeping.")
    logging: LoggingConfig = _opt(LoggingConfig(), "Progress, TensorBoard, W&B, dumps.")
    distributed: DistributedConfig = _opt(DistributedConfig(), "Scale-out on Ray (docs/distributed.md).")
    policies: dict[str, PolicyConfig] = _opt(
        {},
        "Several policies in one run (docs/multi_agent.md): policy name -> how it is held. A trained "
        "policy is a LoRA adapter of that name on the one shared base (model.lora's settings) with "
        "its own optimizer state; empty: one policy, as in any run.",
    )
    roles: dict[str, str] = _opt(
        {},
        "Role name -> the policy (in policies) that plays it; a role not listed is played by the policy "
        "of its own name. Roles are named by the env (Observation.role) or the agent's model names.",
    )


# --- building and validating -------------------------------------------------------------------


# PyYAML reads YAML 1.1, where a float needs a dot: `3e-4` arrives as the string "3e-4". Papers' clip
# ranges are written exactly so, so a float field accepts that spelling.
_YAML11_EXPONENT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``tp`` (coercing int -> float and list -> list[...])."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(key, option, value)
            except ConfigError as e:
                errors.append(e.why)
        raise ConfigError(key, "; ".join(errors))
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(key, f"must be one of {list(choices)}, got {value!r}")
        return value
    if is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, str) and _is_named(tp):
            value = {"name": value}
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a mapping of {tp.__name__} fields, got {value!r}")
        return _build(tp, value, key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)[:1]
        return [_coerce(f"{key}[{i}]", item_tp, v) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a mapping, got {value!r}")
        _, value_tp = typing.get_args(tp) or (Any, Any)
        return {
            name: _coerce(f"{key}.{name}", value_tp, {} if value_tp is not Any and item is None else item)
            for name, item in value.items()
        }
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value.strip()):
            return float(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {key}")


_ENGINE_MOVED = "the engine is chosen the same way in one process and on Ray"
_ALGORITHM_MOVED = "each algorithm option lives in the section of the concept it belongs to"
_ASYNC_MOVED = "asynchronous training is the trainer's, in one process as on Ray"
MOVED_KEYS = {
    "distributed.mode": ("trainer.mode", _ASYNC_MOVED),
    "distributed.max_staleness": ("trainer.max_staleness", _ASYNC_MOVED),
    "distributed.engine": ("rollout.engine", _ENGINE_MOVED),
    "distributed.engine_kwargs": ("rollout.engine_kwargs", _ENGINE_MOVED),
    "algorithm.clip_low": ("algorithm.policy_loss.clip_low", _ALGORITHM_MOVED),
    "algorithm.clip_high": ("algorithm.policy_loss.clip_high", _ALGORITHM_MOVED),
    "algorithm.tis_cap": (
        "algorithm.off_policy.tis_cap, with algorithm.off_policy.name: tis",
        _ALGORITHM_MOVED,
    ),
    "algorithm.policy_loss.tis_cap": (
        "algorithm.off_policy.tis_cap, with algorithm.off_policy.name: tis",
        "off-policy corrections are their own section",
    ),
    "algorithm.gamma": ("algorithm.advantage.gamma", _ALGORITHM_MOVED),
    "algorithm.lam": ("algorithm.advantage.lam", _ALGORITHM_MOVED),
    "algorithm.norm_by_std": ("algorithm.advantage.norm_by_std", _ALGORITHM_MOVED),
    "algorithm.normalize_advantages": ("algorithm.advantage.whiten", _ALGORITHM_MOVED),
    "algorithm.kl_coef": ("algorithm.kl.coef", _ALGORITHM_MOVED),
    "algorithm.kl_estimator": ("algorithm.kl.estimator", _ALGORITHM_MOVED),
}
"""Keys that moved: an old config that sets one gets an error saying where it went, and why."""


def _moved(dotted: str) -> None:
    if dotted in MOVED_KEYS:
        new, why = MOVED_KEYS[dotted]
        raise ConfigError(dotted, f"moved to '{new}' ({why}): set that key instead")


def _build(cls: type, data: Mapping[str, Any], prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            _moved(dotted)
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(dotted, f"unknown key{hint}; known keys: {sorted(known)}")
    kwargs = {}
    for name, f in known.items():
        dotted = f"{prefix}.{name}" if prefix else name
        if name in data:
            value = _coerce(dotted, hints[name], data[name])
        elif f.default is not MISSING:
            value = f.default
        else:
            value = f.default_factory()
        check = f.metadata.get("check")
        reason = check(value) if check else None
        if reason:
            raise ConfigError(dotted, reason)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except InvalidOption as error:
        raise ConfigError(f"{prefix}.{error.field}" if prefix else error.field, error.why) from None


def _is_named(cls: type) -> bool:
    """A section selected by name (``{name: ..., <its options>}``), which a bare name stands for."""
    return is_dataclass(cls) and any(f.name == "name" for f in fields(cls))


def config_from_dict(data: Mapping[str, Any] | None = None, folder: str | Path | None = None) -> TrainConfig:
    """Build and validate a ``TrainConfig`` from a nested mapping (missing keys take defaults).
    ``folder``: the config file's, where relative paths are also looked for (``resolve_paths``).
    A saved adapter at ``model.path`` is read as its base plus ``model.adapter`` (``resolve_adapter``)."""
    config = _build(TrainConfig, data or {})
    if folder is not None:
        config = resolve_paths(config, folder)
    config = resolve_adapter(config)
    _check_cross_field(config)
    return config


def resolve_adapter(config: TrainConfig) -> TrainConfig:
    """The one meaning of a model folder (``agent_r1.models.loading.model_folder``): when
    ``model.path`` holds a saved LoRA adapter, ``model.path`` becomes its base, ``model.adapter`` the
    folder and ``model.tokenizer`` (unset) the folder when it holds a tokenizer; ``model.lora`` (rank
    0) takes the adapter's settings, so that the run is a LoRA run. A ``model.adapter`` is checked to
    be a LoRA adapter folder. Anything else is returned unchanged."""
    from agent_r1.models.loading import ModelNotFoundError, adapter_folder_problem, model_folder

    model = config.model
    if not model.path:
        if model.adapter is not None:
            raise ConfigError("model.path", "model.adapter needs its base model: set model.path")
        return config
    try:
        folder = model_folder(model.path, key=None)
    except ModelNotFoundError as error:
        raise ConfigError("model.path", str(error)) from None
    if folder.adapter is not None:
        if model.adapter is not None:
            raise ConfigError(
                "model.adapter",
                f"model.path {model.path!r} is itself a saved LoRA adapter: give its base model as "
                "model.path, or leave model.adapter unset",
            )
        model = replace(
            model,
            path=folder.base,
            adapter=folder.adapter,
            tokenizer=model.tokenizer or (folder.adapter if folder.has_tokenizer else None),
        )
    elif model.adapter is not None:
        problem = adapter_folder_problem(Path(model.adapter))
        if problem is not None:
            raise ConfigError("model.adapter", problem)
    else:
        return config
    if model.lora.rank == 0:
        saved = json.loads((Path(model.adapter) / "adapter_config.json").read_text(encoding="utf-8"))
        targets = saved.get("target_modules")
        model = replace(
            model,
            lora=LoraConfig(
                rank=int(saved["r"]),
                alpha=float(saved.get("lora_alpha", saved["r"])),
                dropout=float(saved.get("lora_dropout") or 0.0),
                target_modules=sorted(targets) if isinstance(targets, list) else model.lora.target_modules,
            ),
        )
    return replace(config, model=model)


def config_to_dict(config: Any) -> dict[str, Any]:
    return asdict(config)


def _check_cross_field(config: TrainConfig) -> None:
    _check_registered_names(config)
    _check_needs(config)
    _check_policies(config)
    if len(config.trainer.betas) != 2:
        raise ConfigError("trainer.betas", f"must hold two numbers, got {config.trainer.betas}")
    batch = config.trainer.tasks_per_step * config.rollout.n
    if config.trainer.mini_batches > batch:
        raise ConfigError(
            "trainer.mini_batches",
            f"{config.trainer.mini_batches} mini-batches cannot split {batch} trajectories per step",
        )
    dist, algo = config.distributed, config.algorithm
    if algo.resample_rounds and not algo.dynamic_filter:
        raise ConfigError(
            "algorithm.resample_rounds", "refills groups dropped by algorithm.dynamic_filter: set it"
        )
    if algo.dynamic_filter and config.rollout.n < 2:
        raise ConfigError(
            "algorithm.dynamic_filter",
            "drops each group whose samples' rewards agree, and with rollout.n: 1 every group is one "
            "sample: every group would be dropped; set rollout.n >= 2 or dynamic_filter: false",
        )
    asynchronous = config.trainer.mode == "async"
    if (
        asynchronous
        and dist.backend == "none"
        and config.rollout.engine == "hf"
        and config.rollout.share_model
    ):
        raise ConfigError(
            "rollout.share_model",
            "trainer.mode: async samples while the learner updates, so the HF engine needs its own copy "
            "of the weights: set rollout.share_model: false (or use rollout.engine: vllm)",
        )
    if config.trainer.deterministic and config.rollout.engine != "hf":
        raise ConfigError(
            "trainer.deterministic",
            f"needs rollout.engine: hf (its batch-invariant decode); {config.rollout.engine!r} batches "
            "requests as they come",
        )
    if config.trainer.deterministic and asynchronous and config.trainer.partial_rollouts:
        raise ConfigError(
            "trainer.deterministic",
            "trainer.partial_rollouts lands each update wherever the rollout in flight has got to, which "
            "depends on timing: set trainer.partial_rollouts: false (or trainer.mode: sync)",
        )
    if algo.resample_rounds and asynchronous:
        raise ConfigError(
            "algorithm.resample_rounds", "not available with trainer.mode: async (its rollouts run ahead)"
        )
    if asynchronous and algo.old_logprobs == "learner" and algo.off_policy.name == "none":
        raise ConfigError(
            "trainer.mode",
            "async rollouts are sampled by an older policy: correct for it with algorithm.off_policy "
            "(tis, mis_step, mis_trajectory or icepop: weights against the sampler) or "
            "algorithm.old_logprobs: sampler",
        )
    _check_distill(algo)
    if algo.off_policy.name != "none" and algo.old_logprobs == "sampler":
        raise ConfigError(
            "algorithm.off_policy.name",
            "corrects the learner's old log-probs against the sampler's, but algorithm.old_logprobs: "
            "sampler makes them the same (every weight 1): use old_logprobs: learner",
        )


def _check_policies(config: TrainConfig) -> None:
    """``policies`` / ``roles``: what several policies in one run need, and what they do not have yet."""
    if not config.policies:
        if config.roles:
            raise ConfigError("roles", "maps roles to policies, but no policies are configured: add policies")
        return
    for role, policy in config.roles.items():
        if policy not in config.policies:
            raise ConfigError(
                f"roles.{role}",
                f"names policy {policy!r}, which is not in policies {sorted(config.policies)}",
            )
    trained = [name for name, policy in config.policies.items() if not policy.frozen]
    if not trained:
        raise ConfigError("policies", "every policy is frozen: nothing would train")
    for name, policy in config.policies.items():
        if policy.frozen and policy.lr is not None:
            raise ConfigError(f"policies.{name}.lr", "a frozen policy has no optimizer: remove lr")
        if name == "__base__" or not name.isidentifier():
            raise ConfigError(f"policies.{name}", "a policy name must be an identifier (it names an adapter)")
        _check_policy_source(config, name, policy)
    if config.model.lora.rank <= 0:
        raise ConfigError(
            "model.lora.rank",
            "each trained policy is a LoRA adapter on the shared base: set model.lora.rank (e.g. 8)",
        )
    ray = config.distributed.backend != "none"
    unsupported = (
        ("distributed.strategy", ray and config.distributed.strategy != "ddp", "need ddp (one per adapter)"),
        ("algorithm.advantage.name", _needs_critic(config), "has no critic per policy yet"),
    )
    for key, refused, why in unsupported:
        if refused:
            raise ConfigError(key, f"several policies (policies: {sorted(config.policies)}) {why}")


def _check_policy_source(config: TrainConfig, name: str, policy: PolicyConfig) -> None:
    """``adapter`` / ``path`` / ``server`` (and the server's ``model``, ``api_key_env``) of policy
    ``name``. The adapter and model folders themselves are checked where the run starts
    (``agent_r1.train.policies.check_adapters``, ``check_own_models``)."""
    key = f"policies.{name}"
    if policy.path is not None:
        _check_own_model(config, name, policy)
    if policy.server is not None:
        if not policy.frozen:
            raise ConfigError(
                f"{key}.server", "a policy sampled by a server is not trained here: set frozen: true"
            )
        if policy.adapter is not None:
            raise ConfigError(f"{key}.adapter", "a policy is an adapter or a server, not both")
        if not policy.server.startswith(("http://", "https://")):
            raise ConfigError(f"{key}.server", f"must be a URL http://host:port/v1, got {policy.server!r}")
        if config.trainer.deterministic:
            raise ConfigError(
                "trainer.deterministic",
                f"policy {name!r} is sampled by a server, which batches requests as they come",
            )
    for option in ("model", "api_key_env"):
        if getattr(policy, option) is not None and policy.server is None:
            raise ConfigError(f"{key}.{option}", "applies to a policy sampled by a server: set server")


def _check_own_model(config: TrainConfig, name: str, policy: PolicyConfig) -> None:
    """A policy with a model of its own (``path``): what it is not combined with, and what it runs on."""
    key = f"policies.{name}"
    for other in ("adapter", "server"):
        if getattr(policy, other) is not None:
            raise ConfigError(f"{key}.{other}", f"a policy is a model of its own (path) or {other}, not both")
    if config.distributed.backend != "none":
        raise ConfigError(
            "distributed.backend",
            f"policy {name!r} has a model of its own (policies.{name}.path), which runs in one process "
            "for now: set distributed.backend: none",
        )
    if config.rollout.engine != "hf":
        raise ConfigError(
            "rollout.engine",
            f"policy {name!r} has a model of its own (policies.{name}.path), which the HF engine samples; "
            f"{config.rollout.engine!r} serves adapters of one base model: set rollout.engine: hf",
        )
    if not policy.frozen and (not config.rollout.share_model or config.trainer.mode == "async"):
        raise ConfigError(
            "rollout.share_model",
            f"policy {name!r} trains a model of its own (policies.{name}.path), which its engine shares "
            "for now (no weight sync to a copy): set rollout.share_model: true and trainer.mode: sync",
        )
    if not any(not p.frozen and p.path is None for p in config.policies.values()):
        raise ConfigError(
            key,
            "no trained policy is an adapter on the shared base (model.path): make model.path the "
            "model of one trained policy and drop that policy's path",
        )


def _needs_critic(config: TrainConfig) -> bool:
    return ADVANTAGE_ESTIMATORS.needs(config.algorithm.advantage.name).critic is not None


def _check_distill(algo: AlgorithmConfig) -> None:
    distill = algo.distill
    server = distill.teacher.startswith(("http://", "https://"))
    for key in ("teacher_model", "api_key_env"):
        if getattr(distill, key) is not None and not server:
            raise ConfigError(
                f"algorithm.distill.{key}", "applies to a server teacher: algorithm.distill.teacher is no URL"
            )
    if server and distill.device != "learner":
        raise ConfigError("algorithm.distill.device", "applies to a local teacher; this one is a server")
    if distill.teacher and algo.dynamic_filter and distill.reward_weight == 0:
        raise ConfigError(
            "algorithm.dynamic_filter",
            "drops the groups whose rewards agree, but distillation alone (algorithm.distill."
            "reward_weight: 0) learns from every sample: set dynamic_filter: false",
        )


def _check_registered_names(config: TrainConfig) -> None:
    """Reject unknown algorithm names at load time, naming the key and the available choices."""
    algo = config.algorithm
    checks = (
        ("algorithm.advantage.name", algo.advantage.name, ADVANTAGE_ESTIMATORS),
        ("algorithm.policy_loss.name", algo.policy_loss.name, POLICY_LOSSES),
        ("algorithm.loss_aggregation.name", algo.loss_aggregation.name, LOSS_AGGREGATIONS),
        ("algorithm.kl.estimator", algo.kl.estimator, KL_ESTIMATORS),
        ("algorithm.off_policy.name", algo.off_policy.name, OFF_POLICY_CORRECTIONS),
    )
    for key, value, registry in checks:
        if value not in registry:
            raise ConfigError(key, f"unknown {registry.kind} {value!r}; choose one of {sorted(registry)}")


def _check_needs(config: TrainConfig) -> None:
    """What the chosen estimator and loss declared they need (``agent_r1.algos.Needs``), against the
    rest of the config."""
    algo, trainer = config.algorithm, config.trainer
    estimator = ADVANTAGE_ESTIMATORS.needs(algo.advantage.name)
    if config.rollout.n < estimator.min_group_size:
        raise ConfigError(
            "rollout.n",
            f"the '{algo.advantage.name}' baseline needs n >= {estimator.min_group_size} samples per "
            f"task, got {config.rollout.n}",
        )
    loss = POLICY_LOSSES.needs(algo.policy_loss.name)
    updates = trainer.ppo_epochs * trainer.mini_batches
    if loss.single_update and updates > 1:
        raise ConfigError(
            "algorithm.policy_loss.name",
            f"'{algo.policy_loss.name}' is correct only on-policy (one optimizer step per rollout "
            f"batch), but trainer.ppo_epochs x trainer.mini_batches = {updates}: set both to 1 or use a "
            "ratio-based loss (ppo_clip, gspo, cispo)",
        )


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars / lists) to a nested dict."""
    data = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override must look like key.subkey=value")
        dotted, raw = item.split("=", 1)
        dotted = dotted.strip()
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(dotted, f"cannot parse value {raw!r}: {e}") from None
        parts = dotted.split(".")
        types_ = _check_path(parts)
        node = data
        for part, tp in zip(parts[:-1], types_, strict=False):
            if isinstance(node.get(part), str) and _is_named(tp):
                node[part] = {"name": node[part]}  # `policy_loss: gspo` + `policy_loss.clip_low=...`
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(dotted, f"'{part}' is not a section")
        last = parts[-1]
        if isinstance(value, str) and isinstance(node.get(last), dict) and _is_named(types_[-1]):
            node[last]["name"] = value  # a name keeps the section's other options
        else:
            node[last] = value
    return data


def _check_path(parts: list[str]) -> list[Any]:
    """Reject an override path that does not exist in the tree, before it is merged; returns the
    annotation at each part (fewer when the path enters a free-form mapping such as env.kwargs)."""
    cls: Any = TrainConfig
    found: list[Any] = []
    for i, part in enumerate(parts):
        if not is_dataclass(cls):
            if typing.get_origin(cls) is dict:  # free-form mapping (env.kwargs)
                return found + [Any] * (len(parts) - i)
            raise ConfigError(".".join(parts), f"'{'.'.join(parts[:i])}' is not a section")
        hints = typing.get_type_hints(cls)
        if part not in hints:
            _moved(".".join(parts[: i + 1]))
            close = difflib.get_close_matches(part, hints, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(".".join(parts[: i + 1]), f"unknown key{hint}; known keys: {sorted(hints)}")
        cls = hints[part]
        found.append(cls)
    return found


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}


def add_import_dirs(*dirs: str | Path) -> None:
    """Put ``dirs`` at the end of ``sys.path`` (once each), so that the import paths a config names
    (``env.name: my_pkg.envs:MyEnv``, an ``agent_program``'s ``agent: my_pkg.agents:solve``) are found
    there without PYTHONPATH; installed packages of the same name still win."""
    for folder in dirs:
        entry = str(Path(folder).resolve())
        if entry not in sys.path:
            sys.path.append(entry)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """Load a YAML config file (or start from defaults when ``path`` is None) and apply overrides.

    The import paths the config names are then found beside the config file, then in the working
    directory (``add_import_dirs``), as well as wherever Python finds installed packages. A relative
    ``model.path``, ``model.tokenizer``, ``data.train``, ``data.val``, ``policies.<name>.adapter`` or
    ``policies.<name>.path`` is taken from the working directory when it exists there, else from the config file's folder when it
    exists there (``resolve_paths``)."""
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text(encoding="utf-8")
        add_import_dirs(Path(path).parent, Path.cwd())
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError("<file>", f"{path} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, Mapping):
            raise ConfigError(
                "<root>", f"{path} must hold a mapping of sections, got {type(loaded).__name__}"
            )
        data = dict(loaded or {})
    return config_from_dict(apply_overrides(data, overrides), None if path is None else Path(path).parent)


PATH_KEYS = ("model.path", "model.adapter", "model.tokenizer", "data.train", "data.val")
"""The keys naming local files or folders (or hub names) that a relative path may be given for."""


def resolve_paths(config: TrainConfig, folder: str | Path) -> TrainConfig:
    """``config`` with each relative path of ``PATH_KEYS`` (and each ``policies.<name>.adapter`` and
    ``policies.<name>.path``) that does not exist from the working directory but does exist in
    ``folder`` (the config file's) made absolute; every other value unchanged (a hub name, a path
    found from the working directory, one found nowhere)."""

    def beside(value: str | None) -> str | None:
        if not value or Path(value).is_absolute() or Path(value).exists():
            return None
        found = Path(folder) / value
        return str(found.resolve()) if found.exists() else None

    sections: dict[str, dict[str, str]] = {}
    for key in PATH_KEYS:
        section, name = key.split(".")
        found = beside(getattr(getattr(config, section), name))
        if found:
            sections.setdefault(section, {})[name] = found
    changes: dict[str, Any] = {
        section: replace(getattr(config, section), **values) for section, values in sections.items()
    }
    policies = {
        name: {k: found for k in ("adapter", "path") if (found := beside(getattr(policy, k)))}
        for name, policy in config.policies.items()
    }
    if any(policies.values()):
        changes["policies"] = {
            name: replace(policy, **policies[name]) for name, policy in config.policies.items()
        }
    return replace(config, **changes) if changes else config


def dump_config(config: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False), encoding="utf-8")

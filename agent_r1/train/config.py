"""One typed configuration tree for training: model, data, rollout, env, algorithm, trainer, logging.

Load it from YAML with dotted command-line overrides::

    config = load_config("configs/arithmetic_grpo.yaml", ["trainer.steps=50", "algorithm.kl_coef=0.01"])

Every field is documented once, here (``metadata["doc"]``). An unknown key or an invalid value raises
``ConfigError`` naming the dotted key and the reason (with a "did you mean" for near-miss keys); every
problem of a config is found in one pass and raised together (``ConfigErrors``, one per line), and
what ``trainer.mode: async`` needs is chosen where the config leaves it unset
(``config_from_dict_with_choices`` says what).
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
import functools
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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
    "ConfigErrors",
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
    "config_from_dict_with_choices",
    "config_to_dict",
    "dump_config",
    "load_config",
    "load_config_with_choices",
    "resolve_paths",
]


class ConfigError(ValueError):
    """A configuration problem, always naming the dotted key and why."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"config key '{key}': {why}")
        self.key = key
        self.why = why


class ConfigErrors(ConfigError):
    """Several configuration problems found at once (``errors``, in the order found), so that one
    ``agent-r1 check`` lists them all; ``key`` and ``why`` are the first one's. A single problem is
    raised as itself, never wrapped (``raise_all``)."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        super().__init__(errors[0].key, errors[0].why)
        self.errors = list(errors)

    def __str__(self) -> str:
        return f"{len(self.errors)} configuration errors:\n" + "\n".join(f"  {e}" for e in self.errors)

    @classmethod
    def raise_all(cls, errors: Sequence[ConfigError]) -> None:
        """Raise ``errors`` (none: return): one as itself, with its own message, several as one
        ``ConfigErrors``."""
        flat = [e for error in errors for e in (error.errors if isinstance(error, cls) else [error])]
        if len(flat) == 1:
            raise flat[0]
        if flat:
            raise cls(flat)


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
    dtype: Literal["float32", "bfloat16"] = _opt(
        "float32",
        "Dtype of the learner's parameters, gradients and optimizer state (and of the engines' and "
        "the reference's weights); the forward computes in it unless model.compute_dtype is narrower.",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _opt(
        "float32",
        "Dtype the learner's forward passes (policy, reference, critic) compute in, under torch.autocast, "
        "while parameters, gradients and AdamW's state stay in model.dtype (fp32 master weights); "
        "log-probs, entropies, values and losses stay fp32. Not narrower than model.dtype: no autocast. "
        "'auto': bfloat16 on a CUDA device with native bf16 or a CPU with avx512_bf16 or AMX, else float32. "
        "float16 is loss-scaled (torch.amp.GradScaler) and needs model.dtype float32 and no FSDP2. "
        "agent_r1.models.precision.",
    )
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
        "version bump); False gives the engine its own copy synced by update_weights. Unset under "
        "trainer.mode: async in one process: false (chosen, see trainer.mode).",
    )
    eval_temperature: float = _opt(0.0, "Temperature for evaluation rollouts (0 = greedy).", _non_negative)
    eval_n: int = _opt(1, "Samples per validation task.", _positive)
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _opt(
        "float32",
        "Dtype the sampler computes in. HF engine on the CPU: its large linear layers (weights of at "
        "least 2^18 elements, the LM head excepted) multiply bf16 (or fp16) copies of the weights "
        "through oneDNN, everything else fp32 (a tiny model packs none and stays fp32); on a GPU its "
        "forwards run under autocast. vLLM: its dtype (float32: model.dtype, as before). 'auto': "
        "bfloat16 where the device multiplies it natively (CUDA with bf16; a CPU with avx512_bf16 or "
        "AMX), else float32. When the sampler or the learner (model.compute_dtype) computes narrower "
        "than float32, algorithm.off_policy: tis is chosen where neither it nor algorithm.old_logprobs "
        "is set; every step reports mismatch/* (docs/precision.md).",
    )
    engine: Literal["hf", "vllm"] = _opt(
        "hf",
        "Rollout engine, in this process and in each Ray rollout actor alike: 'hf' (continuous "
        "batching over the Hugging Face model; in one process it shares the learner's model) or "
        "'vllm' (vLLM over model.path, weights pushed after every update).",
    )
    engine_kwargs: dict[str, Any] = _opt(
        {},
        "Extra keyword arguments for the engine rollout.engine names: vLLM's (gpu_memory_utilization, "
        "max_model_len, enable_sleep_mode: the engine sleeps during each update on one GPU, ...) or "
        "HFEngine's (prefix_cache_entries, cascade_attention, ...). A key the engine does not take is "
        "refused by name before it is built (agent-r1 check; vLLM's only where vLLM is installed).",
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
        "TIS, masked IS, IcePop (agent_r1.algos.OffPolicyConfig). Its name unset (and old_logprobs "
        "unset) under trainer.mode: async: tis (chosen, see trainer.mode).",
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
        "or vLLM) or on Ray; needs an off-policy correction (algorithm.off_policy). What it needs and "
        "the config leaves unset is chosen, and said once by check, train and eval: "
        "rollout.share_model: false in one process with the HF engine, and algorithm.off_policy: tis "
        "when neither algorithm.off_policy nor algorithm.old_logprobs is set. A value set that "
        "contradicts it is refused, naming the key.",
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


@dataclass
class _Problems:
    """What building a config found: every error, in the order found, and the dotted keys that do not
    hold the user's value (``fallbacks``): a value refused and replaced by the field's default, or the
    key an unknown key probably meant (its "did you mean"), which then kept its default."""

    errors: list[ConfigError] = field(default_factory=list)
    fallbacks: set[str] = field(default_factory=set)

    def refuse(self, error: ConfigError, *fallbacks: str) -> None:
        self.errors.append(error)
        self.fallbacks.update(fallbacks or (error.key,))

    def touch(self, keys: Iterable[str]) -> bool:
        """Whether any of ``keys`` is, holds or lies in a key that fell back ("" is the whole tree)."""
        return any(
            not fallback
            or key == fallback
            or key.startswith(f"{fallback}.")
            or fallback.startswith(f"{key}.")
            for key in keys
            for fallback in self.fallbacks
        )


def _coerce(key: str, tp: Any, value: Any, problems: _Problems) -> Any:
    """Check ``value`` against the annotation ``tp`` (coercing int -> float and list -> list[...]). A
    wrong value raises ``ConfigError``; a section (a dataclass, or a mapping of them) is built field
    by field, and what is wrong in it is added to ``problems`` (``_build``)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        whys = []
        for option in options:
            if option is type(None):
                continue
            found = _Problems()
            try:
                coerced = _coerce(key, option, value, found)
            except ConfigError as e:
                whys.append(e.why)
                continue
            if not found.errors:
                return coerced
            whys += [e.why for e in found.errors]
        raise ConfigError(key, "; ".join(whys))
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
        return _build(tp, value, key, problems)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"must be a list, got {value!r}")
        (item_tp,) = typing.get_args(tp)[:1]
        return [_coerce(f"{key}[{i}]", item_tp, v, problems) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"must be a mapping, got {value!r}")
        _, value_tp = typing.get_args(tp) or (Any, Any)
        items = {}
        for name, item in value.items():
            try:  # each entry on its own (policies.<name>): a wrong one leaves the others checked
                items[name] = _coerce(
                    f"{key}.{name}", value_tp, {} if value_tp is not Any and item is None else item, problems
                )
            except ConfigError as error:
                problems.refuse(error, f"{key}.{name}")
        return items
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


def _refuse_unknown(dotted: str, known: Iterable[str], problems: _Problems) -> None:
    """``dotted`` is no key of its section (whose keys are ``known``): moved (``MOVED_KEYS``), or
    unknown with a "did you mean" for a near miss, which is then counted as not holding the user's
    value."""
    if dotted in MOVED_KEYS:
        new, why = MOVED_KEYS[dotted]
        problems.refuse(ConfigError(dotted, f"moved to '{new}' ({why}): set that key instead"))
        return
    section, _, key = dotted.rpartition(".")
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    meant = [f"{section}.{close[0]}" if section else close[0]] if close else []
    problems.refuse(ConfigError(dotted, f"unknown key{hint}; known keys: {sorted(known)}"), dotted, *meant)


def _build(cls: type, data: Mapping[str, Any], prefix: str, problems: _Problems) -> Any:
    """Section ``cls`` from ``data``: every unknown key, wrong value and refused option is added to
    ``problems``, and a refused field takes its default, so that the rest is still checked."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    for key in data:
        if key not in known:
            _refuse_unknown(f"{prefix}.{key}" if prefix else str(key), known, problems)
    kwargs = {}
    for name, f in known.items():
        dotted = f"{prefix}.{name}" if prefix else name
        value = _default(f)
        if name in data:
            try:
                value = _coerce(dotted, hints[name], data[name], problems)
            except ConfigError as error:
                problems.refuse(error, dotted)
        check = f.metadata.get("check")
        reason = check(value) if check else None
        if reason:
            problems.refuse(ConfigError(dotted, reason))
            value = _default(f)
        kwargs[name] = value
    return _construct(cls, kwargs, prefix, problems)


def _construct(cls: type, kwargs: dict[str, Any], prefix: str, problems: _Problems) -> Any:
    """``cls(**kwargs)``. An option that the section's own checks refuse (``InvalidOption``, e.g. a
    clip range) is reported and takes its default, and the section is built again, so that each
    refused option is reported once; when a default conflicts with another option given, the whole
    section falls back to its defaults."""
    defaults = {f.name: f for f in fields(cls)}
    reset: set[str] = set()
    while True:
        try:
            return cls(**kwargs)
        except InvalidOption as error:
            if error.field not in reset:
                problems.refuse(ConfigError(f"{prefix}.{error.field}" if prefix else error.field, error.why))
            if error.field in reset or error.field not in defaults:
                problems.fallbacks.add(prefix)
                return cls()
            reset.add(error.field)
            kwargs[error.field] = _default(defaults[error.field])


def _default(f: Any) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()


def _is_named(cls: type) -> bool:
    """A section selected by name (``{name: ..., <its options>}``), which a bare name stands for."""
    return is_dataclass(cls) and any(f.name == "name" for f in fields(cls))


def config_from_dict(data: Mapping[str, Any] | None = None, folder: str | Path | None = None) -> TrainConfig:
    """Build and validate a ``TrainConfig`` from a nested mapping (missing keys take defaults).
    ``folder``: the config file's, where relative paths are also looked for (``resolve_paths``).
    A saved adapter at ``model.path`` is read as its base plus ``model.adapter`` (``resolve_adapter``).
    Every problem found is raised at once: one ``ConfigError``, or ``ConfigErrors`` for several.
    What ``trainer.mode: async`` needs is chosen where the user left it unset (``_choose``);
    ``config_from_dict_with_choices`` also says what was chosen."""
    return config_from_dict_with_choices(data, folder)[0]


def config_from_dict_with_choices(
    data: Mapping[str, Any] | None = None, folder: str | Path | None = None
) -> tuple[TrainConfig, tuple[str, ...]]:
    """``config_from_dict``, and one line per value it chose for the user (``_choose``), for the
    command to print once (``agent-r1 check``: ``ok  chose ...``)."""
    return _built(data or {}, folder, _Problems())


def _built(
    data: Mapping[str, Any], folder: str | Path | None, problems: _Problems
) -> tuple[TrainConfig, tuple[str, ...]]:
    """The config of the raw mapping ``data`` and its choices; every error (those already in
    ``problems``, the fields', the cross-field checks') raised together."""
    config = _build(TrainConfig, data, "", problems)
    if folder is not None:
        config = resolve_paths(config, folder)
    if not problems.touch(("model.path", "model.adapter", "model.tokenizer", "model.lora")):
        try:
            config = resolve_adapter(config)
        except ConfigError as error:
            problems.refuse(error, "model")
    config, choices = _choose(config, data)
    problems.errors += _cross_field_errors(config, problems)
    ConfigErrors.raise_all(problems.errors)
    return config, choices


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


# --- what async needs, chosen for the user ----------------------------------------------------------


def _choose(config: TrainConfig, data: Mapping[str, Any]) -> tuple[TrainConfig, tuple[str, ...]]:
    """What ``trainer.mode: async`` needs, chosen where the user's intent is unambiguous (docs/training.md,
    Asynchronous training), one line each:

    - in one process with the HF engine, the engine samples while the learner updates, so it needs its
      own copy of the weights: ``rollout.share_model: false``, when ``rollout.share_model`` is unset;
    - samples drawn by an older policy need an off-policy correction: ``algorithm.off_policy: tis``
      (docs/algorithms.md, "Which to pick"), when neither ``algorithm.off_policy`` (its name) nor
      ``algorithm.old_logprobs`` is set;
    - in any mode, a sampler that computes in another type than the learner needs the same
      correction (``_choose_for_precision``).

    "Set" means present in ``data``, the raw mapping given to the builder (the YAML plus the
    overrides), whatever its value: a value the user set is never replaced, and one that contradicts
    async is refused by the cross-field checks, naming its key. The chosen values are the config's, so
    the resolved config a run writes holds them and a resume compares equal."""
    if config.trainer.mode != "async":
        return _choose_for_precision(config, data, ())
    rollout, algorithm, choices = config.rollout, config.algorithm, []
    in_process_hf = config.distributed.backend == "none" and rollout.engine == "hf"
    if in_process_hf and not _given(data, "rollout.share_model"):
        rollout = replace(rollout, share_model=False)
        choices.append(
            "rollout.share_model: false (trainer.mode: async samples while the learner updates: the HF "
            "engine samples from its own copy of the weights, synced after each update)"
        )
    if not _given(data, "algorithm.off_policy.name") and not _given(data, "algorithm.old_logprobs"):
        algorithm = replace(algorithm, off_policy=replace(algorithm.off_policy, name="tis"))
        choices.append(
            "algorithm.off_policy: tis (trainer.mode: async trains on samples of an older policy: "
            "truncated importance weights against the sampler's log-probs, docs/algorithms.md)"
        )
    return _choose_for_precision(replace(config, rollout=rollout, algorithm=algorithm), data, tuple(choices))


def _choose_for_precision(
    config: TrainConfig, data: Mapping[str, Any], choices: tuple[str, ...]
) -> tuple[TrainConfig, tuple[str, ...]]:
    """A sampler or a learner that computes narrower than fp32 (``rollout.compute_dtype``,
    ``model.compute_dtype``, each resolved on this host) makes the sampler's log-probs differ from the
    learner's by more than float rounding, even at one type (the HF engine narrows its linears only,
    the learner's autocast every product): ``algorithm.off_policy: tis`` when neither it nor
    ``algorithm.old_logprobs`` is set (and async has not chosen it already). On SmolLM2 the k3 KL was
    2.5e-9 fp32 against fp32, 8.5e-5 with a bf16 sampler, 1.6e-3 with both in bf16 (docs/precision.md)."""
    if _given(data, "algorithm.off_policy.name") or _given(data, "algorithm.old_logprobs"):
        return config, choices
    wanted = {config.rollout.compute_dtype, config.model.compute_dtype}
    if config.algorithm.off_policy.name != "none" or wanted == {"float32"}:
        return config, choices
    import torch

    from agent_r1.models.precision import resolve_compute_dtype

    device = torch.device("cpu" if config.model.device == "cpu" or not torch.cuda.is_available() else "cuda")
    learner, _ = resolve_compute_dtype(config.model.compute_dtype, device)
    sampler, _ = resolve_compute_dtype(config.rollout.compute_dtype, device)
    if sampler == learner == torch.float32:
        return config, choices
    algorithm = replace(config.algorithm, off_policy=replace(config.algorithm.off_policy, name="tis"))
    choice = (
        f"algorithm.off_policy: tis (the sampler computes in {str(sampler).removeprefix('torch.')}, the "
        f"learner in {str(learner).removeprefix('torch.')}: their log-probs differ by more than float "
        "rounding; truncated importance weights against the sampler's, docs/precision.md)"
    )
    return replace(config, algorithm=algorithm), (*choices, choice)


def _given(data: Mapping[str, Any], dotted: str) -> bool:
    """Whether the raw mapping ``data`` sets ``dotted`` (a bare name, ``off_policy: tis``, sets its
    section's ``name``)."""
    node: Any = data
    for part in dotted.split("."):
        if isinstance(node, str) and part == "name":
            return True
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


# --- cross-field checks -------------------------------------------------------------------------

CrossFieldCheck = Callable[[TrainConfig], Iterable[ConfigError]]


def _cross_field_errors(config: TrainConfig, problems: _Problems) -> list[ConfigError]:
    """Every error of the cross-field checks (``_CROSS_FIELD_CHECKS``), each small and independent
    of the others, so that one run reports every problem. A check is skipped when a key it reads
    does not hold the user's value (``_Problems.fallbacks``: refused, so the field took its default):
    its error would be about a value nobody gave, beside the error that already names the key.
    Skipping by key, not every check after any field error, still reports the independent problems
    of the rest of the config in the same run. A check whose meaning needs another's condition (a
    registered name) tests that condition itself, as the other reports it."""
    return [
        error for reads, check in _CROSS_FIELD_CHECKS if not problems.touch(reads) for error in check(config)
    ]


def _value(config: TrainConfig, dotted: str) -> Any:
    return functools.reduce(getattr, dotted.split("."), config)


_REGISTERED_NAMES = (
    ("algorithm.advantage.name", ADVANTAGE_ESTIMATORS),
    ("algorithm.policy_loss.name", POLICY_LOSSES),
    ("algorithm.loss_aggregation.name", LOSS_AGGREGATIONS),
    ("algorithm.kl.estimator", KL_ESTIMATORS),
    ("algorithm.off_policy.name", OFF_POLICY_CORRECTIONS),
)
"""The keys naming a registered algorithm function, and their registries."""


def _registered_name(config: TrainConfig, *, key: str, registry: Any) -> Iterator[ConfigError]:
    """An unknown algorithm name is refused at load time, naming the key and the available choices."""
    value = _value(config, key)
    if value not in registry:
        yield ConfigError(key, f"unknown {registry.kind} {value!r}; choose one of {sorted(registry)}")


def _group_size(config: TrainConfig) -> Iterator[ConfigError]:
    """The group size the estimator declared it needs (``agent_r1.algos.Needs.min_group_size``)."""
    name = config.algorithm.advantage.name
    if name not in ADVANTAGE_ESTIMATORS:
        return
    needed = ADVANTAGE_ESTIMATORS.needs(name).min_group_size
    if config.rollout.n < needed:
        yield ConfigError(
            "rollout.n", f"the '{name}' baseline needs n >= {needed} samples per task, got {config.rollout.n}"
        )


def _single_update(config: TrainConfig) -> Iterator[ConfigError]:
    """A loss that declared itself on-policy only (``agent_r1.algos.Needs.single_update``)."""
    name, trainer = config.algorithm.policy_loss.name, config.trainer
    updates = trainer.ppo_epochs * trainer.mini_batches
    if name in POLICY_LOSSES and POLICY_LOSSES.needs(name).single_update and updates > 1:
        yield ConfigError(
            "algorithm.policy_loss.name",
            f"'{name}' is correct only on-policy (one optimizer step per rollout batch), but "
            f"trainer.ppo_epochs x trainer.mini_batches = {updates}: set both to 1 or use a ratio-based "
            "loss (ppo_clip, gspo, cispo)",
        )


def _policy_roles(config: TrainConfig) -> Iterator[ConfigError]:
    """``roles`` name configured policies."""
    if not config.policies:
        if config.roles:
            yield ConfigError("roles", "maps roles to policies, but no policies are configured: add policies")
        return
    for role, policy in config.roles.items():
        if policy not in config.policies:
            yield ConfigError(
                f"roles.{role}",
                f"names policy {policy!r}, which is not in policies {sorted(config.policies)}",
            )


def _policies_trained(config: TrainConfig) -> Iterator[ConfigError]:
    if config.policies and all(policy.frozen for policy in config.policies.values()):
        yield ConfigError("policies", "every policy is frozen: nothing would train")


def _policy_entries(config: TrainConfig) -> Iterator[ConfigError]:
    """Each policy of ``policies``: its name, its optimizer, and where it comes from."""
    for name, policy in config.policies.items():
        if policy.frozen and policy.lr is not None:
            yield ConfigError(f"policies.{name}.lr", "a frozen policy has no optimizer: remove lr")
        if name == "__base__" or not name.isidentifier():
            yield ConfigError(f"policies.{name}", "a policy name must be an identifier (it names an adapter)")
        yield from _policy_source(config, name, policy)
    own = [name for name, policy in config.policies.items() if policy.path is not None]
    if own and not any(not p.frozen and p.path is None for p in config.policies.values()):
        yield ConfigError(
            f"policies.{own[0]}",
            "no trained policy is an adapter on the shared base (model.path): make model.path the "
            "model of one trained policy and drop that policy's path",
        )


def _policy_source(config: TrainConfig, name: str, policy: PolicyConfig) -> Iterator[ConfigError]:
    """``adapter`` / ``path`` / ``server`` (and the server's ``model``, ``api_key_env``) of policy
    ``name``. The adapter and model folders themselves are checked where the run starts
    (``agent_r1.train.policies.check_adapters``, ``check_own_models``)."""
    key = f"policies.{name}"
    if policy.path is not None:
        yield from _own_model(config, name, policy)
    if policy.server is not None:
        if not policy.frozen:
            yield ConfigError(
                f"{key}.server", "a policy sampled by a server is not trained here: set frozen: true"
            )
        if policy.adapter is not None:
            yield ConfigError(f"{key}.adapter", "a policy is an adapter or a server, not both")
        if not policy.server.startswith(("http://", "https://")):
            yield ConfigError(f"{key}.server", f"must be a URL http://host:port/v1, got {policy.server!r}")
        if config.trainer.deterministic:
            yield ConfigError(
                "trainer.deterministic",
                f"policy {name!r} is sampled by a server, which batches requests as they come",
            )
    for option in ("model", "api_key_env"):
        if getattr(policy, option) is not None and policy.server is None:
            yield ConfigError(f"{key}.{option}", "applies to a policy sampled by a server: set server")


def _own_model(config: TrainConfig, name: str, policy: PolicyConfig) -> Iterator[ConfigError]:
    """A policy with a model of its own (``path``): what it is not combined with, and what it runs on."""
    key = f"policies.{name}"
    for other in ("adapter", "server"):
        if getattr(policy, other) is not None:
            yield ConfigError(f"{key}.{other}", f"a policy is a model of its own (path) or {other}, not both")
    if config.distributed.backend != "none":
        yield ConfigError(
            "distributed.backend",
            f"policy {name!r} has a model of its own (policies.{name}.path), which runs in one process "
            "for now: set distributed.backend: none",
        )
    if config.rollout.engine != "hf":
        yield ConfigError(
            "rollout.engine",
            f"policy {name!r} has a model of its own (policies.{name}.path), which the HF engine samples; "
            f"{config.rollout.engine!r} serves adapters of one base model: set rollout.engine: hf",
        )
    if not policy.frozen and (not config.rollout.share_model or config.trainer.mode == "async"):
        yield ConfigError(
            "rollout.share_model",
            f"policy {name!r} trains a model of its own (policies.{name}.path), which its engine shares "
            "for now (no weight sync to a copy): set rollout.share_model: true and trainer.mode: sync",
        )


def _policies_base(config: TrainConfig) -> Iterator[ConfigError]:
    """What several policies on one shared base need of the rest of the config, and what they do
    not have yet."""
    if not config.policies:
        return
    if config.model.lora.rank <= 0:
        yield ConfigError(
            "model.lora.rank",
            "each trained policy is a LoRA adapter on the shared base: set model.lora.rank (e.g. 8)",
        )
    several = f"several policies (policies: {sorted(config.policies)})"
    if config.distributed.backend != "none" and config.distributed.strategy != "ddp":
        yield ConfigError("distributed.strategy", f"{several} need ddp (one per adapter)")
    name = config.algorithm.advantage.name
    if name in ADVANTAGE_ESTIMATORS and ADVANTAGE_ESTIMATORS.needs(name).critic is not None:
        yield ConfigError("algorithm.advantage.name", f"{several} has no critic per policy yet")


def _betas(config: TrainConfig) -> Iterator[ConfigError]:
    if len(config.trainer.betas) != 2:
        yield ConfigError("trainer.betas", f"must hold two numbers, got {config.trainer.betas}")


def _mini_batches(config: TrainConfig) -> Iterator[ConfigError]:
    batch = config.trainer.tasks_per_step * config.rollout.n
    if config.trainer.mini_batches > batch:
        yield ConfigError(
            "trainer.mini_batches",
            f"{config.trainer.mini_batches} mini-batches cannot split {batch} trajectories per step",
        )


def _resample_rounds(config: TrainConfig) -> Iterator[ConfigError]:
    algo = config.algorithm
    if algo.resample_rounds and not algo.dynamic_filter:
        yield ConfigError(
            "algorithm.resample_rounds", "refills groups dropped by algorithm.dynamic_filter: set it"
        )


def _dynamic_filter(config: TrainConfig) -> Iterator[ConfigError]:
    if config.algorithm.dynamic_filter and config.rollout.n < 2:
        yield ConfigError(
            "algorithm.dynamic_filter",
            "drops each group whose samples' rewards agree, and with rollout.n: 1 every group is one "
            "sample: every group would be dropped; set rollout.n >= 2 or dynamic_filter: false",
        )


def _async_engine_copy(config: TrainConfig) -> Iterator[ConfigError]:
    """Async in one process with the HF engine: the engine samples while the learner updates. An unset
    ``rollout.share_model`` is chosen false (``_choose``), so this refuses an explicit true."""
    rollout = config.rollout
    if (
        config.trainer.mode == "async"
        and config.distributed.backend == "none"
        and rollout.engine == "hf"
        and rollout.share_model
    ):
        yield ConfigError(
            "rollout.share_model",
            "trainer.mode: async samples while the learner updates, so the HF engine needs its own copy "
            "of the weights: set rollout.share_model: false (or use rollout.engine: vllm)",
        )


def _deterministic_engine(config: TrainConfig) -> Iterator[ConfigError]:
    if config.trainer.deterministic and config.rollout.engine != "hf":
        yield ConfigError(
            "trainer.deterministic",
            f"needs rollout.engine: hf (its batch-invariant decode); {config.rollout.engine!r} batches "
            "requests as they come",
        )


def _deterministic_partial_rollouts(config: TrainConfig) -> Iterator[ConfigError]:
    trainer = config.trainer
    if trainer.deterministic and trainer.mode == "async" and trainer.partial_rollouts:
        yield ConfigError(
            "trainer.deterministic",
            "trainer.partial_rollouts lands each update wherever the rollout in flight has got to, which "
            "depends on timing: set trainer.partial_rollouts: false (or trainer.mode: sync)",
        )


def _async_resample_rounds(config: TrainConfig) -> Iterator[ConfigError]:
    if config.algorithm.resample_rounds and config.trainer.mode == "async":
        yield ConfigError(
            "algorithm.resample_rounds", "not available with trainer.mode: async (its rollouts run ahead)"
        )


def _async_correction(config: TrainConfig) -> Iterator[ConfigError]:
    """Async samples come from an older policy. With neither correction key set one is chosen
    (``_choose``), so this refuses a config that set them to no correction."""
    algo = config.algorithm
    if config.trainer.mode == "async" and algo.old_logprobs == "learner" and algo.off_policy.name == "none":
        yield ConfigError(
            "trainer.mode",
            "async rollouts are sampled by an older policy: correct for it with algorithm.off_policy "
            "(tis, mis_step, mis_trajectory or icepop: weights against the sampler) or "
            "algorithm.old_logprobs: sampler",
        )


def _distill(config: TrainConfig) -> Iterator[ConfigError]:
    algo = config.algorithm
    distill = algo.distill
    server = distill.teacher.startswith(("http://", "https://"))
    for key in ("teacher_model", "api_key_env"):
        if getattr(distill, key) is not None and not server:
            yield ConfigError(
                f"algorithm.distill.{key}", "applies to a server teacher: algorithm.distill.teacher is no URL"
            )
    if server and distill.device != "learner":
        yield ConfigError("algorithm.distill.device", "applies to a local teacher; this one is a server")
    if distill.teacher and algo.dynamic_filter and distill.reward_weight == 0:
        yield ConfigError(
            "algorithm.dynamic_filter",
            "drops the groups whose rewards agree, but distillation alone (algorithm.distill."
            "reward_weight: 0) learns from every sample: set dynamic_filter: false",
        )


def _float16_compute(config: TrainConfig) -> Iterator[ConfigError]:
    """float16's loss scaling (``agent_r1.models.precision``) needs fp32 master weights, and one
    overflow check for every worker: whole gradients on each."""
    if config.model.compute_dtype != "float16":
        return
    if config.model.dtype != "float32":
        yield ConfigError(
            "model.compute_dtype",
            f"float16 is loss-scaled onto fp32 master weights, but model.dtype is {config.model.dtype}: "
            "set model.dtype: float32 (or compute_dtype: bfloat16, which needs no scaling)",
        )
    if config.distributed.backend != "none" and config.distributed.strategy == "fsdp2":
        yield ConfigError(
            "model.compute_dtype",
            "float16's loss scaler checks each worker's gradients for overflow, and FSDP2 shards them: "
            "use bfloat16 (no scaling) or distributed.strategy: ddp",
        )


def _correction_against_itself(config: TrainConfig) -> Iterator[ConfigError]:
    algo = config.algorithm
    if algo.off_policy.name != "none" and algo.old_logprobs == "sampler":
        yield ConfigError(
            "algorithm.off_policy.name",
            "corrects the learner's old log-probs against the sampler's, but algorithm.old_logprobs: "
            "sampler makes them the same (every weight 1): use old_logprobs: learner",
        )


_ASYNC_ENGINE = ("trainer.mode", "distributed.backend", "rollout.engine", "rollout.share_model")
_DISTRIBUTED = ("distributed.backend", "distributed.strategy")
_CROSS_FIELD_CHECKS: tuple[tuple[tuple[str, ...], CrossFieldCheck], ...] = (
    *(((key,), functools.partial(_registered_name, key=key, registry=r)) for key, r in _REGISTERED_NAMES),
    (("algorithm.advantage.name", "rollout.n"), _group_size),
    (("algorithm.policy_loss.name", "trainer.ppo_epochs", "trainer.mini_batches"), _single_update),
    (("policies", "roles"), _policy_roles),
    (("policies",), _policies_trained),
    (("policies", *_ASYNC_ENGINE, "trainer.deterministic"), _policy_entries),
    (("policies", "model.lora.rank", "distributed", "algorithm.advantage.name"), _policies_base),
    (("trainer.betas",), _betas),
    (("trainer.tasks_per_step", "rollout.n", "trainer.mini_batches"), _mini_batches),
    (("algorithm.resample_rounds", "algorithm.dynamic_filter"), _resample_rounds),
    (("algorithm.dynamic_filter", "rollout.n"), _dynamic_filter),
    (_ASYNC_ENGINE, _async_engine_copy),
    (("trainer.deterministic", "rollout.engine"), _deterministic_engine),
    (("trainer.deterministic", "trainer.mode", "trainer.partial_rollouts"), _deterministic_partial_rollouts),
    (("algorithm.resample_rounds", "trainer.mode"), _async_resample_rounds),
    (("trainer.mode", "algorithm.old_logprobs", "algorithm.off_policy.name"), _async_correction),
    (("algorithm.distill", "algorithm.dynamic_filter"), _distill),
    (("algorithm.off_policy.name", "algorithm.old_logprobs"), _correction_against_itself),
    (("model.compute_dtype", "model.dtype", *_DISTRIBUTED), _float16_compute),
)
"""Each cross-field check with the keys it reads, in the order their errors are listed."""


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (values parsed as YAML scalars / lists) to a nested dict; every
    override that cannot be applied is reported at once."""
    problems = _Problems()
    data = _overridden(data, overrides, problems)
    ConfigErrors.raise_all(problems.errors)
    return data


def _overridden(data: Mapping[str, Any], overrides: Sequence[str], problems: _Problems) -> dict[str, Any]:
    """A copy of ``data`` with each override applied; one that cannot be is added to ``problems`` and
    left out."""
    data = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            problems.refuse(ConfigError(item, "an override must look like key.subkey=value"))
            continue
        dotted, raw = item.split("=", 1)
        dotted = dotted.strip()
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            problems.refuse(ConfigError(dotted, f"cannot parse value {raw!r}: {e}"))
            continue
        parts = dotted.split(".")
        types_ = _check_path(parts, problems)
        if types_ is None:
            continue
        node = data
        for part, tp in zip(parts[:-1], types_, strict=False):
            if isinstance(node.get(part), str) and _is_named(tp):
                node[part] = {"name": node[part]}  # `policy_loss: gspo` + `policy_loss.clip_low=...`
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.refuse(ConfigError(dotted, f"'{part}' is not a section"))
                break
        else:
            last = parts[-1]
            if isinstance(value, str) and isinstance(node.get(last), dict) and _is_named(types_[-1]):
                node[last]["name"] = value  # a name keeps the section's other options
            else:
                node[last] = value
    return data


def _check_path(parts: list[str], problems: _Problems) -> list[Any] | None:
    """The annotation at each part of an override path (fewer when the path enters a free-form mapping
    such as env.kwargs); None, with the problem added to ``problems``, when the path does not exist in
    the tree (it is refused before it is merged)."""
    cls: Any = TrainConfig
    found: list[Any] = []
    for i, part in enumerate(parts):
        if not is_dataclass(cls):
            if typing.get_origin(cls) is dict:  # free-form mapping (env.kwargs)
                return found + [Any] * (len(parts) - i)
            problems.refuse(ConfigError(".".join(parts), f"'{'.'.join(parts[:i])}' is not a section"))
            return None
        hints = typing.get_type_hints(cls)
        if part not in hints:
            _refuse_unknown(".".join(parts[: i + 1]), hints, problems)
            return None
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
    exists there (``resolve_paths``). Every problem of the overrides and the config is raised at
    once (``config_from_dict``)."""
    return load_config_with_choices(path, overrides)[0]


def load_config_with_choices(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> tuple[TrainConfig, tuple[str, ...]]:
    """``load_config``, and one line per value it chose for the user (``_choose``): ``agent-r1 check``,
    ``train`` and ``eval`` print them once."""
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
    problems = _Problems()
    data = _overridden(data, overrides, problems)
    return _built(data, None if path is None else Path(path).parent, problems)


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

"""Several policies in one run (issue 50): roles as data from the env to the learner.

The flow splits an episode of several roles into one trajectory per role; groups are (task, role);
each trained policy (a LoRA adapter on one shared base) updates from its own roles' steps only, with
its own optimizer; checkpoints hold every policy and resume them; a frozen policy never moves."""

from __future__ import annotations

import asyncio

import pytest
import torch
from trainer_envs import LowHighEnv

from agent_r1.flows.base import AgentEnvLoop, by_role, rollout_group, split_roles
from agent_r1.train.config import ConfigError, config_from_dict
from agent_r1.train.policies import by_policy, engine_roles, policy_of
from agent_r1.train.summary import episode_count, evaluation_metrics
from agent_r1.train.trainer import Trainer
from agent_r1.types import (
    Completion,
    Observation,
    SamplingParams,
    Step,
    StepResult,
    StopReason,
    Trajectory,
    TrajectoryGroup,
    TrajectoryStatus,
)


def tasks(n: int) -> list[dict]:
    return [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(n)]


class RecordingEngine:
    """Test double: answers every request with token 65 ("A") and records each request's role."""

    def __init__(self) -> None:
        self.roles: list[str | None] = []

    async def generate(self, prompt_ids, params: SamplingParams) -> Completion:
        self.roles.append(params.role)
        return Completion((65, 66), (-0.5, -0.5), StopReason.STOP)

    def update_weights(self, named_tensors, version=None) -> None:
        pass


def test_an_episode_of_two_roles_is_one_trajectory_per_role(tiny_tokenizer):
    engine = RecordingEngine()
    flow = AgentEnvLoop(lambda: LowHighEnv(tiny_tokenizer), tiny_tokenizer, SamplingParams(max_tokens=2))
    group = asyncio.run(rollout_group(flow, engine, {"id": "t0", "prompt": "hi"}, 2, "0:t0"))
    assert sorted(engine.roles) == ["high", "high", "low", "low"]  # each request sampled by its role
    assert [t.role for t in group.trajectories] == ["low", "high", "low", "high"]
    assert [len(t.steps) for t in group.trajectories] == [1, 1, 1, 1]
    low, high = group.trajectories[:2]
    assert low.total_reward == 1.0 and high.total_reward == 0.0  # ids 65, 66: both below 128
    assert low.info["episode"] == high.info["episode"] == "0:t0/0"
    assert group.trajectories[2].info["episode"] == "0:t0/1"
    split = split_roles([group])
    assert [(g.group_id, g.role, len(g.trajectories)) for g in split] == [
        ("0:t0@low", "low", 2),
        ("0:t0@high", "high", 2),
    ]
    assert all(t.group_id == g.group_id for g in split for t in g.trajectories)


def _step(reward: float = 0.0) -> Step:
    return Step((1,), (2,), (-0.1,), reward=reward)


def test_by_role_outcomes_and_refusals():
    episode = Trajectory("t", ())
    one = by_role(episode, [_step(), _step()], [None, None], 1.0)
    assert isinstance(one, Trajectory) and len(one.steps) == 2 and one.outcome_reward == 1.0
    a, b = by_role(episode, [_step(), _step(), _step()], ["a", "b", "a"], {"a": 1.0, "b": -1.0})
    assert (a.role, len(a.steps), a.outcome_reward) == ("a", 2, 1.0)
    assert (b.role, len(b.steps), b.outcome_reward) == ("b", 1, -1.0)
    team = by_role(episode, [_step(), _step()], ["a", "b"], 0.5)
    assert [t.outcome_reward for t in team] == [0.5, 0.5]  # a float is every role's outcome
    # a role the outcome names but that never acted gets no trajectory: it took no step
    (only,) = by_role(episode, [_step()], ["a"], {"a": 1.0, "b": -1.0})
    assert only.role == "a"
    with pytest.raises(ValueError, match="no reward for role 'b'"):
        by_role(episode, [_step(), _step()], ["a", "b"], {"a": 1.0})
    with pytest.raises(ValueError, match="mixed observations with and without a role"):
        by_role(episode, [_step(), _step()], ["a", None], 1.0)


def test_roles_are_checked_where_they_are_declared():
    with pytest.raises(TypeError, match="Observation.role"):
        Observation(text="x", role="")
    with pytest.raises(TypeError, match="outcome_reward"):
        StepResult(None, terminated=True, outcome_reward={"a": "win"})
    t = Trajectory("t", (), role="a", info={"episode": "g/0"})
    assert Trajectory.from_dict(t.to_dict()) == t
    assert "role" not in Trajectory("t", ()).to_dict()  # one-role dumps are unchanged
    g = TrajectoryGroup("g@a", "t", (t,), role="a")
    assert TrajectoryGroup.from_dict(g.to_dict()) == g


def test_an_error_before_any_role_acted_is_counted_once():
    error = Trajectory("t", (), status=TrajectoryStatus.ERROR, error="boom")
    group = TrajectoryGroup(
        "0", "t", (Trajectory("t", (_step(),), role="a"), Trajectory("t", (_step(),), role="b"), error)
    )
    a, b = split_roles([group])
    assert [t.status for t in a.trajectories] == [TrajectoryStatus.OK, TrajectoryStatus.ERROR]
    assert [t.status for t in b.trajectories] == [TrajectoryStatus.OK]


def test_evaluation_counts_episodes_tasks_and_trajectories():
    """Two tasks, two samples each: a sample of two roles is one episode of two trajectories (linked
    by ``info["episode"]``, as ``rollout_group`` gives them), and a sample that raised before any role
    acted is one episode of one ERROR trajectory."""

    def episode(group_id: str, sample: int, reward: float) -> list[Trajectory]:
        info = {"episode": f"{group_id}/{sample}"}
        return [Trajectory("t", (_step(),), group_id, reward, info=info, role=r) for r in ("a", "b")]

    error = Trajectory("u", (), "1:u", status=TrajectoryStatus.ERROR, error="boom")
    groups = [
        TrajectoryGroup("0:t", "t", (*episode("0:t", 0, 1.0), *episode("0:t", 1, 0.0))),
        TrajectoryGroup("1:u", "u", (*episode("1:u", 0, 1.0), error)),
    ]
    metrics = evaluation_metrics(groups)
    assert (metrics["eval/tasks"], metrics["eval/episodes"], metrics["eval/trajectories"]) == (2, 4, 7)
    assert metrics["eval/error_fraction"] == 1 / 7  # of the trajectories
    assert metrics["eval/reward"] == metrics["eval/success"] == 4 / 7
    assert episode_count(t for g in split_roles(groups) for t in g.trajectories) == 4  # split or not


# ---------------------------------------------------------------------------------- config


def _policies_config(tiny_checkpoint, run_dir, **sections):
    data = {
        "model": {"path": str(tiny_checkpoint), "lora": {"rank": 4, "alpha": 8}},
        "env": {"name": "trainer_envs:LowHighEnv"},
        "rollout": {"n": 4, "max_tokens": 8, "max_steps": 2},
        "trainer": {
            "steps": 3,
            "tasks_per_step": 2,
            "lr": 1e-2,
            "run_dir": str(run_dir),
            "eval_every": 0,
            "mini_batches": 1,
            "checkpoint_every": 2,
        },
        "logging": {"progress": False, "tensorboard": False},
        "policies": {"low": {}, "high": {}},
    }
    for section, values in sections.items():
        data[section] = values if section in ("policies", "roles") else {**data.get(section, {}), **values}
    return config_from_dict(data)


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        ({"roles": {"seat": "nobody"}}, "roles.seat", "not in policies"),
        ({"model": {"lora": {"rank": 0}}}, "model.lora.rank", "LoRA adapter on the shared base"),
        ({"policies": {"low": {"frozen": True, "lr": 1e-3}, "high": {}}}, "policies.low.lr", "no optimizer"),
        ({"policies": {"low": {"frozen": True}}}, "policies", "every policy is frozen"),
        ({"distributed": {"backend": "ray", "strategy": "fsdp2"}}, "distributed.strategy", "ddp"),
        ({"algorithm": {"advantage": {"name": "gae_token"}}}, "algorithm.advantage.name", "no critic"),
        # async samples while the learner updates, as with one policy: the engine needs its own copy
        # (chosen when share_model is unset; an explicit true is refused)
        (
            {
                "trainer": {"mode": "async"},
                "rollout": {"share_model": True},
                "algorithm": {"off_policy": "tis"},
            },
            "rollout.share_model",
            "own copy",
        ),
    ],
)
def test_bad_policies_are_refused_by_key(tiny_checkpoint, tmp_path, change, key, words):
    sections = dict(change)
    if "model" in sections:
        sections["model"] = {"path": str(tiny_checkpoint), **sections["model"]}
    with pytest.raises(ConfigError, match=words) as error:
        _policies_config(tiny_checkpoint, tmp_path, **sections)
    assert error.value.key == key


def test_roles_map_to_policies(tiny_checkpoint, tmp_path):
    config = _policies_config(
        tiny_checkpoint,
        tmp_path,
        policies={"shared": {}, "fixed": {"frozen": True}},
        roles={"player_0": "shared", "player_1": "shared", "opponent": "fixed"},
    )
    assert policy_of(config, "player_1") == "shared" and policy_of(config, "shared") == "shared"
    assert engine_roles(config) == {
        "shared": "shared",
        "fixed": None,
        "player_0": "shared",
        "player_1": "shared",
        "opponent": None,
    }
    with pytest.raises(ConfigError, match="role 'stranger' acted, but no policy plays it"):
        policy_of(config, "stranger")
    groups = [TrajectoryGroup(f"0@{r}", "t", (), role=r) for r in ("player_0", "opponent", "player_1")]
    # one batch for the shared policy from both seats' groups; the frozen opponent's is not trained
    assert [(name, [g.role for g in kept]) for name, kept in by_policy(config, groups)] == [
        ("shared", ["player_0", "player_1"])
    ]


# ---------------------------------------------------------------------------------- training


def _adapter(model, name: str) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n}


def test_each_policy_learns_from_its_own_role_and_resumes(tiny_checkpoint, tmp_path):
    config = _policies_config(tiny_checkpoint, tmp_path / "run")
    trainer = Trainer(config, train_tasks=tasks(4))
    low0, high0 = _adapter(trainer.model, "low"), _adapter(trainer.model, "high")
    metrics = trainer.fit()
    for role in ("low", "high"):
        assert f"role/{role}/reward/mean" in metrics
        assert f"policy/{role}/loss/policy" in metrics and f"policy/{role}/grad_norm" in metrics
    low, high = _adapter(trainer.model, "low"), _adapter(trainer.model, "high")
    assert any(not torch.equal(low[n], low0[n]) for n in low)
    assert any(not torch.equal(high[n], high0[n]) for n in high)
    # the two adapters moved apart: each learned from its own role's steps
    assert any(not torch.equal(low[n], high[n.replace(".low.", ".high.")]) for n in low if "lora_B" in n)
    # every policy's weights and optimizer state are in the checkpoint, and a resume restores them
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000003"
    assert (checkpoint / "model" / "low").is_dir() and (checkpoint / "model" / "high").is_dir()
    resumed = Trainer(config, train_tasks=tasks(4), resume=True)
    resumed._restore()
    for name, value in {**low, **high}.items():
        assert torch.equal(dict(resumed.model.named_parameters())[name].detach(), value), name
    for name in ("low", "high"):
        saved = trainer.learner.policy.learners[name].state_dict()
        loaded = resumed.learner.policy.learners[name].state_dict()
        assert saved["optimizer_steps"] == loaded["optimizer_steps"] == 3
        for key, state in saved["optimizer"]["state"].items():
            assert torch.equal(state["exp_avg"], loaded["optimizer"]["state"][key]["exp_avg"])
    resumed.close()


def test_a_frozen_policy_plays_but_never_moves(tiny_checkpoint, tmp_path):
    config = _policies_config(
        tiny_checkpoint, tmp_path / "run", policies={"low": {}, "high": {"frozen": True}}
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    assert set(trainer.model.peft_config) == {"low"}  # a frozen policy is the base: no adapter
    metrics = trainer.fit()
    assert "role/high/reward/mean" in metrics  # it played
    assert "policy/low/loss/policy" in metrics and not any(k.startswith("policy/high/") for k in metrics)


def test_a_policy_updates_as_if_it_were_alone(tiny_checkpoint):
    """A policy's update on a model holding every policy's adapter equals the same update on a model
    holding its adapter alone (same starting weights): the other adapters take no part, and do not
    move (their weights stay bitwise equal)."""
    from batching_support import random_trajectories

    from agent_r1.algos import PolicyObjective, TokenFields, aggregation_weights
    from agent_r1.train.batch import batch_of
    from agent_r1.train.config import LoraConfig, ModelConfig, TrainerConfig
    from agent_r1.train.learner import Learner, MiniBatch, load_policy
    from agent_r1.train.policies import PolicyLearners, adapter_parameters

    batch = batch_of(random_trajectories(0, count=6), micro_batch_tokens=24)
    t = batch.tokens
    fields = TokenFields(
        mask=t.mask,
        step_ids=t.step_ids,
        traj_ids=t.traj_ids,
        sampler_logprobs=t.sampler_logprobs,
        advantages=torch.cos(t.traj_ids.float()),
    )
    mini = MiniBatch(
        batch.all_micro_batches, aggregation_weights(t.mask, "token-mean", seq_ids=t.step_ids), fields
    )
    config = ModelConfig(path=str(tiny_checkpoint), lora=LoraConfig(rank=4, alpha=8))
    trainer_config = TrainerConfig(lr=1e-2)

    torch.manual_seed(0)
    both = load_policy(config, adapters=("low", "high"))
    learners = PolicyLearners(
        {
            name: Learner(
                both,
                trainer_config,
                temperature=1.0,
                total_optimizer_steps=4,
                parameters=adapter_parameters(both, name),
            )
            for name in ("low", "high")
        }
    )
    torch.manual_seed(1)
    alone = load_policy(config, adapters=("low",))
    alone.load_state_dict(
        {n: p for n, p in both.state_dict().items() if ".high." not in n}, strict=True
    )  # the same starting weights as "low" on the shared model
    single = Learner(alone, trainer_config, temperature=1.0, total_optimizer_steps=4)
    high_before = {n: p.detach().clone() for n, p in both.named_parameters() if ".high." in n}
    for _ in range(2):
        shared_metrics = learners.of("low").update(mini, PolicyObjective())
        alone_metrics = single.update(mini, PolicyObjective())
        assert shared_metrics["loss/policy"] == alone_metrics["loss/policy"]
    moved = dict(alone.named_parameters())
    for name, value in both.named_parameters():
        if ".high." in name:
            assert torch.equal(value, high_before[name]), name
        else:
            assert torch.equal(value, moved[name]), name
    assert any(
        not torch.equal(v, high_before[n.replace(".low.", ".high.")])
        for n, v in moved.items()
        if ".low." in n
    )


def test_no_kept_group_is_nothing_to_learn(tiny_checkpoint, tmp_path):
    """A step whose every group was dropped skips the update, with one policy as with several."""
    one = config_from_dict({"model": {"path": str(tiny_checkpoint)}})
    assert by_policy(one, []) == []
    assert by_policy(_policies_config(tiny_checkpoint, tmp_path), []) == []


def test_a_step_with_every_group_dropped_skips_the_update(tiny_checkpoint, tmp_path):
    """DAPO's filter drops every group (all rewards agree): the step trains nothing and says so."""
    from trainer_envs import LowByteEnv

    from agent_r1.train.config import config_from_dict as build

    config = build(
        {
            "model": {"path": str(tiny_checkpoint)},
            "rollout": {"n": 2, "max_tokens": 4, "max_steps": 1},
            "algorithm": {"dynamic_filter": True},
            "trainer": {"steps": 1, "tasks_per_step": 2, "run_dir": str(tmp_path / "run"), "eval_every": 0},
            "logging": {"progress": False, "tensorboard": False},
        }
    )
    from agent_r1.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_checkpoint)
    trainer = Trainer(
        config,
        tokenizer=tokenizer,
        env_factory=lambda: LowByteEnv(tokenizer, turns=1),
        train_tasks=tasks(2),
        reward_fn=lambda trajectory, task: -sum(s.reward for s in trajectory.steps),  # every return 0
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.fit()
    assert metrics["update/skipped"] == 1.0 and metrics["filter/zero_variance_groups"] == 2
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_eval_serves_every_policy_of_a_checkpoint(tiny_checkpoint, tmp_path, capsys):
    """``agent-r1 eval --checkpoint`` of a run with several policies: every adapter on the base, each
    role sampled by its own: the same metrics as evaluating the trained model object (one request at
    a time, so that both sample the same tokens)."""
    import json

    from agent_r1.cli import main
    from agent_r1.train.config import dump_config
    from agent_r1.train.evaluation import evaluate

    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(t) + "\n" for t in tasks(3)))
    config = _policies_config(
        tiny_checkpoint,
        tmp_path / "run",
        data={"val": str(val)},
        # one request at a time, nothing stored: each response is computed from its own tokens alone
        rollout={"eval_n": 2, "max_batch_size": 1, "engine_kwargs": {"prefix_cache_entries": 0}},
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    trainer.fit()
    expected = evaluate(config, tokenizer=trainer.tokenizer, model=trainer.model)
    untrained = evaluate(config, tokenizer=trainer.tokenizer)  # model.path alone: no adapter serves
    path = tmp_path / "config.yaml"
    dump_config(config, path)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000003"
    assert main(["eval", str(path), "--checkpoint", str(checkpoint)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["eval/episodes"] == expected["eval/episodes"] == 3 * 2  # tasks x eval_n
    assert printed["eval/trajectories"] == 3 * 2 * 2  # one per role of each episode
    assert printed == expected
    assert printed["eval/reward"] != untrained.get("eval/reward")

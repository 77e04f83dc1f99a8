"""Ecosystem arm, OpenEnv: held-out success before and after RL on an environment written in OpenEnv's
own format and served by OpenEnv's own server.

The environment is ``examples/openenv_gridwalk.py`` (grid walk as an OpenEnv ``Environment`` with a
typed ``MoveAction`` and ``GoalObservation``, ``app = create_app(...)``), which the adapter serves
with uvicorn on 127.0.0.1 and reaches through OpenEnv's ``GenericEnvClient``, one WebSocket session
per trajectory (``env.name: openenv``, ``env.kwargs.server``). Tasks are ``agent_r1.tasks.gridwalk``
rows; their ``dx``, ``dy`` and ``budget`` columns become ``reset`` kwargs. Held-out: the 24 test
offsets of ``gridwalk.make_dataset(split="test")``, ``eval_n`` samples each at T=1; success is
OpenEnv's ``done`` with reward 1 (the goal reached within the budget).

The prompt is the system prompt and the newest observation only (``context: latest_observation``,
registered below with agent-r1's public ``register_context_policy``): gridwalk's own context, the
current cell.

Warm start: the tiny model (``build_tiny``) cloned on demonstrations that always move toward the
goal (``gridwalk.demonstrate`` without its sidestepping habit), each replayed through the served
environment (``agent_r1.train.sft``); one epoch, so that RL has signal and something to fix (two
epochs left little: 0.95 held-out before RL; one epoch of 120 demonstrations left none). With
``gridwalk.demonstrate``'s sidesteps, 2 epochs of 400 demonstrations left the tiny model's moves at
chance, with this context and with the whole history appended (5 epochs too); the clean demonstrator
with the history appended was not tried. Then GRPO with PPO-clip through
the real ``Trainer`` for ``rl_steps`` steps; ``Trainer.fit`` evaluates before the first and after
the last step.

    python benchmarks/eco_openenv.py            # full: ~10 min on 2 shared cores
    python benchmarks/eco_openenv.py --quick    # a smoke run, under a minute
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import tempfile
import time
from pathlib import Path

from run_digest import digest

from agent_r1.envs import make_env
from agent_r1.envs.context import (
    ContextPolicy,
    ContextPrompt,
    encode_text,
    register_context_policy,
    render_messages,
)
from agent_r1.envs.ecosystem.openenv import LocalServer
from agent_r1.models.loading import save_model
from agent_r1.models.tiny import build_tiny
from agent_r1.tasks import gridwalk
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft
from agent_r1.train.trainer import Trainer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@register_context_policy
class LatestObservation(ContextPolicy):
    """The system prompt and the newest observation only: gridwalk's own context (the current cell,
    ``agent_r1/tasks/gridwalk.py``), whatever the conversation before it."""

    name = "latest_observation"

    async def build(self, tokenizer, request) -> ContextPrompt:
        system = [m for m in request.messages[:1] if m.get("role") == "system"]
        messages = (*system, *[m for m in request.messages if m.get("role") == "user"][-1:])
        ids = encode_text(tokenizer, render_messages(tokenizer, messages))
        turns = sum(m.get("role") == "assistant" for m in request.messages)
        return ContextPrompt(tuple(ids), messages, self._info(dropped_turns=turns))


ENV_KWARGS = {
    "server": {"app": "openenv_gridwalk:app", "cwd": str(EXAMPLES)},
    "context": "latest_observation",
    "system_prompt": gridwalk.SYSTEM_PROMPT,
    "max_turns": gridwalk.MAX_DISTANCE + gridwalk.DEFAULT_SLACK,  # the longest budget
}
# Every move toward the goal: the cleanest data for a short warm start (the sidestepping habit of
# gridwalk.demonstrate is for the credit-assignment benchmark, benchmarks/credit.py).
DEMONSTRATE = functools.partial(gridwalk.demonstrate, error_rate=0.0)
FULL = {
    "sft_demos": 400,
    "sft_epochs": 1,
    "sft_batch": 32,
    "rl_steps": 32,
    "tasks_per_step": 8,
    "n": 8,
    "eval_n": 8,
}
QUICK = {
    "sft_demos": 48,
    "sft_epochs": 1,
    "sft_batch": 8,
    "rl_steps": 2,
    "tasks_per_step": 2,
    "n": 4,
    "eval_n": 1,
}


def run(seed: int = 0, quick: bool = False) -> dict:
    """Warm start, held-out success, ``rl_steps`` of RL, held-out success again."""
    sizes = QUICK if quick else FULL
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eco_openenv-") as tmp:
        model, tokenizer = build_tiny(seed=seed)
        demos = replay_demonstrations(
            lambda: make_env("openenv", tokenizer=tokenizer, **ENV_KWARGS),
            tokenizer,
            gridwalk.make_dataset(sizes["sft_demos"], split="train", seed=seed + 1),
            DEMONSTRATE,
            seed=seed,
        )
        batch = sizes["sft_batch"]
        sft = SFTConfig(epochs=sizes["sft_epochs"], batch_size=batch, micro_batch_size=batch, seed=seed)
        losses = train_sft(model, sft_sequences(demos), sft, pad_token_id=tokenizer.pad_token_id)
        save_model(model, tokenizer, f"{tmp}/warm")
        run_dir = Path(tmp) / "run"
        config = config_from_dict(
            {
                "model": {"path": f"{tmp}/warm"},
                "env": {"name": "openenv", "kwargs": ENV_KWARGS},
                "rollout": {
                    "n": sizes["n"],
                    "max_tokens": 4,  # a move and the end-of-turn token
                    "max_steps": ENV_KWARGS["max_turns"],
                    "temperature": 1.0,
                    "eval_temperature": 1.0,
                    "eval_n": sizes["eval_n"],
                },
                "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip", "old_logprobs": "sampler"},
                "trainer": {
                    "steps": sizes["rl_steps"],
                    "tasks_per_step": sizes["tasks_per_step"],
                    "lr": 3e-4,
                    "eval_every": sizes["rl_steps"],
                    "seed": seed,
                    "run_dir": str(run_dir),
                    "torch_threads": 1,
                },
                "logging": {"progress": False, "tensorboard": False, "report": False},
            }
        )
        trainer = Trainer(
            config,
            tokenizer=tokenizer,
            model=model,
            train_tasks=gridwalk.make_dataset(4000, split="train", seed=seed),
            val_tasks=gridwalk.make_dataset(split="test"),
        )
        try:
            trainer.fit()
        finally:
            trainer.close()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        measured = digest(run_dir)
    LocalServer.stop_all()
    evals = [r for r in rows if "eval/success" in r]
    train = [r for r in rows if "reward/mean" in r]
    return {
        "env": "openenv: examples/openenv_gridwalk.py served by uvicorn (OpenEnv create_app + GenericEnvClient)",
        "metric": "held-out success (24 test offsets, done with reward 1)",
        "before": evals[0]["eval/success"],
        "after": evals[-1]["eval/success"],
        "tasks": len(gridwalk.make_dataset(split="test")),
        "rl_steps": len(train),
        "seconds": round(time.perf_counter() - started, 1),
        "demonstrator_success": sum(t.info.get("success", False) for t in demos) / len(demos),
        "sft_loss": [round(losses[0], 4), round(losses[-1], 4)],
        "train_success_by_step": [round(r["success/mean"], 3) for r in train],
        "invalid_actions_by_step": [round(r.get("env/invalid_actions", 0.0), 3) for r in train],
        "run": measured,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a smoke run, under a minute")
    args = parser.parse_args()
    print(json.dumps(run(args.seed, args.quick), indent=2), file=sys.stdout)

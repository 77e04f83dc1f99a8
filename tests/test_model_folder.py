"""One meaning for a model folder (issue 65): a folder holding a saved LoRA adapter (``save_model``
after a LoRA warm start, or a LoRA checkpoint's ``model/``) is that adapter on its base, wherever it
is loaded: ``train`` starts from it (its step-0 evaluation is ``eval``'s on the same path), with one
policy or several, the engine's own copy and the KL reference start from it, ``check`` says what it
loads, and a full-model folder means what it always meant."""

from __future__ import annotations

import json

import pytest
import torch

from agent_r1.models.loading import load_frozen_model, load_tokenizer, model_folder, save_model
from agent_r1.train.config import ConfigError, config_from_dict, dump_config, load_config
from agent_r1.train.learner import load_policy

PROMPT_1T = torch.tensor([[1, 60, 61, 62, 63, 64, 65, 66]])


def _logits(model, adapter: str | None = None):
    if adapter is not None:
        model.set_adapter(adapter)
    with torch.no_grad():
        return model(PROMPT_1T).logits


@pytest.fixture(scope="module")
def warm_adapter(tiny_checkpoint, tmp_path_factory):
    """A LoRA adapter that moved away from zero (a stand-in for a warm start: seeded noise on every
    LoRA weight), saved with its tokenizer as docs/training.md says (``save_model``)."""
    config = config_from_dict({"model": {"path": str(tiny_checkpoint), "lora": {"rank": 4, "alpha": 8}}})
    model = load_policy(config.model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    folder = save_model(model, load_tokenizer(tiny_checkpoint), tmp_path_factory.mktemp("warm") / "sft")
    return folder, _logits(model)


def test_a_saved_adapter_folder_is_its_base_plus_the_adapter(tiny_checkpoint, warm_adapter):
    folder, warm_logits = warm_adapter
    config = config_from_dict({"model": {"path": str(folder)}})
    assert config.model.path == str(tiny_checkpoint.resolve())  # the base its adapter_config names
    assert config.model.adapter == str(folder.resolve())
    assert config.model.tokenizer == str(folder.resolve())  # save_model wrote one beside it
    assert (config.model.lora.rank, config.model.lora.alpha) == (4, 8.0)  # taken from the adapter
    model = load_policy(config.model)
    assert torch.equal(_logits(model), warm_logits)  # the warm start, to the bit
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)  # trains on
    base = _logits(load_frozen_model(tiny_checkpoint))
    assert (_logits(model) - base).abs().max() > 0.1  # and not the bare base
    # frozen loads (an engine's copy, serve, a teacher) merge it: the same function to rounding
    assert torch.allclose(_logits(load_frozen_model(folder)), warm_logits, atol=1e-4)


def test_a_full_model_folder_means_what_it_meant(tiny_checkpoint):
    config = config_from_dict({"model": {"path": str(tiny_checkpoint), "lora": {"rank": 4}}})
    assert config.model.path == str(tiny_checkpoint) and config.model.adapter is None
    assert model_folder(tiny_checkpoint).adapter is None
    fresh = load_policy(config.model)  # a fresh adapter: B = 0, the base's function
    assert torch.equal(_logits(fresh), _logits(load_frozen_model(tiny_checkpoint)))


def test_folders_that_cannot_mean_a_policy_are_refused_by_key(tiny_checkpoint, warm_adapter, tmp_path):
    folder, _ = warm_adapter
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in folder.iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    saved = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(
        json.dumps({**saved, "base_model_name_or_path": "/nowhere/base"})
    )
    with pytest.raises(ConfigError, match="give the base model's folder as model.path") as error:
        config_from_dict({"model": {"path": str(moved)}})
    assert error.value.key == "model.path"
    # the base given by hand, the adapter beside it: the explicit form of the same thing
    config = config_from_dict({"model": {"path": str(tiny_checkpoint), "adapter": str(moved)}})
    assert config.model.lora.rank == 4
    with pytest.raises(ConfigError, match="itself a saved LoRA adapter") as error:
        config_from_dict({"model": {"path": str(folder), "adapter": str(moved)}})
    assert error.value.key == "model.adapter"
    with pytest.raises(ConfigError, match="no adapter_config.json") as error:
        config_from_dict({"model": {"path": str(tiny_checkpoint), "adapter": str(tiny_checkpoint)}})
    assert error.value.key == "model.adapter"


def _run_config(path, tmp_path, **sections):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"id": f"v{i}", "prompt": f"task {i}"}) + "\n" for i in range(3)))
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"id": f"t{i}", "prompt": f"task {i}"}) + "\n" for i in range(4)))
    data = {
        "model": {"path": str(path), "lora": {"rank": 4, "alpha": 8}},  # as the user warm-started it
        "data": {"train": str(train), "val": str(val)},
        "env": {"name": "trainer_envs:LowHighEnv"},
        # one request at a time, nothing stored: each response is computed from its own tokens alone
        "rollout": {
            "n": 2,
            "max_tokens": 8,
            "max_steps": 2,
            "max_batch_size": 1,
            "engine_kwargs": {"prefix_cache_entries": 0},
        },
        "trainer": {
            "steps": 1,
            "tasks_per_step": 2,
            "run_dir": str(tmp_path / "run"),
            "eval_every": 1,
            "mini_batches": 1,
        },
        "logging": {"progress": False, "tensorboard": False},
    }
    data.update(sections)
    config = config_from_dict(data)
    dump_config(config, tmp_path / "config.yaml")
    return config


def _step0_eval(run_dir) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r.get("step") == 0 and "eval/reward" in r)
    return {k: v for k, v in first.items() if k.startswith("eval/")}


def _cli_eval(path, capsys) -> dict[str, float]:
    from agent_r1.cli import main

    assert main(["eval", str(path)]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("policies", [None, {"low": {}, "high": {}}], ids=["one policy", "two policies"])
def test_train_starts_where_eval_stands(tiny_checkpoint, warm_adapter, tmp_path, capsys, policies):
    """The user's report: the step-0 evaluation of ``train`` on a saved adapter equals ``eval`` on
    the same path, and differs from the bare base's; with ``policies:`` every trained policy on the
    shared base starts from the adapter."""
    from agent_r1.train.trainer import Trainer

    folder, warm_logits = warm_adapter
    sections = {"policies": policies} if policies else {}
    config = _run_config(folder, tmp_path, **sections)
    evaluated = _cli_eval(tmp_path / "config.yaml", capsys)
    (tmp_path / "bare").mkdir()
    _run_config(tiny_checkpoint, tmp_path / "bare", **sections)
    assert _cli_eval(tmp_path / "bare" / "config.yaml", capsys)["eval/reward"] != evaluated["eval/reward"]
    trainer = Trainer(config)
    for adapter in policies or [None]:
        assert torch.equal(_logits(trainer.model, adapter), warm_logits)
    trainer.fit()
    trainer.close()
    assert _step0_eval(tmp_path / "run") == evaluated


def test_copies_and_the_reference_start_from_the_adapter(tiny_checkpoint, warm_adapter, tmp_path):
    """The engine's own copy (``rollout.share_model: false``, async), the KL reference and an engine
    built from the folder (``agent-r1 serve``) hold the warm start, merged (equal to float rounding:
    W + B A computed once instead of at every forward), never the bare base."""
    from agent_r1.rollout.factory import build_engine
    from agent_r1.train.backends import engine_copy
    from agent_r1.train.builders import load_reference

    folder, warm_logits = warm_adapter
    config = _run_config(folder, tmp_path, rollout={"share_model": False}, algorithm={"kl": {"coef": 0.01}})
    policy = load_policy(config.model)
    for copy in (
        engine_copy(policy, config),
        load_reference(config, policy),
        build_engine("hf", str(folder)).model,
    ):
        assert torch.allclose(_logits(copy), warm_logits, atol=1e-4)
    # a fresh adapter's reference stays the adapter-disabled policy: no second copy
    fresh = config_from_dict(
        {"model": {"path": str(tiny_checkpoint), "lora": {"rank": 4}}, "algorithm": {"kl": {"coef": 0.01}}}
    )
    assert load_reference(fresh, load_policy(fresh.model)) is None


def test_check_says_what_it_loads(warm_adapter, tmp_path, capsys):
    from agent_r1.cli import main

    folder, _ = warm_adapter
    _run_config(folder, tmp_path, policies={"low": {}, "high": {"frozen": True}})
    assert main(["check", str(tmp_path / "config.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"policies.low (trained): starts from the saved adapter '{folder.resolve()}'" in out
    assert "a LoRA adapter of rank 4, alpha 8" in out
    assert "policies.high (frozen): the base model, every adapter off" in out


def test_a_checkpoint_policy_is_a_model_folder(warm_adapter, tmp_path):
    """A LoRA run's checkpoint ``model/`` is an adapter folder naming its base: a new run started
    from it holds the checkpoint's policy."""
    from agent_r1.train.trainer import Trainer

    folder, _ = warm_adapter
    trainer = Trainer(
        _run_config(
            folder,
            tmp_path,
            trainer={
                "steps": 1,
                "eval_every": 0,
                "run_dir": str(tmp_path / "run"),
                "tasks_per_step": 2,
                "mini_batches": 1,
                "lr": 1e-2,
            },
        )
    )
    trainer.fit()
    trained = _logits(trainer.model)
    trainer.close()
    checkpoint = load_config(
        tmp_path / "config.yaml",
        [f"model.path={tmp_path / 'run/checkpoints/step_000001/model'}", "model.adapter=null"],
    )
    assert torch.equal(_logits(load_policy(checkpoint.model)), trained)


def test_serve_serves_the_adapter_on_its_base(warm_adapter, tiny_checkpoint):
    """``agent-r1 serve FOLDER`` on a saved adapter: the warm start's greedy tokens (its weights merged
    into the base), not the bare base's, through the real ``openai``-compatible client."""
    import asyncio
    import os
    import socket
    import subprocess
    import sys
    import time

    from agent_r1.rollout import HFEngine, OpenAIEngine
    from agent_r1.types import SamplingParams

    folder, _ = warm_adapter
    prompt, params = [1, 60, 61, 62, 63], SamplingParams(max_tokens=6, temperature=0.0, seed=0)

    def greedy(model) -> tuple[int, ...]:
        engine = HFEngine(model)
        try:
            return tuple(asyncio.run(engine.generate(prompt, params)).token_ids)
        finally:
            engine.close()

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "agent_r1.cli", "serve", str(folder), "--port", str(port)],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        client = OpenAIEngine(f"http://127.0.0.1:{port}/v1", folder.name)

        async def served() -> tuple[int, ...]:
            deadline = time.monotonic() + 120
            while True:
                assert server.poll() is None, f"agent-r1 serve exited: {server.stdout.read()}"
                result = await client.generate(prompt, params)
                if result.error is None:
                    return tuple(result.token_ids)
                assert time.monotonic() < deadline, f"agent-r1 serve did not come up: {result.error}"
                await asyncio.sleep(0.5)

        tokens = asyncio.run(served())
        asyncio.run(client.aclose())
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert tokens == greedy(load_frozen_model(folder))
    assert tokens != greedy(load_frozen_model(tiny_checkpoint))

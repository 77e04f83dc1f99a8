"""Frozen policies that are not the base model (issue 50 item 1): a LoRA adapter that peft saved
(``policies.<name>: {frozen: true, adapter: PATH}``), and an OpenAI-compatible server
(``{frozen: true, server: URL}``); a trained policy may start from a saved adapter too. The errors
name the key, before any training (exit 2 from the CLI)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from agent_r1.cli import main
from agent_r1.rollout import HFEngine, RoleRouter
from agent_r1.rollout.server import build_app, start_server
from agent_r1.train.builders import rollout_engine
from agent_r1.train.config import ConfigError, LoraConfig, ModelConfig, config_from_dict, load_config
from agent_r1.train.learner import load_policy
from agent_r1.train.policies import engine_roles, server_engines
from agent_r1.train.trainer import Trainer
from agent_r1.types import Completion, SamplingParams, StopReason

STEPS, TASKS_PER_STEP, N = 2, 2, 4


def tasks(n: int) -> list[dict]:
    return [{"id": f"t{i}", "prompt": f"task {i}"} for i in range(n)]


def policies_config(tiny_checkpoint, run_dir, policies, **sections):
    data = {
        "model": {"path": str(tiny_checkpoint), "lora": {"rank": 4, "alpha": 8}},
        "env": {"name": "trainer_envs:LowHighEnv"},
        "rollout": {"n": N, "max_tokens": 8, "max_steps": 2},
        "trainer": {
            "steps": STEPS,
            "tasks_per_step": TASKS_PER_STEP,
            "lr": 1e-2,
            "run_dir": str(run_dir),
            "eval_every": 0,
            "mini_batches": 1,
            "checkpoint_every": STEPS,
        },
        "logging": {"progress": False, "tensorboard": False},
        "policies": policies,
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data)


def save_adapter(base: Path, folder: Path, *, rank: int = 2, target_modules=("q_proj", "v_proj")) -> Path:
    """A LoRA adapter of ``base`` as peft saves it ("default": in ``folder`` itself), with random
    weights (lora_B too, so that it changes the model's outputs)."""
    lora = LoraConfig(rank=rank, alpha=2 * rank, target_modules=list(target_modules))
    torch.manual_seed(7)
    model = load_policy(ModelConfig(path=str(base), lora=lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def saved_adapter(tiny_checkpoint, tmp_path_factory) -> Path:
    return save_adapter(tiny_checkpoint, tmp_path_factory.mktemp("adapter") / "opponent")


def adapter_of(model, name: str) -> dict[str, torch.Tensor]:
    """The peft parameters of adapter ``name``, under peft's saved names (no adapter name)."""
    return {
        n.replace(f".{name}.", "."): p.detach().clone()
        for n, p in model.named_parameters()
        if f".{name}." in n and "lora_" in n
    }


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "adapter_model.safetensors")


# ---------------------------------------------------------------------------------- a saved adapter


def test_a_frozen_adapter_plays_never_moves_and_is_restored(tiny_checkpoint, saved_adapter, tmp_path):
    config = policies_config(
        tiny_checkpoint,
        tmp_path / "run",
        {"low": {}, "high": {"frozen": True, "adapter": str(saved_adapter)}},
    )
    assert engine_roles(config) == {"low": "low", "high": "high"}  # the engine serves it as an adapter
    trainer = Trainer(config, train_tasks=tasks(4))
    model = trainer.model
    assert set(model.peft_config) == {"low", "high"} and model.peft_config["high"].r == 2
    high, saved = adapter_of(model, "high"), saved_tensors(saved_adapter)
    assert set(high) == set(saved) and all(torch.equal(v, saved[n]) for n, v in high.items())
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".high." in n)
    assert set(trainer.learner.policy.learners) == {"low"}  # no Learner, no optimizer
    assert set(trainer.learner.policy.weights()()) == {"low"}  # never pushed by a weight sync
    low0 = adapter_of(model, "low")

    metrics = trainer.fit()
    assert "role/high/reward/mean" in metrics  # it played
    assert "policy/low/loss/policy" in metrics and not any(k.startswith("policy/high/") for k in metrics)
    for name, value in adapter_of(model, "high").items():
        assert torch.equal(value, high[name]), name
    assert any(not torch.equal(v, low0[n]) for n, v in adapter_of(model, "low").items())
    # saved with the checkpoint (model/high/, as the run served it), and restored from there
    checkpoint = tmp_path / "run" / "checkpoints" / f"step_{STEPS:06d}"
    for name, value in saved_tensors(checkpoint / "model" / "high").items():
        assert torch.equal(value, saved[name]), name
    low = adapter_of(model, "low")
    trainer.close()
    resumed = Trainer(config, train_tasks=tasks(4), resume=True)
    resumed._restore()
    assert all(torch.equal(v, low[n]) for n, v in adapter_of(resumed.model, "low").items())
    assert all(torch.equal(v, high[n]) for n, v in adapter_of(resumed.model, "high").items())
    resumed.close()


def test_an_engine_copy_holds_the_frozen_adapter(tiny_checkpoint, saved_adapter, tmp_path):
    """rollout.share_model: false: the engine's own copy holds the frozen adapter too, and serves
    the high role with it (its log-probs equal the learner's model under that adapter)."""
    config = policies_config(
        tiny_checkpoint,
        tmp_path / "run",
        {"low": {}, "high": {"frozen": True, "adapter": str(saved_adapter)}},
        rollout={"share_model": False},
    )
    trainer = Trainer(config, train_tasks=tasks(2))
    engine = trainer.rollouts.raw_engine
    assert engine.model is not trainer.model and set(engine.model.peft_config) == {"low", "high"}
    prompt = list(range(10, 30))
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, role="high")
    completion = asyncio.run(engine.generate(prompt, params))
    ids = torch.tensor([prompt + list(completion.token_ids)])
    with torch.no_grad(), trainer.model.disable_adapter():
        base = torch.log_softmax(trainer.model(input_ids=ids).logits[0, len(prompt) - 1 : -1], -1)
    trainer.model.set_adapter("high")
    with torch.no_grad():
        adapted = torch.log_softmax(trainer.model(input_ids=ids).logits[0, len(prompt) - 1 : -1], -1)
    trainer.model.set_adapter("low")
    chosen = torch.tensor(completion.token_ids)[:, None]
    expected = adapted.gather(1, chosen)[:, 0]
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)
    assert not torch.allclose(base.gather(1, chosen)[:, 0], expected, atol=1e-3)  # the adapter matters
    trainer.close()


def test_a_trained_policy_starts_from_a_saved_adapter(tiny_checkpoint, saved_adapter, tmp_path):
    config = policies_config(
        tiny_checkpoint, tmp_path / "run", {"low": {"adapter": str(saved_adapter)}, "high": {}}
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    model = trainer.model
    assert model.peft_config["low"].r == 2 and model.peft_config["high"].r == 4  # its own rank
    start, saved = adapter_of(model, "low"), saved_tensors(saved_adapter)
    assert set(start) == set(saved) and all(torch.equal(v, saved[n]) for n, v in start.items())
    metrics = trainer.fit()
    assert "policy/low/loss/policy" in metrics and "policy/high/loss/policy" in metrics
    assert any(not torch.equal(v, start[n]) for n, v in adapter_of(model, "low").items())
    assert trainer.learner.policy.learners["low"].state_dict()["optimizer_steps"] == STEPS
    trainer.close()


def test_vllm_loads_a_frozen_adapter_from_its_folder(
    tiny_checkpoint, tiny_tokenizer, saved_adapter, monkeypatch
):
    """rollout.engine: vllm (wiring only; the vLLM tier tests update_adapters with folders): the
    engine serves the frozen adapter's role, loads it once from its folder, with room for its rank."""
    built = {}

    class Engine:
        def update_adapters(self, adapters, version=None):
            built["loaded"] = dict(adapters)

    def build_engine(kind, model, **kwargs):
        built.update(kind=kind, kwargs=kwargs)
        return Engine()

    monkeypatch.setattr("agent_r1.rollout.factory.build_engine", build_engine)
    config = policies_config(
        tiny_checkpoint,
        "run",
        {"low": {}, "high": {"frozen": True, "adapter": str(saved_adapter)}},
        model={"lora": {"rank": 1, "alpha": 2}},
        rollout={"engine": "vllm"},
    )
    rollout_engine(config, tiny_tokenizer)
    assert built["kind"] == "vllm" and built["kwargs"]["roles"] == {"low": "low", "high": "high"}
    assert built["kwargs"]["max_lora_rank"] == 2  # the saved adapter's rank, above model.lora.rank
    assert built["loaded"] == {"high": str(saved_adapter)}


# ---------------------------------------------------------------------------------- a server


class RecordingEngine:
    """The server's engine: records each prompt it is asked to continue."""

    def __init__(self, engine) -> None:
        self.engine, self.prompts = engine, []

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        return await self.engine.generate(prompt_ids, params)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@contextmanager
def serving(engine, tokenizer, *, api_key: str | None = None):
    """``agent-r1 serve``'s app over ``engine`` on a thread of its own; yields its base URL."""
    with running(build_app(engine, model_name="tiny", tokenizer=tokenizer, api_key=api_key)) as url:
        yield url


@contextmanager
def running(app):
    """An aiohttp ``app`` served on a thread of its own; yields its base URL (``.../v1``)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, port = asyncio.run_coroutine_threadsafe(start_server(app), loop).result()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


@pytest.fixture(scope="module")
def server_engine(tiny_checkpoint, tiny_tokenizer):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    return RecordingEngine(HFEngine(model, tokenizer=tiny_tokenizer))


ASYNC = {
    "trainer": {"mode": "async"},
    "rollout": {"share_model": False},
    "algorithm": {"off_policy": {"name": "tis"}},
}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_frozen_policy_on_a_server_samples_its_roles_there(
    tiny_checkpoint, tiny_tokenizer, server_engine, tmp_path, monkeypatch, mode
):
    monkeypatch.setenv("OPPONENT_KEY", "secret")
    with serving(server_engine, tiny_tokenizer, api_key="secret") as url:
        high = {"frozen": True, "server": url, "model": "tiny", "api_key_env": "OPPONENT_KEY"}
        sections = ASYNC if mode == "async" else {}
        config = policies_config(tiny_checkpoint, tmp_path / "run", {"low": {}, "high": high}, **sections)
        assert engine_roles(config) == {"low": "low"}  # the local engine does not serve high
        trainer = Trainer(config, train_tasks=tasks(4))
        assert isinstance(trainer.rollouts.raw_engine, RoleRouter)
        assert set(trainer.model.peft_config) == {"low"}
        low0 = adapter_of(trainer.model, "low")
        server_engine.prompts.clear()
        metrics = trainer.fit()
        trainer.close()
    # exactly the high role's requests, one per episode (its second step), each answered
    prompts = [tiny_tokenizer.decode(p) for p in server_engine.prompts]
    assert len(prompts) == STEPS * TASKS_PER_STEP * N
    assert all("(high)" in p and "(low)" not in p for p in prompts), prompts[:2]
    assert metrics["role/high/response_length/mean"] > 0
    assert "policy/low/loss/policy" in metrics and not any(k.startswith("policy/high/") for k in metrics)
    assert any(not torch.equal(v, low0[n]) for n, v in adapter_of(trainer.model, "low").items())


class Answering:
    def __init__(self, name: str) -> None:
        self.name, self.calls, self.weight_version, self.model = name, [], None, f"{name} model"

    async def generate(self, prompt_ids, params):
        self.calls.append(params.role)
        return Completion((1,), (0.0,), StopReason.STOP, text=self.name)

    def update_weights(self, named_tensors, version=None):
        self.calls.append(("weights", version))
        self.weight_version = version


def test_role_router_sends_each_role_to_its_engine():
    local, remote = Answering("local"), Answering("remote")
    router = RoleRouter(local, {"high": remote})

    async def sample(role):
        return (await router.generate([1, 2], SamplingParams(role=role))).text

    assert [asyncio.run(sample(r)) for r in ("low", "high", None)] == ["local", "remote", "local"]
    router.update_weights([], 3)
    router.weight_version = 4
    assert local.calls == ["low", None, ("weights", 3)] and remote.calls == ["high"]
    assert local.weight_version == router.weight_version == 4 and remote.weight_version is None
    assert router.model == "local model"  # every other attribute is the local engine's


def test_a_server_policy_is_checked_when_its_engine_is_built(
    tiny_checkpoint, tiny_tokenizer, server_engine, tmp_path
):
    def engines(**high):
        policies = {"low": {}, "high": {"frozen": True, **high}}
        return server_engines(policies_config(tiny_checkpoint, tmp_path, policies), tiny_tokenizer)

    with serving(server_engine, tiny_tokenizer) as url:
        assert engines(server=url)["high"].model == "tiny"  # the server's first model
        with pytest.raises(ConfigError, match=r"serves \['tiny'\], not 'other'") as error:
            engines(server=url, model="other")
        assert error.value.key == "policies.high.model"
        with pytest.raises(ConfigError, match="is not set") as error:
            engines(server=url, api_key_env="AGENT_R1_TEST_UNSET_KEY")
        assert error.value.key == "policies.high.api_key_env"
    with pytest.raises(ConfigError, match="cannot list the server's models") as error:
        engines(server=url)  # no longer served
    assert error.value.key == "policies.high.server"


def test_a_server_with_another_tokenizer_is_refused_and_one_that_cannot_tell_is_named(
    tiny_checkpoint, tiny_tokenizer, server_engine, tmp_path, caplog
):
    """Prompts go to a server policy as token ids: its tokenizer must be the run's. ``vllm serve``
    and ``agent-r1 serve`` answer ``/tokenize``, so a probe tells; a server without it gets a warning
    that names the key (never a silent pass)."""
    from agent_r1.models.loading import load_tokenizer

    config = policies_config(
        tiny_checkpoint, tmp_path, {"low": {}, "high": {"frozen": True, "server": "http://127.0.0.1:1/v1"}}
    )
    other = load_tokenizer(tiny_checkpoint)
    other.add_tokens(["Probe"])  # one more token, in the probe: its ids differ from the run's
    with serving(server_engine, other) as url:
        moved = replace(
            config, policies={**config.policies, "high": replace(config.policies["high"], server=url)}
        )
        with pytest.raises(ConfigError, match="tokenizes a probe differently") as error:
            server_engines(moved, tiny_tokenizer)
        assert error.value.key == "policies.high.server"
    with models_only() as url:
        moved = replace(
            config, policies={**config.policies, "high": replace(config.policies["high"], server=url)}
        )
        with caplog.at_level("WARNING", logger="agent_r1.train.policies"):
            assert server_engines(moved, tiny_tokenizer)["high"].model == "tiny"
        assert "policies.high.server" in caplog.text and "no /tokenize endpoint" in caplog.text


@contextmanager
def models_only():
    """Test double: a server that lists one model and has no ``/tokenize`` (a hosted API)."""
    from aiohttp import web

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    with running(app) as url:
        yield url


# ---------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("high", "sections", "key", "words"),
    [
        ({"server": "http://localhost:1/v1"}, {}, "policies.high.server", "set frozen: true"),
        (
            {"frozen": True, "server": "http://localhost:1/v1", "adapter": "a"},
            {},
            "policies.high.adapter",
            "an adapter or a server, not both",
        ),
        ({"frozen": True, "server": "localhost:8000"}, {}, "policies.high.server", "must be a URL"),
        ({"frozen": True, "model": "tiny"}, {}, "policies.high.model", "set server"),
        ({"frozen": True, "adapter": "a", "api_key_env": "K"}, {}, "policies.high.api_key_env", "set server"),
        (
            {"frozen": True, "server": "http://localhost:1/v1"},
            {"trainer": {"deterministic": True}},
            "trainer.deterministic",
            "sampled by a server",
        ),
    ],
)
def test_bad_frozen_policies_are_refused_by_key(tiny_checkpoint, tmp_path, high, sections, key, words):
    with pytest.raises(ConfigError, match=words) as error:
        policies_config(tiny_checkpoint, tmp_path, {"low": {}, "high": high}, **sections)
    assert error.value.key == key


def bad_adapter(kind: str, tiny_checkpoint, saved_adapter, tmp_path) -> tuple[Path, str]:
    """A folder that is no adapter for the tiny base, and the words its refusal says."""
    folder = tmp_path / kind
    if kind == "missing":
        return folder, "is not a folder"
    if kind == "a model":
        return tiny_checkpoint, "holds no adapter_config.json"
    if kind == "several adapters":  # a several-policy checkpoint's model/: one adapter per subfolder
        shutil.copytree(saved_adapter, folder / "low")
        return folder, r"give one of its subfolders \['low'\]"
    if kind == "not LoRA":
        shutil.copytree(saved_adapter, folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
        return folder, "holds a IA3 adapter"
    if kind == "no weights":
        shutil.copytree(saved_adapter, folder)
        (folder / "adapter_model.safetensors").unlink()
        return folder, "holds no adapter weights"
    if kind == "another size":  # the same architecture, hidden size 64: peft's size mismatch
        from agent_r1.models.tiny import save_tiny_checkpoint

        base = save_tiny_checkpoint(tmp_path / "small", hidden_size=64)
        return save_adapter(base, folder), "does not fit the base model"
    if kind == "another architecture":  # modules the base has not (GPT-2's c_attn)
        shutil.copytree(saved_adapter, folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["c_attn"]}))
        return folder, r"does not fit the base model .*c_attn"
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind",
    [
        "missing",
        "a model",
        "several adapters",
        "not LoRA",
        "no weights",
        "another size",
        "another architecture",
    ],
)
@pytest.mark.parametrize("frozen", [True, False])
def test_an_adapter_that_is_no_lora_of_the_base_is_refused_by_key(
    tiny_checkpoint, saved_adapter, tmp_path, kind, frozen
):
    folder, words = bad_adapter(kind, tiny_checkpoint, saved_adapter, tmp_path)
    config = policies_config(
        tiny_checkpoint, tmp_path / "run", {"low": {}, "high": {"frozen": frozen, "adapter": str(folder)}}
    )
    with pytest.raises(ConfigError, match=words) as error:
        Trainer(config, train_tasks=tasks(2))
    assert error.value.key == "policies.high.adapter"


def test_the_cli_refuses_a_bad_adapter_and_finds_one_beside_the_config(
    tiny_checkpoint, saved_adapter, tmp_path, monkeypatch, capsys
):
    shutil.copytree(saved_adapter, tmp_path / "opponent")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks(2)))
    config = {
        "model": {"path": str(tiny_checkpoint), "device": "cpu", "lora": {"rank": 4, "alpha": 8}},
        "data": {"train": "train.jsonl"},
        "env": {"name": "trainer_envs:LowHighEnv"},
        "trainer": {"run_dir": str(tmp_path / "run")},
        "policies": {"low": {}, "high": {"frozen": True, "adapter": "opponent"}},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path.parent)  # relative paths: found beside the config file
    assert load_config(path).policies["high"].adapter == str((tmp_path / "opponent").resolve())
    assert main(["check", str(path)]) == 0, capsys.readouterr().out
    capsys.readouterr()
    assert main(["check", str(path), "policies.high.adapter=nowhere"]) == 2
    printed = capsys.readouterr().out
    assert "config key 'policies.high.adapter': 'nowhere' is not a folder" in printed

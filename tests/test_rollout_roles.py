"""HFEngine serving several roles at once: each role a LoRA adapter of one shared tiny model (or the
base model), rows of every role in one decode batch, KV never shared across adapters.

Tolerance: every log-prob is compared with an unpadded forward of the same tokens under that adapter
alone within 1e-4, the bound of every engine-vs-learner parity test in tests/test_rollout_hf.py. A
mixed-adapter forward runs each LoRA layer's base matmul on the whole batch and its adapter's
``B(A(x))`` on the adapter's rows: the same float32 ops as a forward of that adapter alone, on
different batch shapes, so the gap is float32 rounding (~1e-6 here), as for padding and joins.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import LoraLayer

from agent_r1.models.tiny import build_tiny
from agent_r1.rollout import HFEngine
from agent_r1.types import Completion, SamplingParams, StopReason

TOLERANCE = 1e-4  # tests/test_rollout_hf.py's engine-vs-learner bound (fp32)
ROLES = {"planner": "alpha", "executor": "beta", "judge": None}  # role -> adapter (None: the base model)


@pytest.fixture(scope="module")
def model():
    """The tiny Qwen2 (built from config) with LoRA adapters "alpha" and "beta" on every projection, their B
    matrices drawn at random (peft initialises them to zero: both adapters would be the base model)."""
    base, _ = build_tiny(seed=0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM")
    model = get_peft_model(base, config, adapter_name="alpha")
    model.add_adapter("beta", config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for name in ("alpha", "beta"):
                    weight = module.lora_B[name].weight
                    weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def engine(model):
    return HFEngine(model, roles=ROLES, eos_token_ids=())


@contextlib.contextmanager
def running(model, adapter: str | None):
    """``model`` running ``adapter`` alone (None: the base model, adapters off)."""
    if adapter is None:
        with model.disable_adapter():
            yield
    else:
        model.set_adapter(adapter)
        yield


def reference_logprobs(model, adapter, prompt, token_ids, temperature: float = 1.0) -> torch.Tensor:
    """The learner's recomputation under ``adapter`` alone: one unpadded forward over prompt + response."""
    ids = torch.tensor([list(prompt) + list(token_ids)])
    with torch.no_grad(), running(model, adapter):
        logits = model(input_ids=ids).logits[0].float()
    positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return (logits / (temperature or 1.0)).log_softmax(-1)[positions, ids[0, len(prompt) :]]


def reference_greedy(model, adapter, prompt, n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad(), running(model, adapter):
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def gap(model, role, prompt, done: Completion, temperature: float = 1.0) -> float:
    expected = reference_logprobs(model, ROLES[role], prompt, done.token_ids, temperature)
    return float((expected - torch.tensor(done.logprobs)).abs().max())


def prompt(n: int, start: int = 10) -> list[int]:
    return [start + (i * 7) % 200 for i in range(n)]


def spy_forwards(engine) -> list[tuple[set[str | None], bool]]:
    """Record, for every forward the engine's scheduler runs (a test seam), its rows' adapters and
    whether a cascade block was attended."""
    seen, forward = [], engine._scheduler._forward

    def spied(input_ids_BS, mask_BT, position_ids_BS, cache, plan=None, adapters=(), **kwargs):
        seen.append((set(adapters), plan is not None and plan.blocks is not None))
        return forward(input_ids_BS, mask_BT, position_ids_BS, cache, plan, adapters=adapters, **kwargs)

    engine._scheduler._forward = spied
    return seen


async def together(engine, calls):
    """Submit ``calls`` so that the engine takes them all into one prefill (they share decode steps)."""
    with engine._wakeup:  # the engine thread takes the queue only once all are in it
        tasks = [asyncio.ensure_future(c) for c in calls]
        await asyncio.sleep(0)  # every task runs up to its submission
    return await asyncio.gather(*tasks)


def test_the_adapters_differ(model):
    """The premise of every test here: the same tokens score differently under a, b and the base."""
    ids = prompt(20)
    a, b, base = (reference_logprobs(model, adapter, ids[:5], ids[5:]) for adapter in ("alpha", "beta", None))
    assert (
        min(float((a - b).abs().max()), float((a - base).abs().max()), float((b - base).abs().max())) > 0.05
    )


def test_rows_of_every_role_decode_together_and_match_their_adapter_alone(model):
    """Groups of the planner (alpha) and the executor (beta) with one prompt, the base role and a later joiner decode in the same
    forwards; each row's log-probs equal its adapter's own unpadded forward, and identical prompts of
    different adapters are not prefilled (or held as a cascade block) once for both."""
    engine = HFEngine(model, roles=ROLES, eos_token_ids=())
    assert engine.cascade_attention
    seen = spy_forwards(engine)
    shared = prompt(14, 3)
    first = [
        (shared, SamplingParams(max_tokens=12, seed=1, role="planner")),
        (shared, SamplingParams(max_tokens=12, seed=2, role="planner")),
        (shared, SamplingParams(temperature=0.7, max_tokens=10, seed=3, role="executor")),
        (shared, SamplingParams(temperature=0.7, max_tokens=10, seed=4, role="executor")),
        (prompt(25, 5), SamplingParams(max_tokens=14, seed=5, role="judge")),
        (prompt(6, 8), SamplingParams(temperature=0.0, max_tokens=9, role="executor")),
    ]
    later = (prompt(31, 2), SamplingParams(temperature=1.3, max_tokens=8, seed=6, role="planner"))

    async def main():
        early = asyncio.ensure_future(together(engine, [engine.generate(p, sp) for p, sp in first]))
        await asyncio.sleep(0.05)  # the first rows are decoding when the last one arrives
        return [*await early, await engine.generate(*later)]

    completions = asyncio.run(main())
    assert engine.shared_prefills == 2  # alpha's pair once, beta's pair once: not all four at once
    # rows of every role shared decode steps, the groups' blocks attended in them
    assert any({"alpha", "beta", "__base__"} <= names and blocks for names, blocks in seen)
    for (p, sp), done in zip([*first, later], completions, strict=True):
        assert done.error is None and len(done.token_ids) == sp.max_tokens
        assert gap(model, sp.role, p, done, sp.temperature) < TOLERANCE, sp


def test_greedy_decoding_under_each_role_is_that_roles_own(model, engine):
    """One prompt, greedy, under every role at once: each row is its adapter's greedy continuation,
    the same as when that role decodes alone (and the roles' continuations differ)."""
    ids = prompt(16, 4)
    greedy = {role: SamplingParams(temperature=0.0, max_tokens=12, role=role) for role in ROLES}
    alone = {role: asyncio.run(engine.generate(ids, sp)) for role, sp in greedy.items()}
    in_one_batch = asyncio.run(together(engine, [engine.generate(ids, sp) for sp in greedy.values()]))
    mixed = dict(zip(greedy, in_one_batch, strict=True))
    for role, adapter in ROLES.items():
        assert mixed[role].token_ids == alone[role].token_ids
        assert list(mixed[role].token_ids) == reference_greedy(model, adapter, ids, 12), role
    assert len({c.token_ids for c in mixed.values()}) == len(ROLES)


def test_a_stored_turn_serves_only_its_own_adapter(model):
    """Multi-turn reuse keyed by (adapter, tokens): an executor (beta) turn whose prompt extends a
    planner (alpha) turn's stored sequence token for token runs in full under beta; the planner's own
    next turn reuses it; and trajectories of
    both roles from one prompt reuse only their own turns, every log-prob matching its adapter."""
    engine = HFEngine(model, roles=ROLES, eos_token_ids=())
    opening = prompt(18, 6)
    first = asyncio.run(engine.generate(opening, SamplingParams(max_tokens=6, seed=1, role="planner")))
    extended = opening + list(first.token_ids) + [50, 51]
    as_b = asyncio.run(engine.generate(extended, SamplingParams(max_tokens=6, seed=2, role="executor")))
    assert gap(model, "executor", extended, as_b) < TOLERANCE
    assert engine.prefix_hits == 0  # alpha's KV of these very tokens was stored, and not used for beta
    as_a = asyncio.run(engine.generate(extended, SamplingParams(max_tokens=6, seed=3, role="planner")))
    assert gap(model, "planner", extended, as_a) < TOLERANCE
    assert engine.prefix_hits == 1

    engine = HFEngine(model, roles=ROLES, eos_token_ids=())
    checks = []

    async def trajectory(role: str, seed: int):
        ids = list(opening)
        for turn in range(3):
            done = await engine.generate(
                ids, SamplingParams(max_tokens=5 + turn, seed=seed + turn, role=role)
            )
            checks.append((role, tuple(ids), done))
            ids = ids + list(done.token_ids) + [60 + turn, 61]

    async def main():
        await together(engine, [trajectory(role, 10 * k) for k, role in enumerate(ROLES)])

    asyncio.run(main())
    assert engine.prefix_hits == 2 * len(ROLES)  # turns 2 and 3 of each role, each from its own turn
    for role, ids, done in checks:
        assert done.error is None and gap(model, role, ids, done) < TOLERANCE, (role, len(ids))


def test_a_request_of_a_role_not_served_is_refused_alone(model, engine):
    """An unknown role, or none, is answered at once with ABORT naming the roles served; the engine
    goes on serving the others."""

    async def main():
        return await asyncio.gather(
            engine.generate(prompt(5), SamplingParams(max_tokens=3, role="critic")),
            engine.generate(prompt(5), SamplingParams(max_tokens=3)),
            engine.generate(prompt(5), SamplingParams(max_tokens=3, role="planner")),
        )

    unknown, unnamed, served = asyncio.run(main())
    for refused in (unknown, unnamed):
        assert refused.finish_reason is StopReason.ABORT and not refused.token_ids
        assert "['executor', 'judge', 'planner']" in refused.error
    assert "unknown role 'critic'" in unknown.error
    assert "SamplingParams.role is None" in unnamed.error
    assert served.error is None and len(served.token_ids) == 3


def test_roles_that_cannot_be_served_are_refused_at_construction(model):
    with pytest.raises(ValueError, match=r"no adapter 'gamma'; it has \['alpha', 'beta'\]"):
        HFEngine(model, roles={"planner": "gamma"})
    with pytest.raises(ValueError, match="at least one role"):
        HFEngine(model, roles={})
    plain, _ = build_tiny(seed=0)
    with pytest.raises(ValueError, match="not a peft model"):
        HFEngine(plain, roles={"planner": "alpha"})
    base_only = HFEngine(plain.eval(), roles={"judge": None})  # a plain model serves base-model roles
    done = asyncio.run(base_only.generate(prompt(7), SamplingParams(max_tokens=4, seed=1, role="judge")))
    assert done.error is None and len(done.token_ids) == 4


def test_without_roles_the_role_of_a_request_is_ignored(model):
    """``roles=None``: the model runs as it is (its active adapter) whatever ``params.role`` says,
    bit for bit, and no forward names adapters."""
    model.set_adapter("beta")
    engine = HFEngine(model, eos_token_ids=())
    seen = spy_forwards(engine)
    ids = prompt(12, 9)
    plain = asyncio.run(engine.generate(ids, SamplingParams(max_tokens=8, seed=7)))
    named = asyncio.run(engine.generate(ids, SamplingParams(max_tokens=8, seed=7, role="anything")))
    assert named == plain and plain.error is None
    assert seen and all(names <= {None} for names, _ in seen)
    assert gap(model, "executor", ids, plain) < TOLERANCE  # adapter beta, the active one

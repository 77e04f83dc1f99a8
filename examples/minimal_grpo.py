"""The whole algorithm in one file: multi-step GRPO with a calculator tool, on a tiny model, on CPU.

1. Build a ~1M-parameter Qwen2 and a byte-level ChatML tokenizer from config (nothing downloaded).
2. Warm-start it by supervised learning on an imperfect demonstrator's episodes
   (``agent_r1.tasks.arithmetic``: on half the tasks it usually answers after one call).
3. RL: roll out ``group_size`` multi-step episodes per task (the model calls the calculator, reads the
   result, calls again, answers), score them, compute GRPO advantages, and take PPO-clip steps.
4. Print held-out success (sampled, as the policy is trained) before and after RL.

Each episode is ONE token sequence: prompt, response, tool turn, response, ... (the "append" context);
a loss mask marks the tokens the model sampled. That is the step-level MDP of Agent-R1
(arXiv 2511.14460) with every step's prompt being a prefix of the next, packed into one sequence.

GRPO (Shao et al. 2024, arXiv 2402.03300): advantage_i = (r_i - mean(r)) / (std(r) + eps) over the
group, broadcast to every sampled token of the episode; the PPO-clip surrogate (Schulman et al. 2017)
is averaged over all sampled tokens of a mini-batch. Deviations from the paper: no KL penalty (the
warm start is the reference and the run is short), and groups whose rewards are all equal are dropped
(their advantage is zero; DAPO's dynamic sampling, arXiv 2503.14476).

Sampler and learner compute log-probs the same way, ``log_softmax(logits / temperature)`` over the
full vocabulary with no masking, so the PPO ratio is exactly 1 before the first update.

Run: ``python examples/minimal_grpo.py`` (``--help`` lists the settings; ``--quick`` for a short run).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from agent_r1.models.tiny import build_tiny
from agent_r1.tasks import arithmetic


@dataclass
class Args:
    seed: int = 0
    sft_demos: int = 800  # demonstrations for the warm start
    sft_epochs: int = 3
    sft_lr: float = 3e-3
    sft_batch: int = 16
    rl_steps: int = 12
    tasks_per_step: int = 16
    group_size: int = 8
    lr: float = 2e-4
    clip_eps: float = 0.2  # PPO clip range
    minibatches: int = 2  # optimizer steps per RL step (the second one is off-policy: clipping matters)
    temperature: float = 1.0
    max_turns: int = 4
    max_new_tokens: int = 80
    eval_tasks: int = 100
    eval_samples: int = 4  # sampled episodes per held-out task
    micro_batch: int = 64  # sequences per forward pass


@dataclass
class Episode:
    task: dict
    tokens: list[int]  # the whole conversation so far
    mask: list[int]  # 1 where the model sampled the token
    logprobs: list[float]  # sampling log-prob where mask == 1, else 0
    turns: int = 0
    done: bool = False
    reward: float = 0.0
    memory: arithmetic.CalculatorMemory = field(default_factory=arithmetic.CalculatorMemory)


_CALL_RE = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def start_episode(tok, task: dict) -> Episode:
    ids = encode(tok, tok.apply_chat_template(task["prompt"], add_generation_prompt=True, tokenize=False))
    episode = Episode(task, ids, [0] * len(ids), [0.0] * len(ids))
    episode.memory.reset(task)
    return episode


def env_step(tok, ep: Episode, response: list[int], logprobs: list[float], max_turns: int) -> None:
    """Append the response; end the episode on an answer, or run the calculator and show its result."""
    ep.tokens += response
    ep.mask += [1] * len(response)
    ep.logprobs += logprobs
    ep.turns += 1
    text = tok.decode(response)
    answer = arithmetic.extract_answer(text)
    match = _CALL_RE.search(text)
    if answer is not None or match is None or ep.turns >= max_turns or response[-1] != tok.eos_token_id:
        ep.done, ep.reward = True, arithmetic.score(ep.memory.resolve(answer), ep.task)
        return
    try:
        result = ep.memory.evaluate(json.loads(match.group(1))["arguments"]["expression"])
    except (ValueError, KeyError, TypeError) as e:  # a bad call is an observation, not a crash
        result = f"error: {e}"
    # Exactly what the chat template renders for a role "tool" message after an assistant turn.
    turn = (
        f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    ids = encode(tok, turn)
    ep.tokens += ids
    ep.mask += [0] * len(ids)
    ep.logprobs += [0.0] * len(ids)


@torch.no_grad()
def sample(model, tok, prompts: list[list[int]], args: Args, temperature: float):
    """Sample one response per prompt, token by token with a KV cache (prompts left-padded).

    Returns (ids, logprobs) per prompt; logprob = log_softmax(logits / T) of the sampled token.
    """
    B, L = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((B, L), tok.pad_token_id)
    attn = torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, L - len(p) :] = torch.tensor(p)
        attn[i, L - len(p) :] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, L)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, logits_to_keep=1)
    ids_BT, lps_BT = [], []
    finished = torch.zeros(B, dtype=torch.bool)
    for _ in range(args.max_new_tokens):
        logits_BV = out.logits[:, -1].float()
        if temperature == 0:
            next_B = logits_BV.argmax(-1)
            logprobs_BV = F.log_softmax(logits_BV, -1)
        else:
            logprobs_BV = F.log_softmax(logits_BV / temperature, -1)
            next_B = torch.multinomial(logprobs_BV.exp(), 1).squeeze(-1)
        next_B = torch.where(finished, tok.pad_token_id, next_B)
        ids_BT.append(next_B)
        lps_BT.append(logprobs_BV.gather(-1, next_B[:, None]).squeeze(-1))
        finished |= next_B == tok.eos_token_id
        if finished.all():
            break
        attn = torch.cat([attn, torch.ones(B, 1, dtype=torch.long)], -1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=next_B[:, None],
            attention_mask=attn,
            position_ids=positions,
            cache=out.cache,
        )
    ids_BT, lps_BT = torch.stack(ids_BT, 1).tolist(), torch.stack(lps_BT, 1).tolist()
    results = []
    for ids, lps in zip(ids_BT, lps_BT, strict=True):
        n = ids.index(tok.eos_token_id) + 1 if tok.eos_token_id in ids else len(ids)
        results.append((ids[:n], lps[:n]))
    return results


def rollout(model, tok, tasks: list[dict], args: Args, temperature: float) -> list[Episode]:
    """Run every episode to the end, batching all unfinished episodes at each turn."""
    model.eval()
    episodes = [start_episode(tok, t) for t in tasks]
    while active := [ep for ep in episodes if not ep.done]:
        for i in range(0, len(active), 128):
            chunk = active[i : i + 128]
            responses = sample(model, tok, [e.tokens for e in chunk], args, temperature)
            for ep, (ids, lps) in zip(chunk, responses, strict=True):
                env_step(tok, ep, ids, lps, args.max_turns)
    return episodes


def evaluate(model, tok, tasks: list[dict], args: Args) -> float:
    episodes = rollout(model, tok, tasks * args.eval_samples, args, temperature=args.temperature)
    return sum(ep.reward for ep in episodes) / len(episodes)


def token_logprobs(model, tok, seqs: list[list[int]], temperature: float):
    """Right-pad the sequences; return log p(token_t | tokens_<t) of shape (B, T-1)."""
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), tok.pad_token_id)
    attn = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], attn[i, : len(s)] = torch.tensor(s), 1
    logits_BTV = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logprobs_BTV = F.log_softmax(logits_BTV / temperature, -1)
    return logprobs_BTV.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (B, T-1)


def padded(rows: list[list], width: int, value=0) -> torch.Tensor:
    return torch.tensor([r[1 : width + 1] + [value] * (width + 1 - len(r)) for r in rows])


def sft(model, tok, args: Args) -> list[float]:
    """Supervised warm start: replay the demonstrator through the env; loss on the assistant's tokens."""
    rng = random.Random(args.seed)
    episodes = []
    for task in arithmetic.make_dataset(args.sft_demos, split="train", seed=args.seed + 1):
        ep = start_episode(tok, task)
        for text in arithmetic.demonstrate(task, rng):
            ids = encode(tok, text) + [tok.eos_token_id]
            env_step(tok, ep, ids, [0.0] * len(ids), args.max_turns)
        episodes.append(ep)
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr)
    total = args.sft_epochs * (len(episodes) // args.sft_batch)
    warmup = max(1, total // 10)  # linear warm-up, then linear decay to 10%
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, 1.0 - 0.9 * max(0, s - warmup) / max(1, total - warmup))
    )
    model.train()
    epoch_losses = []
    for epoch in range(args.sft_epochs):
        rng.shuffle(episodes)
        for i in range(0, len(episodes) - args.sft_batch + 1, args.sft_batch):
            batch = episodes[i : i + args.sft_batch]
            logprobs_BT = token_logprobs(model, tok, [e.tokens for e in batch], 1.0)
            mask_BT = padded([e.mask for e in batch], logprobs_BT.shape[1]).float()
            loss = -(logprobs_BT * mask_BT).sum() / mask_BT.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
        epoch_losses.append(loss.item())
        print(f"SFT epoch {epoch + 1}: loss {loss.item():.3f}", flush=True)
    return epoch_losses


def grpo_step(model, tok, opt, tasks: list[dict], args: Args) -> dict:
    """One RL step: roll out groups, GRPO advantages, PPO-clip updates."""
    groups = [tasks[i : i + 1] * args.group_size for i in range(len(tasks))]
    episodes = rollout(model, tok, [t for g in groups for t in g], args, args.temperature)
    rewards_GN = torch.tensor([ep.reward for ep in episodes]).view(len(tasks), args.group_size)
    advantages_GN = (rewards_GN - rewards_GN.mean(1, keepdim=True)) / (rewards_GN.std(1, keepdim=True) + 1e-4)
    keep_G = rewards_GN.std(1) > 0  # zero-variance groups carry no signal
    adv_of = dict(zip(map(id, episodes), advantages_GN.flatten().tolist(), strict=True))
    data = [(ep, adv_of[id(ep)]) for i, ep in enumerate(episodes) if keep_G[i // args.group_size]]
    random.shuffle(data)
    model.train()
    stats = {"reward": rewards_GN.mean().item(), "groups_kept": int(keep_G.sum()), "clip_frac": 0.0}
    size = max(1, -(-len(data) // args.minibatches))
    for start in range(0, len(data), size):
        minibatch = data[start : start + size]
        n_tokens = sum(sum(ep.mask) for ep, _ in minibatch)
        opt.zero_grad()
        for m in range(0, len(minibatch), args.micro_batch):
            micro = minibatch[m : m + args.micro_batch]
            logprobs_BT = token_logprobs(model, tok, [ep.tokens for ep, _ in micro], args.temperature)
            T = logprobs_BT.shape[1]
            mask_BT = padded([ep.mask for ep, _ in micro], T).float()
            old_BT = padded([ep.logprobs for ep, _ in micro], T, 0.0)
            adv_B1 = torch.tensor([adv for _, adv in micro])[:, None]
            ratio_BT = torch.exp((logprobs_BT - old_BT) * mask_BT)
            clipped_BT = ratio_BT.clamp(1 - args.clip_eps, 1 + args.clip_eps)
            pg_loss_BT = -torch.minimum(ratio_BT * adv_B1, clipped_BT * adv_B1)
            ((pg_loss_BT * mask_BT).sum() / n_tokens).backward()
            stats["clip_frac"] += ((ratio_BT != clipped_BT).float() * mask_BT).sum().item() / max(1, n_tokens)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return stats


def main(args: Args) -> dict:
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    model, tok = build_tiny(seed=0)
    heldout = arithmetic.make_dataset(args.eval_tasks, split="test", seed=args.seed)
    train = arithmetic.make_dataset(args.rl_steps * args.tasks_per_step, split="train", seed=args.seed + 2)
    t0 = time.perf_counter()
    sft_losses = sft(model, tok, args)
    before = evaluate(model, tok, heldout, args)
    t1 = time.perf_counter()
    print(f"after SFT ({t1 - t0:.0f}s): held-out success {before:.3f}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    for step in range(args.rl_steps):
        batch = train[step * args.tasks_per_step : (step + 1) * args.tasks_per_step]
        stats = grpo_step(model, tok, opt, batch, args)
        print(f"step {step + 1}: " + " ".join(f"{k} {v:.3g}" for k, v in stats.items()), flush=True)
    after = evaluate(model, tok, heldout, args)
    t2 = time.perf_counter()
    print(f"after RL ({t2 - t1:.0f}s): held-out success {after:.3f} (SFT start {before:.3f})")
    return {"before": before, "after": after, "sft_losses": sft_losses, "seconds": (t1 - t0, t2 - t1)}


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, value in vars(Args()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--quick", action="store_true", help="a short run (for tests)")
    ns = vars(parser.parse_args(argv))
    if ns.pop("quick"):
        ns.update(rl_steps=6, eval_tasks=50)
    return Args(**ns)


if __name__ == "__main__":
    main(parse_args())

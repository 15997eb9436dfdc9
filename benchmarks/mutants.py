"""Mutation check of the training glue (issue 28): does the test suite fail when the loop is wrong?

Each mutant below is one semantic bug, written as an exact edit of one line of ``flowcredit/``
(the update, the values, ψ, the KL term, EMA, resume, export and the credit functions). The script
copies the working tree to a temporary directory, checks that the chosen tests pass there unmutated,
then applies one mutant at a time, runs the tests that should catch it (``pytest -x``), and reports
which test killed it, or that it survived. The working tree itself is never edited.

    .venv/bin/python benchmarks/mutants.py                 # all; writes benchmarks/results/mutants.{json,md}
    .venv/bin/python benchmarks/mutants.py --only adv_sign_in_update,kl_sign

Every test named here is part of ``make test``, so a mutant killed here is killed by ``make test``.
Runs in about 9 minutes on a quiet 2-core machine (43 mutants); `--only A,B --merge` reruns some
and updates their rows of the report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str  # loop, values, psi, kl, ema, resume, export, credit
    path: str  # file under the repository root
    old: str  # exact text, present once
    new: str
    tests: tuple[str, ...]  # pytest node ids or files that should fail
    bug: str  # the bug in words


DIRECTION = "tests/test_direction.py"
VALUES = "tests/test_loop_values.py"
PSI = "tests/test_psi_run.py"
RESUME_TP = "tests/test_resume.py::test_killed_in_a_checkpoint_write_resumes_exactly"
TRAIN = "flowcredit/train.py"
ROLLOUT = "flowcredit/run/rollout.py"
SESSION = "flowcredit/run/session.py"

MUTANTS = [
    Mutant(
        "adv_sign_in_update", "loop", TRAIN,
        "clipped_surrogate(step.logp, logp_old, adv[r, i], cfg.clip_range)",
        "clipped_surrogate(step.logp, logp_old, -adv[r, i], cfg.clip_range)",
        (DIRECTION,), "the update learns to lower the reward (advantage sign flipped)",
    ),
    Mutant(
        "completion_with_other_rows_prompt", "values", ROLLOUT,
        "chunked_velocity(model, x, sigma, cond, group[row_of[live]], batch_size)",
        "chunked_velocity(model, x, sigma, cond, group[live], batch_size)",
        (VALUES,), "a state is completed with another row's prompt",
    ),
    Mutant(
        "update_with_other_rows_prompt", "loop", TRAIN,
        "model.velocity(x, s.sigmas[i].expand(len(r)), cond[group[r]])",
        "model.velocity(x, s.sigmas[i].expand(len(r)), cond[group[r].flip(0)])",
        (DIRECTION,), "the update re-scores a transition under another row's prompt",
    ),
    Mutant(
        "update_at_previous_level", "loop", TRAIN,
        "sigma, sigma_next, level = s.sigmas[i].item(), s.sigmas[i + 1].item(), float(s.levels[i])",
        "sigma, sigma_next, level = s.sigmas[i].item(), s.sigmas[i + 1].item(), float(s.levels[i - 1])",
        (DIRECTION,), "the update scores step i with the noise level of step i - 1",
    ),
    Mutant(
        "advantages_one_group", "loop", TRAIN,
        "s.credit.fn(values_all[ok], group_all[ok], s.trained, **s.credit_kwargs)",
        "s.credit.fn(values_all[ok], torch.zeros_like(group_all[ok]), s.trained, **s.credit_kwargs)",
        (DIRECTION,), "the loop normalises advantages over the batch, not per group",
    ),
    Mutant(
        "update_keeps_dead_groups", "loop", TRAIN,
        "keep = torch.nonzero(torch.isin(group, live_groups), as_tuple=True)[0]",
        "keep = torch.nonzero(~torch.isin(group, live_groups), as_tuple=True)[0]",
        (DIRECTION,), "the update trains the zero-advantage groups and drops the live ones",
    ),
    Mutant(
        "kl_sign", "kl", TRAIN,
        "s.dist.backward((policy_loss + cfg.beta * kl) * weight)",
        "s.dist.backward((policy_loss - cfg.beta * kl) * weight)",
        (f"{DIRECTION}::test_the_kl_term_pulls_the_policy_to_the_reference",),
        "the KL term pushes the policy away from the reference",
    ),
    Mutant(
        "kl_reference_is_the_policy", "kl", TRAIN,
        "with torch.no_grad(), s.policy.reference():",
        "with torch.no_grad():",
        (f"{DIRECTION}::test_the_kl_term_pulls_the_policy_to_the_reference",),
        "the KL's reference forward runs the current policy (KL always 0)",
    ),
    Mutant(
        "values_off_by_one_state", "values", "flowcredit/values.py",
        "idx = (start[:, None] + torch.arange(n + 1, device=start.device)[None, :]).clamp(max=n)",
        "idx = (start[:, None] + 1 + torch.arange(n + 1, device=start.device)[None, :]).clamp(max=n)",
        (VALUES,), "ode_remaining completes along the schedule one σ late",
    ),
    Mutant(
        "euler_one_substep_short", "values", "flowcredit/values.py",
        "return grid, torch.where(start < n, substeps, 0)",
        "return grid, torch.where(start < n, substeps - 1, 0)",
        (VALUES,), "euler(k) stops one sub-step before σ = 0",
    ),
    Mutant(
        "copy_through_ode_steps_for_euler", "values", ROLLOUT,
        "by_step = deterministic if ESTIMATORS[estimator].follows_schedule else tail",
        "by_step = deterministic",
        ("tests/test_rollout.py",), "euler values copied across a deterministic step they do not follow",
    ),
    Mutant(
        "psi_start_level", "psi", "flowcredit/run/calibrate.py",
        "def start_psi(sigmas: torch.Tensor, trained: torch.Tensor, a: float = 0.7)",
        "def start_psi(sigmas: torch.Tensor, trained: torch.Tensor, a: float = 0.5)",
        (PSI,), "ψ starts at Flow-SDE's g with a = 0.5 instead of 0.7",
    ),
    Mutant(
        "psi_not_the_rollout_noise", "psi", ROLLOUT,
        "        levels = torch.where(trained, psi, torch.zeros_like(psi))",
        "        levels = levels",
        (PSI,), "the rollout samples with noise_level, not the calibrated ψ",
    ),
    Mutant(
        "psi_path_ignored", "psi", SESSION,
        "    elif cfg.psi_path:",
        "    elif False:",
        (PSI,), "psi_path is read by validation but never used",
    ),
    Mutant(
        "psi_lost_on_resume", "psi", SESSION,
        'self.psi = torch.tensor(extra["psi"]) if extra.get("psi") is not None else None',
        "self.psi = None",
        (f"{PSI}::test_psi_after_resume_is_the_calibrated_one",), "a resumed DenseGRPO run recalibrates ψ",
    ),
    Mutant(
        "ema_weights_swapped", "ema", "flowcredit/run/policy.py",
        "s.mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)",
        "s.mul_(1.0 - self.decay).add_(p.detach(), alpha=self.decay)",
        ("tests/test_policy.py::test_ema_tracks_and_applies",),
        "EMA keeps (1 - d) of the average instead of d",
    ),
    Mutant(
        "ema_never_updated", "ema", TRAIN,
        "                s.ema.update()",
        "                pass",
        (f"{DIRECTION}::test_ema_averages_the_weights_after_every_optimizer_step",),
        "the loop never updates the EMA",
    ),
    Mutant(
        "ema_not_restored", "resume", SESSION,
        'if self.ema is not None and state["ema"] is not None:',
        "if False:",
        (f"{RESUME_TP}[tp_grpo-after_trainable]",), "a resumed run restarts its EMA from the weights",
    ),
    Mutant(
        "optimizer_not_restored", "resume", SESSION,
        "        self.optimizer.load_state_dict(optimizer)",
        "        pass",
        (f"{RESUME_TP}[tp_grpo-after_trainable]",), "a resumed run restarts AdamW's moments",
    ),
    Mutant(
        "resume_skips_an_iteration", "resume", SESSION,
        'self.start_iteration = state["iteration"]',
        'self.start_iteration = state["iteration"] + 1',
        (f"{RESUME_TP}[tp_grpo-after_trainable]",), "resume starts one iteration late",
    ),
    Mutant(
        "old_checkpoint_not_found", "resume", "flowcredit/run/checkpoint.py",
        'for name in ("checkpoint", "checkpoint.old"):',
        'for name in ("checkpoint",):',
        (f"{RESUME_TP}[tp_grpo-between_renames]",), "a kill between the renames leaves no resumable run",
    ),
    Mutant(
        "checkpoint_deleted_before_swap", "resume", "flowcredit/run/checkpoint.py",
        "        os.replace(final, old)",
        "        shutil.rmtree(final)",
        (f"{RESUME_TP}[tp_grpo-between_renames]",), "the old checkpoint is deleted before the new one is in",
    ),
    Mutant(
        "export_without_ema", "export", "flowcredit/run/outputs.py",
        "with s.ema.applied() if s.ema is not None else contextlib.nullcontext(), s.dist.unsharded(s.model):",
        "with contextlib.nullcontext(), s.dist.unsharded(s.model):",
        ("tests/test_train.py::test_final_export_holds_the_ema_weights",),
        "final/ holds the last iterate, not the EMA",
    ),
    Mutant(
        "export_unmerged_lora", "export", "flowcredit/run/policy.py",
        "                module.merge()\n        out = {}",
        "                pass\n        out = {}",
        ("tests/test_train.py::test_final_model_reloads_as_the_policy",), "the exported model drops the LoRA",
    ),
    Mutant(
        "flow_grpo_not_centred", "credit", "flowcredit/advantages.py",
        "centred = torch.where(ms, xs - mean, torch.zeros_like(xs))",
        "centred = torch.where(ms, xs, torch.zeros_like(xs))",
        ("tests/test_advantages.py",), "group z-scores without the group mean",
    ),
    Mutant(
        "tp_aggregate_sign", "credit", "flowcredit/advantages.py",
        "agg = v[:, -1:] - v[:, :-1]  # (B, N): V_N − V_i",
        "agg = v[:, :-1] - v[:, -1:]  # (B, N): V_N − V_i",
        ("tests/test_advantages.py",), "turning points get V_i - V_N instead of V_N - V_i",
    ),
    Mutant(
        "surrogate_min_not_max", "credit", "flowcredit/losses.py",
        "return torch.maximum(unclipped, clipped).mean()",
        "return torch.minimum(unclipped, clipped).mean()",
        ("tests/test_losses.py",), "PPO's pessimistic bound taken the wrong way",
    ),
    Mutant(
        "dtype_from_first_parameter", "export", "flowcredit/models/diffusers_common.py",
        'if p.is_floating_point() and "lora_" not in name and not any(k in name for k in keep):',
        'if p.is_floating_point():',
        ("tests/test_adapters_dtypes.py",), "Wan in bf16 takes float32 from a kept-in-fp32 norm and crashes",
    ),
    Mutant(
        "cli_samples_the_base", "export", "flowcredit/commands/eval.py",
        "        model.load_trained(final)",
        "        pass",
        ("tests/test_trained_cli.py",), "sample/eval --checkpoint RUN/final quietly use the base weights",
    ),
    Mutant(
        "failed_start_leaves_config", "resume", SESSION,
        '            (run_dir / "config.json").unlink(missing_ok=True)',
        "            pass",
        ("tests/test_trained_cli.py",), "a failed start leaves run_dir/config.json behind",
    ),
    Mutant(
        "slot_before_body", "server", "flowcredit/rewards/app.py",
        "            async with service.bodies.hold(n):\n                phase = \"reading the body\"",
        "            async with service.bodies.hold(n), service.slots:\n"
        "                phase = \"reading the body\"",
        ("tests/test_reward_server_hostile.py::test_slow_uploads_do_not_block_other_clients",),
        "a request takes a scoring slot before its body arrives: slow uploads block everyone",
    ),
    Mutant(
        "fifo_batching", "server", "flowcredit/rewards/batcher.py",
        "        self._fair_order()\n",
        "",
        ("tests/test_reward_server_hostile.py::test_a_small_request_is_not_stuck_behind_a_large_one",),
        "a small request waits behind every call of a large one",
    ),
    Mutant(
        "no_request_head_deadline", "server", "flowcredit/rewards/server.py",
        "        http=guarded_protocol(limits.header_timeout_s),",
        '        http="httptools",',
        ("tests/test_reward_server_hostile.py::test_idle_and_half_open_connections_are_closed",),
        "idle and half-open connections stay open until they fill max_connections",
    ),
    Mutant(
        "no_suspects", "server", "flowcredit/rewards/batcher.py",
        "                if batch[0].pending.source is not None:",
        "                if False:",
        ("tests/test_reward_server_hostile.py::test_a_failing_client_does_not_poison_later_batches",),
        "a failing client's every request joins and fails a merged call",
    ),
    Mutant(
        "bisect_one_by_one", "server", "flowcredit/rewards/batcher.py",
        "            half = set(requests[: len(requests) // 2])",
        "            half = set(requests[:1])",
        ("tests/test_reward_server_hostile.py::test_one_bad_request_costs_log_n_extra_reward_calls",),
        "a failing merged call is split one request at a time (n extra calls)",
    ),
    Mutant(
        "geneval_margin_sign", "geneval", "flowcredit/tasks/geneval/rules.py",
        "shrunk = np.maximum(np.abs(offset) - margin * (size[0] + size[1]), 0) * np.sign(offset)",
        "shrunk = np.maximum(np.abs(offset) + margin * (size[0] + size[1]), 0) * np.sign(offset)",
        ("tests/test_geneval_rules.py",), "position margin grows the offset instead of shrinking it",
    ),
    Mutant(
        "geneval_counting_threshold", "geneval", "flowcredit/tasks/geneval/rules.py",
        'threshold = settings.counting_threshold if tag == "counting" else settings.threshold',
        "threshold = settings.threshold",
        ("tests/test_geneval_rules.py",), "counting prompts use 0.3 instead of GenEval's 0.9",
    ),
    Mutant(
        "geneval_exclude_off_by_one", "geneval", "flowcredit/tasks/geneval/rules.py",
        'float(n < int(req["count"]))', 'float(n <= int(req["count"]))',
        ("tests/test_geneval_rules.py",), "an exclude fails at count − 1 objects",
    ),
    Mutant(
        "geneval_failed_target", "geneval", "flowcredit/tasks/geneval/rules.py",
        "groups.append(group if ok else None)", "groups.append(group)",
        ("tests/test_geneval_rules.py",), "a target group that failed its own rules still anchors a position",
    ),
    Mutant(
        "lora_compose_scale", "lora", "flowcredit/run/lora_compose.py",
        "return weight + (scale * delta).to(weight.dtype)", "return weight + delta.to(weight.dtype)",
        ("tests/test_lora_compose.py",), "the composed LoRA forgets its scale alpha / r",
    ),
    Mutant(
        "one_step_sign", "values", "flowcredit/run/rollout.py",
        "return x - sigma.to(x).view(-1, *([1] * (x.dim() - 1))) * v",
        "return x + sigma.to(x).view(-1, *([1] * (x.dim() - 1))) * v",
        ("tests/test_rollout.py::test_one_step_values_reuse_the_rollout_velocity",),
        "one-step values from the rollout's velocity step the wrong way",
    ),
    Mutant(
        "skill_paired_sign", "bench", "flowcredit/commands/bench_skill.py",
        "values = [by_seed[s][key][part] - arms[baseline][s][key][part] for s in seeds]",
        "values = [arms[baseline][s][key][part] - by_seed[s][key][part] for s in seeds]",
        ("tests/test_bench_skill.py",), "the skill report's paired difference has its sign flipped",
    ),
    Mutant(
        "skill_nfe_no_kl", "bench", "flowcredit/commands/bench_skill.py",
        "update = int(trained.sum()) * cfg.inner_epochs * (2 if cfg.beta else 1)",
        "update = int(trained.sum()) * cfg.inner_epochs",
        ("tests/test_bench_skill.py",), "equal-NFE iterations forget the KL's reference forward",
    ),
]  # fmt: skip


def copy_tree(dst: Path) -> None:
    """The working tree's tracked and untracked-but-not-ignored files (no .venv, no runs)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def run_tests(root: Path, tests: list[str], timeout: float) -> tuple[int, str, float]:
    """``pytest -x`` on ``tests`` in ``root`` (its flowcredit/ shadows the installed one)."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as exc:
        return -1, f"timed out after {timeout} s\n{exc.stdout or ''}", time.perf_counter() - t0


def check_in(root: Path, m: Mutant) -> str:
    text = (root / m.path).read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutant {m.name}: its text occurs {text.count(m.old)} times in {m.path} (want 1)")
    return text


def run_mutant(root: Path, m: Mutant, timeout: float) -> dict:
    """Apply ``m``, run its tests, restore the file; a row of the report."""
    original = check_in(root, m)
    (root / m.path).write_text(original.replace(m.old, m.new))
    try:
        code, out, seconds = run_tests(root, list(m.tests), timeout)
    finally:
        (root / m.path).write_text(original)
    killers = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    status = {0: "survived", 1: "killed"}.get(code, "error")
    row = {**asdict(m), "status": status, "killed_by": killers, "seconds": round(seconds, 1)}
    if status == "error":
        row["output_tail"] = out[-2000:]
    return row


def write_report(rows: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutants.json").write_text(json.dumps(rows, indent=1) + "\n")
    killed = sum(r["status"] == "killed" for r in rows)
    lines = [
        "# Mutation check of the training glue",
        "",
        f"`benchmarks/mutants.py`: {killed} of {len(rows)} mutants killed. Each row is one semantic bug",
        "applied alone to a copy of the tree; *killed by* is the first test that failed (`pytest -x`).",
        "",
        "| mutant | area | file | bug | result | killed by | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        by = "<br>".join(f"`{k}`" for k in r["killed_by"]) or "—"
        cells = [r["name"], r["area"], r["path"], r["bug"], r["status"], by, r["seconds"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    (out / "mutants.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma list of mutant names (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="report folder")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per test run")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated pass of the tests")
    ap.add_argument("--merge", action="store_true", help="with --only: update these rows of the report")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutants {sorted(unknown)}")
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        for m in chosen:
            check_in(root, m)
        if not args.no_baseline:
            tests = sorted({t for m in chosen for t in m.tests})
            code, out, seconds = run_tests(root, tests, 3 * args.timeout)
            if code != 0:
                print(out[-4000:])
                raise SystemExit(f"the unmutated tree fails its tests (exit {code}): fix that first")
            print(f"baseline: the {len(tests)} test targets pass unmutated ({seconds:.0f} s)")
        rows = [run_mutant(root, m, args.timeout) for m in tqdm(chosen, desc="mutants", file=sys.stdout)]
    for r in rows:
        print(f"{r['status']:>8}  {r['name']:<36} {', '.join(r['killed_by'][:1])}")
    survivors = [r["name"] for r in rows if r["status"] != "killed"]
    print(
        f"{len(rows) - len(survivors)} of {len(rows)} killed"
        + (f"; not killed: {survivors}" if survivors else "")
    )
    if not args.only:
        write_report(rows, Path(args.out))
    elif args.merge:  # replace or add these rows, keep the others, in MUTANTS order
        old = {r["name"]: r for r in json.loads((Path(args.out) / "mutants.json").read_text())}
        old |= {r["name"]: r for r in rows}
        write_report([old[m.name] for m in MUTANTS if m.name in old], Path(args.out))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())

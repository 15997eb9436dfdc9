"""The ``skill`` comparison of ``flowcredit bench`` (``--task skill``): its arms, its compute
accounting and its final held-out evaluation.

Every arm is the ``skill`` preset with one change (:data:`SKILL_ARMS`); seeds pair the arms (same
prompt draws and initial noise per seed). After a run finishes, its exported weights (``final/``, the
EMA) are evaluated on all 86 held-out prompts × 16 samples × the noise seeds :data:`FINAL_EVAL_SEEDS`,
which no choice of this library ever looked at (the recipes were chosen on 100–103 and 1234), and on
the confirmation set (:mod:`flowcredit.commands.bench_skill_eval`), the base checkpoint once the same
way; the small JSON of each (``summary.json`` + the evaluations' per-sample scores) is copied to
``--publish`` so that finished runs land in git as they finish.
The report on the published runs (held-out scores, paired differences, verdicts) is
:mod:`flowcredit.commands.bench_skill_report`, re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from flowcredit.commands.bench_skill_eval import (  # noqa: F401 (the evaluations, re-exported)
    CONFIRM_DIR,
    FINAL_EVAL_SAMPLES,
    FINAL_EVAL_SEEDS,
    base_eval,
    base_published,
    final_eval,
    relative_paths,
    score_published,
)
from flowcredit.commands.bench_skill_report import (  # noqa: F401 (the report, re-exported)
    EQUIVALENCE,
    SKILL_CLAIMS,
    VERDICT_METRICS,
    arm_verdict,
    heldout_scores,
    skill_report,
    skill_verdict,
)
from flowcredit.config import Config
from flowcredit.errors import UserError
from flowcredit.presets import load_config
from flowcredit.run.runlog import PROVENANCE, read_iteration_seconds, read_metrics


def nominal_nfe(cfg: Config) -> float:
    """Network calls per trajectory and iteration: rollout + value completions + update (KL: ×2).

    The count the trainer logs as ``nfe/*`` divided by the batch rows, with every group live; the
    value completions are planned exactly as :func:`flowcredit.run.rollout.state_values` plans them.
    """
    return float(sum(nfe_parts(cfg).values()))


def nfe_parts(cfg: Config) -> dict[str, float]:
    """:func:`nominal_nfe`'s terms: ``{"rollout", "values", "update"}`` network calls per trajectory,
    averaged over the run's iterations where the step schedule changes the plan (a branch plan's
    rollout: its trunk, once per group, and every branch, :func:`flowcredit.run.plans.branch_sample`;
    a forward-process update: K time draws × the current and the old policy, and the reference)."""
    import torch

    from flowcredit.advantages import CREDITS
    from flowcredit.run.plans import iteration_plan
    from flowcredit.run.rollout import needed_states, plan_completions
    from flowcredit.schedule import sigmas
    from flowcredit.updates import UPDATES
    from flowcredit.validation import update_options
    from flowcredit.values import ESTIMATORS

    grid = sigmas(cfg.num_steps, cfg.shift)
    plans = [iteration_plan(cfg, grid, it) for it in range(max(cfg.iterations, 1))]
    first = plans[0]
    need = needed_states(CREDITS[cfg.credit].needs, first.trained)  # (M + 1,)
    compute, _ = plan_completions(need, ~first.sde, cfg.estimator)
    start = torch.nonzero(compute, as_tuple=True)[0]
    values = 0
    if len(start) and not (cfg.estimator == "euler" and cfg.substeps == 1):  # one-step: the rollout's v
        _, remaining = ESTIMATORS[cfg.estimator].grid(first.sigmas, start, cfg.substeps)
        values = int(remaining.sum())
    rollout = sum(rollout_calls(p, cfg.group_size) for p in plans) / len(plans)
    rule = UPDATES[cfg.update]
    if rule.forward:
        draws = rule.times(
            grid, 1, torch.Generator().manual_seed(0), **rule.split(update_options(cfg))[1]
        ).shape[0]
        update = draws * cfg.inner_epochs * rule.calls(cfg.beta)
    else:
        trained = sum(trained_per_row(p) for p in plans) / len(plans)
        update = trained * cfg.inner_epochs * (2 if cfg.beta else 1)
    return {"rollout": rollout, "values": values, "update": update}


def trained_per_row(plan) -> float:
    """Steps one trajectory trains: the plan's trained steps; a per-group plan's (Flash-GRPO) one step; a
    tree's transitions over its leaves (each trained once: TreeGRPO's ``Σ_j k^{j+1} / k^d``)."""
    if plan.tree is not None:  # a transition into depth m is trained once per node of depth m
        from flowcredit.tree_plans import step_depths

        depths = step_depths(plan.tree.splits, plan.sde.numel())[plan.sde]
        return float(sum(plan.tree.fanout ** int(m) for m in depths)) / plan.tree.leaves
    return 1 if plan.group_step is not None else int(plan.trained.sum())


def rollout_calls(plan, group_size: int) -> float:
    """Network calls per trajectory of one plan's rollout: its ``M`` steps; a branch plan's trunk
    (``k_max`` steps once per group) and each branch ``k`` (``M − k`` steps per row; G²RPO's coarse
    completions on top, :func:`flowcredit.granular.granular_calls`)."""
    m = plan.sde.numel()
    if plan.tree is not None:
        from flowcredit.tree_plans import tree_calls

        return tree_calls(plan, group_size)
    if not plan.branch:
        return float(m)
    ks = plan.sde.nonzero()[:, 0].tolist()
    extra = 0
    if plan.granular is not None:  # G²RPO's coarse completions of every branch
        from flowcredit.granular import granular_calls

        extra = granular_calls(plan.sigmas, ks, plan.granular.widths)
    return max(ks) / group_size + sum(m - k for k in ks) + extra


def nominal_calls(cfg: Config) -> float:
    """:func:`nominal_nfe`'s terms × network passes per velocity call on the built-in model (2 with CFG,
    1 at guidance 1: no CFG), the skill bench's model; the update's at ``train_guidance_scale``."""
    passes = 1 if cfg.guidance_scale == 1.0 else 2
    train_passes = 1 if (cfg.train_guidance_scale or cfg.guidance_scale) == 1.0 else 2
    parts = nfe_parts(cfg)
    return (parts["rollout"] + parts["values"]) * passes + parts["update"] * train_passes


def _equal_nfe(preset: Config, change: list[str], share: float = 1.0) -> list[str]:
    """``change`` plus the iterations at which its network calls are ``share`` × the preset's (a fixed
    point: an arm whose plan changes with the iteration averages its cost over its own iterations); the
    calls of an iteration count every row (prompts × group)."""
    from flowcredit.validation import apply_overrides

    def per_iteration(cfg: Config) -> float:  # an arm may change the group (TreeGRPO's 27 leaves)
        return nominal_calls(cfg) * cfg.prompts_per_iter * cfg.group_size

    budget, iterations = share * preset.iterations * per_iteration(preset), preset.iterations
    for _ in range(5):
        arm = apply_overrides(dataclasses.replace(preset), [*change, "--iterations", str(iterations)])
        iterations, previous = round(budget / per_iteration(arm)), iterations
        if iterations == previous:
            break
    return [*change, "--iterations", str(iterations)]


TP = ["--credit", "turning_point"]
DENSE = ["--credit", "dense", "--sampler", "dance_sde", "--calibrate", "true"]
STEPWISE = ["--credit", "stepwise", "--credit_options", '{"center": false}', "--estimator", "euler"]
MIXGRPO = [
    "--step_schedule",
    "mixgrpo",
    "--step_schedule_options",
    '{"size": 2, "interval": 25, "skip_last": 5}',
]
TEMPFLOW = [
    "--step_schedule",
    "tempflow",
    "--step_schedule_options",
    '{"skip_last": 5}',
    "--step_weight",
    "tempflow",
]
EGRPO = ["--step_schedule", "egrpo"]
GUARD = ["--update", "ratio_norm", "--step_weight", "grpo_guard"]
SHARED = ["--shared_noise", "true"]  # branches share the prefix of their group
NO_CFG = [
    "--guidance_scale",
    "1",
    "--eval_guidance_scale",
    "2",
]  # rollouts without CFG, evaluated as all arms
NFT = ["--update", "nft", "--sampler", "ode", "--steps_per_update", "9", *NO_CFG]
AWM = ["--update", "awm", "--sampler", "flow_sde", "--noise_level", "0.57", "--window_size", "7"]
AWM += ["--steps_per_update", "6", *NO_CFG]
COCA = ["--credit", "coca"]
FLASH = ["--step_schedule", "flash", "--step_weight", "flash"]
FLASH += ["--sampler", "flash_sde", "--noise_level", "0.9"]  # Flash-GRPO's SDE at σ_1 of the 10-step grid
TREE = ["--step_schedule", "treegrpo", "--step_schedule_options", '{"skip_last": 5}', "--group_size", "27"]
BRANCH = ["--step_schedule", "branchgrpo", "--step_schedule_options", '{"skip_last": 5}']
BRANCH += ["--group_size", "16"]
DGPO = [  # ODE rollouts with CFG and the update on the conditional velocity, as its code
    *["--update", "dgpo", "--sampler", "ode", "--steps_per_update", "4", "--train_guidance_scale", "1"]
]
G2RPO = ["--step_schedule", "g2rpo"]  # branch steps 0–4 (the first half), widths 1 2, summed

SKILL_ARMS = {
    "tp": TP,
    "tp_equal_nfe": lambda cfg: _equal_nfe(cfg, TP),
    "dense_euler1": [*DENSE, "--estimator", "euler", "--substeps", "1"],
    "dense_euler1_cps": ["--credit", "dense", "--estimator", "euler", "--substeps", "1"],
    "dance_psi": ["--sampler", "dance_sde", "--calibrate", "true"],
    "stepwise": [*STEPWISE, "--sampler", "ddim_sde", "--window_start", "1", "--window_size", "4"],
    "stepwise_cps": STEPWISE,
    "dense": DENSE,
    "mixgrpo": lambda cfg: _equal_nfe(cfg, MIXGRPO),
    "tempflow": lambda cfg: _equal_nfe(cfg, [*TEMPFLOW, *SHARED]),
    "egrpo": lambda cfg: _equal_nfe(cfg, [*EGRPO, *SHARED]),
    "grpo_guard": lambda cfg: _equal_nfe(cfg, GUARD),
    "nft_quarter": lambda cfg: _equal_nfe(cfg, NFT, 0.25),
    "awm_quarter": lambda cfg: _equal_nfe(cfg, AWM, 0.25),
    "coca": lambda cfg: _equal_nfe(cfg, COCA),
    "flash": lambda cfg: _equal_nfe(cfg, FLASH),
    "tree": lambda cfg: _equal_nfe(cfg, [*TREE, *SHARED]),
    "branch": lambda cfg: _equal_nfe(cfg, [*BRANCH, *SHARED]),
    "dgpo_quarter": lambda cfg: _equal_nfe(cfg, DGPO, 0.25),
    "g2rpo": lambda cfg: _equal_nfe(cfg, [*G2RPO, *SHARED]),
}
"""The arms beside the preset (Flow-GRPO credit, CPS): TP-GRPO credit at the same iterations and at
the preset's NFE; DenseGRPO (Dance-SDE with ψ calibrated on the frozen base, then dense gains; the
bench calibrates ψ once and hands that one ψ to every seed and every arm that calibrates alike:
bench.shared_psi) with ODE-completed values (``dense``) and, a variant, with one-step values from
the rollout's own velocities (``dense_euler1``: "DenseGRPO with one-step values and one shared ψ",
not DenseGRPO as published); Stepwise-Flow-GRPO with its own DDIM-like SDE (a = 0.7; its first
step, from σ = 1, has std 0, so its window is steps 1–4), euler(5) values and the joint normalisation
that keeps the gains' signs (``stepwise``), and the same credit on the preset's CPS
(``stepwise_cps``: isolates the credit rule). ``dense_euler1`` changes two things, so two
diagnostic arms split it: its credit rule on the preset's CPS (``dense_euler1_cps``) and its sampler
(Dance-SDE with ψ calibrated, the same ψ) under Flow-GRPO's credit (``dance_psi``).
Every other field is the preset's (SDE window: steps 0–4).

The newer methods (docs/benchmarks.md, "The newer methods' claims"), each at the preset's network calls
(:func:`_equal_nfe`) and with the preset's CPS sampler: MixGRPO's progressive window of 2 SDE steps
sliding over steps 0–4 every 25 iterations (``mixgrpo``); TempFlow-GRPO's branches at each of steps
0–4 with its noise-aware weights (``tempflow``); E-GRPO's merged high-entropy branch steps
(``egrpo``); GRPO-Guard's RatioNorm with its 1/Δt step weights (``grpo_guard``). DiffusionNFT and
AWM as their code runs them (rollouts without CFG: DiffusionNFT's deterministic by the old policy,
AWM's Flow-SDE a = 0.57 on steps 0–6; one optimizer step per iteration) at a quarter of the preset's
network calls (``nft_quarter``, ``awm_quarter``), evaluated with the preset's CFG (w = 2) as every arm.
CoCA's credit (``coca``: the preset's rollout, its similarities from the rollout's own velocities, so
the preset's iterations), pre-registered on 2026-12-06 and not run yet. Flash-GRPO (``flash``): one SDE
step per prompt group drawn from the preset's window (steps 0–4), its own SDE (``flash_sde`` at σ_1 =
0.9) and rectification weights; one trained step per trajectory, so more iterations at the preset's
network calls; pre-registered and not run yet. TreeGRPO (``tree``): its tree of 3 × 3 children
from a shared noise (27 leaves per prompt) with the window's start drawn from steps 0–2, so that
its branch steps stay in the preset's window 0–4, at the preset's network calls; pre-registered and
not run yet. BranchGRPO (``branch``): binary splits at steps 0, 1, 3, 4 of one noise per prompt (16
leaves), the preset's CPS on the paths of steps 0–4, ODE after, values z-scored per depth;
pre-registered and not run yet. DGPO (``dgpo_quarter``): deterministic rollouts with the preset's CFG
(as its code samples with CFG) and its group-preference update (4 shared times, one optimizer step
per iteration) at a quarter of the preset's network calls; pre-registered and not run yet."""


def training_curve(rows: list[dict]) -> dict[str, list[float]]:
    """The training reward per iteration and the network calls spent up to it, from ``metrics.jsonl``'s
    rows: ``{"iteration": [...], "reward": [...], "nfe": [...]}`` (``nfe``: cumulative rollout +
    update + value calls, so arms can be set side by side at equal compute)."""
    train = [r for r in rows if "reward/mean" in r]
    nfe, total = [], 0
    for r in train:
        total += r["nfe/rollout"] + r["nfe/train"] + r["nfe/values"]
        nfe.append(total)
    iterations, rewards = [r["iteration"] for r in train], [r["reward/mean"] for r in train]
    return {"iteration": iterations, "reward": rewards, "nfe": nfe}


def training_minutes(run_dir: Path) -> float:
    """Minutes of training summed over the iterations of ``timings.jsonl`` (the last time logged for an
    iteration counts, as a resume may log one twice): a resumed run's whole cost, without its
    evaluations and set-up. ``summary.json``'s minutes count only the process that finished the run."""
    return sum(read_iteration_seconds(run_dir).values()) / 60


def publish(run_dir: Path, dest: Path) -> Path:
    """Copy the run's small results (config, summary, held-out and confirmation per-sample scores,
    training curve) to ``dest/<run>.json``."""
    record = {"run": run_dir.name}
    files = {"config": "config.json", "summary": "summary.json", "heldout": "heldout/eval.json"}
    if not (run_dir / "config.json").is_file():  # the base checkpoint's evaluation directory
        files = {"heldout": "eval.json"}
    files["confirm"] = f"{CONFIRM_DIR}/eval.json"
    for name, path in files.items():
        if (run_dir / path).is_file():
            record[name] = json.loads((run_dir / path).read_text())
    if rows := read_metrics(run_dir):
        record["curve"] = training_curve(rows)
    if (run_dir / "timings.jsonl").is_file():  # every iteration's time, resumed parts included
        record["train_minutes"] = training_minutes(run_dir)
    calibrated = run_dir / "calibration.json"  # ψ's calibration: its rounds are part of the run's cost
    shared = not calibrated.is_file() and record.get("config", {}).get("psi_path")
    if shared:  # the bench calibrates ψ once for the cells that would calibrate alike (bench.shared_psi)
        calibrated = Path(record["config"]["psi_path"]).parent / "calibration.json"
    if calibrated.is_file():
        calibration = json.loads(calibrated.read_text())
        record["calibration"] = {k: calibration[k] for k in ("iterations", "converged", "psi")}
        record["calibration"]["shared"] = bool(shared)
    if (run_dir / PROVENANCE).is_file():  # where each start or resume of the run ran
        lines = (run_dir / PROVENANCE).read_text().splitlines()
        record["provenance"] = [json.loads(ln) for ln in lines if ln.strip()]
    record = relative_paths(record, run_dir.parent)
    dest.mkdir(parents=True, exist_ok=True)
    publish_weights(run_dir, dest / run_dir.name)
    target = dest / f"{run_dir.name}.json"
    target.write_text(json.dumps(record) + "\n")
    return target


def publish_weights(run_dir: Path, dest: Path) -> list[Path]:
    """Copy the run's trained tensors (the EMA weights: ``final/`` and every ``snapshots/iteration-K``,
    ``trainable.safetensors`` only, about 270 KB each on the built-in model) and its ``config.json`` to
    ``dest/final``, ``dest/iteration-K`` and ``dest/config.json``: ``flowcredit eval --config
    dest/config.json`` (or ``--checkpoint dest/iteration-K``) evaluates them again without retraining.
    Returns the weight files written (none for a run without ``final/``)."""
    sources = [run_dir / "final", *sorted((run_dir / "snapshots").glob("iteration-*"))]
    sources = [p for p in sources if (p / "trainable.safetensors").is_file()]
    written = []
    for source in sources:
        target = dest / source.name
        target.mkdir(parents=True, exist_ok=True)
        tmp = target / "trainable.safetensors.tmp"
        shutil.copyfile(source / "trainable.safetensors", tmp)
        tmp.replace(target / "trainable.safetensors")
        written.append(target / "trainable.safetensors")
    if written:
        config = relative_paths(json.loads((run_dir / "config.json").read_text()), run_dir.parent)
        (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return written


# --- what the bench does around each run ---------------------------------------------------------


def published(dest: Path, cell: dict, seed: int) -> bool:
    """``dest/<run>.json`` holds the whole run and its held-out evaluation: nothing to train again."""
    path = dest / f"{cell['name']}-seed{seed}.json"
    if not path.is_file():
        return False
    record = json.loads(path.read_text())
    iterations = load_config(cell["preset"], None, cell["overrides"]).iterations
    done = record.get("summary", {}).get("iterations", 0) >= iterations and "heldout" in record
    if done:
        _same_psi(record, cell, path)
        print(f"bench: {path.stem}: published earlier in {dest}, not recomputed", flush=True)
    return done


def _same_psi(record: dict, cell: dict, path: Path) -> None:
    """A published run that trained with a calibrated ψ must have used the ψ this bench hands to its new
    runs (``--psi_path``, from bench.shared_psi): on a fresh machine ψ is calibrated again, and seeds
    trained with another ψ would not be seeds of one arm."""
    overrides, used = cell["overrides"], record.get("calibration", {}).get("psi")
    if used is None or "--psi_path" not in overrides:
        return
    psi_path = Path(overrides[overrides.index("--psi_path") + 1])
    psi = json.loads(psi_path.read_text())["psi"]
    if psi != used:
        raise UserError(
            f"bench: {path} trained with ψ {used}, but this bench calibrated ψ {psi} ({psi_path}); "
            "new runs would not be seeds of the same arm: write the published ψ into that file, or "
            "move the published runs aside and rerun the arm"
        )


def after_run(args, cells: list[dict], out: Path):
    """What follows each finished run: the ``skill`` task's evaluations on both sets (of the base
    checkpoint first, once; the base and the runs published with their weights but without the
    confirmation set get it first: :func:`score_published`), then ``--publish``. Returns
    ``run_dir -> run_dir``."""
    publish_to = Path(args.publish) if args.publish else None
    cfg = load_config(cells[0]["preset"], None, cells[0]["overrides"]) if args.task == "skill" else None
    if cfg and not args.report_only and not base_published(publish_to, args.quick):
        base = base_eval(cfg, out / "base-heldout", cfg.threads, args.quick).parent
        if publish_to:
            publish(base, publish_to)
    if cfg and not args.report_only and publish_to and not args.quick:
        score_published(publish_to, out / "scored", cfg)

    def after(run_dir: Path) -> Path:
        if args.task == "skill":
            threads = json.loads((run_dir / "config.json").read_text())["threads"]
            final_eval(run_dir, threads, args.quick)
        if publish_to:
            publish(run_dir, publish_to)
        return run_dir

    return after


def run_cost(record: dict) -> dict[str, float]:
    """One published run's cost: ``train_nfe`` (rollout + values + update calls logged over its
    iterations), ``calibration_nfe`` (ψ's calibration rounds × ``calib_groups`` × ``group_size``
    trajectories × their rollout + value calls, from the config), ``nfe_per_iteration`` and
    ``cpu_minutes`` (training minutes × threads, from ``train_minutes`` where the record has it, else
    the summary's minutes, which miss the parts before a resume; inflated when other work shared the
    CPU)."""
    cfg = Config(
        **{k: v for k, v in record["config"].items() if k in {f.name for f in dataclasses.fields(Config)}}
    )
    curve = record.get("curve", {})
    train = curve["nfe"][-1] if curve.get("nfe") else float("nan")
    rounds = record.get("calibration", {}).get("iterations", 0)
    parts = nfe_parts(cfg)
    calibration = rounds * cfg.calib_groups * cfg.group_size * (parts["rollout"] + parts["values"])
    iterations = len(curve.get("nfe", ())) or float("nan")
    minutes = record.get("train_minutes", record.get("summary", {}).get("minutes", float("nan")))
    return {
        "train_nfe": train,
        "calibration_nfe": float(calibration),
        "nfe_per_iteration": train / iterations,
        "cpu_minutes": minutes * cfg.threads,
    }

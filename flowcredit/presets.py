"""The presets: plain functions returning a :class:`~flowcredit.config.Config`, each documented in
docs/training.md, registered by name (``--preset``); and ``load_config``, which merges a preset, a
YAML file and ``--key value`` overrides, in that order, then validates.
"""

from __future__ import annotations

from collections.abc import Callable

from flowcredit.config import Config, from_dict, read_mapping
from flowcredit.errors import UserError
from flowcredit.validation import apply_overrides, import_plugins


def flow_grpo() -> Config:
    """Flow-GRPO: Flow-SDE a = 0.7, terminal reward on every trained step."""
    return Config(sampler="flow_sde", noise_level=0.7, credit="flow_grpo")


def dense_grpo() -> Config:
    """DenseGRPO: Dance-SDE with calibrated per-step ψ, ode_remaining values, per-step z-scores."""
    return Config(
        sampler="dance_sde", noise_level=0.5, credit="dense", estimator="ode_remaining", calibrate=True
    )


def stepwise_grpo() -> Config:
    """Stepwise-Flow-GRPO: DDIM-like SDE, euler(5) values, joint normalisation of the gains that keeps
    their signs (``center: false``), an initial noise per member (docs/algorithms.md §5.3)."""
    return Config(
        sampler="ddim_sde",
        noise_level=0.7,
        credit="stepwise",
        credit_options='{"center": false}',
        estimator="euler",
        substeps=5,
        shared_noise=False,
        window_start=1,
        window_size=8,
    )


def tp_grpo() -> Config:
    """TP-GRPO: CPS α = 0.7 over an SDE window, ode_remaining values, turning points."""
    return Config(
        sampler="cps", noise_level=0.7, credit="turning_point", estimator="ode_remaining", window_size=8
    )


def mixgrpo() -> Config:
    """MixGRPO (Tencent-Hunyuan/MixGRPO, ``scripts/finetune/finetune_flux_grpo_MixGRPO.sh``): Flow-SDE
    a = 0.7 on a progressive window, ODE elsewhere, one initial noise per group (``init_same_noise``),
    Flow-GRPO's credit with the group std. The window keeps the code's share of the steps, 2 of our 10
    (theirs: 4 of 25), and slides by one step every 25 iterations over steps 0–7 (the code's bound
    N − 2), back to 0 after the last; a 40-iteration run sees starts 0 and 1 only."""
    return Config(
        sampler="flow_sde",
        noise_level=0.7,
        credit="flow_grpo",
        shared_noise=True,
        step_schedule="mixgrpo",
        step_schedule_options='{"size": 2}',
    )


def tempflow_grpo() -> Config:
    """TempFlow-GRPO (Shredded-Pork/TempFlow-GRPO, ``scripts/train_sd3_pr.py``): an ODE trunk per group
    branching by one Flow-SDE step (a = 0.7) at every step but the last, each branch completed by the
    ODE (a process reward per step among the branches of one prefix), losses weighted by the
    exploration std over its mean. Deviation: ``group_size`` (16) branches per step from the group's
    trunk, where the code draws 6 per step from each trajectory (``--group_size 6``)."""
    return Config(
        sampler="flow_sde",
        noise_level=0.7,
        credit="flow_grpo",
        shared_noise=True,
        step_schedule="tempflow",
        step_weight="tempflow",
    )


def egrpo() -> Config:
    """E-GRPO (shengjun-zhang/VisualGRPO, ``scripts/finetune/finetune_g2rpo_hps_merge.sh``): Flow-SDE
    a = 0.7 on merged steps whose entropy reaches the threshold within the first half of the steps, each
    explored on a branch off the group's ODE trunk (``init_same_noise``), advantages among the branches
    of one merged step. On our grid the merged steps are 0, 1 and 2–4 (theirs, 16 steps, shift 3: 0, 1,
    2–3, 4–6)."""
    return Config(
        sampler="flow_sde", noise_level=0.7, credit="flow_grpo", shared_noise=True, step_schedule="egrpo"
    )


def tree_grpo() -> Config:
    """TreeGRPO (Ding & Ye, arXiv 2512.08153; no public code): Flow-GRPO's sampler (Flow-SDE a = 0.7) on a
    tree of 3 consecutive branch steps with 3 children each from a shared noise (27 leaves = the group),
    the window's start drawn from a truncated geometric, ODE elsewhere; leaf advantages the group
    z-score, an edge's the π_old-weighted mean of its children's (:mod:`flowcredit.tree_plans`). No KL."""
    return Config(
        sampler="flow_sde",
        noise_level=0.7,
        credit="flow_grpo",
        shared_noise=True,
        group_size=27,
        step_schedule="treegrpo",
    )


def branch_grpo() -> Config:
    """BranchGRPO (Fredreic1849/BranchGRPO, ``scripts/finetune/finetune_flux_branchgrpo_8gpus.sh`` and
    ``fastvideo/train_branchgrpo_flux.py``): one noise per prompt (``--init_same_noise``), Flow-GRPO's SDE
    at η = 0.3 on every step but the last (``--ignore_last``), binary splits at 0, 1, 3, 4 (theirs 0, 3, 6,
    9 of 20 steps; 16 leaves = ``--num_generations 16``), node values the mean over their leaves, z-scored
    per depth (:mod:`flowcredit.tree_plans`), the splits' noise × 4 (``TREE_SPLIT_NOISE_SCALE``, the
    schedule's ``split_noise``). Not taken: ``timestep_fraction`` 0.6 (every transition trains here), lr
    1e-5; depth and width pruning are off in their script (``DEPTH_PRUNING=""``, ``WIDTH_PRUNING_MODE=0``)
    and not built."""
    return Config(
        sampler="flow_sde",
        noise_level=0.3,
        credit="flow_grpo",
        shared_noise=True,
        group_size=16,
        step_schedule="branchgrpo",
    )


def grpo_guard() -> Config:
    """GRPO-Guard (zhtmike/flow_grpo, ``config/grpo_guard.py``): Flow-GRPO (Flow-SDE a = 0.7, every step
    but the last, group std, a noise per member, no KL) with RatioNorm at its clip range 2e-6 (an option
    of ``ratio_norm``; ``--clip_range`` does not reach it) and the 1/Δt step weights."""
    return Config(
        sampler="flow_sde", noise_level=0.7, credit="flow_grpo", update="ratio_norm", step_weight="grpo_guard"
    )


def flow_dppo() -> Config:
    """Flow-DPPO (Tencent-Hunyuan/UniRL, ``FlowDPPO/config.yaml``, ``examples/diffusion/sd3_flowdppo.yaml``):
    Flow-GRPO's rollout (Flow-SDE a = 0.7, a noise per member, no KL) with the update rule ``dppo``, the
    divergence trust region at τ = 1e-5 on ``mean_d (μ_θ − μ_old)²/(2s²)``, the group mean and the
    batch std, SDE on the first half of the steps (0–4 of 10), two optimizer steps per iteration (the
    recipe's ``num_updates_per_batch`` 2; here ``steps_per_update`` 3 over 5 steps). Deviations: every
    step of the first half explores, where the recipe draws 3 of those 5 per iteration; rollouts keep
    the model's CFG, where the recipe samples at guidance 1 (``--guidance_scale 1``)."""
    return Config(
        sampler="flow_sde", noise_level=0.7, credit="flow_grpo", global_std=True, window_size=5, update="dppo"
    )


def coca() -> Config:
    """CoCA (Lil-Shake/CoCA at d8233a5, ``scripts/train_coca.py``, ``config/base.py``): Flow-GRPO's
    recipe (Flow-SDE a = 0.7 on steps 0–8, group std, a noise per member) with its credit only changed:
    ``coca``, the terminal advantage scaled at each step by the share of the cosine-similarity gain of
    the clean predictions still to come, z-scored again per group (docs/algorithms.md §5.5). From the
    code: ``temporal_alpha`` 0, the second z-score and the clip. Our choices: windows of 1 step, the
    code's ten windows (5 steps each of its 50) on our 10 steps; the second z-score per prompt group
    (the code's, over its whole batch when its prompts rarely repeat: ``renorm: "batch"``); shares
    over the whole trajectory, the untrained last step included (``span: "window"``: the trained
    steps only). The clean predictions reuse the rollout's velocities: Flow-GRPO's network calls. The
    code's own base (DDPO on SD v1.4, DDIM η = 1, every step trained) is Flow-GRPO's here."""
    return Config(sampler="flow_sde", noise_level=0.7, credit="coca")


def flash_grpo() -> Config:
    """Flash-GRPO (Shredded-Pork/Flash-GRPO at 4211013, ``scripts/train_wanx2_1_flash.py``,
    ``config/dgx.py`` ``wan2_1_flash``): Flow-GRPO's recipe (a noise per member, clip range 1e-3, no
    KL, advantages clipped at 5) with what Flash-GRPO changes: one SDE step per prompt group, drawn
    uniformly from the first half of the steps and shared by the group (``step_schedule`` ``flash``),
    ODE elsewhere; its SDE (``flash_sde``, ``g = σ_1·σ``: 0.9 is σ_1 of our 10-step grid); the loss
    weighted by the temporal gradient rectification over its mean on those steps (``step_weight``
    ``flash``); the group mean over the batch std (``global_std``). Not taken: their EMA (decay 0.9
    every 8 steps), lr 1e-4 and guidance 4.5 (Flow-GRPO's preset keeps our defaults too)."""
    return Config(
        sampler="flash_sde",
        noise_level=0.9,
        credit="flow_grpo",
        global_std=True,
        step_schedule="flash",
        step_weight="flash",
    )


def diffusion_nft() -> Config:
    """DiffusionNFT (NVlabs/DiffusionNFT, ``config/nft.py``): deterministic rollouts by the old policy
    without CFG (``deterministic``, guidance 1), the forward-process loss with implicit positive and
    negative velocities (β = 1) at 9 of the 10 grid times, the group mean and the batch std, one
    optimizer step per iteration (the code's ``gradient_step_per_epoch`` 1; the old policy's η ramps by
    it). Deviation: Euler ODE steps where the code uses a second-order DPM-Solver."""
    return Config(
        sampler="ode",
        guidance_scale=1.0,
        credit="flow_grpo",
        global_std=True,
        update="nft",
        steps_per_update=9,
    )


def awm() -> Config:
    """AWM (scxue/advantage_weighted_matching, ``config/dgx_awm.py`` GenEval): rollouts by the current
    policy without CFG, SDE on the steps that end at σ' ∈ [0.3, 0.9] (0–6 here) at SA-Solver's τ = 0.4,
    which is Flow-SDE's a = 0.4·√2 ≈ 0.57; the advantage-weighted matching loss at 6 stratified grid
    times with a velocity KL to the lagged policy, the group mean and the batch std, one optimizer step
    per iteration. ``window_size`` 7 is for ``num_steps`` 10 (at another N: the steps that end in
    [0.3, 0.9]). Deviation: one Euler–Maruyama step where the code takes a second-order stochastic
    Adams predictor–corrector step (SA-Solver)."""
    return Config(
        sampler="flow_sde",
        noise_level=0.57,
        window_size=7,
        guidance_scale=1.0,
        credit="flow_grpo",
        global_std=True,
        update="awm",
        steps_per_update=6,
    )


def dgpo() -> Config:
    """DGPO (Luo-Yihong/DGPO, ``config/dgpo.py`` GenEval, ``scripts/train_sd3_dgpo.py``): deterministic
    rollouts by the current policy with the model's CFG (the code: 4.5); the group-preference loss
    against the reference (β_dpo = 100) at 4 times shared by the batch, drawn from steps 0–4 of 10,
    one noise per group, the matching loss clipped at 1e-2 against the old policy
    (η = min(0.001·step, 0.3)), a velocity KL β = 0.02, the group std, one optimizer step per iteration.
    The update's velocities are the conditional ones (``train_guidance_scale`` 1), as the code trains.
    Deviations: Euler ODE steps where the code uses DPM-Solver++ with flow shift 3; no switch to
    sampling with the old policy after 500 optimizer steps (the code's ``switch_ema_ref``)."""
    return Config(
        sampler="ode",
        credit="flow_grpo",
        update="dgpo",
        steps_per_update=4,
        beta=0.02,
        train_guidance_scale=1.0,
    )


def demo() -> Config:
    """The default CPU job (make demo): TP-GRPO credit (CPS α = 0.7 on steps 0–4, turning points) with
    LoRA r = 4 on the built-in U-Net, 4 counting prompts × 12, lr 3e-4, 10 iterations (≈ 8 minutes
    here). Of the four methods under this recipe it was the one whose held-out score never fell
    below the noise floor over 3 seeds (docs/recipes.md). No minutes cap: a preset's result depends
    on its seed and settings only. peft's LoRA forward (``lora_forward="peft"``), so that the README's
    numbers, measured with it, are what ``make demo`` prints; ``--lora_forward auto`` composes the
    LoRA (about 0.7× the time, numbers that differ by float round-off and then by drift)."""
    from importlib import resources

    prompts = str(resources.files("flowcredit") / "tasks" / "data" / "demo_prompts.jsonl")
    return Config(
        sampler="cps",
        noise_level=0.7,
        credit="turning_point",
        estimator="ode_remaining",
        lora_forward="peft",
        train_prompts=prompts,
        prompts_per_iter=4,
        group_size=12,
        window_size=5,
        steps_per_update=1,
        lr=3e-4,
        iterations=10,
        eval_every=5,
        num_eval_prompts=16,
        eval_samples_per_prompt=8,
    )


def skill() -> Config:
    """Held-out skill on the whole ShapeEval ``train`` split (docs/recipes.md, "Skill, not prompts"):
    Flow-GRPO credit with the batch std (CPS α = 0.7 on the 5 layout steps 0–4), prompts drawn
    category-balanced, the reward 0.3 soft + 0.7 strict (a surplus object fails the image), lr 1.5e-4
    with a KL to the reference (β = 0.15, Flow-GRPO's form: KL 1–7e-5), EMA 0.95 evaluated and
    exported, every held-out prompt evaluated; 450 iterations, no minutes cap, float32 on every CPU
    (``--autocast true`` is a speed option for CPUs with AMX, about 2× faster there and 14× slower
    without it; its bf16 rounding changes the numbers). Recipe J, the best of the thirteen measured
    (with ``--autocast true`` on an AMX CPU): +0.071 / +0.065 held-out strict on two seeds (floor
    ±0.009 / ±0.011; +0.057 / +0.055 on fresh noise seeds), no category lower by more than its floor.
    β = 0.3 read +0.061 / +0.039 at 450 iterations, β = 1 +0.036 / +0.036 at 340."""
    return Config(
        sampler="cps",
        noise_level=0.7,
        credit="flow_grpo",
        global_std=True,
        train_prompts="train",
        prompt_weights="category",
        reward="shapes=0.3,shapes_strict=0.7",
        prompts_per_iter=4,
        group_size=12,
        window_size=5,
        steps_per_update=1,
        lr=1.5e-4,
        beta=0.15,
        kl_mode="flow_grpo",
        ema_decay=0.95,
        iterations=450,
        eval_every=120,
        num_eval_prompts=0,
        eval_samples_per_prompt=4,
    )


def g2rpo() -> Config:
    """G²RPO (bcmi/Granular-GRPO, ``fastvideo/train_g2rpo_hps.py``,
    ``scripts/finetune/finetune_g2rpo_hps.sh``): TempFlow-GRPO's branch rollout (an ODE trunk per group
    from one noise, ``init_same_noise``; one Flow-SDE step at a = 0.7, the code's ``eta``, per branch
    step, then the ODE) on the first half of the steps (``eta_step_list`` 0–7 of 16; ours 0–4 of 10),
    each branch also completed by the ODE on every 2nd σ (``granular_list`` 1 2), the z-scores of the
    two completions summed and clipped to ±5 (``adv_clip_max``; :mod:`flowcredit.granular`). Unweighted
    losses (no TempFlow std weight). Deviations: ``group_size`` 16 (theirs ``num_generations`` 12), and
    the library's clip range and lr (theirs 1e-4 and 2e-6 for FLUX)."""
    return Config(
        sampler="flow_sde", noise_level=0.7, credit="flow_grpo", shared_noise=True, step_schedule="g2rpo"
    )


PRESETS: dict[str, Callable[[], Config]] = {}
"""Every preset by name (``--preset``)."""

COMPARED_PRESETS: list[str] = []
"""The presets ``flowcredit bench`` compares by default: one per credit method's own recipe."""


def register_preset(name: str, make: Callable[[], Config], compared: bool = True) -> None:
    """Register ``make`` as ``--preset name``; ``compared``: include it in the bench's default list."""
    if name in PRESETS:
        raise ValueError(f"preset {name!r} is already registered")
    PRESETS[name] = make
    if compared:
        COMPARED_PRESETS.append(name)


register_preset("demo", demo, compared=False)
register_preset("flow_grpo", flow_grpo)
register_preset("dense_grpo", dense_grpo)
register_preset("stepwise_grpo", stepwise_grpo)
register_preset("tp_grpo", tp_grpo)
register_preset("skill", skill, compared=False)
for _name, _make in (
    ("mixgrpo", mixgrpo),
    ("tempflow_grpo", tempflow_grpo),
    ("egrpo", egrpo),
    ("grpo_guard", grpo_guard),
    ("diffusion_nft", diffusion_nft),
    ("awm", awm),
):
    register_preset(_name, _make, compared=False)
NEWER_PRESETS = (
    "mixgrpo",
    "tempflow_grpo",
    "egrpo",
    "grpo_guard",
    "diffusion_nft",
    "awm",
    "flow_dppo",
    "coca",
    "tree_grpo",
    "flash_grpo",
    "branch_grpo",
    "dgpo",
    "g2rpo",
)
"""The presets of the methods that came after the four this library started with (issues 39 and 60)."""
# issue 60's, registered after issue 39's (tests/test_resume.py pairs each preset with a kill point by
# its position in PRESETS; the mutation check names some of those pairs)
register_preset("flow_dppo", flow_dppo, compared=False)
register_preset("coca", coca, compared=False)
register_preset("tree_grpo", tree_grpo, compared=False)
register_preset("flash_grpo", flash_grpo, compared=False)
register_preset("branch_grpo", branch_grpo, compared=False)
register_preset("dgpo", dgpo, compared=False)
register_preset("g2rpo", g2rpo, compared=False)


def load_config(preset: str = "flow_grpo", yaml_path: str | None = None, overrides: list[str] | None = None):
    """Preset → YAML file → ``--key value`` overrides, then :func:`validate`. Modules named by an
    ``--imports`` override are imported first, so that they can register the preset itself."""
    pairs = dict(zip((overrides or [])[::2], (overrides or [])[1::2]))
    import_plugins(pairs.get("--imports", ""))
    if preset not in PRESETS:
        import difflib

        close = difflib.get_close_matches(preset, sorted(PRESETS), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UserError(f"unknown preset {preset!r}; {hint}choose one of {sorted(PRESETS)}")
    cfg = PRESETS[preset]()
    if yaml_path:
        cfg = from_dict(read_mapping("--config", yaml_path), cfg)
    return apply_overrides(cfg, overrides)

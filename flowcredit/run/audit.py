"""The credit audit's rollouts (``flowcredit audit``; the statistics: :mod:`flowcredit.credit_audit`).

For one prompt group at a time: ``G`` trajectories of the policy's own sampler (its SDE window and
noise levels, ODE elsewhere), Monte-Carlo values ``V̂(x_i)`` of their states from ``M`` completions
each by that same sampler, and every audited credit rule's credit on the *same* trajectories, each
with its own value estimates and normalisation (:data:`AUDIT_RULES`: the trainer's own code,
:func:`flowcredit.run.rollout.state_values` and the rule's :data:`flowcredit.advantages.CREDITS`
entry). A state whose remaining steps are all deterministic needs no completion: its value is the
trajectory's own reward exactly (``V̂`` then repeats it ``M`` times).

Cost per trajectory: ``Σ_i M_i · (N − i)`` network calls over the states ``i`` with a noisy step at or
after them (``M · 40`` for the ``skill`` preset's window 0–4 of 10 steps), × 2 with CFG, plus each
rule's own value calls. Every draw comes from generators the audit owns (seeded by ``seed`` and the
group's index); the model's weights are only read.
"""

from __future__ import annotations

import dataclasses

import torch

from flowcredit.advantages import CREDITS
from flowcredit.config import Config
from flowcredit.rewards.guard import ScoreFn
from flowcredit.run.rollout import noise_levels, rollout, state_values
from flowcredit.schedule import sigmas as schedule
from flowcredit.sde import SAMPLERS
from flowcredit.validation import apply_overrides, credit_options

STEPWISE = ["--credit_options", '{"center": false}', "--estimator", "euler", "--substeps", "5"]
AUDIT_RULES: dict[str, list[str]] = {
    "flow_grpo": ["--credit", "flow_grpo"],
    "dense": ["--credit", "dense", "--estimator", "ode_remaining"],
    "dense_euler1": ["--credit", "dense", "--estimator", "euler", "--substeps", "1"],
    "stepwise": ["--credit", "stepwise", *STEPWISE],
    "turning_point": ["--credit", "turning_point", "--estimator", "ode_remaining"],
    "coca": ["--credit", "coca"],
}
"""The audited rules as the skill grid trains them (``bench_skill.SKILL_ARMS``): Flow-GRPO's terminal
reward; DenseGRPO's gains with ODE-completed values and with one-step values; Stepwise-Flow-GRPO's
euler(5) gains normalised jointly, uncentred; TP-GRPO's turning points with ODE values; CoCA's
terminal reward shared out by the similarity gains of the rollout's own clean predictions. Every other
registered credit method is audited too, with the config's own estimator (:func:`audit_rules`)."""


def audit_rules(names: str = "all") -> dict[str, list[str]]:
    """``{rule: overrides}``: :data:`AUDIT_RULES` plus every :data:`CREDITS` entry not among them;
    ``names``: ``"all"`` or a comma list."""
    rules = dict(AUDIT_RULES)
    rules |= {name: ["--credit", name] for name in CREDITS if name not in rules}
    if names == "all":
        return rules
    wanted = [n for n in names.split(",") if n]
    unknown = [n for n in wanted if n not in rules]
    if unknown:
        from flowcredit.errors import ConfigError

        raise ConfigError("rules", f"unknown audited rule(s) {unknown}; choose from {sorted(rules)}")
    return {n: rules[n] for n in wanted}


@dataclasses.dataclass
class GroupAudit:
    """One prompt group's audit: ``completions (G, N + 1, M)`` rewards, ``credit {rule: (G, N)}``,
    the rules' value calls per trajectory ``nfe {rule: float}``, the Monte-Carlo calls per trajectory
    ``mc_nfe``, ``trained (N,)``; ``cosine {rule: float}`` where the gradients were computed; ``owned
    (G, N)`` bool, a tree's (:mod:`flowcredit.run.tree_audit`): the trajectory that owns each transition
    (shared ones counted once)."""

    completions: torch.Tensor
    credit: dict[str, torch.Tensor]
    nfe: dict[str, float]
    mc_nfe: float
    trained: torch.Tensor
    cosine: dict[str, float] = dataclasses.field(default_factory=dict)
    owned: torch.Tensor | None = None


def mc_needed(levels: torch.Tensor) -> torch.Tensor:
    """``(N + 1,)`` bool: the states with a noisy step at or after them (their value needs completions;
    every other state's value is the trajectory's own final reward)."""
    noisy_after = (levels > 0).flip(0).cumsum(0).flip(0) > 0  # (N,)
    return torch.cat([noisy_after, torch.zeros(1, dtype=torch.bool)])


@torch.no_grad()
def mc_completions(model, cond, group, states, sigmas, levels, step_fn, score, m, generator, batch_size):
    """``(B, N + 1, max M)`` rewards: state ``i`` of each trajectory completed ``m[i]`` times by the
    sampler (``levels (N,)``, ``step_fn``), the final state scored as is; a state that needs no
    completion (:func:`mc_needed`) repeats its successor's rewards. Returns ``(rewards, calls)`` with
    ``calls`` the model rows run (× CFG passes not counted). ``m (N + 1,)`` ints; states whose ``m``
    is smaller than the largest are padded by repeating their own draws cyclically."""
    b, n = states.shape[0], states.shape[1] - 1
    m_max = int(max(m))
    out = torch.empty(b, n + 1, m_max, dtype=torch.float64)
    final = score(model.decode(states[:, n]), torch.arange(b)).double()
    out[:, n] = final[:, None]
    need, calls = mc_needed(levels), 0
    for i in range(n - 1, -1, -1):
        if not need[i]:
            out[:, i] = out[:, i + 1]
            continue
        k = int(m[i])
        traj = torch.arange(b).repeat_interleave(k)  # (B·k,) the trajectory of each completion
        x = states[traj, i]
        sub = rollout(
            model, cond, group[traj], x, sigmas[i:], levels[i:], step_fn, generator, batch_size=batch_size
        )
        calls += x.shape[0] * (n - i)
        rewards = score(model.decode(sub.states[:, -1]), traj).double().view(b, k)
        out[:, i] = rewards[:, torch.arange(m_max) % k]
    return out, calls


@dataclasses.dataclass
class AuditRollout:
    """One group's trajectories, drawn from the generators the audit owns (:func:`audit_rollout`), and
    what scoring and completing them needs; ``g_mc`` is the completions' generator, untouched."""

    cond: object
    group: torch.Tensor
    ro: object
    sigmas: torch.Tensor
    levels: torch.Tensor
    trained: torch.Tensor
    step_fn: object
    score: ScoreFn
    g_mc: torch.Generator


def audit_rollout(model, cfg: Config, reward, metas: list[dict], psi=None, seed=0, index=0) -> AuditRollout:
    """The ``cfg.group_size`` trajectories of each prompt of ``metas`` that group ``index`` of an audit
    with ``seed`` draws (the same on every call: the audit owns its generators)."""
    g_init, g_sde, g_mc = (torch.Generator().manual_seed(seed * 1_000_003 + index * 7 + k) for k in range(3))
    sig = schedule(cfg.num_steps, cfg.shift)
    levels, trained = noise_levels(cfg, psi)
    prompts = [meta["prompt"] for meta in metas]
    group = torch.arange(len(metas)).repeat_interleave(cfg.group_size)  # (B,)
    x0 = torch.randn((len(group), *model.latent_shape), generator=g_init)
    step_fn, bs = SAMPLERS[cfg.sampler], cfg.batch_size
    with torch.no_grad():
        cond = model.encode(prompts)
        ro = rollout(
            model, cond, group, x0, sig, levels, step_fn, g_sde, cfg.logp_mode, bs, keep_velocity=True
        )
    score = ScoreFn(reward, cfg.reward, prompts, metas, group, False)
    return AuditRollout(cond, group, ro, sig, levels, trained, step_fn, score, g_mc)


def rule_credits(model, cfg: Config, rules, r: AuditRollout) -> tuple[dict, dict]:
    """Each rule's credit ``{name: (B, N)}`` on the trajectories of ``r`` with its own values, and its
    value calls per trajectory ``{name: float}``; rules that need the same values share them."""
    credit, nfe, cache = {}, {}, {}
    for name, overrides in rules.items():
        rule_cfg = apply_overrides(dataclasses.replace(cfg, credit_options=""), overrides)
        entry = CREDITS[rule_cfg.credit]
        key = (entry.needs, rule_cfg.estimator, rule_cfg.substeps)
        if key not in cache:
            cache[key] = state_values(
                model, r.cond, r.group, r.ro, r.sigmas, key[0], r.trained, *key[1:], r.score, cfg.batch_size
            )
        values, value_calls = cache[key]
        kwargs = {"eps": rule_cfg.adv_eps, "adv_clip": rule_cfg.adv_clip, **credit_options(rule_cfg)}
        credit[name] = entry.fn(values.float(), r.group, r.trained, **kwargs)
        nfe[name] = value_calls / len(r.group)
    return credit, nfe


def audit_group(
    model, cfg: Config, reward, metas: list[dict], rules, m, psi=None, seed=0, index=0, grads=False
):
    """Audit one group of ``cfg.group_size`` trajectories of each prompt of ``metas`` (usually one);
    ``grads``: also the policy-gradient cosines (:func:`gradient_cosines`)."""
    r = audit_rollout(model, cfg, reward, metas, psi, seed, index)
    m_states = torch.as_tensor(m).expand(cfg.num_steps + 1) if torch.as_tensor(m).dim() == 0 else m
    completions, calls = mc_completions(
        model,
        r.cond,
        r.group,
        r.ro.states,
        r.sigmas,
        r.levels,
        r.step_fn,
        r.score,
        m_states,
        r.g_mc,
        cfg.batch_size,
    )
    credit, nfe = rule_credits(model, cfg, rules, r)
    audit = GroupAudit(completions, credit, nfe, calls / len(r.group), r.trained)
    if grads:
        audit.cosine = _cosines(model, cfg, r, credit, completions)
    return audit


def add_rules(
    model, cfg: Config, reward, metas, rules, stored: GroupAudit, psi=None, seed=0, index=0, grads=False
):
    """``stored`` (an audit of group ``index``) with the credit of ``rules`` it lacks, on the same
    trajectories and against its Monte-Carlo completions (not recomputed: the audit's cost).

    The trajectories are drawn again (:func:`audit_rollout`); that they are the stored ones is checked:
    every stored rule that costs no value calls is recomputed and must agree within 1e-4. Gradient
    cosines (``grads``) are computed for the added rules only (the stored ones and the noise halves'
    are kept)."""
    new = {name: o for name, o in rules.items() if name not in stored.credit}
    if not new:
        return stored
    r = audit_rollout(model, cfg, reward, metas, psi, seed, index)
    free = {name: rules[name] for name, calls in stored.nfe.items() if calls == 0 and name in rules}
    again, _ = rule_credits(model, cfg, free, r)
    for name, credit in again.items():
        gap = (credit - stored.credit[name]).abs().max().item()
        if gap > 1e-4:
            raise ValueError(
                f"group {index}: rule {name!r} recomputed differs from the stored audit's by {gap:.2g}: "
                "not the stored trajectories (another seed, settings or model?)"
            )
    credit, nfe = rule_credits(model, cfg, new, r)
    cosine = dict(stored.cosine)
    if grads and stored.cosine:
        cosine |= {k: v for k, v in _cosines(model, cfg, r, credit, stored.completions).items() if k in new}
    return GroupAudit(
        stored.completions, stored.credit | credit, stored.nfe | nfe, stored.mc_nfe, stored.trained, cosine
    )


def _cosines(model, cfg: Config, r: AuditRollout, credit: dict, completions) -> dict[str, float]:
    from flowcredit.credit_audit import mc_delta, split_halves

    step = (r.cond, r.group, r.ro.states, r.sigmas, r.levels, r.step_fn)
    halves = tuple(d.float() for d in split_halves(completions))
    return gradient_cosines(model, cfg, step, credit, mc_delta(completions).float(), r.trained, halves)


def gradient_cosines(
    model, cfg: Config, rollout_of, credits: dict, delta, trained, halves
) -> dict[str, float]:
    """Cosine between the policy gradient each credit produces and the one ``Δ̂`` produces:
    ``g_A = ∇_θ Σ_{b, i trained} A_{b,i} · log π_θ(x_{i+1} | x_i)`` on the LoRA parameters ``θ`` of
    ``cfg`` (rank, alpha, targets, seed; added to a copy of the model, so ``B = 0``: at the audited
    weights the gradient lies on the LoRA ``B`` matrices, the direction a first update step takes).
    ``rollout_of``: ``(cond, group, states (B, N + 1, …), sigmas, levels, step_fn)``. Returns
    ``{name: cos(g_A, g_Δ)}`` over ``credits``, and under ``"noise_halves"`` the cosine between the
    gradients of the two halves' ``Δ̂`` (``halves``): how far ``g_Δ`` itself is from noise-free."""
    import copy

    from flowcredit.run.policy import Policy

    cond, group, states, sig, levels, step_fn = rollout_of
    trainee = copy.deepcopy(model)
    keys = (cfg.train_params, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    params = Policy(trainee, *keys, seed=cfg.seed).parameters()
    logp = []
    for i in torch.nonzero(trained, as_tuple=True)[0].tolist():
        x, b = states[:, i], states.shape[0]
        v = trainee.velocity(x, sig[i].expand(b), cond[group])
        out = step_fn(v, x, sig[i].item(), sig[i + 1].item(), float(levels[i]), x_next=states[:, i + 1])
        logp.append(out.logp)
    logp = torch.stack(logp, 1)  # (B, K)

    def grad(weights: torch.Tensor) -> torch.Tensor:
        parts = torch.autograd.grad((weights[:, trained] * logp).sum(), params, retain_graph=True)
        return torch.cat([p.flatten() for p in parts]).double()

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        norm = a.norm() * b.norm()
        return float(a @ b / norm) if norm > 0 else float("nan")

    g_delta = grad(delta)
    out = {name: cos(grad(credit), g_delta) for name, credit in credits.items()}
    out["noise_halves"] = cos(grad(halves[0]), grad(halves[1]))
    return out


def _interval(x: torch.Tensor) -> tuple[float, float, int]:
    """Mean, 95 % t half-width and n of the finite entries of ``x (P,)`` (prompts)."""
    from scipy.stats import t

    x = x[torch.isfinite(x)].double()
    n = int(x.numel())
    if n == 0:
        return float("nan"), float("nan"), 0
    half = float(t.ppf(0.975, n - 1) * x.std(unbiased=True) / n**0.5) if n > 1 else float("nan")
    return float(x.mean()), half, n


def _summary(per_group: torch.Tensor) -> dict:
    """``(P, K)`` → per step and pooled (each prompt's mean over the steps), mean ± 95 % interval."""
    steps = [_interval(per_group[:, k]) for k in range(per_group.shape[1])]
    pooled = _interval(torch.nanmean(per_group, dim=1))
    return {
        "per_step": [s[0] for s in steps],
        "per_step_interval": [s[1] for s in steps],
        "pooled": pooled[0],
        "pooled_interval": pooled[1],
        "prompts": pooled[2],
    }


def summarise(audits: list[GroupAudit], categories: list[str] | None = None) -> dict:
    """The audit's report over prompt groups (one prompt each): per rule Spearman's ρ with ``Δ̂`` and
    sign agreement, per trained step and pooled, with 95 % t intervals over prompts; the noise ceiling
    (the same statistics between the two halves of the completions, the reliability of ``Δ̂`` by
    Spearman–Brown, its square root as the ceiling of any credit's ρ, and each rule's ρ divided by
    it); network calls per trajectory; per category the pooled ρ of every rule; and each rule's pooled
    ρ minus Flow-GRPO's, paired by prompt (the same trajectories), with its interval."""
    from flowcredit.credit_audit import (
        group_step_sign_agreement,
        group_step_spearman,
        mc_delta,
        spearman_brown,
        split_halves,
    )

    rho, sign, half_rho, half_sign = {}, {}, [], []
    for a in audits:  # a tree's trained steps may differ between groups (TreeGRPO's drawn start): K each
        group, trained, owned = torch.zeros(a.completions.shape[0], dtype=torch.long), a.trained, a.owned
        delta, (d_a, d_b) = mc_delta(a.completions), split_halves(a.completions)
        half_rho.append(group_step_spearman(d_a, d_b, group, trained, False, owned))
        half_sign.append(group_step_sign_agreement(d_a, d_b, group, trained, owned))
        for name, credit in a.credit.items():
            rho.setdefault(name, []).append(group_step_spearman(credit, delta, group, trained, True, owned))
            sign.setdefault(name, []).append(group_step_sign_agreement(credit, delta, group, trained, owned))
    half = _summary(torch.cat(half_rho))
    reliability = spearman_brown(torch.tensor(half["per_step"], dtype=torch.float64))
    ceiling = reliability.clamp_min(0).sqrt()
    with_grads = [a.cosine for a in audits if a.cosine]
    cosines = {
        name: dict(
            zip(("mean", "interval", "prompts"), _interval(torch.tensor([c[name] for c in with_grads])))
        )
        for name in (with_grads[0] if with_grads else {})
    }
    steps = {tuple(torch.nonzero(a.trained, as_tuple=True)[0].tolist()) for a in audits}
    report = {  # trained steps that differ between groups (TreeGRPO's): "step k" is each one's k-th
        "steps": list(steps.pop()) if len(steps) == 1 else list(range(len(next(iter(steps))))),
        "steps_by_position": len(steps) > 1,
        "gradient_cosine": cosines,
        "ceiling": {
            "half_spearman": half,
            "half_sign_agreement": _summary(torch.cat(half_sign)),
            "reliability": reliability.tolist(),
            "spearman_ceiling": ceiling.tolist(),
        },
        "mc_calls_per_trajectory": sum(a.mc_nfe for a in audits) / len(audits),
        "rules": {},
    }
    for name in rho:
        per_group = torch.cat(rho[name])
        r = _summary(per_group)
        r["disattenuated"] = (torch.tensor(r["per_step"], dtype=torch.float64) / ceiling).tolist()
        entry = {"spearman": r, "sign_agreement": _summary(torch.cat(sign[name]))}
        entry["value_calls_per_trajectory"] = sum(a.nfe[name] for a in audits) / len(audits)
        if categories:
            entry["spearman_by_category"] = {
                c: _interval(
                    torch.nanmean(per_group[[k for k, x in enumerate(categories) if x == c]], dim=1)
                )[0]
                for c in sorted(set(categories))
            }
        if "flow_grpo" in rho and name != "flow_grpo":  # paired: the same trajectories and Δ̂
            paired = torch.nanmean(per_group - torch.cat(rho["flow_grpo"]), dim=1)
            entry["spearman_minus_flow_grpo"] = dict(zip(("mean", "interval", "prompts"), _interval(paired)))
        report["rules"][name] = entry
    return report

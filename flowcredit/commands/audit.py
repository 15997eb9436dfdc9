"""``flowcredit audit``: how well each credit rule's per-step credit tracks the true effect of each step.

For a model, a reward, a prompt set and a sampler (a preset, ``--config`` and ``--field value``
overrides, as ``train`` takes them), roll out one group per prompt, estimate every state's value by
``M`` Monte-Carlo completions with the same sampler, and score every registered credit rule's
credit against ``Δ_i = V̂(x_{i+1}) − V̂(x_i)`` (:mod:`flowcredit.run.audit`,
:mod:`flowcredit.credit_audit`). Writes ``OUT/audit.json`` and ``OUT/audit.png``; each prompt's raw
results go to ``OUT/groups/`` as it finishes, so an interrupted audit resumes where it stopped.

    flowcredit audit --max-prompts 16                  # the quick audit of the built-in model
    flowcredit audit --model sd3 --checkpoint DIR --reward pickscore --prompts my.jsonl --m 16
    flowcredit audit --preset tree_grpo --max-prompts 16   # a tree plan: its edges, the tree rules
                                                           # (flowcredit.run.tree_audit)

Cost: states × M × remaining steps network calls per trajectory (× 2 with CFG): ``M · 40`` on the
``skill`` preset (SDE steps 0–4 of 10), about 60 s per prompt group of 12 at M = 32 on 2 CPU cores.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path

import torch

from flowcredit.cli_args import ArgParser, add_config_fields
from flowcredit.errors import ConfigError, UserError


def _parser() -> ArgParser:
    p = ArgParser(
        prog="flowcredit audit",
        description="Audit every credit rule against Monte-Carlo step effects; the config fields below "
        "override the preset's (e.g. --group_size 8 --noise_level 0.5). A step schedule that grows trees "
        "(--preset tree_grpo, branch_grpo) is audited edge by edge with the tree rules.",
    )
    p.add_argument("--preset", default="skill", help="the sampler, reward and model settings (default skill)")
    p.add_argument(
        "--config", default=None, help="a YAML/JSON config on top of the preset (e.g. RUN/config.json)"
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="the weights to audit (default: the config's); also a published run's final/ or iteration-K",
    )
    p.add_argument("--prompts", default="test", help="'test', 'train', a JSONL or text file")
    p.add_argument("--max-prompts", type=int, default=16, help="prompts spread over the set (0: all)")
    p.add_argument("--m", default="32", help="completions per state: one number, or one per audited state")
    p.add_argument("--rules", default="all", help="comma list of audited rules (default: every one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trajectories and completions")
    p.add_argument(
        "--grad-prompts",
        type=int,
        default=4,
        help="prompts (the first) whose policy-gradient cosines are computed",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="runs/audit", help="directory of audit.json, audit.png and groups/")
    add_config_fields(p)  # but seed, checkpoint and threads: the audit's own options above
    return p


def parse_m(text: str, needed: torch.Tensor) -> torch.Tensor:
    """``--m`` as ``(N + 1,)`` completions per state: one number for every state that needs them
    (:func:`flowcredit.run.audit.mc_needed`), or one per such state in order; 1 elsewhere."""
    try:
        given = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError("m", f"expected an integer or a comma list of integers, got {text!r}") from None
    k = int(needed.sum())
    if len(given) not in (1, k) or min(given) < 2:
        raise ConfigError("m", f"give one M ≥ 2, or {k} (one per state with noise after it), got {text!r}")
    m = torch.ones(needed.numel(), dtype=torch.long)
    m[needed] = torch.tensor(given * k if len(given) == 1 else given)
    return m


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from flowcredit.commands.eval import _tensors_only
    from flowcredit.models import load_model
    from flowcredit.presets import load_config
    from flowcredit.run.audit import add_rules, audit_group, audit_rules, mc_needed, summarise
    from flowcredit.run.policy import apply_trained
    from flowcredit.run.psi_file import read_psi
    from flowcredit.run.rollout import noise_levels
    from flowcredit.run.runlog import provenance
    from flowcredit.run.session import build_reward, configure_network
    from flowcredit.run.tree_audit import tree_audit_group
    from flowcredit.tasks.prompt_sets import load_prompt_set

    args, rest = _parser().parse_with_overrides(argv)
    published = Path(args.checkpoint) if args.checkpoint and _tensors_only(args.checkpoint) else None
    if published is not None:  # a published run's tensors: its base from its config, the tensors merged in
        base = json.loads((published.parent / "config.json").read_text())["checkpoint"]
        rest = [*rest, "--checkpoint", base]
    elif args.checkpoint:
        rest = [*rest, "--checkpoint", args.checkpoint]
    cfg = load_config(args.preset, args.config, rest)
    torch.set_num_threads(args.threads)
    if cfg.calibrate and not cfg.psi_path:
        raise ConfigError("psi_path", f"sampler {cfg.sampler!r} with calibrate: give the calibrated ψ file")
    psi = read_psi(cfg.psi_path, cfg.num_steps) if cfg.psi_path else None
    levels, trained = noise_levels(cfg, psi)
    m = parse_m(args.m, mc_needed(levels))
    tree = _is_tree(cfg)
    rules = _tree_rules(args.rules) if tree else audit_rules(args.rules)
    grad_prompts = 0 if tree else args.grad_prompts  # a tree's rules: no gradient cosines
    metas = load_prompt_set(args.prompts, args.max_prompts, spread=True)
    model = load_model(cfg)
    if published is not None:
        apply_trained(model, published)
    configure_network(cfg, model)
    reward = build_reward(cfg, cfg.reward)
    out = Path(args.out)
    (out / "groups").mkdir(parents=True, exist_ok=True)
    settings = {"preset": args.preset, "config": args.config, "prompts": args.prompts, "m": m.tolist()}
    settings |= {"n_prompts": len(metas), "group_size": cfg.group_size, "seed": args.seed, "rules": rules}
    settings |= {"grad_prompts": min(grad_prompts, len(metas))} | (
        {"tree": cfg.step_schedule} if tree else {}
    )
    settings |= {"sampler": cfg.sampler, "noise_level": cfg.noise_level, "levels": levels.tolist()}
    settings |= {"checkpoint": cfg.checkpoint, "model": cfg.model, "reward": cfg.reward}
    settings |= {"published": str(published)} if published is not None else {}
    t0, audits = time.time(), []
    for k, meta in enumerate(tqdm(metas, desc="audit", unit="prompt", dynamic_ncols=True)):
        grads = k < grad_prompts
        compute = partial(audit_group, model, cfg, reward, [meta], rules, m, psi, args.seed, k, grads)
        if tree:
            compute = partial(tree_audit_group, model, cfg, reward, [meta], int(m.max()), args.seed, k)
        add = partial(
            add_rules, model, cfg, reward, [meta], rules, psi=psi, seed=args.seed, index=k, grads=grads
        )
        audits.append(_group(out, k, settings, compute, grads, add))
    report = {"settings": settings, **summarise(audits, [meta.get("category", "") for meta in metas])}
    report["minutes"] = (time.time() - t0) / 60
    report["provenance"] = provenance(0, args.threads, cfg.device)
    report = _keep_history(out / "audit.json", report)
    (out / "audit.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_audit(report, out / "audit.png")
    print(format_report(report))
    print(f"wrote {out / 'audit.json'} and {out / 'audit.png'}")
    return 0


def _group(out: Path, k: int, settings: dict, compute, grads: bool, add=None):
    """Prompt ``k``'s audit, read from ``out/groups/`` when an audit of the same settings stored it
    (with its gradient cosines, if ``grads`` asks for them; else computed again). A stored audit of
    fewer rules (the others' settings the same) gains the missing ones through ``add(stored)``
    (:func:`flowcredit.run.audit.add_rules`: its completions reused), stored again."""
    from safetensors.torch import load_file

    from flowcredit.run.audit import GroupAudit

    path, meta_path = out / "groups" / f"{k:04d}.safetensors", out / "groups" / f"{k:04d}.json"
    if path.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if not _extends(meta["settings"], json.loads(json.dumps(settings))):
            raise UserError(f"{out}: holds an audit of other settings; choose another --out")
        if meta.get("cosine") or not grads:
            t = load_file(str(path))
            credit = {name: t[f"credit.{name}"] for name in meta["nfe"]}
            cosine = meta.get("cosine", {})
            a = GroupAudit(
                t["completions"], credit, meta["nfe"], meta["mc_nfe"], t["trained"], cosine, t.get("owned")
            )
            if set(credit) == set(settings["rules"]):
                return a
            a = add(a)
            _store(path, meta_path, settings, a)
            return a
    a = compute()
    _store(path, meta_path, settings, a)
    return a


def _is_tree(cfg) -> bool:
    """Whether ``cfg``'s step schedule grows trees (its plan at iteration 0)."""
    from flowcredit.run.plans import iteration_plan
    from flowcredit.schedule import sigmas

    return iteration_plan(cfg, sigmas(cfg.num_steps, cfg.shift), 0).tree is not None


def _tree_rules(names: str) -> dict:
    """The tree audit's rules (:data:`flowcredit.run.tree_audit.TREE_RULES`) as settings; only ``all``."""
    from flowcredit.run.tree_audit import TREE_RULES

    if names != "all":
        raise ConfigError(
            "rules", f"a tree plan is audited with its own rules {list(TREE_RULES)}: --rules all"
        )
    return {name: list(shape or ("own leaf",)) for name, shape in TREE_RULES.items()}


def _keep_history(path: Path, report: dict) -> dict:
    """``report``, or, where it only adds rules to the audit at ``path``, that audit's minutes and
    provenance with this run's under ``rules_added`` (the rules, its minutes and provenance)."""
    if not path.is_file():
        return report
    previous = json.loads(path.read_text())
    added = sorted(set(report["settings"]["rules"]) - set(previous["settings"]["rules"]))
    if not added or not _extends(previous["settings"], json.loads(json.dumps(report["settings"]))):
        return report
    step = {"rules": added, "minutes": report["minutes"], "provenance": report["provenance"]}
    history = [*previous.get("rules_added", []), step]
    return report | {k: previous[k] for k in ("minutes", "provenance")} | {"rules_added": history}


def _extends(stored: dict, settings: dict) -> bool:
    """``settings`` asks for the stored audit, or for it with more rules (grad_prompts aside)."""
    rest = ("grad_prompts", "rules")
    if {k: v for k, v in stored.items() if k not in rest} != {
        k: v for k, v in settings.items() if k not in rest
    }:
        return False
    return all(settings["rules"].get(name) == overrides for name, overrides in stored["rules"].items())


def _store(path: Path, meta_path: Path, settings: dict, a) -> None:
    """One group's audit: tensors (safetensors) and its JSON, each written whole (a temporary, renamed)."""
    from safetensors.torch import save_file

    tensors = {"completions": a.completions, "trained": a.trained}
    tensors |= {"owned": a.owned.contiguous()} if a.owned is not None else {}
    tensors |= {f"credit.{name}": c.contiguous() for name, c in a.credit.items()}
    save_file(tensors, str(path.with_suffix(".tmp")))
    path.with_suffix(".tmp").replace(path)
    meta = {"settings": settings, "nfe": a.nfe, "mc_nfe": a.mc_nfe, "cosine": a.cosine}
    meta_path.with_suffix(".tmp").write_text(json.dumps(meta) + "\n")
    meta_path.with_suffix(".tmp").replace(meta_path)


def format_report(report: dict) -> str:
    """The audit as a table: per rule, ρ with Δ̂ per trained step and pooled (± 95 % over prompts)."""
    steps, ceiling = report["steps"], report["ceiling"]
    mark = "#" if report.get("steps_by_position") else ""  # step #k: each group's k-th trained step
    head = f"{'rule':<16}" + "".join(f"  step {mark}{s:<{8 - len(mark)}}" for s in steps)
    head += "  pooled        sign   calls"
    lines = ["Spearman's rho of each rule's credit with the Monte-Carlo step effect (within a group)", head]
    for name, r in report["rules"].items():
        rho = r["spearman"]
        cells = "".join(f"  {v:+.2f}±{h:.2f}   " for v, h in zip(rho["per_step"], rho["per_step_interval"]))
        tail = f"  {rho['pooled']:+.3f}±{rho['pooled_interval']:.3f}  {r['sign_agreement']['pooled']:.2f}"
        lines.append(f"{name:<16}{cells}{tail}  {r['value_calls_per_trajectory']:.0f}")
    cells = "".join(f"  {v:.2f}         " for v in ceiling["spearman_ceiling"])
    lines.append(
        f"{'noise ceiling':<16}{cells}  (Monte Carlo: {report['mc_calls_per_trajectory']:.0f} calls)"
    )
    if cosines := report.get("gradient_cosine"):
        n = next(iter(cosines.values()))["prompts"]
        lines.append(f"policy-gradient cosine with the step effects' gradient ({n} prompts; noise_halves:")
        lines.append("  the two halves' gradients, how close the reference itself is to noise-free)")
        lines += [f"  {name:<16}{c['mean']:+.3f} ± {c['interval']:.3f}" for name, c in cosines.items()]
    return "\n".join(lines)


def plot_audit(report: dict, path: Path) -> None:
    """ρ per trained step, one line per rule, and the noise ceiling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = report["steps"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8), dpi=110)
    rules = report["rules"]
    for k, (name, r) in enumerate(rules.items()):  # each rule a little apart: its interval stays readable
        x = [s + 0.06 * (k - (len(rules) - 1) / 2) for s in steps]
        rho = r["spearman"]
        ax.errorbar(x, rho["per_step"], yerr=rho["per_step_interval"], marker="o", capsize=2, label=name)
    ax.plot(steps, report["ceiling"]["spearman_ceiling"], "k--", label="noise ceiling")
    ax.axhline(0, color="grey", lw=0.6)
    ax.set_xlabel(
        "trained step (its position in each tree)" if report.get("steps_by_position") else "denoising step"
    )
    ax.set_ylabel("Spearman ρ with the step's effect")
    ax.set_xticks(steps)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)

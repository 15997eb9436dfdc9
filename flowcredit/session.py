"""Everything a training run holds between iterations, and its set-up, evaluation and outputs.

``Session.open`` builds the model adapter, the policy (LoRA / trainable set / reference), the
optimizer, EMA, schedule, noise vector (calibrating ψ first for DenseGRPO) and the prompt sets, or
restores them from the run directory's checkpoint.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from flowcredit.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from flowcredit.config import Config
from flowcredit.distributed import Dist
from flowcredit.policy import EMA, Policy
from flowcredit.rewards import Reward, get_reward
from flowcredit.schedule import sigmas as make_sigmas
from flowcredit.sde import SAMPLERS

MODEL_LOADERS = {
    "tiny": "flowcredit.models.tiny:load_for_training",
    "sd3": "flowcredit.models.sd3:load_for_training",
    "flux": "flowcredit.models.flux:load_for_training",
}
"""Adapter loaders ``(cfg: Config) -> FlowModel``, imported only when chosen."""


def load_model(cfg: Config):
    """The model adapter named by ``cfg.model`` with ``cfg.checkpoint`` weights."""
    module, _, name = MODEL_LOADERS[cfg.model].partition(":")
    model = getattr(importlib.import_module(module), name)(cfg)
    if cfg.guidance_scale:
        model.guidance_scale = cfg.guidance_scale
    return model


def read_prompts(spec: str) -> list[dict]:
    """Prompt metadata: a ShapeEval split ('train' / 'test'), a JSONL file (one object with a
    "prompt" key per line) or a text file (one prompt per line)."""
    if spec in ("train", "test"):
        from flowcredit.tasks.shapes import load_prompts

        return load_prompts(spec)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"prompt set {spec!r}: not a ShapeEval split ('train', 'test') nor an existing file")
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip()]
    if path.suffix != ".jsonl":
        return [{"prompt": ln} for ln in lines]
    metas = [json.loads(ln) for ln in lines]
    for k, m in enumerate(metas):
        if not isinstance(m, dict) or not isinstance(m.get("prompt"), str):
            raise ValueError(f"{spec}: line {k + 1} has no string 'prompt' field")
    return metas


def load_prompt_set(spec: str, limit: int, spread: bool) -> list[dict]:
    """:func:`read_prompts`, then the first ``limit`` prompts, or ``limit`` spread evenly (0: all)."""
    metas = read_prompts(spec)
    if not limit or limit >= len(metas):
        return metas
    if spread:
        step = len(metas) / limit
        return [metas[int(i * step)] for i in range(limit)]
    return metas[:limit]


@dataclass
class Session:
    cfg: Config
    run_dir: Path
    model: object
    policy: Policy
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    reward: Reward
    sigmas: torch.Tensor
    levels: torch.Tensor
    trained: torch.Tensor
    train_metas: list[dict]
    eval_metas: list[dict]
    psi: torch.Tensor | None = None
    dist: Dist | None = None
    start_iteration: int = 0
    history: dict = field(default_factory=dict)

    @property
    def step_fn(self):
        return SAMPLERS[self.cfg.sampler]

    @property
    def params(self):
        return self.policy.parameters()

    @property
    def cfg_mult(self) -> int:
        """Network passes per sample per velocity call (2 with CFG; FLUX's guidance embedding: 1)."""
        return getattr(self.model, "nfe_per_call", 1 if self.model.guidance_scale == 1.0 else 2)

    @property
    def adv_opts(self) -> dict:
        c = self.cfg
        return {
            "eps": c.adv_eps,
            "adv_clip": c.adv_clip,
            "global_std": c.global_std,
            "constrained": c.tp_constrained,
            "first_step": c.tp_first_step,
            "balance": c.tp_balance,
        }

    @classmethod
    def open(cls, cfg: Config, resume: bool) -> Session:
        from flowcredit.train import noise_levels

        dist = Dist()
        torch.set_num_threads(cfg.threads if dist.world == 1 else max(1, cfg.threads // dist.world))
        if cfg.prompts_per_iter % dist.world:
            raise ValueError(
                f"config field 'prompts_per_iter' ({cfg.prompts_per_iter}) must be divisible "
                f"by the number of processes ({dist.world})"
            )
        if cfg.global_std and dist.world > 1:
            raise ValueError("config field 'global_std' is not supported with several processes yet")
        run_dir = Path(cfg.run_dir)
        if dist.is_main:
            if not resume and run_dir.exists() and any(run_dir.iterdir()):
                raise FileExistsError(
                    f"run_dir {str(run_dir)!r} exists and is not empty; use "
                    f"'flowcredit train --resume {run_dir}' or another --run_dir"
                )
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
        dist.barrier()
        model = load_model(cfg)
        policy = Policy(
            model,
            cfg.train_params,
            cfg.lora_rank,
            cfg.lora_alpha,
            cfg.lora_targets,
            need_reference=cfg.beta > 0,
            seed=cfg.seed,
        )
        params = policy.parameters()
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        ema = EMA(params, cfg.ema_decay) if cfg.ema_decay else None
        # the adapter's own schedule when it has one (diffusers models: exactly as diffusers computes it)
        sigmas = (
            model.sigmas(cfg.num_steps) if hasattr(model, "sigmas") else make_sigmas(cfg.num_steps, cfg.shift)
        )
        s = cls(
            cfg,
            run_dir,
            model,
            policy,
            optimizer,
            ema,
            get_reward(cfg.reward, json.loads(cfg.reward_options) if cfg.reward_options else None),
            sigmas,
            torch.zeros(cfg.num_steps),
            torch.zeros(cfg.num_steps, dtype=torch.bool),
            load_prompt_set(cfg.train_prompts, cfg.num_train_prompts, spread=False),
            load_prompt_set(cfg.eval_prompts, cfg.num_eval_prompts, spread=True),
        )
        s.dist = dist
        ckpt = find_checkpoint(run_dir) if resume else None
        if resume and ckpt is None:
            raise FileNotFoundError(f"--resume {str(run_dir)!r}: no checkpoint in that run directory")
        if ckpt is not None:
            s._restore(load_checkpoint(ckpt))
        elif cfg.psi_path:
            s.psi = torch.tensor(json.loads(Path(cfg.psi_path).read_text())["psi"])
        elif cfg.calibrate:
            from flowcredit.calibrate_cmd import calibrate_session

            s.psi = calibrate_session(s)
        if s.psi is not None and dist.is_main:
            (run_dir / "psi.json").write_text(json.dumps({"psi": s.psi.tolist()}) + "\n")
        s.levels, s.trained = noise_levels(cfg, s.psi)
        return s

    def _restore(self, state: dict) -> None:
        self.policy.load_trainable_state(state["trainable"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.ema is not None and state["ema"] is not None:
            for shadow, name in zip(self.ema.shadow, sorted(state["ema"])):
                shadow.copy_(state["ema"][name])
        extra = state["extra"]
        self.psi = torch.tensor(extra["psi"]) if extra.get("psi") is not None else None
        self.history = extra.get("history", {})
        self.start_iteration = state["iteration"]

    def save(self, iteration: int) -> None:
        ema = None
        if self.ema is not None:
            ema = {f"{i:05d}": t for i, t in enumerate(self.ema.shadow)}
        extra = {"psi": None if self.psi is None else self.psi.tolist(), "history": self.history}
        save_checkpoint(
            self.run_dir,
            iteration=iteration,
            trainable=self.policy.trainable_state(),
            optimizer=self.optimizer.state_dict(),
            ema=ema,
            extra=extra,
        )


class ScoreFn:
    """``score(images, traj_index) -> (M,)`` with the checks of SPEC: a reward that raises or returns
    NaN/inf stops the run with the reward and prompt named (or, with ``skip_bad``, yields NaN).
    ``components`` keeps each call's per-reward components (for ``reward/<name>`` of a mix)."""

    def __init__(self, reward: Reward, spec: str, prompts, metas, rows, skip_bad: bool):
        self.reward, self.spec, self.prompts, self.metas = reward, spec, prompts, metas
        self.rows, self.skip_bad = rows, skip_bad
        self.components: list[dict[str, torch.Tensor]] = []

    def __call__(self, images, traj_index) -> torch.Tensor:
        p = [self.prompts[j] for j in self.rows[traj_index].tolist()]
        m = [self.metas[j] for j in self.rows[traj_index].tolist()]
        try:
            values, components = self.reward.score(images, p, m)
        except Exception as exc:
            if self.skip_bad:
                self.components.append({})  # keeps components[k] aligned with the k-th call
                return torch.full((len(p),), math.nan)
            raise RuntimeError(f"reward {self.spec!r} failed on prompts like {p[0]!r}: {exc}") from exc
        self.components.append(components)
        bad = ~torch.isfinite(values)
        if bad.any() and not self.skip_bad:
            j = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"reward {self.spec!r} returned {values[j].item()} for prompt {p[j]!r} "
                "(set skip_bad_rewards=true to drop such groups)"
            )
        return torch.where(bad, torch.full_like(values, math.nan), values)


def _eval_tables(s: Session, metas: list[dict], seed: int, images: bool = False) -> dict:
    """ShapeEval tables (``shapes`` reward) or the mean configured reward, ODE sampler, fixed noise."""
    from flowcredit.evaluate import evaluate, initial_noise, sample

    cfg, k = s.cfg, s.cfg.eval_samples_per_prompt
    ema = s.ema.applied() if s.ema is not None else contextlib.nullcontext()
    with torch.no_grad(), ema, s.policy.merged():
        if cfg.reward == "shapes":
            return evaluate(
                s.model,
                metas,
                seed=seed,
                samples_per_prompt=k,
                num_steps=cfg.num_steps,
                shift=cfg.shift,
                return_images=images,
            )
        rows = [m for m in metas for _ in range(k)]
        noise = initial_noise(len(rows), tuple(s.model.latent_shape), seed)
        imgs = sample(
            s.model, [m["prompt"] for m in rows], noise, cfg.num_steps, cfg.shift, None, cfg.batch_size
        )
        score = s.reward(imgs, [m["prompt"] for m in rows], rows).mean().item()
        out = {"table": {"overall": {"soft": score, "strict": math.nan}}}
        return {**out, "images": imgs} if images else out


def evaluate_policy(s: Session, tag: str | None) -> dict:
    """Held-out (and, with a small training set, trained-prompt) ShapeEval with fixed noise.

    ``tag="start"`` also measures the noise floor (std over 3 noise seeds) and saves the grid.
    """
    out = {}
    sets = {"test": s.eval_metas}
    if len(s.train_metas) <= 32:  # a small training set is evaluated too (did the trained prompts improve?)
        sets["train"] = s.train_metas
    for name, metas in sets.items():
        res = _eval_tables(s, metas, s.cfg.eval_seed, images=tag is not None)
        overall = res["table"]["overall"]
        out[f"eval/{name}/soft"], out[f"eval/{name}/strict"] = overall["soft"], overall["strict"]
        for cat, row in res["table"].items():  # per ShapeEval category (held-out set only)
            if name == "test" and cat != "overall" and len(res["table"]) > 2:
                out[f"eval/test/{cat}/soft"], out[f"eval/test/{cat}/strict"] = row["soft"], row["strict"]
        if tag is not None:
            _save_grid(s, res, metas, f"grid_{tag}_{name}.png")
        if tag == "start":
            floors = [_eval_tables(s, metas, s.cfg.eval_seed + k)["table"]["overall"]["soft"] for k in (1, 2)]
            spread = torch.tensor([overall["soft"], *floors])
            s.history[f"floor/{name}/soft"] = spread.std(unbiased=False).item()
            out[f"eval/{name}/floor_soft"] = s.history[f"floor/{name}/soft"]
    return out


def _save_grid(s: Session, res: dict, metas: list[dict], filename: str) -> None:
    from flowcredit.evaluate import image_grid

    k = s.cfg.eval_samples_per_prompt
    n = min(len(metas), 8)
    rows = torch.tensor([i * k + j for i in range(n) for j in range(k)])
    grid = image_grid(res["images"][rows], [m["prompt"] for m in metas[:n]], k)
    grid.save(s.run_dir / filename)


def final_artifacts(s: Session, elapsed: float) -> dict:
    """Final weights (merged model + trainable tensors), summary.json, and the printed summary."""
    from safetensors.torch import save_file

    from flowcredit.runlog import read_metrics

    final = s.run_dir / "final"
    final.mkdir(exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in s.policy.trainable_state().items()},
        str(final / "trainable.safetensors"),
    )
    if hasattr(s.model, "save_final"):  # adapter-specific format (e.g. diffusers LoRA)
        s.model.save_final(s.policy, final)
    else:
        merged = type(s.model)(s.model.config)
        merged.net.load_state_dict(s.policy.merged_state_dict())
        merged.guidance_scale = s.model.guidance_scale
        merged.save(final)
    rows = read_metrics(s.run_dir)
    evals = [r for r in rows if "eval/test/soft" in r]
    summary = {"minutes": elapsed / 60, "iterations": rows[-1]["iteration"] if rows else 0}
    for name in ("test", "train"):
        if evals and f"eval/{name}/soft" in evals[0]:
            summary[name] = {
                "before": evals[0][f"eval/{name}/soft"],
                "after": evals[-1][f"eval/{name}/soft"],
                "best": max(r[f"eval/{name}/soft"] for r in evals),
                "noise_floor": s.history.get(f"floor/{name}/soft", math.nan),
            }
    (s.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"flowcredit: {summary['iterations']} iterations of {s.cfg.credit} in {summary['minutes']:.1f} min"
    ]
    for name in ("train", "test"):
        if name in summary:
            e = summary[name]
            lines.append(
                f"  eval {name:>5} (soft, ODE, fixed noise): before {e['before']:.3f} → after "
                f"{e['after']:.3f} (best {e['best']:.3f}); noise floor ±{e['noise_floor']:.3f}"
            )
    lines.append(f"  outputs in {s.run_dir}/ (metrics.jsonl, reward_curve.png, grid_*.png, final/)")
    print("\n".join(lines))
    return summary

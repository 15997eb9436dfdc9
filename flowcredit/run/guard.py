"""The reward-hacking guard of a training run (docs/guard.md): its signals at every evaluation, its
``best/`` checkpoint, and its action on an alarm (``GUARD_ACTION[cfg.guard]``).

At each evaluation :meth:`Guard.measure` scores the held-out samples with the trained reward and the
monitors (loaded then, dropped after), and measures diversity, saturation, colour drift,
high-frequency energy and weight drift (:mod:`flowcredit.guard_signals`); the start evaluation fixes the
references and the monitors' noise floors (std over its 3 noise seeds). :meth:`Guard.act` then
decides: an evaluation without alarm whose choosing score (the first monitor's, else the trained
reward's) beats the best so far becomes ``best/`` (the exported model, loadable with ``flowcredit
eval --checkpoint RUN/best``, and its training state in ``best/state``; written atomically); an
alarm warns, stops the run or rolls back to ``best/`` with ``lr × guard_lr_scale`` and
``β × guard_beta_scale``. The guard's state is JSON in the checkpoint's ``history`` (resume keeps it).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable

import torch
from tqdm import tqdm

from flowcredit.guard_signals import (
    MONITOR_RULES,
    colour_histogram,
    high_frequency_share,
    histogram_tv,
    sample_spread,
    saturation,
    thresholds_crossed,
    weight_drift,
)
from flowcredit.run.checkpoint import fresh_dir, load_checkpoint, swap_in
from flowcredit.run.outputs import export_final
from flowcredit.run.sharding import full_dict

START_FILE = "guard_start.safetensors"
"""The trainable weights at the start, kept in the run folder when ``guard_drift_max`` is set."""


def monitor_names(cfg) -> list[str]:
    """The monitors of ``cfg.guard_monitors``, in order."""
    return [m.strip() for m in cfg.guard_monitors.split(",") if m.strip()]


class Guard:
    """A run's guard; ``state`` is the JSON kept in ``s.history["guard"]``: the start's ``reference``
    signals and monitor ``floors``, each monitor's ``peak`` ``[value, trained reward then]``, ``best``
    (the checkpoint's iteration and score), ``alarms`` ``[[iteration, [signal, …]], …]``, ``streak``
    (evaluations in a row that alarmed: the action waits for ``guard_patience``), ``rollbacks`` and the
    β in force."""

    def __init__(self, s):
        self.cfg = s.cfg
        self.state = s.history.setdefault(
            "guard",
            {
                "reference": None,
                "floors": {},
                "peak": {},
                "best": None,
                "alarms": [],
                "streak": 0,
                "rollbacks": 0,
            },
        )
        self.state.setdefault("beta", s.cfg.beta)
        s.cfg = dataclasses.replace(s.cfg, beta=self.state["beta"])  # a resumed run keeps a raised β
        self.measured: dict | None = None  # this evaluation's scores and signals, until act()
        self.stopped = ""  # why the guard stopped the run

    def measure(self, s, images: torch.Tensor, metas: list[dict], floor_images=()) -> dict:
        """The ``guard/`` metrics of the held-out samples ``images (P·k, …)`` (prompt-major over
        ``metas``); at the start, ``floor_images``: the same prompts' samples on the 2 other noise seeds."""
        cfg, k = self.cfg, self.cfg.eval_samples_per_prompt
        scores = reward_means(s, [images, *floor_images], metas, k)  # name → [mean per noise seed]
        values = {"saturation": saturation(images), "high_freq": high_frequency_share(images)}
        if k >= 2:  # one sample per prompt has no spread (validation: guard_diversity_frac then 0)
            values["diversity"] = sample_spread(images, k)
        histogram = colour_histogram(images)
        st = self.state
        if st["reference"] is None:  # the start evaluation
            st["reference"] = {**values, "histogram": histogram.tolist()}
            st["floors"] = {n: torch.tensor(v).std(unbiased=False).item() for n, v in scores.items()}
            if cfg.guard_drift_max:
                save_start(s)
        values["histogram_tv"] = histogram_tv(histogram, st["reference"]["histogram"])
        if cfg.guard_drift_max:
            values["drift"] = drift_from_start(s)
        self.measured = {"scores": {n: v[0] for n, v in scores.items()}, "values": values}
        out = {f"guard/{n}": v[0] for n, v in scores.items()} | {f"guard/{n}": v for n, v in values.items()}
        if floor_images:
            out |= {f"guard/floor/{n}": f for n, f in st["floors"].items()}
        return out

    def alarms(self) -> dict[str, str]:
        """The signals that fire on the last measurement, each with its reason."""
        cfg, st = self.cfg, self.state
        scores, values = self.measured["scores"], self.measured["values"]
        fired = {}
        for name in monitor_names(cfg):
            if name not in st["peak"]:  # the start evaluation: nothing to fall from yet
                continue
            best, trained_then = st["peak"][name]
            floor = st["floors"][name]
            rule = MONITOR_RULES[cfg.guard_monitor_rule]
            if rule(scores[name], scores["trained"], best, trained_then, floor, cfg.guard_noise_mult):
                fired[name] = (
                    f"monitor {name} {scores[name]:.4f} < its best {best:.4f} − {cfg.guard_noise_mult:g} × "
                    f"floor {floor:.4f}; trained reward {scores['trained']:.4f}, {trained_then:.4f} then"
                )
        limits = {
            "diversity_frac": cfg.guard_diversity_frac,
            "saturation_delta": cfg.guard_saturation_delta,
            "histogram_tv": cfg.guard_histogram_tv,
            "high_freq_ratio": cfg.guard_high_freq_ratio,
            "drift_max": cfg.guard_drift_max,
        }
        return fired | thresholds_crossed(values, st["reference"], limits)

    def act(self, s, iteration: int) -> dict:
        """After an evaluation, on every rank (rank 0 decides, its decision is shared): keep ``best/``
        or act on the alarms. Returns ``guard/alarm`` (signals fired), ``guard/rollback``, ``guard/best``."""
        fired = self.alarms() if self.measured is not None else {}
        code = torch.tensor(float(len(fired) > 0 if s.dist.is_main else 0))
        alarm = s.dist.sum_(code).item() > 0  # FSDP: every rank measured; DDP: rank 0 alone
        out = {"guard/alarm": float(len(fired))}
        if not alarm:
            self.state["streak"] = 0
            if self.measured is not None:  # DDP: rank 0 alone measured, and alone writes
                out |= self.keep_if_best(s, iteration)
            self.measured = None
            return out
        self.state["alarms"].append([iteration, sorted(fired)])  # rank 0's list; others: []
        self.measured = None
        for reason in fired.values():
            say(s, f"guard: alarm at iteration {iteration}: {reason}")
        st = self.state
        st["streak"] = st.get("streak", 0) + 1  # evaluations in a row that alarmed
        if st["streak"] < self.cfg.guard_patience:
            return out
        st["streak"] = 0
        return out | GUARD_ACTION[self.cfg.guard](self, s, iteration)

    def keep_if_best(self, s, iteration: int) -> dict:
        """Raise the monitors' peaks; write ``best/`` if the choosing score beats the best so far."""
        scores, st = self.measured["scores"], self.state
        for name in monitor_names(self.cfg):
            if scores[name] > st["peak"].get(name, (-math.inf,))[0]:
                st["peak"][name] = [scores[name], scores["trained"]]
        chooser = (monitor_names(self.cfg) or ["trained"])[0]
        if st["best"] is not None and scores[chooser] <= st["best"]["score"]:
            return {}
        st["best"] = {"iteration": iteration, "score": scores[chooser], "by": chooser}
        write_best(s, iteration)
        return {"guard/best": 1.0}


def reward_means(s, image_sets: list[torch.Tensor], metas: list[dict], k: int) -> dict[str, list[float]]:
    """``trained`` and each monitor's mean score on each set of samples (a monitor is built here and
    dropped after: monitors hold memory only during evaluation)."""
    rows = [m for m in metas for _ in range(k)]
    prompts = [m["prompt"] for m in rows]
    rewards = {
        "trained": s.reward,
        **{n: s.named_reward(n) for n in monitor_names(s.cfg)},
    }
    out = {
        name: [float(fn(images, prompts, rows).mean()) for images in image_sets]
        for name, fn in rewards.items()
    }
    del rewards
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def write_best(s, iteration: int) -> None:
    """``run_dir/best``: the exported model (``flowcredit eval --checkpoint``) and, in ``state/``, the
    training state a rollback restores; swapped in atomically (every rank calls it under FSDP)."""
    best = s.run_dir / "best"
    tmp = fresh_dir(best.with_name("best.tmp")) if s.dist.is_main else best
    export_final(s, tmp)
    s.save(iteration, tmp / "state")
    if s.dist.is_main:
        swap_in(tmp, best)


def save_start(s) -> None:
    """Keep the trainable weights at the start (``guard_drift_max``), for resume too."""
    from safetensors.torch import save_file

    state = s.policy.trainable_state()
    state = full_dict(state) if s.dist.sharded else state
    if s.dist.is_main:
        save_file({k: v.cpu().contiguous() for k, v in state.items()}, str(s.run_dir / START_FILE))
    s.dist.barrier()


def drift_from_start(s) -> float:
    """:func:`flowcredit.guard_signals.weight_drift` of the trained weights from :data:`START_FILE`."""
    from safetensors.torch import load_file

    start = load_file(str(s.run_dir / START_FILE))
    now = s.policy.trainable_state()
    now = full_dict(now) if s.dist.sharded else now
    return weight_drift([now[k].cpu() for k in sorted(start)], [start[k] for k in sorted(start)])


def say(s, message: str) -> None:
    """A line above the training bar (rank 0)."""
    if s.dist.is_main:
        tqdm.write(f"flowcredit: {message}", file=sys.stdout)


def warn(guard: Guard, s, iteration: int) -> dict:
    """``warn``: the alarm is logged (``guard/alarm``) and marked on the curves; training goes on."""
    return {}


def stop(guard: Guard, s, iteration: int) -> dict:
    """``stop``: the run ends after this iteration (``best/`` holds its best model)."""
    guard.stopped = f"guard (alarm at iteration {iteration})"
    best = guard.state["best"] or {}
    say(s, f"guard: stopping; the best model is {s.run_dir / 'best'} (iteration {best.get('iteration')})")
    return {"guard/stop": 1.0}


def rollback(guard: Guard, s, iteration: int) -> dict:
    """``rollback``: restore ``best/``'s weights, optimizer state and EMA, multiply the learning rate by
    ``guard_lr_scale`` and β by ``guard_beta_scale``, and go on; past ``guard_max_rollbacks``, stop."""
    st, cfg = guard.state, guard.cfg
    if st["rollbacks"] >= cfg.guard_max_rollbacks:
        return stop(guard, s, iteration)
    s.restore_training(load_checkpoint(s.run_dir / "best" / "state"))
    st["rollbacks"] += 1
    st["last_rollback"] = iteration
    for group in s.optimizer.param_groups:
        group["lr"] = cfg.lr * cfg.guard_lr_scale ** st["rollbacks"]
    st["beta"] = cfg.beta * cfg.guard_beta_scale ** st["rollbacks"]
    s.cfg = dataclasses.replace(s.cfg, beta=st["beta"])
    lr, best = s.optimizer.param_groups[0]["lr"], (st["best"] or {}).get("iteration")
    n, most = st["rollbacks"], cfg.guard_max_rollbacks
    say(s, f"guard: rolled back to best/ (iteration {best}); lr {lr:.3g}, β {st['beta']:.3g} ({n} of {most})")
    return {"guard/rollback": float(st["rollbacks"])}


GUARD_ACTION: dict[str, Callable[[Guard, object, int], dict]] = {
    "warn": warn,
    "stop": stop,
    "rollback": rollback,
}
"""The guard's actions by ``cfg.guard`` (``off``: no guard is built)."""

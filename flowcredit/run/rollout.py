"""Model-agnostic rollouts and the state values a credit method needs (docs/algorithms.md §3 and
docs/training.md, "One iteration", steps 1–3).

An iteration's draws (prompts, initial noise) come from :func:`seeded` generators, so a resumed run
draws exactly what the uninterrupted one would have. A rollout stores every state ``x_0 … x_N``
and ``logp_old``; values are computed only for the states the method needs, all completions of all
trajectories batched in lock-step, then decoded and scored in one reward call. With an estimator that
follows the schedule (``ode_remaining``), a state whose step is deterministic (std 0 on every row: ODE
steps outside the SDE window, the last step of cps / ddim_sde) has ``V_i = V_{i+1}`` exactly, so it
is copied, not recomputed. A method with ``needs="similarity"`` (CoCA) gets, in place of ``V_0 …
V_{N−1}``, the cosine of each state's one-step clean prediction to the final latent, from the
velocities the rollout kept (:func:`rollout_keeps`): no model call and no reward call of its own.
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from flowcredit.config import Config, trained_window
from flowcredit.contribution import similarity_to_final
from flowcredit.values import ESTIMATORS, complete


def seeded(seed: int, iteration: int, purpose: int) -> torch.Generator:
    """A generator for one purpose of one iteration (no state to checkpoint).

    Purposes: 0 prompts, 1 initial noise, 2 SDE noise, 3 update order.
    """
    return torch.Generator().manual_seed(seed * 1_000_003 + iteration * 101 + purpose)


@dataclass
class Batch:
    """One iteration's rows on this rank: ``metas``/``prompts`` of its groups, ``group (b,)`` (index
    into ``prompts``), the initial noise ``x0 (b, C, H, W)`` and ``rows = (total, lo, hi)``, where
    they sit in the batch of all ranks."""

    metas: list[dict]
    prompts: list[str]
    group: torch.Tensor
    x0: torch.Tensor
    rows: tuple[int, int, int]


def draw_batch(
    metas: list[dict],
    num_prompts: int,
    group_size: int,
    latent_shape: tuple[int, ...],
    shared_noise: bool,
    seed: int,
    iteration: int,
    world: int = 1,
    rank: int = 0,
    weights: list[float] | None = None,
) -> Batch:
    """Draw ``num_prompts`` prompts (with replacement; with probability ∝ ``weights``, uniform when
    None) and the initial noise of all their rows, then keep this rank's whole groups.

    The draw of all ``B = num_prompts · group_size`` rows is the same on every rank, so ranks together
    hold exactly the rows of a single-process run. ``shared_noise``: one x₀ per group.
    """
    gen = seeded(seed, iteration, 0)
    if weights is None:
        pick = torch.randint(len(metas), (num_prompts,), generator=gen)
    else:
        pick = torch.multinomial(torch.tensor(weights, dtype=torch.float64), num_prompts, True, generator=gen)
    per_rank = num_prompts // world
    mine_prompts = [metas[i] for i in pick[rank * per_rank : (rank + 1) * per_rank].tolist()]
    group_all = torch.arange(num_prompts).repeat_interleave(group_size)  # (B,) group of each row
    n_noise = num_prompts if shared_noise else len(group_all)
    x0 = torch.randn((n_noise, *latent_shape), generator=seeded(seed, iteration, 1))
    x0 = x0[group_all] if shared_noise else x0
    mine = (group_all >= rank * per_rank) & (group_all < (rank + 1) * per_rank)
    prompts = [m["prompt"] for m in mine_prompts]
    lo = rank * per_rank * group_size
    rows = (len(group_all), lo, lo + per_rank * group_size)
    return Batch(mine_prompts, prompts, group_all[mine] - rank * per_rank, x0[mine], rows)


def noise_levels(cfg: Config, psi: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step sampler levels ``(N,)`` (0 = ODE step) and the trained mask ``(N,)``.

    Inside the SDE window the level is ``cfg.noise_level``, or ψ_i when a calibrated ``psi (N,)`` is
    given (DenseGRPO); outside it is 0.
    """
    w, k = trained_window(cfg)
    trained = torch.zeros(cfg.num_steps, dtype=torch.bool)
    trained[w : w + k] = True
    levels = torch.where(trained, torch.full((cfg.num_steps,), cfg.noise_level), torch.zeros(cfg.num_steps))
    if psi is not None:
        levels = torch.where(trained, psi, torch.zeros_like(psi))
    return levels, trained


@dataclass
class Rollout:
    """``states (B, N + 1, C, H, W)``, ``logp (B, N)``, ``std (B, N)`` (0 on deterministic steps)."""

    states: torch.Tensor
    logp: torch.Tensor
    std: torch.Tensor
    velocities: torch.Tensor | None = None
    """``(B, N, C, H, W)``: the velocity the rollout computed at each state (``keep_velocity``)."""
    means: torch.Tensor | None = None
    """``(B, N, C, H, W)``: the mean of each step's Gaussian transition (``keep_mean``)."""
    uncond: torch.Tensor | None = None
    """``(B, N, C, H, W)``: CFG's unconditional velocity at each state (``keep_uncond``)."""


def chunked_velocity(model, x, sigma, cond, group, batch_size: int) -> torch.Tensor:
    """``model.velocity`` over ``x (b, …)`` in chunks of ``batch_size`` rows; ``group (b,)`` indexes
    ``cond``."""
    out = []
    for lo in range(0, x.shape[0], batch_size):
        hi = lo + batch_size
        out.append(model.velocity(x[lo:hi], sigma[lo:hi], cond[group[lo:hi]]))
    return torch.cat(out)


@torch.no_grad()
def rollout(
    model,
    cond,
    group,
    x0,
    sigmas,
    levels,
    step_fn,
    generator,
    logp_mode="gaussian",
    batch_size=64,
    rows: tuple[int, int, int] | None = None,
    keep_velocity: bool = False,
    keep_mean: bool = False,
    keep_uncond: bool = False,
) -> Rollout:
    """Sample ``B`` trajectories with ``step_fn`` and per-step noise ``levels (N,)`` (0 = ODE step).

    Args:
        cond: the model's encoding of the unique prompts; ``group (B,)`` maps each row to its prompt.
        x0: ``(B, C, H, W)`` initial noise. sigmas: ``(N + 1,)``. generator: the SDE noise source.
        rows: ``(total, lo, hi)``: these ``B`` rows are rows ``lo … hi − 1`` of a batch of ``total``.
            Every step then draws the noise of all ``total`` rows and keeps this slice, so a row's
            noise depends on the seed and its global index only, not on how the batch is split
            over processes. None: ``(B, 0, B)``, the same draws.
        keep_velocity: also return the velocity of every step (one-step values reuse it).
        keep_mean: also return every step's transition mean (GRPO-Guard's ratio needs the old one).
        keep_uncond: also return CFG's unconditional velocity of every step (``cfg_uncond_grad`` off:
            the update's first pass reuses it, :meth:`flowcredit.models.FlowModelBase.guided_pair`).
    """
    b, n = x0.shape[0], sigmas.numel() - 1
    total, lo, hi = rows or (b, 0, b)
    if hi - lo != b:
        raise ValueError(f"rows {rows} do not match the {b} rows of x0")
    states, logps, stds, velocities, means, unconds = [x0.float()], [], [], [], [], []
    x = states[0]
    for i in range(n):
        sigma = sigmas[i].expand(b)
        if keep_uncond:
            v, uncond = recorded_velocity(model, x, sigma, cond, group, batch_size)
            unconds.append(uncond)
        else:
            v = chunked_velocity(model, x, sigma, cond, group, batch_size)
        if keep_velocity:
            velocities.append(v.float())
        noise = torch.randn((total, *x.shape[1:]), generator=generator, dtype=torch.float32)[lo:hi]
        step = step_fn(
            v,
            x,
            sigmas[i].item(),
            sigmas[i + 1].item(),
            float(levels[i]),
            noise=noise.to(x.device),
            logp_mode=logp_mode,
        )
        x = step.x_next
        states.append(x)
        logps.append(step.logp)
        stds.append(step.std)
        if keep_mean:
            means.append(step.mean.float())
    kept = torch.stack(velocities, 1) if keep_velocity else None
    kept_means = torch.stack(means, 1) if keep_mean else None
    ro = Rollout(torch.stack(states, 1), torch.stack(logps, 1), torch.stack(stds, 1), kept, kept_means)
    ro.uncond = torch.stack(unconds, 1) if keep_uncond and all(u is not None for u in unconds) else None
    return ro


@contextlib.contextmanager
def uncond_given(model, uncond: torch.Tensor | None):
    """Inside: ``model``'s guided calls under gradient take ``uncond`` as CFG's unconditional
    velocity instead of running its pass (None: no effect)."""
    if uncond is None:
        yield
        return
    model.uncond_given = uncond
    try:
        yield
    finally:
        model.uncond_given = None


def recorded_velocity(model, x, sigma, cond, group, batch_size: int):
    """:func:`chunked_velocity` and the unconditional velocity its guided calls computed ``(b, …)``,
    recorded through the adapter's ``uncond_record`` (None if its calls record none)."""
    model.uncond_record = []
    try:
        v = chunked_velocity(model, x, sigma, cond, group, batch_size)
        record = model.uncond_record
    finally:
        model.uncond_record = None
    if sum(len(u) for u in record) != len(x):  # an adapter without guided_pair: nothing to reuse
        return v, None
    return v, torch.cat(record).float().to(x.device)


def rollout_keeps(needs: str) -> dict:
    """The :func:`rollout` options a credit method's ``needs`` asks for: ``"similarity"`` keeps the
    velocities (its clean predictions ``x − σ·v`` then cost no model call)."""
    return {"keep_velocity": True} if needs == "similarity" else {}


def needed_states(needs: str, trained: torch.Tensor) -> torch.Tensor:
    """Bool ``(N + 1,)``, the states whose reward a method needs: ``V_N`` always; with
    ``needs="states"`` also both ends of every trained step (``"similarity"`` scores ``V_N`` only).

    ``needs`` is a credit method's :attr:`flowcredit.advantages.Credit.needs`.
    """
    n = trained.numel()
    need = torch.zeros(n + 1, dtype=torch.bool)
    need[n] = True
    if needs == "states":
        need[:n] |= trained
        need[1:] |= trained
    return need


def plan_completions(need: torch.Tensor, deterministic: torch.Tensor, estimator: str):
    """Which states to complete, and which to copy from the next state (``V_i = V_{i+1}``).

    Copied: with an estimator that follows the schedule, the start state of any deterministic step (its
    completion passes through the next state); with any estimator, a state whose remaining steps are
    all deterministic (anchoring: the sampled image *is* its completion, so ``V_i = V_N`` exactly and
    the gains of a window telescope to ``V_N − V_w``).

    Args:
        need: ``(N + 1,)`` bool, the states whose value the method needs.
        deterministic: ``(N,)`` bool, steps with std 0 on every row.
    Returns:
        ``(compute (N + 1,) bool, copy (N + 1,) bool)``; ``V_N`` is always scored directly.
    """
    need = need.clone()
    n = need.numel() - 1
    copy = torch.zeros_like(need)
    tail = deterministic.flip(0).cumprod(0).flip(0).bool()  # (N,): steps i … N − 1 all deterministic
    by_step = deterministic if ESTIMATORS[estimator].follows_schedule else tail
    for i in range(n):  # ascending, so chains of deterministic steps propagate
        if need[i] and by_step[i]:
            copy[i] = True
            need[i + 1] = True
    compute = need & ~copy
    compute[n] = False
    return compute, copy


def reuses_velocity(ro: Rollout, estimator: str, substeps: int) -> bool:
    """Whether the values are one-step estimates (``euler``, k = 1) from the rollout's own velocities."""
    return ro.velocities is not None and estimator == "euler" and substeps == 1


def one_step_clean(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``x̂0 = x − σ·v`` for states ``x (M, …)`` with their velocities ``v (M, …)`` at ``σ (M,)``: the
    ``euler(1)`` completion (one Euler step from σ to 0), with the velocity the rollout computed
    (policy weights unmerged, so it differs from a merged completion by float round-off only)."""
    return x - sigma.to(x).view(-1, *([1] * (x.dim() - 1))) * v


@torch.no_grad()
def state_values(
    model, cond, group, ro: Rollout, sigmas, needs, trained, estimator, substeps, score, batch_size=64
):
    """``V (B, N + 1)``: NaN where the method does not need a value (``needs``: see :func:`needed_states`).

    ``score(images (M, 3, H, W), row_index (M,)) -> rewards (M,)`` is called twice: on the ``B``
    final images, in a background thread while the completions run (a reward outside torch then
    costs no wall time), and on all completions at once. One-step values (``euler``, k = 1) of a
    rollout that kept its velocities (:func:`reuses_velocity`) need no model call. Returns
    ``(values, nfe)`` with ``nfe`` = model calls × rows.
    """
    b, n = ro.logp.shape
    deterministic = (ro.std == 0).all(dim=0)  # (N,)
    compute, copy = plan_completions(needed_states(needs, trained), deterministic, estimator)
    states_idx = torch.nonzero(compute, as_tuple=True)[0]  # (S,)
    row_of = torch.arange(b).repeat_interleave(len(states_idx))  # (B·S,)
    start = states_idx.repeat(b)
    nfe = [0]

    def velocity(x, sigma, live):
        nfe[0] += x.shape[0]
        return chunked_velocity(model, x, sigma, cond, group[row_of[live]], batch_size)

    values = torch.full((b, n + 1), math.nan)
    finals = model.decode(ro.states[:, -1])
    with ThreadPoolExecutor(max_workers=1) as pool:
        final_rewards = pool.submit(score, finals, torch.arange(b))
        clean = None
        if len(start) and reuses_velocity(ro, estimator, substeps):  # x̂0 = x − σ·v, no model call
            clean = one_step_clean(ro.states[row_of, start], ro.velocities[row_of, start], sigmas[start])
        elif len(start):
            clean = complete(
                velocity, ro.states[row_of, start], sigmas, start, estimator, substeps, with_rows=True
            )
        values[:, n] = final_rewards.result()
    if clean is not None:
        values[row_of, start] = score(model.decode(clean), row_of)
    for i in range(n - 1, -1, -1):
        if copy[i]:
            values[:, i] = values[:, i + 1]
    if needs == "similarity":  # CoCA: c_0 … c_{N−1} in place of V_0 … V_{N−1}
        similarities, calls = clean_similarities(model, cond, group, ro, sigmas, batch_size)
        values[:, :n], nfe[0] = similarities.to(values), nfe[0] + calls
    return values, nfe[0]


def clean_similarities(model, cond, group, ro: Rollout, sigmas, batch_size: int = 64):
    """CoCA's ``c (B, N)``: ``cos(x̂0_i, x_N)`` with ``x̂0_i = x_i − σ_i·v_i`` at every state ``i < N``
    (:func:`one_step_clean`), from the rollout's own velocities when it kept them (no model call),
    else from one call per state. Returns ``(c, nfe)`` with ``nfe`` = model calls × rows (0 or B·N)."""
    b, n = ro.logp.shape
    x = ro.states[:, :n].flatten(0, 1)  # (B·N, …) state i of row b at b·N + i
    sigma = sigmas[:n].to(torch.float32).repeat(b)  # (B·N,)
    if ro.velocities is not None:
        v, calls = ro.velocities.flatten(0, 1), 0
    else:
        v = chunked_velocity(model, x, sigma, cond, group.repeat_interleave(n), batch_size).float()
        calls = b * n
    clean = one_step_clean(x, v, sigma).view(b, n, *x.shape[1:])  # (B, N, …)
    return similarity_to_final(clean, ro.states[:, n]), calls

"""Model-agnostic rollouts and the state values a credit method needs (SPEC §4, §7 steps 2–3).

A rollout stores every state ``x_0 … x_N`` and ``logp_old``; values are computed only for the states
the method needs, all completions of all trajectories batched in lock-step, then decoded and scored
in one reward call. With ``ode_remaining``, a state whose step is deterministic (std 0 on every row:
ODE steps outside the SDE window, the last step of cps / ddim_sde) has ``V_i = V_{i+1}`` exactly,
so it is copied, not recomputed.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from flowcredit.values import complete


@dataclass
class Rollout:
    """``states (B, N + 1, C, H, W)``, ``logp (B, N)``, ``std (B, N)`` (0 on deterministic steps)."""

    states: torch.Tensor
    logp: torch.Tensor
    std: torch.Tensor


def chunked_velocity(model, x, sigma, cond, rows, batch_size: int) -> torch.Tensor:
    """``model.velocity`` over ``x (b, …)`` in chunks of ``batch_size`` rows; ``rows (b,)`` index ``cond``."""
    out = []
    for lo in range(0, x.shape[0], batch_size):
        hi = lo + batch_size
        out.append(model.velocity(x[lo:hi], sigma[lo:hi], cond[rows[lo:hi]]))
    return torch.cat(out)


@torch.no_grad()
def rollout(
    model, cond, rows, x0, sigmas, levels, step_fn, generator, logp_mode="gaussian", batch_size=64
) -> Rollout:
    """Sample ``B`` trajectories with ``step_fn`` and per-step noise ``levels (N,)`` (0 = ODE step).

    Args:
        cond: the model's encoding of the unique prompts; ``rows (B,)`` maps each row to its prompt.
        x0: ``(B, C, H, W)`` initial noise. sigmas: ``(N + 1,)``. generator: the SDE noise source.
    """
    b, n = x0.shape[0], sigmas.numel() - 1
    states, logps, stds = [x0.float()], [], []
    x = states[0]
    for i in range(n):
        sigma = sigmas[i].expand(b)
        v = chunked_velocity(model, x, sigma, cond, rows, batch_size)
        step = step_fn(
            v,
            x,
            sigmas[i].item(),
            sigmas[i + 1].item(),
            float(levels[i]),
            generator=generator,
            logp_mode=logp_mode,
        )
        x = step.x_next
        states.append(x)
        logps.append(step.logp)
        stds.append(step.std)
    return Rollout(torch.stack(states, 1), torch.stack(logps, 1), torch.stack(stds, 1))


def needed_states(credit: str, trained: torch.Tensor) -> torch.Tensor:
    """Bool ``(N + 1,)``: ``V_N`` always; dense methods also both ends of every trained step."""
    n = trained.numel()
    need = torch.zeros(n + 1, dtype=torch.bool)
    need[n] = True
    if credit != "flow_grpo":
        need[:n] |= trained
        need[1:] |= trained
    return need


def plan_completions(need: torch.Tensor, deterministic: torch.Tensor, estimator: str):
    """Which states to complete, and which to copy from the next state (``ode_remaining`` only).

    Returns ``(compute (N + 1,) bool, copy (N + 1,) bool)``; ``V_N`` is always scored directly.
    """
    need = need.clone()
    n = need.numel() - 1
    copy = torch.zeros_like(need)
    if estimator == "ode_remaining":
        for i in range(n):  # ascending, so chains of deterministic steps propagate
            if need[i] and deterministic[i]:
                copy[i] = True
                need[i + 1] = True
    compute = need & ~copy
    compute[n] = False
    return compute, copy


@torch.no_grad()
def state_values(
    model, cond, rows, ro: Rollout, sigmas, credit, trained, estimator, substeps, score, batch_size=64
):
    """``V (B, N + 1)``: NaN where the method does not need a value.

    ``score(images (M, 3, H, W), row_index (M,)) -> rewards (M,)`` is called twice: on the ``B``
    final images, in a background thread while the completions run (a reward outside torch then
    costs no wall time), and on all completions at once. Returns ``(values, nfe)`` with ``nfe`` =
    model calls × rows.
    """
    b, n = ro.logp.shape
    deterministic = (ro.std == 0).all(dim=0)  # (N,)
    compute, copy = plan_completions(needed_states(credit, trained), deterministic, estimator)
    states_idx = torch.nonzero(compute, as_tuple=True)[0]  # (S,)
    row_of = torch.arange(b).repeat_interleave(len(states_idx))  # (B·S,)
    start = states_idx.repeat(b)
    nfe = [0]

    def velocity(x, sigma, live):
        nfe[0] += x.shape[0]
        return chunked_velocity(model, x, sigma, cond, rows[row_of[live]], batch_size)

    values = torch.full((b, n + 1), math.nan)
    finals = model.decode(ro.states[:, -1])
    with ThreadPoolExecutor(max_workers=1) as pool:
        final_rewards = pool.submit(score, finals, torch.arange(b))
        clean = None
        if len(start):
            clean = complete(
                velocity, ro.states[row_of, start], sigmas, start, estimator, substeps, with_rows=True
            )
        values[:, n] = final_rewards.result()
    if clean is not None:
        values[row_of, start] = score(model.decode(clean), row_of)
    for i in range(n - 1, -1, -1):
        if copy[i]:
            values[:, i] = values[:, i + 1]
    return values, nfe[0]

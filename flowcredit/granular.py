"""G²RPO, "Granular-GRPO" / "Fine-Grained GRPO" (arXiv 2510.01982): singular stochastic sampling on
branches and multi-granularity advantage integration (docs/algorithms.md, "G²RPO"). This module holds
the math (completion grids, their network calls, the integration) and the step schedule ``g2rpo``
(registered in :mod:`flowcredit.step_schedules`); the rollout is
:func:`flowcredit.run.granular_plans.with_completions`.

Source: bcmi/Granular-GRPO at 04ee954 (training part unchanged at ef6ec9f), ``fastvideo/train_g2rpo_hps.py``
(line numbers ≈, ±10: read through a viewer without numbers):

* ``sample_reference_model`` (≈L300-520): per prompt, one *anchor* ODE trajectory from one shared
  noise (``init_same_noise``, ≈L345; ``run_anchor_sample_step`` ≈L145, ``eta=0``). For each step ``k``
  of ``eta_step_list`` each of the ``num_generations`` rows takes ONE Flow-SDE step from the anchor's
  ``x_k`` (``run_sde_sample_step`` ≈L190, ``flow_grpo_step`` L63-101 at ``eta``), then for each ``g`` of
  ``granular_list`` the ODE on ``cat(σ[:k+2], σ[k+2::g])`` from ``x_{k+1}`` (≈L420-430;
  ``run_ode_sample_step`` ≈L235 runs ``range(k + 1, len − 1)`` and returns the last step's clean
  prediction ``x − σ·v``: the completion's last σ is replaced by 0, :func:`completion_grid`). Each
  completion is scored.
* ``train_one_step`` (≈L545-720): per granularity and reward model, the z-score over the
  ``num_generations`` rows of a prompt at each step (``(r − mean)/(std + 1e-8)``, ``torch.std``:
  unbiased), summed over granularities (and over the two reward models of ``_hps_clip``); clipped to
  ``±adv_clip_max`` (5.0) when used; only the SDE transition at ``k`` is trained (clip 1e-4).
* ``scripts/finetune/finetune_g2rpo_hps.sh``: 16 steps, shift 3, ``eta`` 0.7, ``num_generations`` 12,
  ``eta_step_list`` 0–7 (the first half), ``granular_list`` 1 2, lr 2e-6.

Deviations:
1. The rows' z-scores use the library's ``flow_grpo`` credit (population std, eps 1e-4, each z clipped
   to ±``adv_clip`` before the sum; a z-score of n rows is at most √(n − 1), so that clip is inert
   below 26 rows).
2. One noise per prompt group (``shared_noise``); the code draws one per rank and batch.
3. The branch steps are the first ``⌊fraction·N⌋`` (``fraction`` 0.5: 0–4 of our 10; theirs 0–7 of 16).
4. The widths must start with 1: the fine completion is the branch itself (every published run: 1 2).
5. One PPO update over all branch steps (the library's micro-batches); the code takes one optimizer
   step per branch step ``k``.
"""

from __future__ import annotations

import torch

from flowcredit.step_plan import GranularShape, StepPlan

__all__ = ["INTEGRATIONS", "check_g2rpo", "completion_grid", "g2rpo", "granular_calls", "granular_credit"]
__all__ += ["completion_positions", "integrate_granular", "parse_widths"]


def completion_grid(sigmas: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """``(L,)``: the ODE grid of G²RPO's completion at granularity ``width`` after the SDE step ``k``.

    ``c = [σ_{k+1}, σ_{k+2}, σ_{k+2+w}, σ_{k+2+2w}, …]`` (the code's ``cat(σ[:k+2], σ[k+2::g])`` from
    ``k + 1``), its last entry replaced by 0: the code returns the last step's clean prediction
    ``x − σ·v``, an Euler step to σ = 0 (a no-op replacement when ``w`` divides ``M − k − 2``).
    ``width`` 1 is the plan's own grid ``σ_{k+1} … σ_M``. Needs ``0 ≤ k ≤ M − 2``.
    """
    m = sigmas.numel() - 1
    if not 0 <= k <= m - 2 or width < 1:
        raise ValueError(f"completion_grid: step {k} of {m} needs 0 <= k <= M - 2, width {width} >= 1")
    grid = torch.cat([sigmas[k + 1 : k + 2], sigmas[k + 2 :: width]]).clone()  # (L,)
    grid[-1] = 0.0
    return grid


def completion_positions(m: int, k: int, width: int) -> torch.Tensor:
    """``(M − k,)`` int64: for each state ``i = k+1 … M`` of the plan's grid, the index into the
    completion's states (:func:`completion_grid`) that stands for it: the latest completion state at or
    before ``σ_i`` ("held"), the last one (the clean prediction) at ``i = M``."""
    last = (m - k - 2) // width + 1  # the completion's last state (its grid has last + 1 entries)
    i = torch.arange(k + 1, m + 1)
    pos = torch.where(i == k + 1, torch.zeros_like(i), 1 + (i - k - 2).clamp(min=0) // width)
    return torch.where(i == m, torch.full_like(i, last), pos.clamp(max=max(last - 1, 0)))


def granular_calls(sigmas: torch.Tensor, steps: list[int], widths: tuple[int, ...]) -> int:
    """Network calls per row of the coarse completions (every width but the first, 1, whose completion
    is the branch's own ODE): ``Σ_k Σ_{w > 1} (L_{k,w} − 1)``."""
    return sum(completion_grid(sigmas, k, w).numel() - 1 for k in steps for w in widths[1:])


def integrate_sum(z: torch.Tensor) -> torch.Tensor:
    """``A = Σ_g z_g`` over the last dim (the code's ``hps_advantages += group_advantages``)."""
    return z.sum(dim=-1)


def integrate_mean(z: torch.Tensor) -> torch.Tensor:
    """``A = (1/G) Σ_g z_g`` (ours: the sum's scale grows with G; the mean keeps a z-score's)."""
    return z.mean(dim=-1)


INTEGRATIONS = {"sum": integrate_sum, "mean": integrate_mean}
"""How a branch's per-granularity z-scores ``z (…, G)`` combine into one advantage (by name)."""


def integrate_granular(z: torch.Tensor, integration: str = "sum", clip: float = 5.0) -> torch.Tensor:
    """``clip(INTEGRATIONS[integration](z), −clip, clip)``: ``z (…, G)`` → ``(…)``."""
    return INTEGRATIONS[integration](z).clamp(-clip, clip)


def granular_credit(adv: torch.Tensor, shape: GranularShape, steps: int) -> torch.Tensor:
    """A G²RPO rollout's advantages ``adv (B·K·G, M)`` (rows ``(r, k, g)``, ``g`` fastest; each the
    z-score of its completion among its ``(group, k, g)`` rows) → ``(B·K·G, M)``: each ``(r, k)``'s
    integrated advantage on its first row ``g = 0`` (the one that trains), 0 on the others."""
    g = len(shape.widths)
    z = adv.view(-1, steps, g, adv.shape[-1])  # (B, K, G, M)
    out = torch.zeros_like(z)
    out[:, :, 0] = integrate_granular(z.transpose(2, 3), shape.integration, shape.clip)  # (B, K, M)
    return out.view_as(adv)


def parse_widths(widths: str) -> tuple[int, ...]:
    """``"1,2"`` → ``(1, 2)``; a one-line ``ValueError`` naming the option otherwise."""
    try:
        return tuple(int(w) for w in widths.split(","))
    except ValueError:
        raise ValueError(
            f"step schedule 'g2rpo': option 'widths' must be like '1,2', got {widths!r}"
        ) from None


def g2rpo(
    sigmas, *, level, iteration, total, generator, fraction=0.5, widths="1,2", integration="sum", clip=5.0
) -> StepPlan:
    """G²RPO's plan: a branch plan (ODE trunk per group, one Flow-SDE step per branch step ``k``, the
    ODE to the end) on the first ``⌊fraction·N⌋`` steps (the code's ``eta_step_list`` 0–7 of 16), each
    branch also completed at the coarser ``widths`` (:func:`completion_grid`); the advantages of the
    widths combine by ``integration``, clipped to ``±clip`` (the config's ``adv_clip``)."""
    n = sigmas.numel() - 1
    count = int(n * fraction)
    if not 1 <= count <= n - 1:
        raise ValueError(f"step schedule 'g2rpo': option 'fraction' {fraction} gives {count} of {n} steps")
    sde = torch.zeros(n, dtype=torch.bool)
    sde[:count] = True
    shape = GranularShape(parse_widths(widths), integration, float(clip))
    return StepPlan(sigmas, sde, sde.clone(), torch.arange(n + 1), branch=True, granular=shape)


def check_g2rpo(o: dict) -> None:
    """The options' check: ``0 < fraction ≤ 1``, widths increasing from 1, a known integration, clip > 0."""
    w = parse_widths(o["widths"])
    if not 0 < o["fraction"] <= 1:
        raise ValueError(f"step schedule 'g2rpo': option 'fraction' must lie in (0, 1], got {o['fraction']}")
    if w[0] != 1 or any(a >= b for a, b in zip(w, w[1:])):
        raise ValueError(f"step schedule 'g2rpo': option 'widths' must increase from 1, got {o['widths']!r}")
    if o["integration"] not in INTEGRATIONS:
        raise ValueError(f"step schedule 'g2rpo': option 'integration' must be one of {sorted(INTEGRATIONS)}")
    if not o["clip"] > 0:
        raise ValueError(f"step schedule 'g2rpo': option 'clip' must be > 0, got {o['clip']}")

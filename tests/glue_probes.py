"""What the newer methods' loop-glue tests (``test_loop_plans.py``, ``test_loop_updates.py``) share: a
small session, the sampler written out with the Flow-SDE formulas of docs/algorithms.md §1
(``g = a·√(σ/(1 − σ̃))``, σ̃ = σ' at σ = 1), the iteration's rollout as ``grpo_iteration`` draws it,
and probes of the gradients and of the old policy.

Sizes: 4 steps σ = 1, .75, .5, .25, 0 (shift 1), 2 groups of 2 rows.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from loop_probes import small_session

from flowcredit.run.plans import iteration_plan, levels_of, sample
from flowcredit.run.rollout import seeded

SIZE = dict(num_steps=4, prompts_per_iter=2, group_size=2, batch_size=64, beta=0.0, max_grad_norm=1e9)
SIZE["guidance_scale"] = 1.0  # one network pass per call (the glue is the same with CFG's two)
GRID = [1.0, 0.75, 0.5, 0.25, 0.0]  # the tiny model's σ grid at 4 steps
# E-GRPO at horizon 0.75: step 0 alone (entropy 1.06 ≥ 1), steps 1–2 merged into σ .75 → .25 (0.92 < 1 ≤ 1.27)
MERGE, MERGED_GRID = '{"horizon": 0.75}', [1.0, 0.75, 0.25, 0.0]


def session(preset: str, tmp_path, **extra):
    return small_session(preset, tmp_path / "run", **{**SIZE, **extra})


# --- the sampler written out (Flow-SDE, docs/algorithms.md §1) ---------------------------------------


def flow_std(sigma: float, sigma_next: float, a: float) -> float:
    """``g·√(σ − σ')`` with ``g = a·√(σ/(1 − σ̃))``."""
    tilde = sigma_next if sigma >= 1.0 else sigma
    return a * math.sqrt(sigma / (1.0 - tilde)) * math.sqrt(sigma - sigma_next)


def flow_mean(v, x, sigma: float, sigma_next: float, a: float) -> torch.Tensor:
    """``x + dt·[v + g²/(2σ)·(x + (1 − σ)·v)]``."""
    tilde = sigma_next if sigma >= 1.0 else sigma
    g2 = a * a * sigma / (1.0 - tilde)
    return x + (sigma_next - sigma) * (v + g2 / (2.0 * sigma) * (x + (1.0 - sigma) * v))


def gauss_logp(x_next, mean, std: float) -> torch.Tensor:
    """``mean_d[−(x' − μ)²/(2s²)] − log s − ½·log 2π``, ``(B,)``."""
    sq = ((x_next - mean) ** 2).flatten(1).mean(1)
    return -sq / (2.0 * std**2) - math.log(std) - 0.5 * math.log(2.0 * math.pi)


def velocity(s, x, sigma, cond_rows) -> torch.Tensor:
    """The policy's velocity at ``x (b, …)``; ``sigma`` a float or ``(b,)``."""
    return s.model.velocity(x, torch.as_tensor(sigma, dtype=torch.float32).expand(len(x)), cond_rows)


def rollout_of(s, it: int = 0):
    """The iteration's batch, its encoding, plan, levels and :func:`sample` (what ``grpo_iteration`` does)."""
    batch = s.draw(it)
    with torch.no_grad():
        cond = s.model.encode(batch.prompts)
    plan = iteration_plan(s.cfg, s.sigmas, it)
    levels = levels_of(plan, s.cfg, s.psi)
    args = (s.model, cond, batch.group, batch.x0, plan, levels, s.step_fn, seeded(s.cfg.seed, it, 2))
    sam = sample(*args, batch.rows, **s.rollout_opts)
    return batch, cond, plan, levels, sam


def grads_at_optimizer_steps(s) -> list[list[torch.Tensor]]:
    """Replace ``s.optimizer.step`` by a spy that records every parameter's gradient and does not step."""
    seen: list[list[torch.Tensor]] = []
    s.optimizer.step = lambda *a, **k: seen.append(
        [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in s.params]
    )
    return seen


@contextmanager
def weights(s, values: list[torch.Tensor]):
    """Run with ``values`` copied into the trainable parameters (restored after)."""
    kept = [p.detach().clone() for p in s.params]
    with torch.no_grad():
        for p, v in zip(s.params, values):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(s.params, kept):
                p.copy_(v)


def assert_grads_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    scale = max(w.abs().max().item() for w in want)
    assert scale > 0, "no gradient at all: nothing is checked"
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale)


def grads_far(got: list[torch.Tensor], other: list[torch.Tensor]) -> bool:
    """``other`` differs from ``got`` by far more than :func:`assert_grads_close` tolerates."""
    scale = max(g.abs().max().item() for g in got)
    return max((g - o).abs().max().item() for g, o in zip(got, other)) > 1e-2 * scale


def perturb_old(s, scale: float = 0.05, seed: int = 1) -> list[torch.Tensor]:
    """Move the old policy off θ (every shadow weight plus ``scale``·N(0, 1)); returns its copy."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for shadow in s.old.shadow:
            shadow.add_(scale * torch.randn(shadow.shape, generator=gen))
    return [t.clone() for t in s.old.shadow]

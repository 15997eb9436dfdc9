"""DGPO, Direct Group Preference Optimization (Luo et al., arXiv 2510.08425): a forward-process update
rule that learns a group's preference with a DPO-style log-sigmoid, registered in
:mod:`flowcredit.updates` (docs/algorithms.md, "DGPO").

Read in Luo-Yihong/DGPO at 01ceb4b: ``scripts/train_sd3_dgpo.py`` L52-108 (shared times, noise per
group), L162-193 (``compute_group_dgpo_loss_allreduce``), L1062-1177 (the training step: reference,
PPO-style clip of the matching loss, KL, the old policy's decay), ``config/dgpo.py`` and
``config/base.py`` (the defaults); Flow-Factory's port (``trainers/dgpo.py`` L448-528 at a0b2bc5)
has the same math. Conventions as :mod:`flowcredit.update_rules` (σ = t, target ``ε − clean``).
"""

from __future__ import annotations

import torch

from flowcredit.update_rules import matching_error


def _check(v_theta, v_old, v_ref, clean, noise, t, adv, group) -> None:
    for name, x in (("v_theta", v_theta), ("v_old", v_old), ("v_ref", v_ref), ("noise", noise)):
        if x.shape != clean.shape:
            raise ValueError(f"{name} must have clean's shape {tuple(clean.shape)}, got {tuple(x.shape)}")
    for name, x in (("t", t), ("adv", adv), ("group", group)):
        if x.shape != clean.shape[:1]:
            raise ValueError(f"{name} must be ({clean.shape[0]},), got {tuple(x.shape)}")


def dgpo_group_weights(err, err_ref, adv, group, beta_dpo: float) -> torch.Tensor:
    """Each row's group weight ``σ(s_g)``, ``(B,)`` float32 without gradient, where
    ``s_g = β_dpo/n_g · Σ_{b∈g} A_b·(ℓ_b − ℓ_ref,b)`` over the rows ``b`` of group ``g`` (``n_g`` of them).

    Args: err, err_ref: ``(B,)`` matching errors of the current and the reference policy; adv ``(B,)``;
    group ``(B,)`` integer ids (any values: only equality matters)."""
    with torch.no_grad():
        _, idx = torch.unique(group, return_inverse=True)  # (B,) ids 0 … G−1
        term = adv.float() * (err.float() - err_ref.float())  # (B,)
        sums = torch.zeros(int(idx.max()) + 1).index_add_(0, idx, term)  # (G,)
        counts = torch.zeros(len(sums)).index_add_(0, idx, torch.ones_like(term))  # (G,)
        return torch.sigmoid(beta_dpo * sums / counts)[idx]


def dgpo_clipped(v_theta, v_old, clean, noise, adv, *, clip_range: float) -> torch.Tensor:
    """The rows whose matching loss DGPO's PPO-style clip detaches, ``(B,)`` bool: ``r = exp(ℓ_old − ℓ)``
    outside ``1 ± clip_range`` in the advantage's direction (``r > 1 + ε`` if ``A > 0``, else
    ``r < 1 − ε``). ``clip_range = 0``: none (the code's ``clip_dsm`` off; the registry wants > 0)."""
    with torch.no_grad():
        if not clip_range:
            return torch.zeros(adv.shape, dtype=torch.bool)
        r = torch.exp(matching_error(v_old, clean, noise) - matching_error(v_theta, clean, noise))
        return torch.where(adv > 0, r > 1.0 + clip_range, r < 1.0 - clip_range)


def dgpo(
    v_theta, v_old, v_ref, clean, noise, t, adv, group, *, beta_dpo: float = 100.0, clip_range: float = 1e-2
) -> torch.Tensor:
    """DGPO (arXiv 2510.08425): ``mean_b[sg(σ(s_{g(b)}))·A_b·ℓ_b]``, the group-preference loss's gradient.

    ``ℓ_b = mean_d (v_θ(x_t) − (ε − x̂))²`` the matching error at ``x_t = noised(clean, noise, t)``
    (noise shared by a group's rows: the registry's ``group_noise``), ``ℓ_ref`` the reference's, and
    ``s_g = β_dpo/n_g · Σ_{b∈g} A_b·(ℓ_b − ℓ_ref,b)`` (:func:`dgpo_group_weights`). The group's DPO loss is
    ``−log σ(−s_g)``: the group's better rows (A > 0) should match better, its worse ones worse, than
    under the reference. Its gradient is ``σ(s_g)·β_dpo/n_g·Σ A_b ∇ℓ_b``, so this loss's gradient is
    ``(1/B)·Σ_g (n_g/β_dpo)·∇[−log σ(−s_g)]``, the code's form (its value is not the DPO loss). Rows that
    DGPO's PPO-style clip marks (:func:`dgpo_clipped`, against the old policy ``v_old``) keep ``ℓ_b`` in
    the weights but lose its gradient.

    Args:
        v_theta: ``(B, …)`` current velocity at ``x_t`` (with grad). v_old, v_ref: ``(B, …)`` the old
            policy's and the reference's there (no grad). clean, noise: ``(B, …)``. t, adv: ``(B,)``.
        group: ``(B,)`` integer ids of the rows' groups (prompts).
        beta_dpo: 100, ``config/dgpo.py`` (GenEval, OCR; 2000 in ``dgpo_wocfg_emaref.py``).
        clip_range: 1e-2, ``config/dgpo.py`` GenEval/OCR with ``clip_dsm`` on (0: no clip).
    Returns a scalar (float32).

    Deviations: ``n_g`` counts the group's rows in the micro-batch, where the code divides by the
    configured group size; the loop gives a forward rule that needs ``group`` micro-batches of whole
    groups, so the two agree (a group whose rows were dropped, e.g. a single member, uses its own count).
    The code's advantages are clipped at ±5 (``adv_clip_max``); the loop's credit clips at ``adv_clip``.
    """
    _check(v_theta, v_old, v_ref, clean, noise, t, adv, group)
    err = matching_error(v_theta, clean, noise)  # (B,)
    err_ref = matching_error(v_ref.detach(), clean, noise)  # (B,)
    weights = dgpo_group_weights(err, err_ref, adv, group, beta_dpo)  # (B,)
    clip = dgpo_clipped(v_theta, v_old, clean, noise, adv, clip_range=clip_range)  # (B,)
    err = torch.where(clip, err.detach(), err)
    return (weights * adv.float() * err).mean()


def dgpo_times(sigmas, batch: int, generator=None, *, time_draws: int = 4, time_fraction: float = 0.5):
    """DGPO's times ``(K, B)``: K = ``time_draws`` distinct step indices drawn without replacement from
    ``[0, int(N·time_fraction))``, each shared by every row (the grid's ``σ_j``, σ_0 = 1 included).

    The code's ``num_train_timesteps`` 4 from ``range(trunc_steps + 1)`` (``trunc_steps`` 4 in
    GenEval's ``config/dgpo.py``, 6 for OCR/PickScore, of 10 steps: ``time_fraction`` 0.5 / 0.7),
    shared across GPUs (``generate_shared_sampled_timesteps``). Deviation: fewer indices than draws
    (a short grid) draws every index once instead of failing."""
    n = sigmas.numel() - 1
    stop = int(n * time_fraction)
    if stop < 1:
        raise ValueError(f"time_fraction {time_fraction} leaves no step index of {n} steps")
    idx = torch.randperm(stop, generator=generator)[: min(time_draws, stop)]  # (K,)
    return sigmas.float()[idx].view(-1, 1).expand(len(idx), batch).clone()

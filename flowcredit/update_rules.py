"""The loss functions of the update rules and their pieces: the reverse-process surrogates (``clipped``,
``ratio_norm``, ``dppo``), the forward-process losses (``awm``, ``nft``), their time draws and the old
policy's soft update. :mod:`flowcredit.updates` registers them (its docstring: conventions, deviations
from the papers); they are re-exported there.
"""

from __future__ import annotations

import torch

from flowcredit.losses import clipped_surrogate


def _dims(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(1, x.ndim))


def _col(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``(B,)`` → ``(B, 1, …, 1)`` to broadcast against ``x``."""
    return t.view(-1, *([1] * (x.ndim - 1)))


# --- reverse process ---------------------------------------------------------------------------


def clipped(logp_new, logp_old, adv, *, clip_range: float) -> torch.Tensor:
    """Flow-GRPO's clipped surrogate ``mean(max(−A·r, −A·clip(r, 1 ± ε)))``, ``r = exp(logp_new − logp_old)``.

    :func:`flowcredit.losses.clipped_surrogate` unchanged (docs/algorithms.md §6). Args: ``(B,)`` each.
    """
    return clipped_surrogate(logp_new, logp_old, adv, clip_range)


def normalized_log_ratio(logp_new, logp_old, mean_new, mean_old, std) -> torch.Tensor:
    """GRPO-Guard's RatioNorm log-ratio (arXiv 2510.22319): ``ℓ = s·(Δlogp + mean_d(μ_θ − μ_old)²/(2s²))``.

    ``Δlogp = logp_new − logp_old``. With ``x' = μ_old + s·ε`` this is ``ℓ = mean_d(ε·(μ_θ − μ_old))``:
    the quadratic term that shifts the raw log-ratio's mean below 0 is removed (``E_ε ℓ = 0``, so
    ``exp ℓ`` centres on 1), and the ``1/s`` that makes its spread differ from step to step is
    multiplied away; one clip range then binds positive-advantage updates at every noise level.

    Args:
        logp_new, logp_old: ``(B,)`` averaged Gaussian log-densities (§2) of the stored ``x_next``.
        mean_new, mean_old: ``(B, …)`` transition means under the current and the sampling policy.
        std: ``(B,)`` the transition std ``s`` (> 0; the same for both policies).
    Returns:
        ``(B,)`` float32.

    Deviations from the authors' code (``scripts/train_sd3_GRPO_Guard.py``): per-row ``s``, where it takes
    the batch mean of ``g`` and of ``√(−dt)``, the same number when every row is at one step, as in our
    loop; and a per-row bias ``b = mean_d(μ_θ − μ_old)²/(2s²)``, where it adds the micro-batch mean of
    ``b`` to every row. Per row, ``ℓ = mean_d(ε·(μ_θ − μ_old))`` holds row by row; the mean shifts each
    row by ``s·(mean b − b)``: equal at θ = old (``b = 0``), a different loss otherwise (6.5 % on a
    2-row probe; docs/algorithms.md, "`ratio_norm`").
    """
    if (
        mean_new.shape != mean_old.shape
        or not logp_new.shape == logp_old.shape == std.shape == mean_new.shape[:1]
    ):
        raise ValueError("ratio_norm: means must be (B, …) of one shape, logp_new, logp_old and std (B,)")
    if not bool((std > 0).all()):
        raise ValueError("ratio_norm: std must be > 0 (a deterministic step cannot be trained)")
    std = std.float()
    shift = ((mean_new.float() - mean_old.float()) ** 2).mean(dim=_dims(mean_new)) / (2.0 * std**2)
    return (logp_new.float() - logp_old.float() + shift) * std


def ratio_norm(logp_new, logp_old, mean_new, mean_old, std, adv, *, clip_range: float = 2e-6) -> torch.Tensor:
    """GRPO-Guard's surrogate: the clipped surrogate of ``r = exp(ℓ)``, ℓ from :func:`normalized_log_ratio`.

    ``clip_range`` 2e-6 is the authors' config (``config/grpo_guard.py``): ℓ is about ``s`` times the
    raw log-ratio, so Flow-GRPO's ranges do not transfer. Returns a scalar.
    """
    ell = normalized_log_ratio(logp_new, logp_old, mean_new, mean_old, std)
    return clipped_surrogate(ell, torch.zeros_like(ell), adv, clip_range)


def dppo_divergence(mean_new, mean_old, std, *, add_kl_coefficient: bool = True) -> torch.Tensor:
    """Flow-DPPO's divergence of a transition, ``D = mean_d (μ_θ − μ_old)² / (2·s²)``: ``(B,)`` float32.

    Both transitions are ``N(μ, s²I)`` with one std ``s``, so ``mean_d``·dims of this is their exact
    KL (either direction; the paper's Eq. 14); the authors' codes reduce with a mean over the latent
    dims, and so does this (their threshold is calibrated on that scale). ``add_kl_coefficient=False``:
    ``mean_d (μ_θ − μ_old)² / 2`` (the codes' option, no ``s``). Args: means ``(B, …)``, std ``(B,)``.
    """
    sq = ((mean_new.float() - mean_old.float()) ** 2).mean(dim=_dims(mean_new))
    return sq / (2.0 * std.float() ** 2) if add_kl_coefficient else sq / 2.0


def dppo_masked(
    logp_new, logp_old, mean_new, mean_old, std, adv, *, kl_mask_threshold: float, add_kl_coefficient: bool
) -> torch.Tensor:
    """The rows Flow-DPPO removes from the loss, ``(B,)`` bool: outside the trust region
    (``D ≥ τ``, :func:`dppo_divergence`) and moved further in their advantage's direction
    (``r > 1`` with ``A > 0``, or ``r < 1`` with ``A < 0``; ``r = exp(logp_new − logp_old)``)."""
    with torch.no_grad():
        d = dppo_divergence(mean_new, mean_old, std, add_kl_coefficient=add_kl_coefficient)
        far = d >= kl_mask_threshold
        r, a = torch.exp(logp_new.float() - logp_old.float()), adv.float()
        return far & (((r > 1.0) & (a > 0)) | ((r < 1.0) & (a < 0)))


def dppo(
    logp_new,
    logp_old,
    mean_new,
    mean_old,
    std,
    adv,
    *,
    kl_mask_threshold: float = 1e-5,
    add_kl_coefficient: bool = True,
) -> torch.Tensor:
    """Flow-DPPO (arXiv 2606.11025): ``mean_b[−A_b·r_b·1(¬m_b)]``, ``m`` = :func:`dppo_masked`.

    PPO's ratio clip replaced by a trust region on the transitions' exact divergence
    ``D = mean_d (μ_θ − μ_old)²/(2s²)`` (the paper's Eqs. 14 and 18): inside it (``D < τ``) every
    row keeps the plain policy gradient ``−A·∇r``, however far ``r`` is from 1; outside it a row is
    dropped (gradient 0) only if it has moved further in its advantage's direction (``r > 1``,
    ``A > 0`` or ``r < 1``, ``A < 0``); a row moving back toward the old policy keeps its gradient.
    The mask carries no gradient. ``r = exp(logp_new − logp_old)``.

    Args:
        logp_new, logp_old: ``(B,)`` averaged Gaussian log-densities (§2) of the stored ``x_next``.
        mean_new, mean_old: ``(B, …)`` transition means under the current and the sampling policy.
        std: ``(B,)`` the transition std ``s`` (> 0; the same for both policies). adv: ``(B,)``.
        kl_mask_threshold: ``τ``, on :func:`dppo_divergence`'s per-dimension scale; 1e-5 is the
            authors' config (UniRL ``FlowDPPO/config.yaml``, verl-omni ``diffusion_actor.yaml``).
        add_kl_coefficient: divide by ``s²`` (True, the authors' default) or not.
    Returns a scalar (float32).

    Read in Tencent-Hunyuan/UniRL ``unirl/algorithms/flowdppo.py`` L43-138 (``_gaussian_kl_div``,
    ``_flowdppo_kl_adv_loss``), L342-368 (``s``) at 1a7b501, and verl-project/verl-omni
    ``verl_omni/trainer/diffusion/diffusion_algos.py`` L361-443 (``FlowDPPOLoss``) at a1139ba: the
    same loss and mask. They differ in ``s``; we follow verl-omni, the sampler's own transition std
    (its ``std_dev_t·√dt``), where UniRL recomputes Flow-SDE's from the σ grid with σ clamped at 0.99
    (different at σ = 1 only, where the library's Flow-SDE takes σ̃ = σ'). Neither code clips the
    advantage; this function does not either (the loop's credit methods clip at ``adv_clip``).
    """
    if (
        mean_new.shape != mean_old.shape
        or not logp_new.shape == logp_old.shape == std.shape == adv.shape == mean_new.shape[:1]
    ):
        raise ValueError("dppo: means must be (B, …) of one shape, logp_new, logp_old, std and adv (B,)")
    if not bool((std > 0).all()):
        raise ValueError("dppo: std must be > 0 (a deterministic step cannot be trained)")
    masked = dppo_masked(
        logp_new,
        logp_old,
        mean_new,
        mean_old,
        std,
        adv,
        kl_mask_threshold=kl_mask_threshold,
        add_kl_coefficient=add_kl_coefficient,
    )
    surrogate = -adv.float() * torch.exp(logp_new.float() - logp_old.float())
    return torch.where(masked, surrogate.new_zeros(()), surrogate).mean()


# --- forward process ---------------------------------------------------------------------------


def noised(clean: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The forward process ``x_t = (1 − t)·clean + t·noise`` (§0, σ = t): ``t (B,)`` → float32 ``(B, …)``."""
    tt = _col(t.float(), clean)
    return (1.0 - tt) * clean.float() + tt * noise.float()


def matching_error(v: torch.Tensor, clean: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching error ``mean_d (v − (noise − clean))²``: ``(B, …) -> (B,)`` float32."""
    return ((v.float() - (noise.float() - clean.float())) ** 2).mean(dim=_dims(v))


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """``mean_d (v − v_ref)²``: ``(B, …) -> (B,)``, the velocity-space KL of AWM's and DiffusionNFT's code."""
    return ((v.float() - v_ref.float()) ** 2).mean(dim=_dims(v))


def _check_forward(v_theta, v_old, clean, noise, t, adv) -> None:
    for name, x in (("v_theta", v_theta), ("v_old", v_old), ("noise", noise)):
        if x.shape != clean.shape:
            raise ValueError(f"{name} must have clean's shape {tuple(clean.shape)}, got {tuple(x.shape)}")
    for name, x in (("t", t), ("adv", adv)):
        if x.shape != clean.shape[:1]:
            raise ValueError(f"{name} must be ({clean.shape[0]},), got {tuple(x.shape)}")


AWM_WEIGHTINGS = ("uniform", "t", "t2", "ghuber")
_DELTA = 1e-10  # ghuber's offset inside the power (the authors' code)


def awm_weighted_error(err: torch.Tensor, t: torch.Tensor, weighting: str, power: float) -> torch.Tensor:
    """AWM's per-sample loss ``ℓ`` from the matching error ``err (B,)``: ``uniform`` err, ``t`` t·err,
    ``t2`` t²·err, ``ghuber`` ``t·((err + δ)^p − δ^p)/p`` (δ = 1e-10, p = ``power``)."""
    t = t.float()
    if weighting == "uniform":
        return err
    if weighting == "t":
        return t * err
    if weighting == "t2":
        return t**2 * err
    if weighting == "ghuber":
        return t * ((err + _DELTA) ** power - _DELTA**power) / power
    raise ValueError(f"weighting must be one of {AWM_WEIGHTINGS}, got {weighting!r}")


def awm(
    v_theta, v_old, clean, noise, t, adv, *, weighting="ghuber", power=0.25, adv_scale=5.0, old_beta=1.0
) -> torch.Tensor:
    """Advantage Weighted Matching (Xue et al., arXiv 2509.25050): ``mean_b(â_b·ℓ_b) + β_old·mean_b KL_v``.

    ``ℓ_b`` = :func:`awm_weighted_error` of ``mean_d (v_θ(x_t) − (ε − x̂))²`` (the pretraining loss at
    ``x_t = noised(clean, noise, t)``), ``â = clip(A/adv_scale, −1, 1)``, ``KL_v = mean_d (v_θ − v_old)²``
    to the lagged (old) policy. A positive advantage lowers the sample's matching error, a negative
    one raises it.

    Args:
        v_theta: ``(B, …)`` current velocity at ``x_t`` (with grad). v_old: ``(B, …)`` the old policy's
            there (no grad). clean, noise: ``(B, …)``. t: ``(B,)``. adv: ``(B,)``.
    Returns a scalar.

    Read in the authors' ``scripts/train_sd3_awm.py`` (``compute_log_prob_awm``, the training step) and
    ``config/dgx_awm.py`` (defaults: ghuber p = 0.25, ``adv_clip_max`` 5 with ``advantage_max`` 1,
    ``ema_beta`` 1). Deviations: their loss is the PPO surrogate of ``r = exp(ℓ_old − ℓ)`` with
    ``ℓ_old`` = ℓ detached, so ``r ≡ 1`` and the gradient is ours, ``â·∇ℓ``; its value is ``−mean(â)``
    where ours is ``mean(â·ℓ)``. Float32 where they use float64.
    """
    _check_forward(v_theta, v_old, clean, noise, t, adv)
    err = matching_error(v_theta, clean, noise)  # (B,)
    a = (adv.float() / adv_scale).clamp(-1.0, 1.0)
    loss = (a * awm_weighted_error(err, t, weighting, power)).mean()
    if old_beta:
        loss = loss + old_beta * velocity_kl(v_theta, v_old.detach()).mean()
    return loss


def nft_optimality(adv: torch.Tensor, adv_scale: float) -> torch.Tensor:
    """DiffusionNFT's optimality probability ``r = ½ + ½·clip(A/adv_scale, −1, 1)`` in [0, 1], ``(B,)``."""
    return 0.5 + 0.5 * (adv.float() / adv_scale).clamp(-1.0, 1.0)


NFT_WEIGHTINGS = ("adaptive", "uniform")


def _nft_branch(v, target, t, weighting):
    """One branch's ``(B,)`` loss: ``uniform`` ``mean_d (v − target)²``; ``adaptive`` the code's x0-space
    ``mean_d e² / sg(max(mean_d |e|, 1e-5))`` with ``e = x̂0 − x0 = −t·(v − target)``."""
    if weighting not in NFT_WEIGHTINGS:
        raise ValueError(f"weighting must be one of {NFT_WEIGHTINGS}, got {weighting!r}")
    diff = v - target
    if weighting == "uniform":
        return (diff**2).mean(dim=_dims(v))
    e = _col(t.float(), v) * diff
    scale = e.detach().abs().mean(dim=_dims(v)).clamp(min=1e-5)
    return (e**2).mean(dim=_dims(v)) / scale


def nft(
    v_theta, v_old, clean, noise, t, adv, *, beta=1.0, adv_scale=5.0, weighting="adaptive"
) -> torch.Tensor:
    """DiffusionNFT (Zheng et al., arXiv 2509.16117): ``(Z/β)·mean_b[r·L(v⁺) + (1 − r)·L(v⁻)]``.

    ``v⁺ = (1 − β)·v_old + β·v_θ``, ``v⁻ = (1 + β)·v_old − β·v_θ`` (implicit positive and negative
    policies), ``r`` = :func:`nft_optimality`, ``Z = adv_scale``, ``L`` the matching loss of each branch
    against ``ε − x̂`` at ``x_t = noised(clean, noise, t)`` (:func:`_nft_branch`). ``v_old`` is the
    old (sampling) policy, a soft-updated copy of θ. With ``r > ½`` the gradient moves ``v_θ`` toward
    the target, with ``r < ½`` away from it.

    Args: as :func:`awm`. Returns a scalar.

    Read in the authors' ``scripts/train_nft_sd3.py`` (the training step) and ``config/nft.py``
    (β = 1, 0.1 for OCR; ``adv_clip_max`` Z = 5). ``weighting="adaptive"`` (default) is their code's
    self-normalised x0-space loss; ``"uniform"`` the paper's plain ``‖v − (ε − x̂)‖²``. The factor
    ``Z/β`` is the code's (``ori_policy_loss / beta · adv_clip_max``).
    """
    _check_forward(v_theta, v_old, clean, noise, t, adv)
    v_theta, v_old = v_theta.float(), v_old.detach().float()
    target = noise.float() - clean.float()
    r = nft_optimality(adv, adv_scale)
    pos = _nft_branch((1.0 - beta) * v_old + beta * v_theta, target, t, weighting)
    neg = _nft_branch((1.0 + beta) * v_old - beta * v_theta, target, t, weighting)
    return adv_scale / beta * (r * pos + (1.0 - r) * neg).mean()


# --- time draws and the old policy -------------------------------------------------------------


def awm_times(sigmas, batch: int, generator=None, *, time_draws=6, time_fraction=0.9, time_from_first=False):
    """AWM's times ``(K, B)``: K = ``time_draws`` grid values ``σ_j``, one per stratum of the step indices
    ``[j0, M)`` (``M = int(N·time_fraction)``, ``j0 = 0`` if ``time_from_first`` else 1), shared by the
    rows of a draw. The authors' ``time_type`` "discrete_wo_init" (GenEval, OCR) / "discrete" (PickScore).

    Deviation: the loop calls this once per iteration for all ``B`` rows, so every micro-batch of draw
    k trains at the same ``t_k``; the authors' code (``train_sd3_awm.py``) draws its K times afresh for
    each micro-batch. Each row's times have the same distribution either way; an iteration here sees
    K distinct times, the code's K per micro-batch (docs/algorithms.md, "`awm`").
    """
    n = sigmas.numel() - 1
    start, stop = (0 if time_from_first else 1), int(n * time_fraction)
    if stop <= start:
        raise ValueError(f"time_fraction {time_fraction} leaves no step index in [{start}, {stop})")
    edges = torch.linspace(start, stop, time_draws + 1).long()  # stratum k: [edges[k], edges[k+1])
    u = torch.rand(time_draws, generator=generator)
    idx = edges[:-1] + (u * (edges[1:] - edges[:-1])).long()
    return sigmas.float()[idx].view(-1, 1).expand(time_draws, batch).clone()


def nft_times(sigmas, batch: int, generator=None, *, time_fraction=0.99):
    """DiffusionNFT's times ``(K, B)``: each row takes K = ``int(N·time_fraction)`` distinct grid values of
    ``σ_0 … σ_{N−1}`` in random order (the sampling schedule's, σ_0 = 1 included)."""
    n = sigmas.numel() - 1
    k = int(n * time_fraction)
    if k < 1:
        raise ValueError(f"time_fraction {time_fraction} draws no time from {n} steps")
    idx = torch.rand(batch, n, generator=generator).argsort(dim=1)[:, :k]  # (B, K): a random permutation
    return sigmas.float()[idx].T.contiguous()


def soft_update_decay(step: int, *, old_decay_rate: float, old_decay_max: float, old_decay_flat: int = 0):
    """``η = 0`` before ``old_decay_flat`` optimizer steps, then ``min((step − flat)·rate, max)``; the old
    policy becomes ``η·old + (1 − η)·θ``. DiffusionNFT's ``return_decay``, AWM's ``kl_ema_decay`` "linear"."""
    return 0.0 if step < old_decay_flat else min((step - old_decay_flat) * old_decay_rate, old_decay_max)

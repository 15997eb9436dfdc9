"""DenseGRPO's ψ inside a run (issue 28, item 3): its start value, its use as the rollout's per-step
noise, ``psi_path``, and its value after resume. Expected numbers are written out here: Flow-SDE's
``g = a·√(σ/(1 − σ̃))`` for the start, Dance-SDE's ``std = ψ_i·√(σ_i − σ_{i+1})`` for the noise."""

from __future__ import annotations

import json
import math

import pytest
import torch
from loop_probes import record_iteration, small_config, small_session

import flowcredit.run.calibrate as calibration
from flowcredit.run.session import build_session
from flowcredit.train import train

SIGMAS = [1.0, 0.8, 0.6, 0.4, 0.2, 0.0]  # the 5-step schedule at shift 1
TRAINED = [True, True, True, True, False]  # window_size 0: every step but the last


def start_psi_by_hand(a: float = 0.7) -> list[float]:
    """ψ's start: Flow-SDE's g on the trained steps (σ̃ = σ' where σ = 1), 0 elsewhere."""
    out = []
    for i, trained in enumerate(TRAINED):
        sigma, sigma_next = SIGMAS[i], SIGMAS[i + 1]
        tilde = sigma_next if sigma == 1.0 else sigma
        out.append(a * math.sqrt(sigma / (1 - tilde)) if trained else 0.0)
    return out


def assert_rollout_noise_is(ro, psi: list[float]) -> None:
    """Every row's step std is ψ_i·√(σ_i − σ_{i+1}) on trained steps and 0 elsewhere."""
    want = [p * math.sqrt(SIGMAS[i] - SIGMAS[i + 1]) if TRAINED[i] else 0.0 for i, p in enumerate(psi)]
    torch.testing.assert_close(ro.std, torch.tensor(want).expand_as(ro.std), atol=1e-6, rtol=1e-5)


def no_calibration(*_):
    raise AssertionError("ψ was calibrated again")


def test_psi_starts_at_flow_sde_g_and_is_the_rollout_noise(tmp_path, monkeypatch):
    s = small_session("dense_grpo", tmp_path / "run")
    assert s.sigmas.tolist() == pytest.approx(SIGMAS) and s.trained.tolist() == TRAINED
    levels_seen = []
    real_rollout = calibration.rollout
    monkeypatch.setattr(
        calibration, "rollout", lambda *a, **k: levels_seen.append(a[5].clone()) or real_rollout(*a, **k)
    )
    calibration.ensure_psi(s)
    monkeypatch.setattr(calibration, "rollout", real_rollout)
    start = start_psi_by_hand()
    torch.testing.assert_close(levels_seen[0], torch.tensor(start))  # round 1 samples at ψ's start
    report = json.loads((tmp_path / "run" / "calibration.json").read_text())
    assert report["history"][0] == pytest.approx(start, rel=1e-6)
    psi = report["psi"]
    assert psi != pytest.approx(start)  # one round of Algorithm 1 moved it
    assert s.psi.tolist() == pytest.approx(psi, rel=1e-7)
    assert json.loads((tmp_path / "run" / "psi.json").read_text())["psi"] == pytest.approx(psi, rel=1e-7)
    seen, _ = record_iteration(s, monkeypatch)
    assert_rollout_noise_is(seen["ro"], psi)


def test_psi_path_is_used_as_given_and_not_recalibrated(tmp_path, monkeypatch):
    psi = [0.3, 0.5, 0.45, 0.2, 0.9]  # the last step is outside the window: it stays an ODE step
    path = tmp_path / "psi.json"
    path.write_text(json.dumps({"psi": psi}))
    s = small_session("dense_grpo", tmp_path / "run", calibrate=False, psi_path=str(path))
    monkeypatch.setattr(calibration, "calibrate_psi", no_calibration)
    calibration.ensure_psi(s)
    assert s.psi.tolist() == pytest.approx(psi)
    assert json.loads((tmp_path / "run" / "psi.json").read_text())["psi"] == pytest.approx(psi)
    assert not (tmp_path / "run" / "calibration.json").exists()
    seen, _ = record_iteration(s, monkeypatch)
    assert_rollout_noise_is(seen["ro"], psi)


def test_psi_after_resume_is_the_calibrated_one(tmp_path, monkeypatch):
    cfg = small_config("dense_grpo", tmp_path / "run", iterations=1)
    train(cfg)
    psi = json.loads((tmp_path / "run" / "calibration.json").read_text())["psi"]
    monkeypatch.setattr(calibration, "calibrate_psi", no_calibration)
    s = build_session(cfg, resume=True)
    calibration.ensure_psi(s)
    assert s.start_iteration == 1 and s.psi.tolist() == pytest.approx(psi, rel=1e-7)
    seen, _ = record_iteration(s, monkeypatch, it=1)
    assert_rollout_noise_is(seen["ro"], psi)

"""The update rules' registry (flowcredit.updates): the built-in entries, option resolution and its
one-line errors, rules registered from outside (reverse and forward process), the checks of a
registration. The rules themselves: test_updates.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowcredit.losses import clipped_surrogate
from flowcredit.schedule import sigmas
from flowcredit.updates import UPDATES, matching_error, ratio_norm, register_update, resolve_options

DOCS = (Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()


def _t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_built_in_entries():
    assert UPDATES["clipped"].needs == ("logp",) and not UPDATES["clipped"].forward
    assert UPDATES["ratio_norm"].needs == ("logp", "mean")
    assert UPDATES["ratio_norm"].inputs() == ("logp_new", "logp_old", "mean_new", "mean_old", "std")
    for name in ("awm", "nft"):
        entry = UPDATES[name]
        assert entry.forward and entry.inputs() == ("clean", "noise", "t", "v_theta", "v_old")
    assert UPDATES["nft"].samples_with == "old" and UPDATES["awm"].samples_with == "current"
    fn_opts, time_opts, decay_opts = UPDATES["awm"].split(resolve_options("awm"))
    assert set(fn_opts) == {"weighting", "power", "adv_scale", "old_beta"}
    assert set(time_opts) == {"time_draws", "time_fraction", "time_from_first"}
    assert set(decay_opts) == {"old_decay_rate", "old_decay_max", "old_decay_flat"}
    for name, entry in UPDATES.items():
        assert f"`{name}`" in DOCS, name
        assert entry.doc


def test_clipped_entry_is_the_existing_surrogate():
    logp_new, logp_old, adv = _t([0.1, -0.3]), _t([0.0, 0.0]), _t([1.0, -2.0])
    opts = resolve_options("clipped", field_values={"clip_range": 0.2})
    assert opts == {"clip_range": 0.2}
    got = UPDATES["clipped"].fn(logp_new=logp_new, logp_old=logp_old, adv=adv, **opts)
    assert torch.equal(got, clipped_surrogate(logp_new, logp_old, adv, 0.2))


def test_options_are_resolved_and_checked_with_one_line_errors():
    assert resolve_options("nft", {"beta": 1})["beta"] == 1  # an int for a float
    assert resolve_options("awm", {"time_from_first": True})["time_from_first"] is True
    cases = [
        ("nft", {"bta": 0.1}, r"'nft' has no option 'bta' \(options: adv_scale, beta, "),
        ("nft", {"beta": "big"}, "option 'beta' of 'nft' must be float, got 'big'"),
        ("awm", {"time_draws": True}, "option 'time_draws' of 'awm' must be int"),
        (
            "clipped",
            {"clip_range": 0.2},
            "set option 'clip_range' of 'clipped' with its own field --clip_range",
        ),
        ("nft", {"beta": 0.0}, "update rule 'nft': option 'beta' must be > 0, got 0.0"),
        ("awm", {"weighting": "cubic"}, "update rule 'awm': option 'weighting' must be one of"),
        ("awm", {"time_fraction": 1.5}, r"option 'time_fraction' must be in \(0, 1\], got 1.5"),
        ("nft", {"old_decay_max": 1.0}, r"option 'old_decay_max' must be in \[0, 1\)"),
        ("ratio_norm", {"clip_range": -1e-6}, "option 'clip_range' must be > 0"),
        ("sgd", {}, "unknown update rule 'sgd'"),
    ]
    for name, given, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            resolve_options(name, given)
        assert "\n" not in str(info.value)


@pytest.fixture
def toy_update():
    """A user's rule, registered from outside the package: Flow-GRPO's surrogate times ``scale``."""
    calls = []

    def scaled(logp_new, logp_old, adv, *, scale=0.5):
        """Flow-GRPO's clipped surrogate times ``scale``."""
        calls.append(scale)
        return scale * clipped_surrogate(logp_new, logp_old, adv, 1e-3)

    entry = register_update("scaled", scaled, ("logp",), {"scale": 0.5})
    yield entry, calls
    UPDATES.pop("scaled")


def test_a_rule_registered_from_outside_is_used_like_a_built_in(toy_update):
    entry, calls = toy_update
    assert UPDATES["scaled"] is entry and entry.needs == ("logp",) and "surrogate" in entry.doc
    opts = resolve_options("scaled", {"scale": 2})
    fn_opts, _, _ = entry.split(opts)
    inputs = dict(zip(entry.inputs(), (_t([0.0, 0.0]), _t([0.0, 0.0]))))
    loss = entry.fn(**inputs, adv=_t([1.0, 3.0]), **fn_opts)
    assert loss.item() == pytest.approx(-4.0) and calls == [2]  # 2·(−mean A)
    with pytest.raises(ValueError, match="'scaled' has no option 'scal'"):
        resolve_options("scaled", {"scal": 1.0})


def test_a_forward_rule_registered_from_outside():
    def weighted_fm(v_theta, clean, noise, t, adv):
        """Advantage-weighted flow matching, no anchor."""
        return (adv * matching_error(v_theta, clean, noise)).mean()

    def mid_time(grid, batch, generator=None, *, draws=2):
        return grid[grid.numel() // 2].expand(draws, batch).clone()

    needs = ("clean", "noise", "time", "velocity")
    entry = register_update("weighted_fm", weighted_fm, needs, {"draws": 2}, times=mid_time)
    try:
        assert entry.forward and entry.inputs() == ("clean", "noise", "t", "v_theta")
        _, time_opts, _ = entry.split(resolve_options("weighted_fm", {"draws": 3}))
        assert entry.times(sigmas(4), 2, None, **time_opts).tolist() == [[0.5, 0.5]] * 3
    finally:
        UPDATES.pop("weighted_fm")


def test_registration_checks_the_entry():
    def fm(v_theta, clean, noise, t, adv):
        return v_theta.sum()

    def times(grid, batch, generator=None):
        return grid[:1].expand(1, batch)

    forward = ("clean", "noise", "time", "velocity")
    bad = [
        (("nft", fm, forward), dict(times=times), "already registered"),
        (("x", fm, ("clean", "speed")), {}, "needs must be distinct names of"),
        (("x", fm, ("logp", "clean")), {}, "exactly one of 'logp'"),
        (("x", fm, ("clean", "noise", "time")), dict(times=times), "needs all of"),
        (("x", fm, forward), {}, "must give its time sampler"),
        (("x", fm, (*forward, "old_velocity")), dict(times=times), "takes no keyword 'v_old'"),
        (
            ("x", fm, forward, {"lr": 1.0}),
            dict(times=times),
            "no function of the entry takes the option 'lr'",
        ),
        (("x", fm, forward), dict(times=times, samples_with="old"), "'old' needs 'old_velocity'"),
        (("x", ratio_norm, ("logp", "mean", "time")), {}, "reverse-process rule takes"),
    ]
    for args, kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            register_update(*args, **kwargs)
    assert "x" not in UPDATES


@pytest.mark.parametrize(
    ("preset", "said"),
    [
        ("grpo_guard", """option (default 2e-06), set with --update_options '{"clip_range": 0.0001}'"""),
        ("awm", "update 'awm' clips no ratio"),
        ("diffusion_nft", "update 'nft' clips no ratio"),
    ],
)
def test_clip_range_for_a_rule_that_does_not_read_it_is_refused(preset, said):
    """``--clip_range`` is ``clipped``'s: another rule would ignore it without a word (issue 53)."""
    from flowcredit.errors import ConfigError
    from flowcredit.presets import load_config

    assert load_config(preset, None, ["--clip_range", "0.001"]).clip_range == 1e-3  # the default: fine
    with pytest.raises(ConfigError, match=r"^config field 'clip_range': 0\.0001, but ") as err:
        load_config(preset, None, ["--clip_range", "1e-4"])
    assert said in str(err.value) and str(err.value).endswith("leave clip_range at 0.001")
    assert load_config("flow_grpo", None, ["--clip_range", "1e-4"]).clip_range == 1e-4  # clipped reads it

"""Reward registry: factories, options and their errors, lazy imports: flowcredit/rewards/__init__.py."""

import subprocess
import sys

import pytest
import torch

from flowcredit.rewards import REWARDS, Reward, get_reward, parse_mix

USER_MODULE = """
def scaled(images, prompts, metadata):
    return images.mean(dim=(1, 2, 3))

def make_scaled(*, factor: float, offset: float = 0.0):
    return lambda images, prompts, metadata: factor * images.mean(dim=(1, 2, 3)) + offset
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A user's reward module ``my_rewards`` on sys.path, for dotted paths."""
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


IMAGES = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))


def test_registry_names():
    expected = {
        "shapes",
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "ocr",
        "pickscore",
        "clipscore",
        "aesthetic",
        "imagereward",
        "clip_product_head",
        "remote",
    }
    assert expected <= set(REWARDS)
    assert all(callable(f) for f in REWARDS.values())


def test_parse_mix():
    assert parse_mix("a=1,b=0.5") == {"a": 1.0, "b": 0.5}
    assert parse_mix("a") == {"a": 1.0}
    assert parse_mix({"a": 2}) == {"a": 2.0}
    with pytest.raises(ValueError, match="'b'"):
        parse_mix("a=1,b=x")


def test_plain_rewards_and_mix_components():
    r = get_reward("jpeg_compressibility=1,jpeg_incompressibility=0.5")
    total = r(IMAGES, ["x", "y"], [{}, {}])
    c = r.last_components
    assert set(c) == set(r.fns) == {"jpeg_compressibility", "jpeg_incompressibility"}
    assert torch.allclose(c["jpeg_compressibility"], -c["jpeg_incompressibility"])
    assert torch.allclose(total, -0.5 * c["jpeg_incompressibility"])


def test_unknown_option_names_reward_and_option():
    with pytest.raises(ValueError, match=r"'jpeg_compressibility'.*'quality'"):
        get_reward("jpeg_compressibility", {"jpeg_compressibility": {"quality": 90}})
    with pytest.raises(ValueError, match=r"'ocr'.*'colour'"):
        get_reward("ocr", {"ocr": {"colour": "red"}})
    with pytest.raises(ValueError, match=r"'pickscore'.*'modeldir'"):
        get_reward("pickscore", {"pickscore": {"modeldir": "/x"}})


def test_missing_required_option_is_named():
    with pytest.raises(ValueError, match=r"'clipscore'.*'model_dir'"):
        get_reward("clipscore")
    with pytest.raises(ValueError, match=r"'remote'.*'url'"):
        get_reward("remote", {"remote": {"token": "t"}})


def test_options_for_a_reward_not_in_the_spec():
    with pytest.raises(ValueError, match=r"'pickscore'.*not in the reward spec"):
        get_reward("shapes", {"pickscore": {"model_dir": "/x"}})
    with pytest.raises(ValueError, match="must be an object"):
        get_reward("shapes", {"shapes": 3})


def test_unknown_reward():
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")


def test_dotted_path_and_dotted_factory_with_options(user_module):
    r = get_reward("my_rewards:scaled")
    assert torch.allclose(r(IMAGES, ["a", "b"], [{}, {}]), IMAGES.mean(dim=(1, 2, 3)))
    name = "my_rewards:make_scaled"
    r = get_reward(name, {name: {"factor": 2.0}})
    assert torch.allclose(r(IMAGES, ["a", "b"], [{}, {}]), 2 * IMAGES.mean(dim=(1, 2, 3)))
    with pytest.raises(ValueError, match=r"make_scaled.*'scale'"):
        get_reward(name, {name: {"scale": 2.0}})
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("my_rewards:missing")


def test_factory_is_built_once_per_reward(monkeypatch):
    calls = []

    def factory(*, k: int = 1):
        calls.append(k)
        return lambda images, prompts, metadata: torch.full((images.shape[0],), float(k))

    monkeypatch.setitem(REWARDS, "counted", factory)
    r = Reward("counted", {"counted": {"k": 3}})
    for _ in range(3):
        assert r(IMAGES, ["a", "b"], [{}, {}]).tolist() == [3.0, 3.0]
    assert calls == [3]


def test_wrong_length_is_an_error(monkeypatch):
    monkeypatch.setitem(REWARDS, "short", lambda: lambda images, prompts, metadata: torch.zeros(1))
    with pytest.raises(ValueError, match="'short' returned 1 values for 2 images"):
        get_reward("short")(IMAGES, ["a", "b"], [{}, {}])


def test_heavy_modules_are_imported_lazily():
    code = (
        "import sys, flowcredit.rewards as r, flowcredit.rewards.server;"
        "heavy = [m for m in ('transformers', 'rapidocr', 'onnxruntime', 'flowcredit.rewards.clip',"
        " 'flowcredit.rewards.ocr') if m in sys.modules]; print(heavy); assert not heavy"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_reward_models_default_to_this_ranks_gpu(monkeypatch):
    """Under torchrun / accelerate every rank builds its own reward model: on cuda:LOCAL_RANK, not all
    on cuda:0 (the default device of every local-weights reward and GenEval's detector)."""
    import inspect

    import torch

    from flowcredit.models.diffusers_common import default_device
    from flowcredit.rewards import clip, hps, imagereward
    from flowcredit.tasks.geneval import mask2former

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert default_device() == torch.device("cuda", 3)
    for module in (clip, hps, imagereward, mask2former):
        assert module.default_device is default_device
        assert '"cuda" if torch.cuda.is_available()' not in inspect.getsource(module)

"""The ``geneval`` reward's ``jpeg_quality`` option (Flow-GRPO's JPEG step before GenEval scores an image,
flowcredit/tasks/geneval/reward.py) and the checks of the reward's options."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from flowcredit.errors import UserError
from flowcredit.rewards import get_reward
from flowcredit.tasks.geneval.reward import SHAPE_CLASSES, geneval, jpeg_round_trip

META = {"tag": "single_object", "prompt": "a circle", "include": [{"class": "circle", "count": 1}]}


def independent_jpeg(image: torch.Tensor, quality: int) -> torch.Tensor:
    """One float32 ``(3, H, W)`` image through PIL's JPEG at ``quality``, written out step by step: uint8 as
    Flow-GRPO makes it (``(x * 255).round()`` in float32, half to even), then PIL both ways."""
    hwc = np.ascontiguousarray(image.permute(1, 2, 0).numpy(), dtype=np.float32)
    arr = np.clip(np.round(hwc * np.float32(255)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, mode="RGB").save(buf, format="JPEG", quality=quality)
    decoded = np.array(Image.open(io.BytesIO(buf.getvalue())))
    return torch.tensor(decoded, dtype=torch.float32).permute(2, 0, 1) / 255


def images() -> torch.Tensor:
    """Two 16×16 images: a smooth gradient with a red square, and noise."""
    g = torch.Generator().manual_seed(0)
    ramp = torch.linspace(0, 1, 16)
    a = torch.stack(
        [ramp.view(1, 16).expand(16, 16), ramp.view(16, 1).expand(16, 16), torch.full((16, 16), 0.3)]
    )
    a[:, 4:9, 5:11] = torch.tensor([0.9, 0.1, 0.1]).view(3, 1, 1)
    return torch.stack([a, torch.rand(3, 16, 16, generator=g)])


class Spy:
    """A detector that records the images it is given and finds nothing."""

    classes = SHAPE_CLASSES

    def __init__(self):
        self.seen = []

    def __call__(self, imgs, metas):
        self.seen.append(imgs.clone())
        return [({}, lambda name, group: []) for _ in metas]


def test_round_trip_by_hand():
    flat = torch.full((1, 3, 8, 8), 128 / 255)  # one flat 8×8 block at JPEG's level shift: exact
    assert torch.equal(jpeg_round_trip(flat, 75), flat)
    m = (torch.arange(64).view(8, 8) % 2 == torch.arange(64).view(8, 8) // 8 % 2).float()
    grey = m.expand(1, 3, 8, 8)  # a black/white 1-pixel checkerboard: luma only, nearly kept
    out = jpeg_round_trip(grey, 75)
    assert out.shape == grey.shape and out.dtype == torch.float32
    assert 0 < (out - grey).abs().max() < 0.1 and torch.equal((out * 255).round() / 255, out)
    # red/green 1-pixel checkerboard: PIL's 4:2:0 chroma subsampling averages the colours of each 2×2
    # block, so every pixel ends up a muddy mix of red and green
    red_green = torch.stack([m, 1 - m, torch.zeros(8, 8)])[None]
    mixed = jpeg_round_trip(red_green, 75)
    assert (mixed - red_green).abs().max() > 0.5
    assert ((mixed[0, :2] > 0.25) & (mixed[0, :2] < 0.75)).all()


@pytest.mark.parametrize("quality", [75, 20, 95])
def test_round_trip_equals_an_independent_pil_round_trip(quality):
    x = images()
    got = jpeg_round_trip(x, quality)
    for i in range(x.shape[0]):
        assert torch.equal(got[i], independent_jpeg(x[i], quality))
    assert not torch.equal(got, x)  # it does change the pixels


def test_the_detector_sees_the_jpeg_pixels_only_when_the_option_is_set():
    x, prompts, metas = images(), ["a circle"] * 2, [META] * 2
    for quality, expected in ((75, torch.stack([independent_jpeg(i, 75) for i in images()])), (0, x)):
        reward = geneval(detector="shapes", score="strict", jpeg_quality=quality)
        reward.detect = spy = Spy()
        assert reward(x, prompts, metas).tolist() == [0.0, 0.0]
        reward.tabulate(x, prompts, metas)
        assert len(spy.seen) == 2 and all(torch.equal(seen, expected) for seen in spy.seen)
    assert geneval(detector="shapes").jpeg_quality == 0  # off by default


def test_the_option_through_the_registry():
    reward = get_reward("geneval", {"geneval": {"detector": "shapes", "jpeg_quality": 75}})
    assert reward.fns["geneval"].jpeg_quality == 75
    assert reward(images(), ["a circle"] * 2, [META] * 2).shape == (2,)


@pytest.mark.parametrize("bad", [-1, 96, 100, 7.5, "75", True, None, [75]])
def test_bad_jpeg_quality_is_one_line_naming_the_option(bad):
    with pytest.raises(
        UserError, match=r"^geneval reward: option 'jpeg_quality' must be 0 \(off\) or an"
    ) as info:
        get_reward("geneval", {"geneval": {"detector": "shapes", "jpeg_quality": bad}})
    assert "\n" not in str(info.value) and repr(bad) in str(info.value)


def test_unknown_detector_options_are_named():
    with pytest.raises(UserError, match=r"detector 'shapes' has no option 'model_dir'; its options: none"):
        get_reward("geneval", {"geneval": {"detector": "shapes", "model_dir": "/models/m2f"}})
    with pytest.raises(
        UserError, match=r"detector 'mask2former' has no option 'size'; its options: \['model_dir'"
    ):
        get_reward("geneval", {"geneval": {"size": 800}})
    with pytest.raises(UserError, match=r"detector 'mask2former' needs option 'clip_dir'"):
        get_reward("geneval", {"geneval": {"model_dir": "/models/m2f"}})
    with pytest.raises(UserError, match="no option 'clip_loader'"):
        get_reward("geneval", {"geneval": {"clip_loader": "x"}})

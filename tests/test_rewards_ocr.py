"""OCR reward: Flow-GRPO's scoring rule by hand, and rapidocr on rendered text: flowcredit/rewards/ocr.py."""

import numpy as np
import pytest
import torch

from flowcredit.rewards import get_reward
from flowcredit.rewards.ocr import levenshtein, ocr_score, ocr_target


def test_target_is_first_quoted_text_without_spaces_lower_case():
    assert ocr_target('A sign that says "Hello World" and "other"') == "helloworld"
    with pytest.raises(ValueError, match="a cat on a mat"):
        ocr_target("a cat on a mat")
    with pytest.raises(ValueError, match="empty"):
        ocr_target('a sign saying ""')


@pytest.mark.parametrize(
    ("a", "b", "d"), [("", "", 0), ("abc", "", 3), ("kitten", "sitting", 3), ("hello", "help", 2)]
)
def test_levenshtein(a, b, d):
    assert levenshtein(a, b) == d == levenshtein(b, a)


def test_score_rule():
    assert ocr_score("Big HELLO sign", "hello") == 1.0  # contained, after removing spaces
    assert ocr_score("hello", "help") == 0.5  # dist 2 of 4
    assert ocr_score("", "hello") == 0.0  # nothing read: dist capped at len(target)
    assert ocr_score("xxxxxxxxxxxx", "abc") == 0.0  # capped, never negative


def _text_image(text: str, size: int = 256) -> torch.Tensor:
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(img).text(
        (size // 8, size // 2 - 30), text, fill="black", font=ImageFont.load_default(size=56)
    )
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255.0


def test_rapidocr_reads_rendered_text_and_not_noise():
    reward = get_reward("ocr")
    hello = _text_image("HELLO")
    noise = torch.rand(3, 256, 256, generator=torch.Generator().manual_seed(0))
    prompts = ['a sign that says "Hello"', 'a poster with "hello"', 'a sign that says "help"']
    r = reward(torch.stack([hello, noise, hello]), prompts, [{}] * 3)
    assert r.shape == (3,) and r.dtype == torch.float32
    assert r.tolist() == [1.0, 0.0, 0.5]


def test_prompt_without_quotes_is_named():
    with pytest.raises(ValueError, match="no quotes here"):
        get_reward("ocr")(torch.zeros(1, 3, 32, 32), ["no quotes here"], [{}])

"""The reward server's error answers name the culprit (issue 58): a field, ``images[k]``,
``metadata[k]`` or where the JSON breaks, with the index counted in the client's request; a reward's
:class:`RewardInputError` is answered word for word (422), its other exceptions by type and error id
only. No answer holds a path or a traceback. Also the error type in process (mixes, clips, ``ocr``,
``geneval``) and the ``remote`` client's note on split calls."""

from __future__ import annotations

import base64
import copy
import io
import json
import re

import numpy as np
import pytest
import torch
from reward_serving import request

from flowcredit.rewards import RewardInputError, get_reward, score_frames
from flowcredit.rewards.server import Limits, start_server
from flowcredit.tasks.shapes import load_prompts, render_prompt

LIMITS = Limits(max_batch=2, max_wait_ms=5, max_pixels=64 * 64, timeout_s=30)
META = load_prompts("test")[:3]  # three ShapeEval prompts with their metadata


def _png(array: np.ndarray, fmt: str = "PNG") -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def _scene(meta: dict, size: int = 32) -> str:
    return _png(render_prompt(meta, np.random.default_rng(0), size=size))


def _body(metas=META, **changes) -> dict:
    body = {"images": [_scene(m) for m in metas], "prompts": [m["prompt"] for m in metas], "metadata": metas}
    return body | changes


def _probe(images, prompts, metadata):
    """Brightness; ``bad`` in a prompt: a RewardInputError for it; ``plain: TEXT``: a ValueError of TEXT;
    ``bug: TEXT``: a RuntimeError of TEXT."""
    for i, p in enumerate(prompts):
        if p == "bad":
            raise RewardInputError("prompts", i, "the probe takes no prompt 'bad'")
        if p.startswith(("plain: ", "bug: ")):
            kind = ValueError if p.startswith("plain") else RuntimeError
            raise kind(p.partition(": ")[2])
    return images.mean(dim=(1, 2, 3))


@pytest.fixture(scope="module")
def port():
    rewards = {"shapes": get_reward("shapes"), "probe": _probe}
    with start_server(rewards, limits=LIMITS) as running:
        yield int(running.url.rsplit(":", 1)[1])


LEAKS = re.compile(r"Traceback|File \"|\.py\b|/work/|/usr/|/tmp/|site-packages|/home/|\\\\")


def _refused(port: int, body, status: int, path: str = "/score/shapes") -> str:
    """The error text of the answer to ``body``, which must have ``status`` and leak nothing."""
    got, answer = request(port, path=path, body=body, token=None)
    assert got == status and isinstance(answer, dict), (got, answer)
    assert not LEAKS.search(answer["error"]), answer
    return answer["error"]


# --- a reward's input: 422 naming the sample, the index counted in the request --------------------


def test_metadata_missing_a_key_names_the_sample_and_the_key(port):
    """metadata[2] lacks 'category': max_batch 2 scores it in the second call, as that call's first
    image, and the answer still counts it in the request."""
    metas = [META[0], META[1], {k: v for k, v in META[2].items() if k != "category"}]
    error = _refused(port, _body(metas), 422)
    assert error.startswith("reward 'shapes' rejected metadata[2]: the shapes reward needs 'category' (")
    assert "ShapeEval metadata holds 'prompt', 'category', 'objects'" in error
    assert request(port, path="/score/shapes", body=_body(), token=None)[0] == 200  # and it goes on


def test_metadata_left_out_and_malformed_metadata_are_named(port):
    body = _body()
    del body["metadata"]
    error = _refused(port, body, 422)
    assert error.startswith("reward 'shapes' rejected metadata[0]: the shapes reward needs 'prompt', ")
    hexagon = dict(META[1], objects=[dict(META[1]["objects"][0], shape="hexagon")])
    error = _refused(port, _body(META[:2], metadata=[META[0], hexagon]), 422)
    assert "rejected metadata[1]: the shapes reward cannot score it: " in error and "hexagon" in error
    error = _refused(port, _body([META[0], META[0]], prompts=[META[0]["prompt"], "a cat"]), 422)
    assert "rejected metadata[1]: " in error and "metadata is for" in error  # another prompt's


def test_a_rewards_input_error_is_said_and_its_other_errors_are_not(port):
    images = [_scene(META[0])] * 4
    error = _refused(port, {"images": images, "prompts": ["a", "b", "c", "bad"]}, 422, "/score/probe")
    assert error == "reward 'probe' rejected prompts[3]: the probe takes no prompt 'bad'"
    plain = {"images": images[:1], "prompts": ["plain: no such file /srv/secret/weights.bin"]}
    error = _refused(port, plain, 422, "/score/probe")
    assert "rejected the input: ValueError (error id " in error and "secret" not in error
    bug = {"images": images[:1], "prompts": ["bug: out of memory at /srv/secret"]}
    error = _refused(port, bug, 500, "/score/probe")
    assert "failed: RuntimeError (error id " in error and "secret" not in error


# --- the server's own checks: 400 naming the field, the image or the place -------------------------


def _sixteen_bit() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((32, 32), 128 * 257, dtype=np.uint16)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        (_sixteen_bit, "images[1]: not an 8-bit PNG (grey, RGB, RGBA or palette): PIL reads it as I;16"),
        (lambda: _scene(META[1], size=16), "images[1] is 16x16, images[0] 32x32: "),
        (lambda: np.zeros((32, 32, 3)).tolist(), "images[1]: must be a base64 PNG string, got an array"),
        (lambda: 0.5, "images[1]: must be a base64 PNG string, got a number"),
        (lambda: _png(np.zeros((32, 32, 3), np.uint8), "JPEG"), "images[1]: must be a PNG, got JPEG"),
        (lambda: "A" * 100, "images[1]: undecodable image: "),
    ],
    ids=["16-bit", "another size", "pixel array", "number", "jpeg", "not an image"],
)
def test_a_bad_image_is_named_by_its_index(port, image, expected):
    body = _body(META[:2])
    body["images"][1] = image()
    assert expected in _refused(port, body, 400)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda b: b | {"imgs": b["images"]}, "unknown field 'imgs' in the body; it takes {\"images\""),
        (lambda b: {k: v for k, v in b.items() if k != "prompts"}, "the body lacks 'prompts'"),
        (lambda b: b | {"prompts": ["a", 3, "c"]}, "prompts[1] must be a string, got a number"),
        (
            lambda b: b | {"metadata": [b["metadata"][0], [], {}]},
            "metadata[1] must be an object, got an array",
        ),
        (lambda b: b | {"metadata": {"category": "x"}}, "metadata must be an array, got an object"),
        (lambda b: [b], "body must be a JSON object {"),
        (lambda b: b | {"prompts": ["a"]}, "3 images, 1 prompts, 3 metadata: must match"),
    ],
    ids=[
        "unknown field",
        "missing field",
        "prompt type",
        "metadata type",
        "not a list",
        "not an object",
        "counts",
    ],
)
def test_a_bad_field_is_named(port, change, expected):
    assert expected in _refused(port, json.dumps(change(_body())).encode(), 400)


def test_a_json_error_is_placed_in_the_body_as_sent(port):
    """Images are taken out of the body before it is parsed; the place JSON breaks is still counted
    in the body, after them (line, column, character), and a bad byte by its byte."""
    text = json.dumps(_body(META[:1]))  # one line: the image, then the prompts and metadata
    at = text.index('"prompts"')
    bad = text[:at] + text[at:].replace(",", ";", 1)  # the separator after the prompts list
    where = bad.index(";")
    error = _refused(port, bad.encode(), 400)
    assert error == f"body is not JSON: Expecting ',' delimiter at line 1 column {where + 1} " + (
        f"(character {where} of the body)"
    )
    two_lines = text[:at] + "\n " + text[at:].replace("]", "] ]", 1)
    where = two_lines.index("] ]") + 2
    column = where - two_lines.index("\n")
    error = _refused(port, two_lines.encode(), 400)
    assert f"at line 2 column {column} (character {where} of the body)" in error, error
    raw = text.replace(META[0]["prompt"], "a \udcff circle").encode("utf-8", "surrogateescape")
    where = raw.index(b"\xff")
    error = _refused(port, raw, 400)
    assert f"not UTF-8 (invalid start byte) at line 1 column {where + 1} (byte {where} of the body)" in error


# --- in process -------------------------------------------------------------------------------------


def test_the_error_names_its_sample_survives_a_rebuild_and_moves():
    exc = RewardInputError("metadata", 2, "why")
    assert str(exc) == "metadata[2]: why" and isinstance(exc, ValueError)
    again = copy.deepcopy(exc)  # rebuilt from its __reduce__, as a process boundary rebuilds it
    assert (again.field, again.index, again.reason, str(again)) == ("metadata", 2, "why", str(exc))
    assert str(exc.at(7)) == "metadata[7]: why"


def test_a_mix_and_clips_name_the_sample_of_the_call():
    x = torch.rand(2, 3, 32, 32)
    metas = [META[0], {"prompt": META[1]["prompt"]}]
    with pytest.raises(RewardInputError, match=r"^metadata\[1\]: the shapes reward needs 'category' and"):
        get_reward("shapes=1,jpeg_compressibility=0.1")(x, [m["prompt"] for m in metas], metas)
    clips = torch.rand(3, 4, 3, 8, 8)  # frame j of clip i is sample 4i + j of the reward call

    def frames(images, prompts, metadata):
        raise RewardInputError("metadata", 9, "frame 9 is clip 2's")

    with pytest.raises(RewardInputError, match=r"^metadata\[2\]: frame 9"):
        score_frames(frames, clips, ["p"] * 3, [{}] * 3, frame_stride=1)


def test_ocr_and_geneval_name_the_sample():
    with pytest.raises(
        RewardInputError, match=r"^prompts\[1\]: the ocr reward needs a text in double quotes"
    ):
        get_reward("ocr")(torch.zeros(2, 3, 32, 32), ['a "sign"', "no quotes"], [{}, {}])
    reward = get_reward("geneval", {"geneval": {"detector": "shapes", "jpeg_quality": 75}})
    geneval = reward.fns["geneval"]
    assert geneval.jpeg_quality == 75 and callable(geneval.tabulate)  # the wrapped reward's
    metas = [META[0], {"tag": "single_object", "prompt": META[1]["prompt"]}]
    with pytest.raises(RewardInputError, match=r"^metadata\[1\]: .*needs a non-empty 'include' list"):
        reward(torch.zeros(2, 3, 32, 32), [m["prompt"] for m in metas], metas)


def test_the_remote_client_says_which_request_of_a_split_call_was_refused(port):
    """max_batch 2: images 2–3 go in a request of their own, whose 422 names metadata[1]."""
    from flowcredit.rewards.remote import RemoteRewardError

    reward = get_reward("remote", {"remote": {"url": f"http://127.0.0.1:{port}", "reward": "shapes"}})
    metas = [META[0], META[1], META[2], {"prompt": META[0]["prompt"]}]
    scenes = np.stack([render_prompt(m, np.random.default_rng(0)) for m in [*META, META[0]]])
    images = torch.from_numpy(scenes).permute(0, 3, 1, 2).float().div(255)
    with pytest.raises(RemoteRewardError) as caught:
        reward(images, [m["prompt"] for m in metas], metas)
    text = str(caught.value)
    assert "HTTP 422: reward 'shapes' rejected metadata[1]: the shapes reward needs 'category'" in text
    assert text.endswith("(in the request of images 2–3 of this call, numbered from 0 there)"), text

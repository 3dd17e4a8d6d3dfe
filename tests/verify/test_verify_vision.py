"""`backfit verify` on the tiny Vision-Exp checkpoint (real CLI processes): image prompts beside
the text through the runtime's tower, fusion, bias_vl routing and in-span attention, against
the reference's own, under the same three gates; and the gates fail when the image path is
wrong while every tensor still equals its original (two sentinels swapped)."""

import json
import shutil

from test_verify_cli import _cli, _swap_tensors


def test_verify_vision_semantics_full_forward(tiny_vision, tiny_converted, tmp_path):
    """Lossless at tp 2 (the tower's weights on both ranks, its images shared between them):
    logits rel <= 1e-4 and every layer within 1e-5 over text and two image prompts (the 64x48
    and 320x400 images)."""
    r = _cli("verify", tiny_vision, tiny_converted(2, "bf16", "vision"), "--tp", 2,
             "--max-positions", 32, "--images", 2, "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "image prompts: 2" in r.stdout and "semantics check: PASS" in r.stdout
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["images"] == 2 and rep["positions"] > 1000
    assert rep["gates"] == {"weights": [], "hidden": [], "logits": []}


def test_verify_vision_paged_chunks(tiny_vision, tiny_converted):
    """On the paged pools in chunks of 96 at tp 2 (the cut before the image block moved to its
    start, the block whole in the next chunk, span keys in flight): still the strict gates."""
    r = _cli("verify", tiny_vision, tiny_converted(2, "bf16", "vision"), "--max-positions", 32,
             "--images", 1, "--kv-cache-dtype", "auto", "--chunk", 96)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "prefill chunks of 96" in r.stdout and "semantics check: PASS" in r.stdout


def test_verify_vision_fails_on_swapped_sentinels(tiny_vision, tiny_converted, tmp_path):
    """image_pad and image_newline swapped (bytes and manifest sources): the weight gate still
    passes, the image prompt's hidden states and logits do not."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_converted(1, "bf16", "vision"), bad)
    _swap_tensors(bad, "image_pad", "image_newline")
    r = _cli("verify", tiny_vision, bad, "--max-positions", 16, "--images", 1, "--json",
             tmp_path / "r.json")
    assert r.returncode == 1, r.stdout + r.stderr
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["gates"]["weights"] == [] and rep["gates"]["hidden"] and rep["gates"]["logits"]

"""`backfit verify` and `backfit generate` end to end on tiny checkpoints (real CLI processes)."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from backfit.formats import rank_dir


@pytest.fixture(scope="module")
def lossless(tiny_converted):
    return tiny_converted(1, "bf16")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "backfit.cli", *map(str, args)],
                          capture_output=True, text=True)


def test_verify_semantics_passes(tiny_flash, lossless, tmp_path):
    r = _cli("verify", tiny_flash, lossless, "--max-positions", 200, "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "semantics check: PASS" in r.stdout and "layer 5" in r.stdout
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["check"] == "semantics" and rep["positions"] == 200
    assert rep["logits"]["top1"] == 1.0 and rep["logits"]["rel"] < 1e-4


def test_verify_conversion_passes_on_int8(tiny_flash, tiny_converted, tmp_path):
    """The default INT8 conversion keeps top-1 >= 99 % and mean KL <= 1e-3 over 512 positions
    of the built-in text (float32 activations, tp 2), and the experts are bit-exact."""
    r = _cli("verify", tiny_flash, tiny_converted(2), "--tp", 2, "--json", tmp_path / "r.json")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "conversion check: PASS" in r.stdout
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["check"] == "conversion" and rep["positions"] >= 512
    assert rep["logits"]["top1"] >= 0.99 and rep["logits"]["kl_mean"] <= 1e-3
    assert rep["weights"]["int8_mx32"]["rel_max"] == 0.0


def test_verify_precision_uses_the_bf16_floor(tiny_flash, lossless, tmp_path):
    r = _cli("verify", tiny_flash, lossless, "--max-positions", 128, "--activations", "bfloat16",
             "--json", tmp_path / "r.json")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["check"] == "precision" and rep["floor"]["rel"] > 1e-4      # bf16 noise exists
    assert "ref-bf16 floor" in r.stdout
    assert r.returncode == (0 if rep["ok"] else 1)


def test_verify_fails_on_a_corrupted_conversion(tiny_flash, lossless, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(lossless, bad)
    f = rank_dir(bad, 0) / "model-00004-of-00009.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-5000] ^= 0x40                                   # flip a bit inside the last tensor
    f.write_bytes(bytes(raw))
    r = _cli("verify", tiny_flash, bad, "--max-positions", 64)
    assert r.returncode == 1 and "FAIL" in r.stdout


def test_generate_matches_reference_greedy(tiny_flash, lossless):
    from tokenizers import Tokenizer

    from backfit.verify.reference import Reference
    prompt = "Hello world, this is a test"
    r = _cli("generate", lossless, "--prompt", prompt, "--max-tokens", 12, "--activations", "float32")
    assert r.returncode == 0, r.stderr
    tok = Tokenizer.from_file(str(tiny_flash / "tokenizer.json"))
    ids = [0] + tok.encode(prompt, add_special_tokens=False).ids
    ref = Reference(tiny_flash)
    for _ in range(12):                                  # greedy with full re-forward each step
        nxt = int(ref.forward(torch.tensor(ids))["logits"][-1].argmax())
        if nxt == 1:
            break
        ids.append(nxt)
    want = tok.decode(ids[len(tok.encode(prompt, add_special_tokens=False).ids) + 1:],
                      skip_special_tokens=False)
    assert r.stdout.rstrip("\n") == want

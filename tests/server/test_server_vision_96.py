"""One Chat request with 96 images on the CPU (the seed deployment's per-request maximum) through
a live server on a smaller Vision-Exp checkpoint: every image through the tower once, the
usage counting all ~9,600 image positions."""

import pytest
import support
from live_server import real_server
from test_server_vision import data_url, oai

from backfit.verify.image_prompts import synthetic_png


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A smaller Vision-Exp checkpoint for the 96-image request (~9,600 positions): 4 layers
    (HCA at ratio 128), head_dim 128, a 64-wide tower; int8, tp 1."""
    from backfit.convert.run import convert
    from backfit.synthetic import write_checkpoint
    d = tmp_path_factory.mktemp("micro")
    with support.one_thread():
        write_checkpoint(d / "src", "vision", seed=0, small_vocab=True, n_routed_experts=8,
                         moe_intermediate_size=256, main_ratios=[0, 0, 4, 128], head_dim=128,
                         vision_dim=64, vision_n_heads=2, vision_inter_dim=176)
        return convert(d / "src", d / "int8", tp=1, progress=False) and d / "int8"


def test_96_images_in_one_request(micro):
    """96 distinct small images (98-101 positions each) in one Chat request on the CPU: each
    image through the tower once, the usage counting every block."""
    with support.one_thread():
        srv = real_server(micro, engine_kw=dict(block_size=128, max_model_len=12288,
                                                num_blocks=100, max_num_batched_tokens=4096))
        try:
            parts = [{"type": "image_url", "image_url": {"url": data_url(
                synthetic_png(64, 48, seed=s))}} for s in range(96)]
            r = oai(srv).chat.completions.create(model="m", max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": "Count them."}, *parts]}])
            assert r.usage.prompt_tokens > 96 * 98
            assert srv.engine.engine.ranks.runner.image_cache.tower_images == 96
        finally:
            srv.stop()

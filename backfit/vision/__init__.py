"""Image input for DeepSeek-V4-Flash-Vision-Exp, upstream of the model (dsv4-vision.md s5-s7, s10).

Plain Python / torch / Pillow over the leaves; no runtime, engine or server code (tests/
test_imports.py). One module per responsibility:

  preprocess.py  bytes -> PreparedImage: decode, the reference resize rules, uint8 pixels,
                 ViT / LM grids, float patches on demand, content_key()
  block.py       the pad-free N-layout block of a grid, splice() into a prompt with the leading
                 pad, ImageSpan, check_counts() of IMAGE slots against embedding rows
  cache.py       ImageCache: PreparedImages by content key (position-free, so B1 cannot recur)

Token types: out-of-vocabulary ids. An image-block position carries the id vocab_size + t for
its type t (IMAGE_START 0, IMAGE_PAD 1, IMAGE 2, IMAGE_NEW_LINE 3, IMAGE_END 4), as DeepSeek's
reference does; every text id is below vocab_size. So "is this an image position" is
`id >= vocab_size`, a value no tokenizer output can take: user, system or tool text can never
become an image slot, a sentinel or a bias_vl-routed row, whatever it quotes (section 13, B2-B4;
the in-vocabulary sentinels 129257-129261 that upstream vLLM switched to are not used). One int
array then carries text and images through the engine unchanged. Images enter a prompt only
through splice(), which takes the prompt as segments (text id lists and PreparedImages in
order) and never searches ids for the placeholder `<｜deepseek_image｜>` (129264).

What a consumer of a VisionPrompt must do (the runtime / engine side):
  - look up a safe embedding row (0) for ids >= vocab_size, then overwrite those rows: START,
    PAD, NEW_LINE, END with the sentinel vectors `image_start`, `image_pad`, `image_newline`,
    `image_end`; the IMAGE slots of span k, in block order, with aligner rows e_k[perm_k]
    (block.ImageBlock.perm; e_k row-major over the gh x gw grid); before the mHC expansion;
  - call check_counts() before every forward that contains image positions;
  - route every position with id >= vocab_size through bias_vl (all five types, hash layers and
    DSpark stages included) and give in-span positions [IMAGE_START, IMAGE_END] the
    bidirectional window in prefill (section 11); never split a span across prefill chunks;
  - key any prefix cache on ImageSpan.key as well as the ids: two images with the same grid
    have the same ids.
The independent FP32 reference of the same path is backfit/verify/ref_vision.py.
"""

from backfit.vision.block import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_PAD, IMAGE_START,
                                  ImageBlock, image_block, lead_pad)
from backfit.vision.cache import ImageCache
from backfit.vision.preprocess import ImageError, Plan, PreparedImage, prepare, resize_plan
from backfit.vision.prompt import ImageCountError, ImageSpan, VisionPrompt, check_counts, splice

__all__ = ["IMAGE", "IMAGE_END", "IMAGE_NEW_LINE", "IMAGE_PAD", "IMAGE_START", "ImageBlock",
           "ImageCache", "ImageCountError", "ImageError", "ImageSpan", "Plan", "PreparedImage",
           "VisionPrompt", "check_counts", "image_block", "lead_pad", "prepare", "resize_plan",
           "splice"]

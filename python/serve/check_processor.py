"""vLLM's real multimodal processor (Qwen2-VL's, for the tiny model of ``tiny_model.py``)
with two front-ends on one shmstore store, as with several API servers or data-parallel
ranks: an image that one front-end processed is served by the other without the HF
processor, with the same prompt.

Checks, per image:

* the second front-end reports the image cached (its prompt updates came with it from
  the store), and gives the same prompt token ids, placeholders and hashes as the
  front-end that processed it, and as vLLM's own processing without a cache;
* both send the workers a marker;
* in a request of three images, two of which the other front-end processed, only the
  third is processed, and the prompt is the same as without a cache.

Prints, per image size, in the same run (medians over the images; milliseconds):

* what vLLM's fallback for several front-ends (``processor_only``: each front-end its
  own cache) costs a front-end that has not seen the image: the HF processor, in full;
* what the same costs with shmstore (the other front-end processed it);
* a front-end's hit on an image it processed itself, with either cache (the floor).

    python check_processor.py MODEL_DIR [--images 20]

Exit status 0 when every check holds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

#: Image sides (square), small to the model's largest (max_pixels 1344^2).
SIDES = (448, 1120, 1344)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--images", type=int, default=20, help="distinct images per size")
    args = ap.parse_args()

    import numpy as np
    from PIL import Image

    from vllm.config import ModelConfig, ParallelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.cache.base import MultiModalProcessorOnlyCache

    from shmstore.vllm import ShmstoreSenderCache, is_marker

    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            print(f"  FAIL {what}")
            failures.append(what)

    model_config = ModelConfig(model=os.path.abspath(args.model), max_model_len=32768,
                               mm_processor_cache_gb=1, limit_mm_per_prompt={"image": 3})
    vllm_config = SimpleNamespace(model_config=model_config, parallel_config=ParallelConfig())
    processor = MULTIMODAL_REGISTRY.create_processor(model_config)
    rng = np.random.default_rng(0)

    def apply(image, cache):
        """One request (one image, or a list of them) through the processor."""
        images = image if isinstance(image, list) else [image]
        prompt = IMAGE * len(images) + "What is in this image?"
        t = time.perf_counter()
        out = processor(prompt, processor.info.parse_mm_data({"image": images}), cache=cache)
        return out, (time.perf_counter() - t) * 1e3

    def random_image(side: int):
        return Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))

    def prompt_of(out) -> tuple:
        return (out["prompt_token_ids"], out["mm_hashes"],
                [(p.offset, p.length) for p in out["mm_placeholders"]["image"]])

    with tempfile.TemporaryDirectory(prefix="shmstore-processor-", dir="/dev/shm") as d:
        os.environ["SHMSTORE_VLLM_DIR"] = d
        os.environ["SHMSTORE_VLLM_STORE"] = "check-processor"
        first, second = ShmstoreSenderCache(vllm_config), ShmstoreSenderCache(vllm_config)
        for cache in (first, second):
            # The store's background work (page tables, and in its creator the rebuild as
            # 2 MiB pages) done before anything is timed: on two cores it ran beside the
            # first rows and tripled a few of their figures.
            cache.store.prefault()
        vllm_first = MultiModalProcessorOnlyCache(model_config)
        apply(Image.new("RGB", (64, 64)), None)  # warm-up: the HF processor's first call
        print(f"vLLM's Qwen2-VL processor, two front-ends on one store, {args.images} images "
              "per size; medians, ms per image")
        print(f"{'':19} | front-end 2 gets an image front-end 1 processed | front-end 1 gets it again")
        print(f"{'image':>11} {'tokens':>6}  | {'vLLM processor_only':>20} {'shmstore':>16}     | "
              f"{'vLLM processor_only':>20} {'shmstore':>9}")
        try:
            for side in SIDES:
                times: dict[str, list[float]] = {k: [] for k in ("vllm_other", "ours_other",
                                                                 "vllm_own", "ours_own")}
                tokens = 0
                for _ in range(args.images):
                    image = random_image(side)
                    plain, _ = apply(image, None)
                    # vLLM's fallback: front-end 1 processed the image; front-end 2, with
                    # a cache of its own, processes it again.
                    apply(image, vllm_first)
                    vllm_second = MultiModalProcessorOnlyCache(model_config)
                    out, ms = apply(image, vllm_second)
                    times["vllm_other"].append(ms)
                    times["vllm_own"].append(apply(image, vllm_first)[1])
                    # shmstore: front-end 1 processes and stores it, front-end 2 finds it.
                    stored, _ = apply(image, first)
                    h = stored["mm_hashes"]["image"][0]
                    check(second.is_cached([h]) == [True],
                          f"{side}px: the other front-end reports the image cached")
                    second.release_sender_touches()  # is_cached pinned it, as in vLLM
                    hits = second.make_stats().hits
                    shared, ms = apply(image, second)
                    times["ours_other"].append(ms)
                    check(second.make_stats().hits == hits + 1,
                          f"{side}px: the other front-end served the image as a hit")
                    times["ours_own"].append(apply(image, first)[1])
                    check(prompt_of(shared) == prompt_of(stored) == prompt_of(plain) == prompt_of(out),
                          f"{side}px: the same prompt, placeholders and hashes from either "
                          "front-end, with or without a cache")
                    check(all(is_marker(x) for o in (stored, shared)
                              for x in o["mm_kwargs"]["image"]),
                          f"{side}px: both front-ends send the workers a marker")
                    tokens = shared["mm_placeholders"]["image"][0].length
                m = {k: statistics.median(v) for k, v in times.items()}
                print(f"{f'{side}x{side}':>11} {tokens:>6}  | {m['vllm_other']:>8.2f} (processes) "
                      f"{m['ours_other']:>9.2f} ({m['vllm_other'] / m['ours_other']:>3.0f}x faster) | "
                      f"{m['vllm_own']:>20.2f} {m['ours_own']:>9.2f}")
            # A request of three images, two of which the other front-end processed.
            a, b, c = (random_image(448) for _ in range(3))
            apply([a, b], first)
            hits, total = second.make_stats().hits, second.make_stats().total
            plain, _ = apply([a, c, b], None)
            mixed, _ = apply([a, c, b], second)
            st = second.make_stats()
            check((st.hits - hits, st.total - total) == (2, 3),
                  "three images, two processed by the other front-end: 2 hits of 3 "
                  f"(found {st.hits - hits} of {st.total - total})")
            check(prompt_of(mixed) == prompt_of(plain),
                  "three images: the same prompt, placeholders and hashes as without a cache")
            print(f"a request of 3 images, 2 processed by the other front-end: "
                  f"{st.hits - hits} hits of {st.total - total}")
        finally:
            first.close()
            second.close()
    print("every check passed" if not failures else f"{len(failures)} checks failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

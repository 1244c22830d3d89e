"""Demo data: an ImageFolder tree of 100x100 "fruit-like" JPEGs that needs no download.

Each class is a fruit-like blob with its own hue, shape (aspect ratio) and surface pattern, drawn at
a random position, size and rotation-free tilt on a white background with lighting noise, like a
Fruits-360 photo. Hue alone nearly separates the classes, so a small ResNet reaches high accuracy
in a few CPU minutes, yet the random placement and noise keep it from being trivial.
"""
import colorsys
import os

import numpy as np
from PIL import Image

SIZE = 100
_PATTERNS = ("plain", "spots", "stripes", "gradient")


def _class_style(k: int, num_classes: int) -> dict:
    return {"hue": k / num_classes, "aspect": 0.7 + 0.6 * ((k * 7) % num_classes) / max(1, num_classes - 1),
            "pattern": _PATTERNS[k % len(_PATTERNS)]}


def draw_fruit(style: dict, rng: np.random.Generator) -> np.ndarray:
    """One HxWx3 uint8 image of a fruit of the given style."""
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(np.float32)
    cy, cx = rng.uniform(35, 65, size=2)
    radius = rng.uniform(22, 36)
    ry, rx = radius * style["aspect"] ** 0.5, radius / style["aspect"] ** 0.5
    dist = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2
    hue = (style["hue"] + rng.normal(0, 0.02)) % 1.0
    base = np.array(colorsys.hsv_to_rgb(hue, rng.uniform(0.55, 0.95), rng.uniform(0.6, 0.95)), np.float32)
    shade = 1.0 - 0.35 * np.clip(dist, 0, 1)  # darker towards the rim, like a lit sphere
    if style["pattern"] == "spots":
        shade *= 1.0 - 0.25 * (np.sin(xx * 0.9) * np.sin(yy * 0.9) > 0.6)
    elif style["pattern"] == "stripes":
        shade *= 1.0 - 0.2 * (np.sin((xx + yy) * 0.5) > 0.3)
    elif style["pattern"] == "gradient":
        shade *= 0.75 + 0.25 * (yy - cy + ry) / (2 * ry)
    fruit = base[None, None, :] * shade[..., None]
    image = np.where((dist <= 1.0)[..., None], fruit, 1.0)
    image = image + rng.normal(0, 0.03, image.shape)
    return (np.clip(image, 0, 1) * 255).astype(np.uint8)


def synthesize(out_dir: str, num_classes: int = 4, per_class: int = 120, test_fraction: float = 0.25,
               seed: int = 0) -> dict:
    """Write `{out_dir}/Training/<class>/*.jpg` and `{out_dir}/Test/<class>/*.jpg`.

    Returns:
        Image counts: {"Training": n, "Test": m}.
    """
    rng = np.random.default_rng(seed)
    counts = {"Training": 0, "Test": 0}
    num_test = max(1, int(round(per_class * test_fraction)))
    for k in range(num_classes):
        style = _class_style(k, num_classes)
        name = f"fruit_{k:02d}"
        for i in range(per_class + num_test):
            split = "Training" if i < per_class else "Test"
            folder = os.path.join(out_dir, split, name)
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(draw_fruit(style, rng)).save(os.path.join(folder, f"{i:04d}.jpg"), quality=92)
            counts[split] += 1
    return counts


def tie_free_copy(src_dir: str, out_dir: str, per_class: dict = None, noise: int = 8, seed: int = 0) -> dict:
    """Copy an ImageFolder tree with per-pixel noise added, saved losslessly (PNG).

    Fruits-360's uniform white backgrounds make thousands of pre-activations exactly equal, so one
    rounding decision (e.g. a ReLU at 0) flips them all at once; independent noise on every pixel
    removes those ties, which is what a per-step numerical comparison of two implementations needs.

    Args:
        src_dir: tree with `Training/<class>/` and `Test/<class>/`.
        out_dir: where the copy goes.
        per_class: images per class to copy for each split, e.g. {"Training": 4, "Test": 1}; None = all.
        noise: each channel of each pixel moves by a uniform integer in [-noise, noise].
        seed: seed of the noise.

    Returns:
        Image counts per split.
    """
    rng = np.random.default_rng(seed)
    counts = {}
    for split in ("Training", "Test"):
        counts[split] = 0
        for name in sorted(os.listdir(os.path.join(src_dir, split))):
            files = sorted(os.listdir(os.path.join(src_dir, split, name)))
            files = files[:per_class[split]] if per_class else files
            os.makedirs(os.path.join(out_dir, split, name), exist_ok=True)
            for f in files:
                with Image.open(os.path.join(src_dir, split, name, f)) as img:
                    pixels = np.asarray(img.convert("RGB"), dtype=np.int16)
                pixels = np.clip(pixels + rng.integers(-noise, noise + 1, size=pixels.shape), 0, 255)
                Image.fromarray(pixels.astype(np.uint8)).save(
                    os.path.join(out_dir, split, name, os.path.splitext(f)[0] + ".png"))
                counts[split] += 1
    return counts

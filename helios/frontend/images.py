"""Images: decode client bytes safely and prepare them as the core's image profile says.

Everything model-specific is data (manifest VisionProfile); this module only knows the resize
rules by name. Order of checks, so a hostile image costs bounded memory: encoded size, then the
header (format, frame count, pixel extent) read without decoding, then the profile's per-image
token limit, and only then the full decode. Preparation (resize, rescale, normalize, patchify)
runs later, in the engine, only for images outside a reused prefix (engine/images.py).
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from helios.core.manifest import VisionProfile

# Our own profile limits (max_image_pixels) are checked on the header before any decode and are
# stricter than PIL's global bomb guard, which would otherwise raise before we can report the size.
Image.MAX_IMAGE_PIXELS = None

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


class ImageError(ValueError):
    """An image this core refuses; the message names the image and its observed size."""


@dataclass(frozen=True, slots=True)
class ImageHeader:
    format: str  # PNG | JPEG | WEBP
    width: int
    height: int
    num_bytes: int


@dataclass(frozen=True, slots=True)
class ImageCost:
    """What one image costs after the profile's normalization."""

    height: int  # resized extent in pixels
    width: int
    num_patches: int
    num_tokens: int  # patches / k^2: image tokens (usage multimodal_tokens.image)


def read_header(data: bytes, profile: VisionProfile, where: str) -> ImageHeader:
    """Format, extent and frame count from the header alone; refuses what the profile does not accept."""
    if len(data) > profile.max_image_bytes:
        raise ImageError(f"{where} is {len(data)} bytes, over max_image_bytes {profile.max_image_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data))  # lazy: reads the header, decodes nothing
    except Exception:  # PIL raises assorted errors on garbage
        raise ImageError(f"{where} is not a readable PNG, JPEG or WebP image") from None
    with image:
        if image.format not in FORMATS:
            raise ImageError(f"{where} is a {image.format or 'unknown'} image; PNG, JPEG or static WebP are accepted")
        if getattr(image, "is_animated", False) or getattr(image, "n_frames", 1) > 1:
            raise ImageError(f"{where} is animated; only static images are accepted")
        width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"{where} has an empty extent {width}x{height}")
    if width * height > profile.max_image_pixels:
        raise ImageError(f"{where} is {width}x{height} = {width * height} pixels, over max_image_pixels "
                         f"{profile.max_image_pixels}")  # fmt: skip
    return ImageHeader(image.format, width, height, len(data))


def cost(width: int, height: int, profile: VisionProfile) -> ImageCost:
    """The resized grid and token count of a width x height image under the profile's resize rule."""
    if profile.resize != "aspect_ratio_patch_budget":
        raise ImageError(f"this core's image resize rule {profile.resize!r} is not known to this helios")
    ps, k, budget = profile.patch_size, profile.pooling_kernel_size, profile.max_patches
    target_px = budget * ps * ps
    factor = math.sqrt(target_px / (height * width))
    side = k * ps
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    max_side = (budget // k**2) * side
    if th == 0 and tw == 0:
        raise ImageError(f"a {width}x{height} image resizes to nothing under this core's profile")
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, max_side)
    elif tw == 0:
        tw, th = side, min(int(math.floor(height / width)) * side, max_side)
    patches = (th // ps) * (tw // ps)
    return ImageCost(th, tw, patches, patches // k**2)


def decode(data: bytes) -> np.ndarray:
    """Full decode (after read_header accepted it) to RGB uint8 [H, W, 3]; transparency over white."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        image = Image.open(io.BytesIO(data))
        image.load()
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    else:
        image = image.convert("RGB")
    return np.array(image)


def prepare(rgb: np.ndarray, profile: VisionProfile) -> tuple[torch.Tensor, torch.Tensor]:
    """RGB uint8 [H, W, 3] -> (pixel_values [X, 3 * patch^2] fp32, pixel_positions [X, 2] int64), the
    vision program's inputs: resized by the profile, rescaled, normalized, patches in row-major
    order with each patch's pixels in (row, col, channel) order and (x, y) positions."""
    height, width = rgb.shape[:2]
    c = cost(width, height, profile)
    if (c.height, c.width) != (height, width):
        resample = Image.BICUBIC if profile.resample == "bicubic" else Image.BILINEAR
        rgb = np.array(Image.fromarray(rgb).resize((c.width, c.height), resample=resample))
    pixels = (rgb.astype(np.float64) * profile.rescale_factor).astype(np.float32)
    mean, std = np.array(profile.image_mean, np.float32), np.array(profile.image_std, np.float32)
    if mean.any() or (std != 1).any():
        pixels = (pixels - mean) / std
    ps = profile.patch_size
    rows, cols = c.height // ps, c.width // ps
    patches = pixels.reshape(rows, ps, cols, ps, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, ps * ps * 3)
    gy, gx = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    positions = np.stack([gx.reshape(-1), gy.reshape(-1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(patches)), torch.from_numpy(positions.astype(np.int64))


def content_digest(data: bytes, profile: VisionProfile) -> bytes:
    """Prefix identity of one image: its bytes and the profile's processing settings."""
    digest = hashlib.blake2b(data, digest_size=16)
    digest.update(profile.settings_digest())
    return digest.digest()

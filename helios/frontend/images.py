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
import itertools
import math
import platform
import warnings
from dataclasses import dataclass

import msgspec
import numpy as np
import PIL
import torch
from PIL import Image

from helios.core.manifest import VisionProfile

# Our own profile limits (max_image_pixels) are checked on the header before any decode and are
# stricter than PIL's global bomb guard, which would otherwise raise before we can report the size.
Image.MAX_IMAGE_PIXELS = None

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
# Bump when prepare_views' output changes for the same image and profile: host retention keeps
# prepared views across restarts under preparation() (it then starts a new record directory).
PREPARATION_VERSION = 1


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

    height: int  # resized extent of the (global) view in pixels
    width: int
    num_patches: int  # over every view
    num_tokens: int  # patches / k^2: image tokens (usage multimodal_tokens.image)
    tiles: tuple[int, int] = (0, 0)  # (columns, rows) of tile views before the global view; (0, 0): none


@dataclass(frozen=True, slots=True)
class TilePlan:
    """Step 3.7's sliding-window layout of one image (transformers' Step3p7ImageProcessor._plan_patches)."""

    width: int  # extent after squaring and the max_image_side scale-down: the global view's first resize
    height: int
    crop_width: int  # extent the image is resized to before tiles are cut
    crop_height: int
    window: int  # tile side before each tile's resize to tile_size; 0: no tiles
    columns: int
    rows: int
    square_pad: bool  # near-degenerate images are zero-padded to a square (original top-left) first


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
        raise ImageError(
            f"{where} is {width}x{height} = {width * height} pixels, over max_image_pixels {profile.max_image_pixels}"
        )
    return ImageHeader(image.format, width, height, len(data))


def tile_plan(width: int, height: int, profile: VisionProfile) -> TilePlan:
    """Squaring of extreme aspects (min side < 32 and ratio > 4), the scale-down to max_image_side,
    then the window: none when the image fits the global view and is not elongated (ratio <= 1.5),
    the short side when it fits but is elongated or is very elongated (ratio > 4, capped at
    tile_size), else tile_size; each side snaps to a window multiple, up when the remainder
    exceeds a fifth of the window."""
    square_pad = min(width, height) < 32 and max(width / height, height / width) > 4
    if square_pad:
        width = height = max(width, height)
    if max(width, height) > profile.max_image_side:
        scale = profile.max_image_side / max(width, height)
        width, height = int(width * scale), int(height * scale)
    short, long = min(width, height), max(width, height)
    if long <= profile.image_size:
        window = short if long / short > 1.5 else 0
    elif long / short > 4:
        window = min(short, profile.tile_size)
    else:
        window = profile.tile_size
    if window == 0:
        return TilePlan(width, height, width, height, 0, 0, 0, square_pad)
    crop_w, crop_h = (
        window * (d // window + (d % window > 0.2 * window)) if d >= window else d for d in (width, height)
    )
    return TilePlan(
        width, height, crop_w, crop_h, window, max(1, crop_w // window), max(1, crop_h // window), square_pad
    )


def cost(width: int, height: int, profile: VisionProfile) -> ImageCost:
    """The resized grid and token count of a width x height image under the profile's resize rule."""
    if profile.resize == "global_and_tiles":
        plan = tile_plan(width, height, profile)
        ps, k = profile.patch_size, profile.pooling_kernel_size
        patches = plan.columns * plan.rows * (profile.tile_size // ps) ** 2 + (profile.image_size // ps) ** 2
        return ImageCost(profile.image_size, profile.image_size, patches, patches // k**2, (plan.columns, plan.rows))
    if profile.resize == "smart_resize":
        th, tw = smart_resize(width, height, profile)
        patches = (th // profile.patch_size) * (tw // profile.patch_size)
        return ImageCost(th, tw, patches, patches // profile.pooling_kernel_size**2)
    if profile.resize == "fit_and_pad":
        th, tw, _, _ = fit_and_pad(width, height, profile)
        patches = (th // profile.patch_size) * (tw // profile.patch_size)
        return ImageCost(th, tw, patches, patches // profile.pooling_kernel_size**2)
    if profile.resize == "aspect_grid":
        th, tw = aspect_grid(width, height, profile)
        patches = (th // profile.patch_size) * (tw // profile.patch_size)
        return ImageCost(th, tw, patches, patches // profile.pooling_kernel_size**2)
    if profile.resize == "navit":
        _, (th, tw) = navit_resize(width, height, profile)
        patches = (th // profile.patch_size) * (tw // profile.patch_size)
        return ImageCost(th, tw, patches, patches // profile.pooling_kernel_size**2)
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


def smart_resize(width: int, height: int, profile: VisionProfile) -> tuple[int, int]:
    """(height, width) after transformers' Qwen2-VL-style smart_resize: each side rounded to a multiple
    of factor = patch_size * k, then, if the area leaves min_pixels .. max_pixels, both sides scaled
    by one factor into it (floored down, or ceiled up; a side never below factor)."""
    if max(width, height) / min(width, height) > 200:
        raise ImageError(f"a {width}x{height} image's aspect ratio is over 200, which this core's profile refuses")
    factor = profile.patch_size * profile.pooling_kernel_size
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > profile.max_pixels:
        beta = math.sqrt((height * width) / profile.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < profile.min_pixels:
        beta = math.sqrt(profile.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def fit_and_pad(width: int, height: int, profile: VisionProfile) -> tuple[int, int, int, int]:
    """(canvas height, width, content height, width) by transformers' Glm5NextImageProcessor: the
    canvas is each side ceiled to a multiple of factor = patch_size * k, scaled up (sides ceiled)
    when under min_pixels, else cut to the largest height whose aspect-kept canvas fits max_pixels
    (a binary search, as theirs); the image is resized into it by one scale, never up unless
    it is under min_pixels, and zero-padded at the bottom and right."""
    factor = profile.patch_size * profile.pooling_kernel_size

    def align(value: int) -> int:
        return math.ceil(value / factor) * factor

    th, tw = align(height), align(width)
    if th * tw < profile.min_pixels:
        scale = math.sqrt(profile.min_pixels / (height * width))
        th, tw = align(max(1, math.ceil(height * scale))), align(max(1, math.ceil(width * scale)))
    if th * tw > profile.max_pixels:
        low, high, th, tw = 1, height, factor, factor
        while low <= high:
            middle = (low + high) // 2
            h, w = align(middle), align(max(1, math.floor(width * middle / height)))
            if h * w <= profile.max_pixels:
                th, tw, low = h, w, middle + 1
            else:
                high = middle - 1
    scale = min(th / height, tw / width)
    if height * width >= profile.min_pixels:
        scale = min(1.0, scale)
    return th, tw, max(1, min(th, math.floor(height * scale))), max(1, min(tw, math.floor(width * scale)))


def navit_resize(width: int, height: int, profile: VisionProfile) -> tuple[tuple[int, int], tuple[int, int]]:
    """((height, width) resized, (height, width) padded) as transformers' Kimi K2.5 navit_resize: one
    scale, never above 1, keeping the whole-patch count within patch_budget and each side within
    max_side_patches patches (sides truncated, at least 1 pixel), then each side padded up to a
    multiple of factor = patch_size * k."""
    ps, side = profile.patch_size, profile.max_side_patches
    patches = max(1, height // ps) * max(1, width // ps)
    scale = min(1.0, math.sqrt(profile.patch_budget / patches), side * ps / height, side * ps / width)
    new_h = min(max(1, int(height * scale)), side * ps)
    new_w = min(max(1, int(width * scale)), side * ps)
    factor = ps * profile.pooling_kernel_size
    return (new_h, new_w), (-(-new_h // factor) * factor, -(-new_w // factor) * factor)


def aspect_grid(width: int, height: int, profile: VisionProfile) -> tuple[int, int]:
    """(height, width) by transformers' MuseGlimmerImageProcessor smart_resize: in tokens of factor =
    patch_size * k pixels, the ideal grid (height / factor, width / factor) scaled down to the cap of
    max_patches / k^2 tokens when over it, then among its floor / ceil grids within the cap (at least
    one token a side) the one whose aspect ratio is nearest the image's (ties: the first in
    transformers' candidate order), else the rounded ideal grid."""
    factor = profile.patch_size * profile.pooling_kernel_size
    cap = profile.max_patches // profile.pooling_kernel_size**2
    ideal_h, ideal_w = height / factor, width / factor
    ratio = ideal_w / ideal_h if ideal_h > 0 else 1.0
    if ideal_h * ideal_w > cap:
        ideal_h = (cap / ratio) ** 0.5
        ideal_w = ideal_h * ratio
    candidates = list(
        set(itertools.product([math.floor(ideal_h), math.ceil(ideal_h)], [math.floor(ideal_w), math.ceil(ideal_w)]))
    )
    candidates = [(h, w) for h, w in candidates if h >= 1 and w >= 1 and h * w <= cap]
    if not candidates:
        candidates = [(max(1, round(ideal_h)), max(1, round(ideal_w)))]
    grid_h, grid_w = min(candidates, key=lambda grid: abs(grid[0] / grid[1] - height / width))
    return grid_h * factor, grid_w * factor


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


def prepare_views(rgb: np.ndarray, profile: VisionProfile) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """RGB uint8 [H, W, 3] -> the vision program's inputs for each view of the image, in feature
    order: prepare()'s one view, under global_and_tiles the tiles (row-major) then the global view, or
    under smart_resize, fit_and_pad or navit one view in merge-block order (_prepare_merge_blocks)."""
    if profile.resize in ("smart_resize", "fit_and_pad", "navit", "aspect_grid"):
        return [_prepare_merge_blocks(rgb, profile)]
    if profile.resize != "global_and_tiles":
        return [prepare(rgb, profile)]
    height, width = rgb.shape[:2]
    plan = tile_plan(width, height, profile)
    image = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).contiguous()  # [3, H, W] uint8
    if plan.square_pad:
        side = max(width, height)
        image = torch.nn.functional.pad(image, (0, side - width, 0, side - height))
    views = []
    if plan.window:
        crop, w, t = _resize(image, plan.crop_height, plan.crop_width, profile), plan.window, profile.tile_size
        views += [
            _resize(crop[:, y : y + w, x : x + w], t, t, profile)
            for y in range(0, plan.crop_height, w)
            for x in range(0, plan.crop_width, w)
        ]
    size = profile.image_size
    views.append(_resize(_resize(image, plan.height, plan.width, profile), size, size, profile))
    # Rescale and normalize fused into one mean/std (as transformers' torch image processors do).
    mean = (torch.tensor(profile.image_mean) * (1.0 / profile.rescale_factor))[:, None, None]
    std = (torch.tensor(profile.image_std) * (1.0 / profile.rescale_factor))[:, None, None]
    return [_patchify(((view.float() - mean) / std).permute(1, 2, 0).numpy(), profile.patch_size) for view in views]


def _resize(image: torch.Tensor, height: int, width: int, profile: VisionProfile) -> torch.Tensor:
    """[3, h, w] uint8 -> [3, height, width] uint8 by the profile's filter, as torchvision resizes
    on the CPU: natively on uint8 (AVX2/AVX512 hosts), else in fp32 then rounded."""
    if tuple(image.shape[1:]) == (height, width):
        return image
    if profile.resample == "torch_bicubic":  # torchvision resizes uint8 natively by bicubic on every CPU
        out = torch.nn.functional.interpolate(
            image[None], size=[height, width], mode="bicubic", align_corners=False, antialias=True
        )
        return out[0]
    if profile.resample != "torch_bilinear":
        resample = {"bicubic": Image.BICUBIC, "lanczos": Image.LANCZOS}.get(profile.resample, Image.BILINEAR)
        pil = Image.fromarray(image.permute(1, 2, 0).contiguous().numpy()).resize((width, height), resample=resample)
        return torch.from_numpy(np.array(pil)).permute(2, 0, 1)
    native = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64", "arm64")
    x = image[None] if native else image[None].float()
    out = torch.nn.functional.interpolate(x, size=[height, width], mode="bilinear", align_corners=False, antialias=True)
    return out[0] if native else out[0].round().to(torch.uint8)


def _patchify(pixels: np.ndarray, ps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[H, W, 3] fp32 -> (patches [X, ps * ps * 3] in (row, col, channel) order, row-major; (x, y) positions)."""
    rows, cols = pixels.shape[0] // ps, pixels.shape[1] // ps
    patches = pixels.reshape(rows, ps, cols, ps, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, ps * ps * 3)
    gy, gx = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    positions = np.stack([gx.reshape(-1), gy.reshape(-1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(patches)), torch.from_numpy(positions.astype(np.int64))


def _prepare_merge_blocks(rgb: np.ndarray, profile: VisionProfile) -> tuple[torch.Tensor, torch.Tensor]:
    """smart_resize's (or fit_and_pad's, navit's) one view: resized (fit_and_pad, navit: then zero-padded to its
    canvas, before normalization), rescaled and normalized (fused, as transformers' torch image
    processors do), patches in k x k merge-block order, each patch's pixels in (channel, frame, row,
    col) order over temporal_patch_size copies of the image, with (x, y) positions."""
    height, width = rgb.shape[:2]
    c = cost(width, height, profile)
    image = torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1).contiguous()
    if profile.resize in ("fit_and_pad", "navit"):
        if profile.resize == "navit":
            content_h, content_w = navit_resize(width, height, profile)[0]
        else:
            _, _, content_h, content_w = fit_and_pad(width, height, profile)
        image = torch.nn.functional.pad(
            _resize(image, content_h, content_w, profile), (0, c.width - content_w, 0, c.height - content_h)
        )
    else:
        image = _resize(image, c.height, c.width, profile)
    mean = (torch.tensor(profile.image_mean) * (1.0 / profile.rescale_factor))[:, None, None]
    std = (torch.tensor(profile.image_std) * (1.0 / profile.rescale_factor))[:, None, None]
    pixels = (image.float() - mean) / std  # [3, H, W]
    ps, k, frames = profile.patch_size, profile.pooling_kernel_size, max(1, profile.temporal_patch_size)
    rows, cols = c.height // ps, c.width // ps
    blocks = pixels.reshape(3, rows // k, k, ps, cols // k, k, ps).permute(1, 4, 2, 5, 0, 3, 6)  # [R, C, k, k, 3, p, p]
    patches = blocks.unsqueeze(5).expand(-1, -1, -1, -1, -1, frames, -1, -1).reshape(rows * cols, 3 * frames * ps * ps)
    gy, gx = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    order = (rows // k, k, cols // k, k)
    ys, xs = (g.reshape(order).transpose(1, 2).reshape(-1) for g in (gy, gx))
    return patches.contiguous(), torch.stack([xs, ys], dim=-1)


def token_layout(cost: ImageCost, profile: VisionProfile) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """The tokens one image placeholder expands to, and where its feature rows sit among them:
    (offset, rows) runs in feature order (one per view)."""
    ids: list[int] = []
    runs: list[tuple[int, int]] = []
    columns, rows = cost.tiles
    per_tile = (profile.tile_size // profile.patch_size // profile.pooling_kernel_size) ** 2 if columns else 0
    for row in range(rows):
        for column in range(columns):
            ids += profile.tile_prefix_token_ids
            runs.append((len(ids), per_tile))
            ids += [profile.image_token_id] * per_tile + list(profile.tile_suffix_token_ids)
            if column == columns - 1 and row < rows - 1:
                ids += profile.tile_row_separator_token_ids
    ids += profile.prefix_token_ids
    rest = cost.num_tokens - columns * rows * per_tile
    runs.append((len(ids), rest))
    ids += [profile.image_token_id] * rest + list(profile.suffix_token_ids)
    return ids, tuple(runs)


def preparation(profile: VisionProfile) -> str:
    """What an image's prepared views depend on beyond its bytes: the whole profile, this code's
    version, and the libraries and CPU path (_resize) that resize and normalize it."""
    return "|".join(
        (
            f"v{PREPARATION_VERSION}",
            msgspec.json.encode(profile).decode(),
            f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()} {platform.machine()}",
            f"PIL {PIL.__version__}",
            f"numpy {np.__version__}",
        )
    )


def source_description(header: ImageHeader) -> tuple[int, int, int, int]:
    """An image's source as its header says (format number, width, height, encoded bytes): what a
    retained record of its prepared views must describe to be served for it."""
    return (tuple(FORMATS).index(header.format), header.width, header.height, header.num_bytes)


def content_digest(data: bytes, profile: VisionProfile) -> bytes:
    """Prefix identity of one image: its bytes and the profile's processing settings."""
    digest = hashlib.blake2b(data, digest_size=16)
    digest.update(profile.settings_digest())
    return digest.digest()

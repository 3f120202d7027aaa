"""core.json: the manifest of a core bundle, format version 2 (version 1: no `parallel`).

The manifest is the contract between ignition (which writes it) and helios (which
serves from it). Its structs are decoded strictly; the format name and version are
checked before anything else so that a newer core is refused with a clear message.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from helios.core.sampling import SamplingSpec

FORMAT_NAME = "flare-core"
# 3: quantized weights (`quantization`); 4: float16 scales; 5: a compiled step that needs this
# version's native kernels (int8-activation blobs with scales beside their weights, topk_rows).
# A core is written at the oldest version it needs.
FORMAT_VERSION = 5
OLDEST_FORMAT_VERSION = 1  # read as a core declaring only one rank (no `parallel` record)
MANIFEST_FILE = "core.json"
MAX_TOP_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 128  # per request, before deduplication; the chosen token may add one


class _Struct(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class FormatTag(_Struct):
    name: str  # always FORMAT_NAME
    version: int  # bumped on any incompatible change


class SourceIdentity(_Struct):
    kind: str  # "gguf" | "hf-dir" | "hf-cache"
    reference: str  # what the user passed (path or repo id), for humans only
    files: dict[str, str]  # source file name -> sha256 of its bytes
    format: str = ""  # how the source stored its weights ("gguf Q4_1+F32", "safetensors nvfp4 (modelopt)"); "" before it was recorded


class ModelInfo(_Struct):
    id: str  # checkpoint identifier (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)
    aliases: tuple[str, ...]  # extra names the model answers to; the first is the public id
    family: str  # ignition architecture family that produced the programs
    name: str  # human-readable name from the checkpoint
    source: SourceIdentity


class RecipeInfo(_Struct):
    """The recipe as resolved at export time."""

    name: str
    family: str
    basis: str  # where the sampling settings come from (model card, etc.)
    sampling: SamplingSpec
    template_source: str  # "checkpoint", "file:NAME" or "native:NAME"
    reasoning_syntax: str | None  # output parser name for reasoning regions
    tool_syntax: str | None  # output parser name for tool calls
    effort_levels: tuple[str, ...]  # named reasoning-effort vocabulary accepted by the template
    default_effort: str | None


class TokenizerInfo(_Struct):
    file: str  # tokenizer.json (Hugging Face tokenizers format)
    vocab_size: int  # rows of the output distribution (may exceed the tokenizer's vocabulary)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # every id that ends generation
    pad_token_id: int | None
    add_bos_token: bool  # prepend BOS when encoding raw text
    special_tokens: dict[str, int]  # control tokens, content -> id
    chat_template: str | None  # file holding the Jinja chat template


class Limits(_Struct):
    max_model_len: int  # prompt + output tokens per sequence
    page_tokens: int  # tokens per KV page


class ExtraCache(_Struct):
    """A per-token cache some layers keep beside their keys and values (e.g. a sparse-attention
    indexer's keys): one tensor [num_pages, page_tokens, num_heads, head_dim] per listed layer,
    on the same pages as the KV (same block tables and slot mapping), in the KV dtype."""

    name: str  # what the family calls it, for humans (e.g. "index_keys")
    layers: tuple[int, ...]  # the layers holding one, ascending
    num_heads: int
    head_dim: int


class WindowPool(_Struct):
    """Sliding-window layers whose paged caches live in a second, smaller pool (KvLayout.window_pool).

    Their tensors are [num_window_pages, page_tokens, heads, head_dim], addressed by the step's
    `window_slot_mapping` and `window_block_tables` inputs (one table per sequence over the same
    logical page indexes as block_tables). Once every query still to come is past a page's
    window, the runner may free it and leave any id in its table entry: these layers never read
    keys more than `window` - 1 positions behind their query. A runner that does not reclaim
    passes the main pool's tables for both (the caches then have as many pages as the others)."""

    window: int  # tokens: key j is visible to the query at p iff p - window < j <= p (the largest of these layers')
    caches: tuple[int, ...]  # indexes into the program's paged cache list (KvLayout.cache_shapes order), ascending


class StateCache(_Struct):
    """Fixed-size per-sequence state some layers carry instead of (or beside) paged KV: a
    recurrent layer's conv window or its SSM / linear-attention state. One tensor
    [num_slots, *shape] per listed layer; a sequence owns one slot (KvLayout.state)."""

    name: str  # what the family calls it, for humans (e.g. "conv", "ssm")
    layers: tuple[int, ...]  # the layers holding one, ascending
    shape: tuple[int, ...]  # per-slot shape
    dtype: str = "float32"  # torch dtype name (recurrent state stays fp32 in a 16-bit core)


class KvLayout(_Struct):
    """Enough for helios to allocate the paged cache without knowing the architecture."""

    num_layers: int  # program takes 2 * num_layers cache tensors: k0, v0, k1, v1, ... (see shared_kv)
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name of the cache pages
    # True: one cache tensor per layer, read as both keys and values (MLA's latent cache),
    # so the program takes num_layers tensors; absent in cores written before it existed.
    shared_kv: bool = False
    # Extra per-token caches, after the KV tensors in the program's list: each entry's layers
    # in order, entries in order; absent (none) in cores written before it existed.
    extra: tuple[ExtraCache, ...] = ()
    # Recurrent state slots, after every paged cache in the program's list: each entry's layers
    # in order, entries in order. A core with state takes the `state_slots` input; absent (none)
    # in cores written before it existed.
    state: tuple[StateCache, ...] = ()
    # Sliding-window layers' caches in a second page pool (their pages reclaimed behind the window);
    # absent (none) in cores written before it existed and in families that keep one pool.
    window_pool: WindowPool | None = None

    @property
    def num_caches(self) -> int:
        """Paged cache tensors the program takes (shapes: cache_shapes); the state tensors follow."""
        return len(self.cache_shapes())

    def state_shapes(self) -> tuple[tuple[tuple[int, ...], str], ...]:
        """(per-slot shape, dtype) of each state tensor in the program's order, after the paged
        caches; every tensor is [num_slots, *shape]."""
        return tuple((tuple(e.shape), e.dtype) for e in self.state for _ in e.layers)

    @property
    def slot_bytes(self) -> int:
        """Bytes one sequence's state slot takes over all state tensors."""
        return sum(math.prod(shape) * _dtype_size(dtype) for shape, dtype in self.state_shapes())

    def cache_shapes(self) -> tuple[tuple[int, int], ...]:
        """(heads, head_dim) of each cache tensor in the program's order; every tensor is
        [num_pages, page_tokens, heads, head_dim]."""
        main = ((self.num_kv_heads, self.head_dim),) * (self.num_layers if self.shared_kv else 2 * self.num_layers)
        return main + tuple((e.num_heads, e.head_dim) for e in self.extra for _ in e.layers)

    @property
    def token_elements(self) -> int:
        """Cache elements one token takes over the main pool's tensors (page bytes = page_tokens *
        this * dtype size); without a window pool, over every tensor."""
        windowed = set(self.window_pool.caches) if self.window_pool is not None else set()
        return sum(heads * dim for index, (heads, dim) in enumerate(self.cache_shapes()) if index not in windowed)

    @property
    def window_token_elements(self) -> int:
        """Cache elements one token takes over the window pool's tensors (0 without one)."""
        if self.window_pool is None:
            return 0
        shapes = self.cache_shapes()
        return sum(shapes[index][0] * shapes[index][1] for index in self.window_pool.caches)


def _dtype_size(dtype: str) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[dtype]


class Capabilities(_Struct):
    max_top_logprobs: int  # natural alternatives per generated position, 0..20
    explicit_logprob_ids: bool  # programs accept caller-chosen ids to score
    prompt_logprobs: bool  # the scored_prefill program exists
    vision: bool


class VisionProfile(_Struct):
    """How helios prepares an image for the core's `vision` program, and the limits it admits.

    Preparation (helios.frontend.images): decode, convert to RGB, resize by `resize` into one
    or more views, scale by rescale_factor, normalize by mean/std, cut each view into
    patch_size squares in row-major order (each patch's pixels in (row, col, channel) order)
    with (x, y) patch positions; the vision program runs once per view and a view costs
    patches / pooling_kernel_size^2 tokens. The chat template renders one placeholder_token_id
    per image; the frontend expands it to the tile views' tokens (only under a tiling rule:
    each tile framed by tile_prefix/tile_suffix_token_ids, tile_row_separator_token_ids after
    the last tile of every row but the last), then prefix_token_ids, the (global) view's
    image_token_id rows and suffix_token_ids. Image-token rows' embeddings are replaced by the
    vision features, views in that order; framing tokens are ordinary prompt tokens. Under
    smart_resize, patches come in k x k merge-block order (blocks row-major, patches row-major
    inside each) and each patch's pixels in (channel, frame, row, col) order, the still image
    repeated over temporal_patch_size frames (transformers' Qwen2-VL-style processors' layout);
    navit lays patches out the same way with one frame.
    """

    resize: str  # "aspect_ratio_patch_budget": one view, the largest aspect-preserving size of at most
    # max_patches patches whose sides are multiples of patch_size * pooling_kernel_size (Gemma 4);
    # "global_and_tiles": a square image_size global view after zero or more tile_size tiles cut
    # by Step 3.7's sliding-window plan (frontend/images.py tile_plan; Step 3.7); "smart_resize": one
    # view, sides rounded to multiples of patch_size * k with the area kept within min_pixels ..
    # max_pixels (frontend/images.py smart_resize; MiniMax M3); "fit_and_pad": one view, sides ceiled to
    # multiples of patch_size * k within min_pixels .. max_pixels, the image scaled into it (never up
    # unless under min_pixels) and zero-padded at the bottom and right, patches as smart_resize's
    # (frontend/images.py fit_and_pad; GLM-5.3); "navit": one view scaled down (never up) to at most
    # patch_budget patches and max_side_patches patches a side, then zero-padded at the bottom and right
    # to multiples of patch_size * k, patches as smart_resize's, one frame (frontend/images.py
    # navit_resize; Kimi K2.5); "aspect_grid": one view, the grid of patch_size * k tokens nearest the
    # image's aspect ratio within max_patches / k^2 tokens, patches as smart_resize's (frontend/images.py
    # aspect_grid; Muse Spark)
    patch_size: int  # pixels per patch side
    pooling_kernel_size: int  # k: k x k patches merge into one token (per view)
    max_patches: int  # per view (one vision program call); the only view under aspect_ratio_patch_budget
    resample: str  # "bicubic" | "bilinear" (PIL filters) | "torch_bilinear" (antialiased bilinear on
    # uint8 tensors, rounded per resize, as torchvision's CPU resize computes it) | "torch_bicubic" (the same,
    # antialiased bicubic) | "lanczos" (PIL's filter)
    rescale_factor: float  # uint8 pixel -> [0, 1]
    image_mean: tuple[float, ...]  # per channel, after rescaling
    image_std: tuple[float, ...]
    placeholder_token_id: int  # what the chat template renders for one image
    image_token_id: int  # one per image token in the prompt
    prefix_token_ids: tuple[int, ...]  # framing before the image tokens (counted in prompt_tokens only)
    suffix_token_ids: tuple[int, ...]
    feature_dim: int  # columns of image_features (the language model's hidden size)
    # The /v1/models limits (spec "Native inference APIs"), at the exported context length;
    # helios lowers the context-derived ones to its served max_model_len.
    max_images_per_prompt: int
    max_image_tokens_per_prompt: int
    image_feature_window_tokens: int
    max_image_tokens_per_image: int
    max_image_pixels: int
    max_image_bytes: int
    # Tiling rules only (global_and_tiles); zeros and empty under aspect_ratio_patch_budget, so
    # cores written before these fields read unchanged.
    image_size: int = 0  # the global view's side in pixels (multiple of patch_size * k)
    tile_size: int = 0  # each tile's side after resizing (multiple of patch_size * k)
    max_image_side: int = 0  # a longer side is first scaled down to this
    tile_prefix_token_ids: tuple[int, ...] = ()  # framing around each tile's image tokens
    tile_suffix_token_ids: tuple[int, ...] = ()
    tile_row_separator_token_ids: tuple[int, ...] = ()  # after the last tile of each row but the last
    # smart_resize and fit_and_pad only; zeros under the other rules, so older cores read unchanged.
    min_pixels: int = 0  # the resized area's bounds (transformers' size shortest_edge / longest_edge)
    max_pixels: int = 0
    temporal_patch_size: int = 0  # frames per patch row (the still image repeated); 0: one frame, no repeat
    # navit only; zeros under the other rules, so cores written before these fields read unchanged.
    patch_budget: int = 0  # patches before padding (transformers' max_patches)
    max_side_patches: int = 0  # a side's limit in patches before padding (transformers' size max_height)

    def settings_digest(self) -> bytes:
        """The processing settings as bytes, for the prefix identity of pages after an image."""
        import hashlib

        fields: tuple = (
            self.resize,
            self.patch_size,
            self.pooling_kernel_size,
            self.max_patches,
            self.resample,
            self.rescale_factor,
            self.image_mean,
            self.image_std,
        )
        if self.tile_size:  # only tiling profiles: a Gemma 4 core's digests stay what they were
            fields += (self.image_size, self.tile_size, self.max_image_side)
        if self.max_pixels:  # only smart_resize / fit_and_pad profiles: older cores' digests stay what they were
            fields += (self.min_pixels, self.max_pixels, self.temporal_patch_size)
        if self.patch_budget:  # only navit profiles: older cores' digests stay what they were
            fields += (self.patch_budget, self.max_side_patches)
        return hashlib.blake2b(repr(fields).encode(), digest_size=8).digest()


class WeightsInfo(_Struct):
    file: str
    dtype: str
    num_parameters: int


class HostEmbedding(_Struct):
    """An embedding table the step programs do not hold (ignition export --host-embeddings): the
    runner gathers the rows of each step token and passes them as the program input `input`
    [T, width] in `dtype`, exactly the table's rows. The table stays in the core's weights file
    (`file`, its row-major bytes at `offset`), outside the weights dict the programs take; helios
    serves it from RAM or a memory map through a device row cache (helios.engine.memory.embedding_rows).
    A step row whose input embedding is an image feature (the step's image_rows) takes the row of
    `image_row_id` instead of its token's (None: no substitution, a text-only core)."""

    name: str  # the weight's name in the weights file (e.g. "embed_per_layer")
    input: str  # the step input it feeds (e.g. "embed_per_layer_rows")
    rows: int
    width: int
    dtype: str  # torch dtype name of the stored rows and of the input
    file: str  # the safetensors file holding the bytes (the core's weights file)
    offset: int  # byte offset of row 0 in that file
    image_row_id: int | None = None


class OpSet(_Struct):
    namespace: str
    version: int
    ops: tuple[str, ...]


class TensorSpec(_Struct):
    name: str
    dtype: str
    shape: tuple[str | int, ...]  # symbolic dims are names (T tokens, B sequences, ...)


class ProgramSpec(_Struct):
    file: str  # torch.export archive, saved without weights or example inputs
    inputs: tuple[TensorSpec, ...]  # after the weights dict and the KV cache list
    outputs: tuple[TensorSpec, ...]


class HostFingerprint(_Struct):
    """The machine a compiled artifact was built for (helios.core.host)."""

    machine: str  # platform.machine(), e.g. x86_64
    isa: tuple[str, ...]  # instruction-set flags that change generated code or weight packing
    torch_version: str


class CompiledSpec(_Struct):
    """A program compiled ahead of time for one host (AOTInductor), weights packed inside.

    It takes the KV cache list and the portable program's inputs (no weights dict) and
    returns the same outputs; on any other host helios runs the portable program.
    """

    file: str  # the AOTInductor model's shared object
    host: HostFingerprint
    max_abs_diff: float  # largest logprob difference from the portable program on the golden prompts


class GoldenInfo(_Struct):
    file: str  # safetensors with the recorded full-vocabulary logprobs
    prompts: tuple[tuple[int, ...], ...]  # token ids of the fixed prompts
    prefill_chunk: int  # chunk size the check prefills with (exercises paged KV)
    tolerance: float  # max absolute logprob difference accepted
    max_abs_diff: float  # program vs the plain-torch reference, measured at export


class Provenance(_Struct):
    ignition_version: str
    torch_version: str
    exported_at: str  # the only field that differs between two exports of one source


class ParallelLayout(_Struct):
    """One declared tensor-parallel size N > 1: the rank programs (one file per kind, the same for
    every rank: a rank's offsets are weights) and each rank's weight shard (docs/parallel.md)."""

    programs: dict[str, ProgramSpec]  # kind -> the rank program (traced with heads, kv heads, MLP width / N)
    weights: tuple[WeightsInfo, ...]  # rank r's shard is weights[r]
    kv: KvLayout  # each rank's caches (kv heads / N); every rank's pool has the same page count
    expert: bool = False  # experts split across the ranks (expert parallel) instead of each expert's width


class Parallel(_Struct):
    """The tensor-parallel sizes a core can be served at; absent: one rank only."""

    tensor: tuple[int, ...] = (1,)  # declared sizes, ascending, always with 1
    layouts: dict[str, ParallelLayout] = {}  # str(N) -> its layout, every declared N > 1


# omit_defaults: "activations" is written only where int8, so an older helios reads float-activation cores.
class QuantizedTensor(_Struct, omit_defaults=True):
    """One weight stored quantized (layout: helios.core.quant): the programs take it as a float
    tensor of `shape` and `dtype`; helios runs its linears on the stored values, or dequantizes."""

    format: str  # "int8" | "int4"
    group: int  # elements per scale along the input dimension: 32, 64 or 128
    scale_dtype: str  # "float32" | "bfloat16" | "float16" (format version 4)
    shape: tuple[int, ...]  # the float weight's shape, [..., out, in]
    dtype: str  # the dtype the programs take the weight in
    origin: str = "export"  # "export" (quantized by ignition) or the source block type kept as is, e.g. "gguf Q4_K"
    # What its linears multiply it by: "float" (the activations as they are: the exact product of the
    # stored values) or "int8" (export --quant-activations int8: each activation row quantized per
    # 32-feature block to int8 with one float32 scale, as llama.cpp's Q8_0, and integer dot products;
    # helios.engine.quantized_ref is its reference). The self-check figures were measured so.
    activations: str = "float"


class QuantSelfCheck(_Struct):
    """The export's measurement of the quantized core against the same checkpoint unquantized."""

    prompts: int  # calibration prompts compared
    positions: int  # next-token distributions compared over them
    top1_agreement: float  # fraction of positions whose most likely token is the same
    max_abs_logprob_diff: float  # over every vocabulary entry of every compared position
    mean_abs_logprob_diff: float
    perplexity: float  # of the quantized core on the shipped text
    reference_perplexity: float  # of the unquantized weights on the same text
    perplexity_tokens: int
    requantized: dict[str, float] = {}  # source tensors whose blocks had no core layout -> max |error| of requantizing


class Quantization(_Struct):
    """Weights stored at fewer bits (ignition export --quantize, or a quantized GGUF kept as is)."""

    level: str  # what users see, e.g. "int4-g32" (quant.level); "int4-g32+int8-g32" when tensors differ
    tensors: dict[str, QuantizedTensor]  # weight name -> how it is stored; unlisted weights are stored as is
    self_check: QuantSelfCheck | None = None


class Manifest(_Struct):
    format: FormatTag
    model: ModelInfo
    recipe: RecipeInfo
    tokenizer: TokenizerInfo
    limits: Limits
    kv: KvLayout
    capabilities: Capabilities
    decode_weight_bytes: int  # weight bytes one decode step reads for one request
    weights: WeightsInfo
    ops: OpSet
    programs: dict[str, ProgramSpec]  # "step", optional "scored_prefill"
    decode_buckets: tuple[int, ...]  # batch sizes for which CUDA graphs are captured
    golden: GoldenInfo
    provenance: Provenance
    files: dict[str, str]  # every other file of the bundle -> sha256
    compiled: dict[str, CompiledSpec] = {}  # program kind -> its ahead-of-time build, where exported
    vision: VisionProfile | None = None  # image preparation of a vision core (capabilities.vision); None: text-only
    parallel: Parallel = Parallel()  # tensor-parallel sizes and their rank programs and shards (format 2)
    # Tables the programs take as gathered rows instead of weights (export --host-embeddings); absent: none.
    host_embeddings: tuple[HostEmbedding, ...] = ()
    quantization: Quantization | None = None  # quantized weights (format 3); None: every weight as stored dtype

    @property
    def public_id(self) -> str:
        """The name discovery routes advertise: first nonempty alias, else the checkpoint id."""
        return next((a for a in self.model.aliases if a), self.model.id)


class ManifestError(ValueError):
    """The manifest is missing, malformed or of an unsupported format."""


class FormatTooNew(ManifestError):
    """The core was written by a newer ignition than this code understands."""


def encode(manifest: Manifest) -> bytes:
    """Deterministic, human-readable JSON (sorted dict keys, struct fields in order)."""
    raw = msgspec.json.encode(manifest, order="deterministic")
    return msgspec.json.format(raw, indent=2) + b"\n"


def decode(data: bytes) -> Manifest:
    """Parse core.json, refusing other formats and newer versions before the schema."""
    try:
        head: Any = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{MANIFEST_FILE} is not valid JSON: {exc}") from exc
    tag = head.get("format") if isinstance(head, dict) else None
    if not isinstance(tag, dict) or tag.get("name") != FORMAT_NAME:
        raise ManifestError(f"{MANIFEST_FILE} is not a Flare core manifest (format.name != {FORMAT_NAME!r})")
    version = tag.get("version")
    if not isinstance(version, int):
        raise ManifestError(f"{MANIFEST_FILE} has no integer format.version")
    if version > FORMAT_VERSION:
        raise FormatTooNew(
            f"core format version {version} is newer than this Flare understands (version {FORMAT_VERSION}): "
            "upgrade Flare, or re-export the core with this version's `ignition export`"
        )
    if version < OLDEST_FORMAT_VERSION:
        raise ManifestError(
            f"core format version {version} is no longer supported (oldest {OLDEST_FORMAT_VERSION}): "
            "re-export the core with `ignition export`"
        )
    try:
        return msgspec.json.decode(data, type=Manifest)
    except msgspec.ValidationError as exc:
        raise ManifestError(f"{MANIFEST_FILE} does not match format version {FORMAT_VERSION}: {exc}") from exc

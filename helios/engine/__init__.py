"""The engine's face: the only names the rest of helios imports from the engine (ARCHITECTURE.md,
"The engine's face"). Submodules below import each other directly, never from this package."""

from helios.engine.build import build_engine
from helios.engine.client import EngineClient, EngineUnavailable, FlushRefused, QueueFull, RequestRejected
from helios.engine.devices import DeviceError, is_cuda
from helios.engine.devices import resolve as resolve_device
from helios.engine.engine import EngineConfig, HostCacheConfig, LLMEngine
from helios.engine.logprobs import RankedLogprob, TokenLogprobs
from helios.engine.memory.embedding_rows import RowCacheConfig
from helios.engine.memory.host_store import default_directory as default_host_cache_directory
from helios.engine.memory.host_store import default_memory_bytes as default_host_cache_memory_bytes
from helios.engine.memory.vision_inputs import RestoredInputs, VisionInputStore, vision_identity
from helios.engine.metrics import EMPTY_HISTOGRAM, CacheFlush, EngineMetrics, HistogramSnapshot, HostStoreMetrics
from helios.engine.parallel.launch import plan_from as parallel_plan
from helios.engine.parallel.launch import run_headless as serve_headless_rank
from helios.engine.parallel.launch import start as start_parallel
from helios.engine.parallel.world import World as ParallelWorld
from helios.engine.parallel.world import WorldError as ParallelError
from helios.engine.parallel.world import rank_core
from helios.engine.request import (
    IMAGE_COUNTERS,
    EngineEvent,
    EngineImage,
    EngineRequest,
    FinishCause,
    MaskRow,
    ReasoningBudget,
    ReasoningGate,
    TokenConstraint,
)
from helios.engine.sampling_params import GREEDY, SamplingParams
from helios.engine.speculation.draft_core import incompatibility as draft_core_incompatibility
from helios.engine.speculation.drafter import MaskHook, SpeculationConfig

__all__ = [
    # the client and its errors
    "EngineClient",
    "EngineUnavailable",
    "QueueFull",
    "RequestRejected",
    # dropping the prefix caches (POST /flush_cache)
    "CacheFlush",
    "FlushRefused",
    # the engine, built from its config
    "EngineConfig",
    "HostCacheConfig",
    "RowCacheConfig",
    "SpeculationConfig",
    "LLMEngine",
    "build_engine",
    "DeviceError",
    "resolve_device",
    "is_cuda",
    "draft_core_incompatibility",
    "default_host_cache_directory",
    "default_host_cache_memory_bytes",
    # tensor/expert parallel serving (helios.engine.parallel)
    "ParallelWorld",
    "ParallelError",
    "parallel_plan",
    "start_parallel",
    "serve_headless_rank",
    "rank_core",
    # host retention of CPU vision inputs (the frontend looks there before decoding an image)
    "VisionInputStore",
    "RestoredInputs",
    "vision_identity",
    # requests in
    "EngineRequest",
    "EngineImage",
    "ReasoningBudget",
    "ReasoningGate",
    "IMAGE_COUNTERS",
    "SamplingParams",
    "GREEDY",
    # structured output: the constraint the frontend builds, and the rows its mask hook reads
    "TokenConstraint",
    "MaskRow",
    "MaskHook",
    # events out
    "EngineEvent",
    "FinishCause",
    "TokenLogprobs",
    "RankedLogprob",
    # metrics
    "EngineMetrics",
    "HostStoreMetrics",
    "HistogramSnapshot",
    "EMPTY_HISTOGRAM",
]

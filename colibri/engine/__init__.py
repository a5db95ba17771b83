"""The batched engine: requests, KV slots, the scheduler and the engine thread (docs/ENGINE.md)."""

from .request import EngineClosedError, QueueFullError, RequestHandle, RequestStats, SamplingParams, TokenEvent

__all__ = ["EngineClosedError", "QueueFullError", "RequestHandle", "RequestStats", "SamplingParams", "TokenEvent"]

"""The engine: one model, a live sequence per request slot, prompts read in parts with checkpoints, decode (batched
across slots) and streaming."""
from strata.engine.types import (ContextOverflow, EmptyPrompt, FinalEvent, GenerationRequest, MaxTokensTooLarge,
                                 TokenEvent, merge_choices)


def __getattr__(name):
    # Engine is imported lazily so the request/event types can be used without loading the model stack.
    if name == "Engine":
        from strata.engine.engine import Engine
        return Engine
    raise AttributeError(f"module 'strata.engine' has no attribute {name!r}")


__all__ = ["Engine", "GenerationRequest", "TokenEvent", "FinalEvent", "ContextOverflow", "EmptyPrompt", "MaxTokensTooLarge",
           "merge_choices"]

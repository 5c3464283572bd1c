"""The family plans the CUDA backend knows, in the order it tries them: a model's carve runs on the first whose
``unsupported`` has no objection (adding a family is one line here and one module beside its model)."""
from __future__ import annotations

from strata.backend.cuda.llama import LlamaPlanModel
from strata.backend.cuda.qwen35 import Qwen35GraphModel
from strata.backend.cuda.runner import PlanModel

PLAN_MODELS: tuple[type[PlanModel], ...] = (LlamaPlanModel, Qwen35GraphModel)


def plan_model(model, lo: int = 0, hi: int | None = None) -> PlanModel | None:
    """The PlanModel of the first family plan that can run blocks [lo, hi) of `model`, or None (then the model's own
    forward runs on the backend's ops)."""
    for cls in PLAN_MODELS:
        if cls.plan_class.unsupported(model, lo, hi) is None:
            return cls(model, lo, hi)
    return None

"""Model architectures (one file per family) and their registry; `load_model(path, backend)` builds one."""
from strata.models.base import MODEL_CLASSES, Model, load_model, model_class, register, supported_archs

__all__ = ["MODEL_CLASSES", "Model", "load_model", "model_class", "register", "supported_archs"]

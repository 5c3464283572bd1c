"""Conversation checkpoints over the KV arena: resume planning, cut points kept, retention (one pure function)."""
from strata.cache.checkpoints import CheckpointCache, PrefillPlan
from strata.cache.cut_points import KINDS
from strata.cache.retention import Kept, choose_victims, pinned_root

__all__ = ["CheckpointCache", "PrefillPlan", "KINDS", "Kept", "choose_victims", "pinned_root"]

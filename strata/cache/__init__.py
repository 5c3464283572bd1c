"""Conversation checkpoints over the KV arena: resume planning, cut points kept, retention (one pure function)."""
from strata.cache.checkpoints import KINDS, CheckpointCache, PrefillPlan
from strata.cache.retention import Kept, choose_victims, pinned_root

__all__ = ["CheckpointCache", "PrefillPlan", "KINDS", "Kept", "choose_victims", "pinned_root"]

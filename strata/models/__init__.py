"""Model architectures: the base class (base), one module per family, and which class reads a file (registry)."""

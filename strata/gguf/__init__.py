"""GGUF model files: the reader (file), the typed hyper-parameters (config), the default model, the synthetic writer (synth)."""

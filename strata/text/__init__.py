"""Text and token ids: the tokenizer, the chat template with its cut points, the caches that spare a later turn re-tokenizing and re-rendering, token id arrays."""

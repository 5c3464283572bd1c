"""Structured answers: tool-call formats and their streaming parser, JSON read as it streams, the reasoning split, and the plan of a request that uses them."""

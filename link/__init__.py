"""The stage link (protocol 5, hand-framed over TCP) between the main process and remote stage workers: not yet built."""

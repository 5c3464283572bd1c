"""Host RAM as the kernel reports it: the available bytes that parking and a worker's checkpoint store are held to."""
from __future__ import annotations


def available_ram() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None when it cannot be read (then nothing is parked and a worker
    keeps no checkpoint part)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None

"""Counts, per state verb, the classes of the state modules that define it (as `verb` or its hook `_verb`, a def or
an assignment; an abstract declaration is not counted): how many places a change to one verb touches. The memory
and stage verbs are counted over strata/memory and strata/stages; the conversation verbs (what the conversation
store owns: resume, note, forget, park, save, load, make room) over those and strata/cache, strata/engine, with the
names they had before the store (park_live, forget_live, drop_live, slot_save...) counted as theirs; the cache verbs
(park, take, spill, drop, entries, best, make room of the checkpoints, parked conversations and disk files) over
strata/cache, every definition under any of its names.
Usage: python tools/state_verbs.py [--json]."""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERBS = ("new_seq", "drop_seq", "reserve", "capture", "validate", "restore", "check_truncate", "truncate", "reset",
         "trim", "hashes", "nbytes", "materialize", "detach", "hold", "release", "attach_prefix", "write", "read")
#: the modules that own a sequence's state (the byte codec, the page pool's K/V access and the worker's message
#: handlers are not state verbs)
FILES = ("strata/memory/*.py", "strata/stages/*.py")
#: the conversation verbs and the other names each went by
STORE_VERBS = {"resume": ("resume", "apply", "switch"), "note": ("note",), "forget": ("forget", "forget_live",
               "drop_live", "state_reset"), "erase": ("erase", "slot_erase"), "park": ("park", "park_live"),
               "save": ("save",), "load": ("load",), "make_room": ("make_room",)}
STORE_FILES = FILES + ("strata/cache/*.py", "strata/engine/*.py")
#: the verbs of what the store keeps (checkpoints, parked conversations, the disk tier's files), counted over
#: strata/cache with their private hooks; "name@Class": that name counts in that class only
CACHE_VERBS = {"park": ("park", "_park", "park_resident", "put_back", "_enter", "_enter_below", "_place"),
               "take/restore": ("take", "restore", "read_node", "peek_node", "pop_lru", "promote", "read",
                                "peek@DiskTier"),
               "spill/demote": ("spill", "_spill", "demote", "_demote", "add", "add_node", "_move_down", "_host_copy"),
               "drop/forget": ("drop", "_drop", "discard", "clear", "drop_gone", "remove", "release", "_dropped",
                               "_remove_lru", "forget_dropped", "_forget", "_release"),
               "entries": ("entries", "parked"), "best": ("best", "peek@CheckpointCache", "plan", "_choose"),
               "make_room": ("make_room",)}
SKIP = {"kv.py", "pages.py", "codec.py", "pinned.py", "host.py", "hostram.py", "worker.py", "carrier.py", "link_client.py",
        "split.py", "part.py"}


def definers(paths) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {v: [] for v in VERBS}
    for path in paths:
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = set()
            for node in cls.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if not any(getattr(d, "id", getattr(d, "attr", None)) == "abstractmethod"
                               for d in node.decorator_list):      # a declaration, not a definition
                        names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            for v in VERBS:
                if v in names or "_" + v in names:
                    out[v].append(f"{path.relative_to(ROOT)}:{cls.name}")
    return out


def store_definers(paths) -> dict[str, list[str]]:
    """Per conversation verb, the classes that define it under any of its names (def only)."""
    out: dict[str, list[str]] = {v: [] for v in STORE_VERBS}
    for path in paths:
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for v, aka in STORE_VERBS.items():
                if names & set(aka):
                    out[v].append(f"{path.relative_to(ROOT)}:{cls.name}")
    return out


def cache_definers(paths) -> dict[str, list[str]]:
    """Per cache verb, "Class.name" for each definition (def only) under any of its names."""
    out: dict[str, list[str]] = {v: [] for v in CACHE_VERBS}
    for path in paths:
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for v, aka in CACHE_VERBS.items():
                mine = {a.split("@")[0] for a in aka if "@" not in a or a.split("@")[1] == cls.name}
                out[v] += [f"{cls.name}.{n}" for n in sorted(names & mine)]
    return out


def main() -> None:
    paths = sorted(p for g in FILES for p in ROOT.glob(g) if p.name not in SKIP)
    d = definers(paths)
    s = store_definers(sorted(p for g in STORE_FILES for p in ROOT.glob(g) if p.name not in SKIP))
    c3 = cache_definers(sorted(ROOT.glob("strata/cache/*.py")))
    if "--json" in sys.argv:
        print(json.dumps({**{v: len(c) for v, c in d.items()}, **{"store." + v: len(c) for v, c in s.items()},
                          **{"cache." + v: len(c) for v, c in c3.items()}}))
        return
    for v, c in d.items():
        print(f"{v:15s} {len(c):2d}  {', '.join(x.split(':')[1] for x in c)}")
    print("conversation verbs")
    for v, c in s.items():
        print(f"{v:15s} {len(c):2d}  {', '.join(x.split(':')[1] for x in c)}")
    print("cache verbs (definitions, classes)")
    for v, c in c3.items():
        print(f"{v:15s} {len(c):2d} {len({x.split('.')[0] for x in c}):2d}  {', '.join(c)}")


if __name__ == "__main__":
    main()

"""Write a GGUF holding only the default model's tokenizer (its tokenizer.* keys, no tensors): the synthetic models
(strata/gguf/synth.py) copy that tokenizer, so a machine that only writes synthetic files can point
STRATA_DEFAULT_MODEL at this 1.7 MB file instead of carrying the whole default model. The synthetic files are
byte-identical either way.
Usage: PYTHONPATH=. python tools/tokenizer_gguf.py OUT.gguf
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: tools/tokenizer_gguf.py OUT.gguf", file=sys.stderr)
        return 2
    import gguf
    from strata.gguf import synth
    w = gguf.GGUFWriter(argv[0], "llama")
    for name, (val, vt, sub) in synth._tokenizer_fields().items():
        w.add_key_value(name, val, vt, sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A multilingual text corpus from the manual pages Debian installs (roff sources of every
language under /usr/share/man: CJK, Cyrillic, Latin scripts), one JSON object per page
({"text": ...}), for comparing the engine's BPE tokenizer with HuggingFace `tokenizers`.

Usage: python3 tools/tokenizer/make_corpus.py OUT.jsonl [MIN_MB]   (default 24 MB of text;
every non-English page first, then English ones until the size is reached). Compress it with
`xz -T0 OUT.jsonl` for the trip to the GPU machine.
"""
import glob
import gzip
import json
import os
import sys


def pages():
    langs = sorted(d for d in os.listdir("/usr/share/man") if not d.startswith("man"))
    for lang in langs:
        yield from sorted(glob.glob(f"/usr/share/man/{lang}/man*/*.gz"))
    yield from sorted(glob.glob("/usr/share/man/man*/*.gz"))


def main():
    out, min_mb = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 24.0
    total = docs = 0
    with open(out, "w", encoding="utf-8") as f:
        for path in pages():
            try:
                text = gzip.open(path).read().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue  # the comparison needs valid UTF-8, as Python strings are
            if not text.strip():
                continue
            f.write(json.dumps({"text": text, "source": path}, ensure_ascii=False) + "\n")
            total += len(text.encode("utf-8"))
            docs += 1
            if total >= min_mb * 1e6:
                break
    print(json.dumps({"documents": docs, "bytes": total}))


if __name__ == "__main__":
    main()

"""The engine's BPE tokenizer against HuggingFace `tokenizers` (run where `tokenizers` is
installed: the GPU machine). Trains two tokenizer.json files on the corpus with `tokenizers`:
GLM's layout (its Split regex with lookahead, then ByteLevel without regex; [gMASK] <sop> added by
a TemplateProcessing; GLM's special tokens) and GPT-2's (ByteLevel with its regex). Encodes every
document with both implementations (HF: encode_batch on every core; the engine: `sparsetron
preprocess --tokenizer` on every core), compares the ids document by document and reports the
mismatches and each side's throughput. One JSON line per tokenizer.

Usage: python3 tools/tokenizer/compare_with_hf.py SPARSETRON_BIN CORPUS.jsonl WORK_DIR
"""
import json
import os
import struct
import subprocess
import sys
import time

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

GLM_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
             r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GLM_SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
               "<|user|>", "<|assistant|>", "<|observation|>"]


def train(kind, texts, path):
    tok = Tokenizer(models.BPE())
    if kind == "glm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(GLM_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        special = GLM_SPECIAL
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        special = ["<|endoftext|>"]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=70000 if kind == "glm" else 50257,
                                  special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    if kind == "glm":
        ids = {t: tok.token_to_id(t) for t in ("[gMASK]", "<sop>")}
        tok.post_processor = processors.TemplateProcessing(
            single="[gMASK] <sop> $A", special_tokens=list(ids.items()))
    tok.save(path)
    return tok


def read_dataset(prefix):
    """Megatron .idx/.bin: magic, version, dtype code, sequence/document counts, lengths, pointers."""
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00", "not an indexed dataset"
    code = idx[17]
    n = struct.unpack_from("<Q", idx, 18)[0]
    lengths = struct.unpack_from(f"<{n}i", idx, 34)
    pointers = struct.unpack_from(f"<{n}q", idx, 34 + 4 * n)
    size, fmt = {8: (2, "H"), 4: (4, "i")}[code]
    data = open(prefix + ".bin", "rb").read()
    return [list(struct.unpack_from(f"<{l}{fmt}", data, p)) for l, p in zip(lengths, pointers)]


def main():
    binary, corpus, work = sys.argv[1:4]
    os.makedirs(work, exist_ok=True)
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    mb = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    for kind in ("glm", "gpt2"):
        path = os.path.join(work, f"{kind}-tokenizer.json")
        tok = train(kind, texts, path)
        t0 = time.time()
        hf = [e.ids for e in tok.encode_batch(texts)]
        hf_s = time.time() - t0
        prefix = os.path.join(work, f"{kind}-engine")
        t0 = time.time()
        subprocess.run([binary, "preprocess", "--tokenizer", path, "--input-format", "jsonl",
                        "-i", corpus, "-o", prefix], check=True, stdout=subprocess.DEVNULL)
        engine_s = time.time() - t0
        engine = read_dataset(prefix)
        # preprocess skips empty documents; the corpus has none.
        mismatched = sum(a != b for a, b in zip(hf, engine)) + abs(len(hf) - len(engine))
        first = next((i for i, (a, b) in enumerate(zip(hf, engine)) if a != b), None)
        if first is not None:
            a, b = hf[first], engine[first]
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            print(json.dumps({"tokenizer": kind, "first_mismatch_document": first,
                              "at_token": at, "hf": a[max(0, at - 3):at + 5],
                              "engine": b[max(0, at - 3):at + 5],
                              "hf_text": tok.decode(a[max(0, at - 3):at + 5]),
                              "engine_text": tok.decode(b[max(0, at - 3):at + 5])},
                             ensure_ascii=False))
        print(json.dumps({"tokenizer": kind, "documents": len(texts), "corpus_mb": round(mb, 1),
                          "vocab": tok.get_vocab_size(), "mismatched_documents": mismatched,
                          "hf_encode_batch_mb_per_s": round(mb / hf_s, 2),
                          "engine_preprocess_mb_per_s": round(mb / engine_s, 2),
                          "threads": os.cpu_count()}))


if __name__ == "__main__":
    main()

"""TensorBoard's own reader on a run's event file: every scalar the engine wrote must load, and
"lm loss" / "lm loss validation" must equal metrics.jsonl's lm_loss / valid_lm_loss (float32).

Usage (where the tensorboard package is installed, e.g. the GPU machine):
    python3 tools/check_tensorboard.py RUN_DIR TENSORBOARD_DIR
Prints one JSON line; exits 1 on a mismatch, 2 when tensorboard is not installed.
"""
import glob
import json
import struct
import sys


def f32(x):
    return struct.unpack("f", struct.pack("f", x))[0]


def main():
    run_dir, tb_dir = sys.argv[1], sys.argv[2]
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        print(json.dumps({"tensorboard": "not installed", "error": str(e)}))
        return 2
    files = glob.glob(f"{tb_dir}/events.out.tfevents.*")
    acc = EventAccumulator(files[0], size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    by_tag = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags}
    bad = []
    steps = 0
    with open(f"{run_dir}/metrics.jsonl") as f:
        for line in f:
            m = json.loads(line)
            steps += 1
            if by_tag.get("lm loss", {}).get(m["step"]) != f32(m["lm_loss"]):
                bad.append(("lm loss", m["step"]))
            if "valid_lm_loss" in m and by_tag.get("lm loss validation", {}).get(m["step"]) != f32(
                    m["valid_lm_loss"]):
                bad.append(("lm loss validation", m["step"]))
    print(json.dumps({"files": len(files), "tags": len(tags), "steps": steps,
                      "validation_points": len(by_tag.get("lm loss validation", {})),
                      "mismatches": bad}))
    return 1 if bad or len(files) != 1 else 0


if __name__ == "__main__":
    sys.exit(main())

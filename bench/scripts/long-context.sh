#!/usr/bin/env bash
# On nvidia-h200: the proxy (recipes/glm5.2-proxy-h200.yaml) at several micro-batch lengths, one
# synthetic document filling each micro-batch, timed as replayed graphs: the backbone's
# forward+backward (no MTP, no indexer loss) and, with STEP=1, the full step. With a second build
# (A.tar.xz as for compare-builds.sh) each length runs A then B, so both arms share the call.
# Lines into OUT/<measure>-<tokens>.jsonl (arm order in OUT/arms-<measure>-<tokens>.txt); the
# tokens/s and peak memory of every run on stdout. EXTRA adds options (e.g. "--set ...").
# Usage: bench/scripts/long-context.sh OUT B_COMMIT "4096 16384" [A.tar.xz A_COMMIT] [ITERS]
set -uo pipefail
out=${1:?usage: long-context.sh OUT B_COMMIT LENGTHS [A.tar.xz A_COMMIT] [ITERS]}
b_commit=${2:?} lengths=${3:?} tarball=${4:-} a_commit=${5:-} iters=${6:-4}
mkdir -p "$out"
declare -A bin=([B]=build/default/bin/sparsetron)
declare -A commit=([B]="$b_commit")
arms="B"
if [ -n "$tarball" ]; then
  mkdir -p "$out/a"
  tar -xJf "$tarball" -C "$out/a"
  bin[A]="$out/a/build/default/bin/sparsetron"
  commit[A]="$a_commit"
  arms="A B"
fi
measures="backbone"
[ "${STEP:-0}" = 1 ] && measures="backbone step"
for tokens in $lengths; do
  for name in $measures; do
    opts="--set seq_length=$tokens"
    [ "$name" = backbone ] && opts="$opts --set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward"
    for arm in $arms; do
      log="$out/$name-$tokens-$arm.log"
      # shellcheck disable=SC2086  # the options are words
      timeout 280 scripts/gpu-run.sh "${bin[$arm]}" bench --recipe recipes/glm5.2-proxy-h200.yaml \
        --commit "${commit[$arm]}" $opts ${EXTRA:-} --variants graph --warmup 2 --iters "$iters" \
        --json "$out/$name-$tokens.jsonl" >"$log" 2>&1 || echo "$name $tokens $arm failed (see $log)"
      echo "$arm" >>"$out/arms-$name-$tokens.txt"
      python3 - "$out/$name-$tokens.jsonl" "$name" "$tokens" "$arm" <<'EOF'
import json, sys
path, name, tokens, arm = sys.argv[1:]
try:
    r = [json.loads(l) for l in open(path)][-1]
except (OSError, IndexError, ValueError):
    sys.exit(0)
t = int(tokens)
print(f"{name} {t:>6} {arm}: median {r['median_ms']:9.1f} ms  {t / r['median_ms'] * 1e3:9.0f} tok/s"
      f"  peak {r['peak_mem_mib'] / 1024:6.1f} GiB")
EOF
    done
  done
done
rm -rf "$out/a"

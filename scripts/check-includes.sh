#!/usr/bin/env bash
# Fails on an include that points up: every file of src/sparsetron may include its own room and
# the rooms below it (docs/architecture.md, "Rooms"), never one above. Inside ops/, common/ is below
# every family and the families are ordered; inside parallel/, comm/ < layout/ < expert/ and
# context/ (which do not include each other); a room's cuda/ folder is above the room's other files
# (they build without CUDA). Run from anywhere; prints each upward include and exits 1, or says
# how many includes it checked.
set -euo pipefail
cd "$(dirname "$0")/../src/sparsetron"

ROOMS=(core data config cuda ops parallel model optim io runtime perf cli)
OPS=(common gemm copy fp8 elementwise norm moe attention indexer loss optim)
PARALLEL=(comm layout expert context)

index_of() {  # index_of NAME LIST... -> its position, or -1
    local name=$1 i=0
    shift
    for x in "$@"; do
        [ "$x" = "$name" ] && { echo "$i"; return; }
        i=$((i + 1))
    done
    echo -1
}

# rank PATH -> "ROOM_RANK SUB_RANK CUDA" for a path under src/sparsetron (file or include).
rank() {
    local path=$1 room sub=0 cuda=0 r s
    room=${path%%/*}
    r=$(index_of "$room" "${ROOMS[@]}")
    local rest=${path#*/}
    case $room in
        ops) s=$(index_of "${rest%%/*}" "${OPS[@]}"); sub=$((s * 10)) ;;
        parallel)
            s=$(index_of "${rest%%/*}" "${PARALLEL[@]}")
            [ "$s" -eq 3 ] && s=2  # expert and context share a level
            sub=$((s * 10))
            ;;
    esac
    [[ $rest == */* && ${rest%%/*} == cuda ]] && cuda=1
    [[ $room == ops || $room == parallel ]] && [[ $rest == */cuda/* ]] && cuda=1
    echo "$r $sub $cuda"
}

room_parallel=$(index_of parallel "${ROOMS[@]}")
violations=0
checked=0
while IFS= read -r file; do
    read -r fr fs fc <<<"$(rank "$file")"
    [ "$fr" -lt 0 ] && { echo "check-includes: $file is in no known room"; violations=$((violations + 1)); continue; }
    while IFS= read -r inc; do
        checked=$((checked + 1))
        read -r ir is ic <<<"$(rank "$inc")"
        up=0
        if [ "$ir" -lt 0 ]; then
            up=1
        elif [ "$ir" -gt "$fr" ]; then
            up=1
        elif [ "$ir" -eq "$fr" ]; then
            # Same room: a sub-room above this file's, another family at the same level, or the
            # room's cuda/ folder from a file outside it.
            if [ "$is" -gt "$fs" ] || { [ "$is" -eq "$fs" ] && [ "$ic" -gt "$fc" ]; }; then
                up=1
            elif [ "$room_parallel" -eq "$fr" ] && [ "$fs" -eq 20 ] && [ "$is" -eq 20 ] &&
                [ "$(cut -d/ -f2 <<<"$inc")" != "$(cut -d/ -f2 <<<"$file")" ]; then
                up=1  # expert/ and context/ stay apart
            fi
        fi
        if [ "$up" -eq 1 ]; then
            echo "upward include: $file -> $inc"
            violations=$((violations + 1))
        fi
    done < <(grep -oE '^#include "sparsetron/[^"]+"' "$file" | sed 's|#include "sparsetron/||; s|"$||')
done < <(find . -type f \( -name '*.h' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.cu' \) | sed 's|^\./||' | sort)

if [ "$violations" -gt 0 ]; then
    echo "check-includes: $violations upward include(s); rooms, lowest first: ${ROOMS[*]}"
    exit 1
fi
echo "check-includes: $checked includes, none upward (rooms: ${ROOMS[*]})"

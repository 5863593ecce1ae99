#!/usr/bin/env bash
# The files under a working directory, for the MPI tests' check that they leave none behind:
#   working_dir_files.sh record STATE DIR [PRUNE...]   lists DIR's files into STATE
#   working_dir_files.sh check  STATE DIR [PRUNE...]   fails naming every file DIR gained since
# PRUNE: directories left out of the listing (the build tree, .git), absolute paths.
set -euo pipefail
mode=$1 state=$2 dir=$3
shift 3
prune=(-path "$dir/.git")
for p in "$@"; do prune+=(-o -path "$p"); done
list() { find "$dir" -mindepth 1 \( "${prune[@]}" \) -prune -o -print | LC_ALL=C sort; }
case "$mode" in
  record)
    list >"$state"
    echo "recorded $(wc -l <"$state") paths under $dir"
    ;;
  check)
    added=$(LC_ALL=C comm -13 "$state" <(list))
    if [ -n "$added" ]; then
      echo "error: the MPI tests left files under $dir:"
      printf '%s\n' "$added" | sed 's/^/  /' | cat -v
      exit 1
    fi
    echo "no file added under $dir"
    ;;
  *) echo "usage: $0 record|check STATE DIR [PRUNE...]" >&2; exit 2 ;;
esac

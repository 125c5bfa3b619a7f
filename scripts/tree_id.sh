#!/usr/bin/env bash
# Prints "tree <hash>": git's tree hash of this working tree (tracked files and untracked ones
# git does not ignore), computed in a throw-away index, so it names the code that actually ran
# even where the copy's .git is stale (the lent GPU's copies). Here, find the commit with that
# tree: git log --all --format='%H %T' | grep <hash>   (a clean checkout's is `git rev-parse HEAD^{tree}`).
cd "$(dirname "$0")/.." || exit 1
index=$(mktemp -u)
trap 'rm -f "$index"' EXIT
# Seeded with the real index, so tracked files that an ignore pattern matches still count. The
# copy is dated 1 s after the epoch (git ignores 0; POSIX `touch -t`, read in UTC) so that git
# re-reads every file: an entry is trusted by its size and mtime only when older than the index,
# and a file edited within the filesystem's timestamp granularity of its last `git add`, to the
# same size, looked unchanged to a fresh copy.
real=$(git rev-parse --git-path index 2>/dev/null) && [ -f "$real" ] && cp "$real" "$index" && TZ=UTC0 touch -t 197001010000.01 "$index"
if tree=$(GIT_INDEX_FILE=$index git add -A 2>/dev/null && GIT_INDEX_FILE=$index git write-tree 2>/dev/null); then
  echo "tree $tree"
else
  echo "tree unknown (no git repository)"
fi

#!/usr/bin/env bash
# Prints "tree <hash>": git's tree hash of this working tree (tracked files and untracked ones
# git does not ignore), computed in a throw-away index, so it names the code that actually ran
# even where the copy's .git is stale (the lent GPU's copies). Here, find the commit with that
# tree: git log --all --format='%H %T' | grep <hash>   (a clean checkout's is `git rev-parse HEAD^{tree}`).
cd "$(dirname "$0")/.." || exit 1
index=$(mktemp -u)
trap 'rm -f "$index"' EXIT
# Seeded with the real index, so tracked files that an ignore pattern matches still count.
real=$(git rev-parse --git-path index 2>/dev/null) && [ -f "$real" ] && cp "$real" "$index"
if tree=$(GIT_INDEX_FILE=$index git add -A 2>/dev/null && GIT_INDEX_FILE=$index git write-tree 2>/dev/null); then
  echo "tree $tree"
else
  echo "tree unknown (no git repository)"
fi

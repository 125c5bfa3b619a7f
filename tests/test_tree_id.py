"""scripts/tree_id.sh names the code that ran, even where the copy's .git is stale."""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "tree_id.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def _tree_id(repo: Path) -> str:
    return subprocess.run(["bash", str(repo / "scripts" / "tree_id.sh")], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_tree_id_is_the_working_tree_not_the_last_commit(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "tree_id.sh")
    (repo / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("out/\n*.jsonl\n")
    (repo / "fixture.jsonl").write_text("{}\n")  # tracked although an ignore pattern matches it
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "add", "-f", "fixture.jsonl")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    assert _tree_id(repo) == f"tree {_git(repo, 'rev-parse', 'HEAD^{tree}')}"

    # the copy changed after its .git was made: an edit and a new file count, ignored files do not
    (repo / "a.py").write_text("x = 2\n")
    (repo / "b.py").write_text("y = 3\n")
    (repo / "out").mkdir()
    (repo / "out" / "result.json").write_text("{}")
    changed = _tree_id(repo)
    assert changed != f"tree {_git(repo, 'rev-parse', 'HEAD^{tree}')}"
    assert _git(repo, "diff", "--cached", "--name-only") == ""  # nothing staged: the real index was left alone
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    assert changed == f"tree {_git(repo, 'rev-parse', 'HEAD^{tree}')}"


def test_tree_id_sees_an_edit_with_the_same_size_and_time(tmp_path: Path) -> None:
    """An edit that git's stat check cannot see (same size, same mtime as when it was added; on a
    loaded machine an edit within one timestamp tick did this, about 1 run in 16) still changes
    the tree id. Simulated by restoring the mtime with ctime not trusted: ``git add -A`` itself
    then keeps the old blob, and so did the script, whose fresh copy of the index looked newer
    than the file."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "tree_id.sh")
    a = repo / "a.py"
    a.write_text("x = 1\n")
    past = time.time_ns() - 100 * 10**9
    os.utime(a, ns=(past, past))  # older than the index: git trusts its recorded stat (no smudge)
    _git(repo, "init", "-q")
    _git(repo, "config", "core.trustctime", "false")
    _git(repo, "add", "-A")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    a.write_text("x = 2\n")
    os.utime(a, ns=(past, past))
    changed = _tree_id(repo)
    _git(repo, "rm", "--cached", "-rq", ".")  # a fresh index hashes every file (git add -A alone sees no change)
    _git(repo, "add", "-A")
    truth = _git(repo, "write-tree")
    assert _git(repo, "cat-file", "-p", f"{truth}:a.py") == "x = 2"
    assert changed == f"tree {truth}"


def test_tree_id_without_a_repository(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "tree_id.sh")
    env = {"PATH": "/usr/bin:/bin", "GIT_CEILING_DIRECTORIES": str(tmp_path.parent)}
    out = subprocess.run(["bash", str(tmp_path / "scripts" / "tree_id.sh")], capture_output=True, text=True,
                         env=env, check=True).stdout.strip()
    assert out == "tree unknown (no git repository)"

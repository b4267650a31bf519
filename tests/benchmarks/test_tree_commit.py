"""benchmarks.common.tree_commit: what a results JSON names as the tree's commit."""

import os
import subprocess

from benchmarks.common import tree_commit


def _git(tree, *args):
    return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_a_commit_file_comes_first_unless_stale_then_git_marks_a_modified_tree(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    assert tree_commit(tree) == "unknown (not a git checkout's root)"
    _git(tree, "init", "-q")
    (tree / "a.txt").write_text("one\n")
    _git(tree, "add", "a.txt")
    _git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = _git(tree, "rev-parse", "HEAD")
    assert tree_commit(tree) == head
    (tree / "a.txt").write_text("two\n")
    assert tree_commit(tree) == head + " (modified)"
    (tree / "COMMIT").write_text("0123abcd\n")   # a device copy's: its git is stale
    assert tree_commit(tree) == "0123abcd"
    # A COMMIT file older than the last commit was left behind: git answers.
    os.utime(tree / "COMMIT", (1_000_000, 1_000_000))
    _git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    assert tree_commit(tree) == _git(tree, "rev-parse", "HEAD")
    sub = tree / "sub"
    sub.mkdir()
    assert tree_commit(sub) == "unknown (not a git checkout's root)"

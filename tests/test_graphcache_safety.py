"""The graph cache (specgraph.graphcache) removes, lists and loads only its own entries, and one
process builds an entry at a time. No package is built: ``package_graph`` is replaced by a
stand-in that writes a few bytes and ``Package`` by a recorder, so entries are made by the
cache's own code (records, sha256, renames, locks) in milliseconds.

- ``clear`` removes the folders whose name is the digest of their own graph-cache key and
  nothing else (a folder of the user's, a renamed entry, a digest-named folder whose key.json is
  no cache key, a file), reporting each skip; the CLI says so and exits 0;
- an entry or cache root that another user owns, that group or others can write, or that is a
  link, is not loaded (a warning names the path and why); a record or package in a trusted entry
  that is another user's, writable by others or a link is removed and rebuilt, never opened;
  new folders are 0700 and files 0600 whatever the umask;
- two processes compiling the same entry at once build each graph once: the second waits for
  the first's lock, then loads; ``clear`` skips an entry whose lock another process holds; the
  lock stays held while a helper builds in the background; what a dead process left is swept at
  once, whatever its age;
- a compiled directory (specgraph.aot) that every local user can write is refused before a file
  of it is hashed or opened.

Ownership tests chown to another uid and need root (the test machines run as root).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import specgraph
from specgraph import aot, cli, graphcache
from specgraph.artifacts import ArtifactError
from specgraph.packages import PT2_SUBDIR
from tiny_models import tiny_causal_lm

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX owners and modes")
as_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another uid needs root")

SETTINGS = dict(num_speculative_tokens=2, max_batch_size=1, max_seq_len=96, progress=False, warmup=False, cache=False)
OTHER_UID = 54321
TESTS = Path(__file__).resolve().parent


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(scope="module")
def model():
    return tiny_causal_lm(eos=5)


@pytest.fixture
def fast(model):
    return specgraph.compile(model, "ngram", **SETTINGS)


@pytest.fixture
def opened(monkeypatch):
    """Packages built as a few bytes and opened by a recorder: the list of (file name, its lstat
    when it was opened)."""
    calls = []

    def package_graph(fast, g, stage, *args, **kwargs):
        f = Path(stage) / PT2_SUBDIR / f"{g.name}.pt2"
        f.write_bytes(g.name.encode() * 100)
        return {"name": g.name, "file": f"{PT2_SUBDIR}/{g.name}.pt2"}, None

    class Recorded:
        def __init__(self, path, tensors, spec):
            calls.append((Path(path).name, os.lstat(path)))

    monkeypatch.setattr(graphcache, "package_graph", package_graph)
    monkeypatch.setattr(graphcache, "Package", Recorded)
    monkeypatch.setenv(graphcache.ENV_HELPER, "off")
    return calls


def make_entry(fast, root: Path) -> Path:
    info = graphcache.load_or_build(fast, root=root, progress=False)
    assert info is not None and info["built"] == 2, info
    return Path(info["path"])


def lock_held(folder: Path) -> bool:
    """Whether another process holds ``folder``'s build lock (asked from a fresh process)."""
    code = ("import sys, filelock\ntry:\n    filelock.FileLock(sys.argv[1]).acquire(timeout=0)\n"
            "except filelock.Timeout:\n    print('held')\nelse:\n    print('free')")
    r = subprocess.run([sys.executable, "-c", code, str(folder / graphcache.LOCK_FILE)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip() == "held"


# ----------------------------------------------------------------------------------------------
# clear and entries: the cache's own entries only


def plant_others(root: Path, entry: Path) -> dict:
    """Beside ``entry``: a user's folder, the entry's files under another name, a digest-named
    folder whose key.json is no cache key, a file. Returns {name: path}."""
    thesis = root / "thesis"
    thesis.mkdir()
    (thesis / "main.tex").write_text("\\documentclass{article}\n")
    renamed = root / ("0" * 32)
    shutil.copytree(entry, renamed)
    not_a_key = {"format_version": 4, "title": "my notes"}
    keyless = root / graphcache.key_digest(not_a_key)
    keyless.mkdir()
    (keyless / graphcache.KEY_FILE).write_text(json.dumps(not_a_key))
    notes = root / "notes.txt"
    notes.write_text("mine")
    return {p.name: p for p in (thesis, renamed, keyless, notes)}


def test_clear_removes_its_entries_and_nothing_else(fast, opened, tmp_path):
    root = tmp_path / "cache"
    entry = make_entry(fast, root)
    others = plant_others(root, entry)
    done = graphcache.clear(root)
    assert done.removed == [str(entry)] and not entry.exists() and done.freed > 0
    assert all(p.exists() for p in others.values())
    assert (others["thesis"] / "main.tex").read_text().startswith("\\documentclass")
    skipped = {Path(p).name: why for p, why in done.skipped}
    assert skipped.keys() == others.keys()
    assert all(why.startswith("not a specgraph cache entry") for why in skipped.values()), skipped


def test_entries_lists_only_entries(fast, opened, tmp_path):
    root = tmp_path / "cache"
    entry = make_entry(fast, root)
    others = plant_others(root, entry)
    assert [e["path"] for e in graphcache.entries(root)] == [str(entry)]
    assert sorted(Path(p).name for p, _ in graphcache.others(root)) == sorted(others)


@pytest.mark.parametrize("by", ["--dir", "env"])
def test_cli_clear_of_a_folder_without_entries_removes_nothing(tmp_path, monkeypatch, capsys, by):
    root = tmp_path / "home"
    (root / "thesis").mkdir(parents=True)
    (root / "thesis" / "main.tex").write_text("x")
    if by == "env":
        monkeypatch.setenv(graphcache.ENV_ROOT, str(root))
    assert cli.main(["cache", "--clear", *(["--dir", str(root)] if by == "--dir" else [])]) == 0
    out = capsys.readouterr().out
    assert f"skipped {root / 'thesis'}: not a specgraph cache entry" in out
    assert f"no specgraph cache entries in {root}: nothing removed" in out
    assert (root / "thesis" / "main.tex").read_text() == "x"


@contextlib.contextmanager
def locked_by_another_process(entry: Path):
    """Entry ``entry``'s build lock, held by a child process until the block ends."""
    code = ("import sys, filelock\nlock = filelock.FileLock(sys.argv[1])\nlock.acquire()\n"
            "print('locked', flush=True)\nsys.stdin.read()")
    holder = subprocess.Popen([sys.executable, "-c", code, str(entry / graphcache.LOCK_FILE)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_clear_skips_an_entry_another_process_is_building(fast, opened, tmp_path):
    entry = make_entry(fast, tmp_path / "cache")
    with locked_by_another_process(entry):
        done = graphcache.clear(tmp_path / "cache")
    assert done.removed == [] and entry.is_dir()
    assert done.skipped == [(str(entry), "another process is building its graphs")]
    assert graphcache.clear(tmp_path / "cache").removed == [str(entry)]  # once it is done


# ----------------------------------------------------------------------------------------------
# loading: only what this user could have written


def chown_tree(path: Path, uid: int) -> None:
    for p in [path, *path.rglob("*")]:
        os.lchown(p, uid, -1)


def move_away(root: Path, entry: Path) -> None:
    """``entry`` moved out of the root, a link to it in its place."""
    away = root.parent / "elsewhere" / entry.name
    away.parent.mkdir()
    entry.rename(away)
    entry.symlink_to(away, target_is_directory=True)


UNTRUSTED = {  # how a cache folder is made untrusted -> the reason the warning gives
    "entry of another user": (lambda root, entry: chown_tree(entry, OTHER_UID), f"owned by uid {OTHER_UID}"),
    "root of another user": (lambda root, entry: os.chown(root, OTHER_UID, -1), f"owned by uid {OTHER_UID}"),
    "group-writable root": (lambda root, entry: os.chmod(root, 0o775), "writable by group"),
    "world-writable root": (lambda root, entry: os.chmod(root, 0o707), "writable by others"),
    "group-writable entry": (lambda root, entry: os.chmod(entry, 0o770), "writable by group"),
    "entry is a link": (move_away, "a symbolic link"),
}


@pytest.mark.parametrize("case", list(UNTRUSTED))
def test_an_untrusted_entry_or_root_is_not_loaded(fast, opened, tmp_path, case):
    """A package planted with a record holding its own sha256 passes the integrity check: the
    owner and modes of the root and the entry are what keep another user's graphs out."""
    if "another user" in case and os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    tamper, why = UNTRUSTED[case]
    root = tmp_path / "cache"
    entry = make_entry(fast, root)
    tamper(root, entry)
    opened.clear()
    place = root if "root" in case else entry
    with pytest.warns(UserWarning, match=f"not using the graph cache at {place}: it is {why}"):
        info = graphcache.load_or_build(fast, root=root, progress=False)
    assert info is None and opened == []


def plant_foreign_package(entry: Path) -> None:
    os.lchown(next(entry.glob("*.pt2")), OTHER_UID, -1)


def writable_record(entry: Path) -> None:
    os.chmod(next(entry.glob("*.json")), 0o666)


def linked_package(entry: Path) -> None:
    pkg = next(entry.glob("*.pt2"))
    away = entry.parent.parent / pkg.name
    shutil.copy(pkg, away)
    pkg.unlink()
    pkg.symlink_to(away)


@pytest.mark.parametrize("tamper", [pytest.param(plant_foreign_package, marks=as_root), writable_record,
                                    linked_package])
def test_a_planted_file_in_an_entry_is_rebuilt_not_opened(fast, opened, tmp_path, tamper):
    entry = make_entry(fast, tmp_path / "cache")
    tamper(entry)
    opened.clear()
    with pytest.warns(UserWarning, match="is not usable .*(owned by uid|writable by group|a symbolic link)"):
        info = graphcache.load_or_build(fast, root=tmp_path / "cache", progress=False)
    assert info["built"] == 1 and info["loaded"] == 2
    assert len(opened) == 2
    for name, st in opened:  # every package opened is this user's own file, writable by no one else
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022, name


def test_new_folders_and_files_are_private_whatever_the_umask(fast, opened, tmp_path):
    old = os.umask(0)
    try:
        root = tmp_path / "home" / ".cache" / "graphs"
        entry = make_entry(fast, root)
    finally:
        os.umask(old)
    assert mode(root) == mode(entry) == 0o700
    files = [p for p in entry.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {graphcache.KEY_FILE, "round_b1_k0_any.frozen.pt2", "round_b1_k2_any.frozen.json"}
    assert {p.name: mode(p) for p in files} == {p.name: 0o600 for p in files}


def test_an_entry_others_can_read_is_made_private(fast, opened, tmp_path):
    entry = make_entry(fast, tmp_path / "cache")
    os.chmod(entry, 0o755)
    assert graphcache.load_or_build(fast, root=tmp_path / "cache", progress=False)["hit"] is True
    assert mode(entry) == 0o700


def test_a_compiled_directory_anyone_can_write_is_refused_before_it_is_read(tmp_path, monkeypatch):
    d = tmp_path / "compiled"
    (d / PT2_SUBDIR).mkdir(parents=True)
    (d / aot.MANIFEST).write_text("{}")
    (d / PT2_SUBDIR / "round.pt2").write_bytes(b"x")
    names = [aot.MANIFEST, f"{PT2_SUBDIR}/round.pt2"]
    os.chmod(d / PT2_SUBDIR, 0o775)  # group-writable (umask 002): a shared directory's writers are trusted
    aot.check_writers(d, names)
    for p in (d, d / PT2_SUBDIR, d / PT2_SUBDIR / "round.pt2"):
        os.chmod(p, mode(p) | 0o002)
        with pytest.raises(ArtifactError, match=f"{p} is writable by others"):
            aot.check_writers(d, names)
        os.chmod(p, mode(p) & ~0o002)
    os.chmod(d / PT2_SUBDIR / "round.pt2", 0o666)
    man = {"formats": ["pt2"], "files": {n: {"bytes": 1, "sha256": "0" * 64} for n in names[1:]},
           "model": {"dir": "model", "dtype": "float32"}, "platform": {}, "graphs": []}
    monkeypatch.setattr(aot, "read_manifest", lambda path: man)
    monkeypatch.setattr(aot, "FileVerifier", lambda *a, **k: pytest.fail("hashed before the writers were checked"))
    with pytest.raises(ArtifactError, match="round.pt2 is writable by others"):
        aot.load_dir(d, tokenizer=False)


# ----------------------------------------------------------------------------------------------
# one builder per entry


CHILD = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import specgraph
    from specgraph import graphcache
    from specgraph.packages import PT2_SUBDIR
    from tiny_models import tiny_causal_lm

    root, me = Path(sys.argv[1]), sys.argv[2]
    built = []

    def package_graph(fast, g, stage, *args, **kwargs):  # a build that takes a while
        time.sleep(2.5)
        (Path(stage) / PT2_SUBDIR / f"{{g.name}}.pt2").write_bytes(g.name.encode() * 100)
        built.append(g.name)
        return {{"name": g.name, "file": f"{{PT2_SUBDIR}}/{{g.name}}.pt2"}}, None

    graphcache.package_graph = package_graph
    graphcache.Package = lambda path, tensors, spec: object()
    fast = specgraph.compile(tiny_causal_lm(eos=5), "ngram", **{settings!r})
    (root.parent / f"ready-{{me}}").touch()
    while not (root.parent / "go").exists():
        time.sleep(0.01)
    info = graphcache.load_or_build(fast, root=root, progress=True)
    print(json.dumps({{"built": built, "hit": info["hit"], "loaded": info["loaded"]}}))
""").format(tests=str(TESTS), settings=SETTINGS)


def test_two_processes_build_an_entry_once(tmp_path):
    """Both start building the same entry at the same moment: one builds its two graphs, the
    other waits for its lock, then loads them."""
    root = tmp_path / "cache"
    env = {**os.environ, graphcache.ENV_HELPER: "off"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(2)]
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"ready-{i}").exists() for i in range(2)):
            running = all(p.poll() is None for p in procs)
            assert running and time.monotonic() < deadline, [p.stderr.read()[-3000:] for p in procs if p.poll() is not None]
            time.sleep(0.05)
        (tmp_path / "go").touch()
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    builder, waiter = sorted(range(2), key=lambda i: -len(results[i]["built"]))
    assert len(results[builder]["built"]) == 2 and results[builder]["hit"] is False
    assert results[waiter] == {"built": [], "hit": True, "loaded": 2}
    assert "another process is building the graphs of" in outs[waiter][1]


def test_the_lock_stays_held_while_the_helper_builds_in_the_background(fast, opened, tmp_path, monkeypatch):
    ends = []
    helper = SimpleNamespace(on_exit=ends.append)
    work = SimpleNamespace(built=2, by_helper=0, pending=lambda: 1, background=True, helper=helper)
    monkeypatch.setattr(graphcache, "_build", lambda *args: work)
    info = graphcache.load_or_build(fast, root=tmp_path / "cache", progress=False, refine="background")
    folder = Path(info["path"])
    assert len(ends) == 1 and lock_held(folder)
    ends[0]()  # the helper's thread ends
    assert not lock_held(folder)


def test_what_a_dead_process_left_is_swept_at_once(tmp_path):
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                              timeout=60).stdout)
    folder = tmp_path / "entry"
    folder.mkdir()
    left = [folder / f".helper-model-{dead}-k2x9", folder / f".build-{dead}-a8f0", folder / f".helper-{dead}-7f3a.log",
            folder / f".key.json.{dead}.tmp"]
    kept = [folder / f".build-{os.getpid()}-q1w2",  # this process's build, in progress
            folder / ".helper-model-abcd1234"]  # no pid in the name: removed only once an hour old
    for p in left[:2] + kept:
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"w" * 1000)
    for p in left[2:]:
        p.write_text("x")
    graphcache._sweep(folder)
    assert [p.name for p in left if p.exists()] == []
    assert all(p.exists() for p in kept)


def test_what_an_earlier_process_of_the_same_pid_left_is_swept(tmp_path):
    """A restarted container runs as pid 1 again: a leftover named with this process's pid but
    last written before this process started is an earlier process's, and is swept; one written
    since is this process's own build, and stays."""
    started = graphcache._process_start(os.getpid())
    if started is None:
        pytest.skip("no /proc here: a process's start time is unknown")
    folder = tmp_path / "entry"
    folder.mkdir()
    earlier, own = folder / f".helper-model-{os.getpid()}-old1", folder / f".helper-model-{os.getpid()}-new1"
    for p in (earlier, own):
        p.mkdir()
        (p / "model.safetensors").write_bytes(b"w" * 1000)
    os.utime(earlier, (started - 600, started - 600))
    graphcache._sweep(folder)
    assert not earlier.exists() and own.exists()


def test_clear_skips_an_entry_this_process_is_building(fast, opened, tmp_path):
    entry = make_entry(fast, tmp_path / "cache")
    lock = graphcache._lock(entry)
    lock.acquire()  # as load_or_build holds it while its helper builds in the background
    try:
        done = graphcache.clear(tmp_path / "cache")
    finally:
        lock.release()
    assert done.removed == [] and entry.is_dir()
    assert done.skipped == [(str(entry), "this process is building its graphs")]


def test_a_build_that_never_ends_is_waited_for_a_bounded_time(tmp_path, monkeypatch, capsys):
    """Another process holds an entry's lock and never lets go: this process waits at most
    LOCK_WAIT_SECONDS, saying so, then compiles without the cache (a warning)."""
    folder = tmp_path / "entry"
    folder.mkdir()
    monkeypatch.setattr(graphcache, "LOCK_WAIT_SECONDS", 1.0)
    monkeypatch.setattr(graphcache, "LOCK_REPORT_SECONDS", 0.3)
    with locked_by_another_process(folder):
        t0 = time.monotonic()
        with pytest.warns(UserWarning, match="compiling without the cache"):
            assert graphcache._acquire(folder, progress=True) is None
        assert 1.0 <= time.monotonic() - t0 < 10
    assert "waiting for it" in capsys.readouterr().err
    lock = graphcache._acquire(folder, progress=False)  # free again: taken at once
    assert lock is not None and lock.is_locked
    lock.release()

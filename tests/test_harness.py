"""Every malformed ledger of the corpus (tests/malformed.py) x the four commands that read a
ledger: a located one-line error per problem and exit 1, or (for the valid near misses) a correct
acceptance; never a traceback, never a hang, never an impossible value accepted, and the input
never changed by a refused command."""

from __future__ import annotations

import contextlib
import signal
import stat
from pathlib import Path

import pytest

from ledger import cli
from malformed import VALID, cases

CASES = cases()
#: Each command gets this long before the harness calls it a hang.
HANG_S = 20


def test_the_corpus_is_large_enough():
    assert len(CASES) >= 80 and len({name for name, _ in CASES}) == len(CASES)


class Hang(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: int):
    def fire(*_):
        raise Hang(f"no answer in {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def snapshot(path: Path) -> object:
    st = path.lstat()
    return path.read_bytes() if stat.S_ISREG(st.st_mode) else (stat.S_IFMT(st.st_mode), st.st_ino)


def commands(path: Path, tmp: Path) -> dict[str, list[str]]:
    return {
        "validate": ["validate", str(path)],
        "merge": ["merge", str(path), "-o", str(tmp / "merged.json")],
        "build": ["build", "--ledger", str(path), "--out", str(tmp / "site"), "-q"],
        "predict": ["predict", "--fixes", "all", "--ledger", str(path), "--gpu", "rtx-3070-ti", "--rank", "16", "--seq-len", "2048"],
    }


def call(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    with deadline(HANG_S):
        rc = cli.main(argv)
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("name,write", CASES, ids=[c[0] for c in CASES])
def test_a_malformed_ledger_is_refused_by_every_command(name, write, tmp_path, capsys):
    path = tmp_path / f"{name}.json"
    write(path)
    before = snapshot(path)
    for command, argv in commands(path, tmp_path).items():
        rc, err = call(argv, capsys)
        lines = err.strip().splitlines()
        assert rc == 1, f"{command} accepted {name}: {err}"
        assert lines and "Traceback" not in err, f"{command} on {name}: {err}"
        assert all(line.startswith(f"{path}:") for line in lines), f"{command} on {name}: not located: {err}"
        assert snapshot(path) == before, f"{command} changed {name}"
    assert not (tmp_path / "merged.json").exists() and not (tmp_path / "site" / "index.html").exists()


@pytest.mark.parametrize("name,write", VALID, ids=[c[0] for c in VALID])
def test_a_valid_near_miss_is_accepted_by_every_command(name, write, tmp_path, capsys):
    path = tmp_path / f"{name}.json"
    write(path)
    for command, argv in commands(path, tmp_path).items():
        rc, err = call(argv, capsys)
        assert rc == 0 and "Traceback" not in err, f"{command} refused {name}: {err}"
    assert (tmp_path / "merged.json").exists() and (tmp_path / "site" / "index.html").exists()

"""moefp8/errors.py: how a user error leaves the process (CPU, no launcher needed)."""

import json

import pytest

from moefp8 import errors
from moefp8.errors import EXIT_ERROR, report


def test_the_reporting_rank_prints_once_and_leaves_the_launcher_its_message(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(errors.time, "sleep", lambda s: pytest.fail("the reporting rank must not wait"))
    env = {"WORLD_SIZE": "2", "TORCHELASTIC_ERROR_FILE": str(tmp_path / "err.json")}
    with pytest.raises(SystemExit) as e:
        report("error: x=1: bad; set x=2", env=env)
    assert e.value.code == EXIT_ERROR
    assert capsys.readouterr().err == "error: x=1: bad; set x=2\n"
    assert json.loads((tmp_path / "err.json").read_text())["message"]["message"] == "error: x=1: bad; set x=2"


def test_a_quiet_rank_under_a_launcher_fails_after_the_reporting_rank(capsys, monkeypatch):
    # torchrun takes the first rank to exit as the root cause and SIGTERMs the rest: a quiet rank
    # that exits at once can kill the reporting rank before it prints (seen in CI)
    waited = []
    monkeypatch.setattr(errors.time, "sleep", waited.append)
    with pytest.raises(SystemExit) as e:
        report("error: x=1: bad", quiet=True, env={"WORLD_SIZE": "2"})
    assert e.value.code == EXIT_ERROR and waited == [errors.QUIET_EXIT_DELAY_S]
    assert capsys.readouterr().err == ""


def test_a_single_process_never_waits(monkeypatch):
    monkeypatch.setattr(errors.time, "sleep", lambda s: pytest.fail("no launcher: nothing to wait for"))
    with pytest.raises(SystemExit):
        report("error: x", quiet=True, env={})

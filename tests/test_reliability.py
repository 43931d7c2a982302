"""A user's data and runs are never lost (the failure cases of README "Failure handling", each
through the real command line): no file the user made is changed (their folders are hashed
before and after), bad input is one line with a clear exit status, checkpoints are verified,
a run directory has one owner, SIGTERM/SIGINT stop with a checkpoint and the same command
resumes the same loss curve bit for bit."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moefp8.errors import EXIT_STOPPED
from moefp8.launch import job_dir_name

REPO = Path(__file__).resolve().parent.parent
# one CPU thread: multi-threaded CPU matmuls may sum in another order from run to run
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_SILENT": "true"}
TRAIN = [sys.executable, "-m", "moefp8.train"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def tiny(data_dir, out, *overrides) -> list[str]:
    """The tiny model on the shared test data (prepared from 2 MB of the standard library); an
    override of one of these keys replaces it."""
    base = ["model=tiny", "logger.mode=disabled", "train.progress=false", "train.micro_batch=4", "train.seq_len=64",
            "train.log_every=1", "optim.warmup_steps=2", f"data.path={data_dir}", "data.max_bytes=2000000",
            f"train.out_dir={out}"]
    keys = {o.split("=", 1)[0] for o in overrides}
    return [b for b in base if b.split("=", 1)[0] not in keys] + list(overrides)


def run(args, env=ENV, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env, **kw)


def digest(root: Path, skip=()) -> dict[str, str]:
    """Every file and folder under root (but those under `skip`) -> its sha256 ("dir" for folders)."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if any(p == s or s in p.parents for s in map(Path, skip)):
            continue
        out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line(r: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The run exited with `code` and printed exactly one line on stderr, holding `words`; no traceback."""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == code and len(lines) == 1, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stdout + r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def user_folder(root: Path) -> Path:
    """A folder of the user's own texts (and one sub-folder)."""
    d = root / "mytexts"
    (d / "sub").mkdir(parents=True)
    for i in range(3):
        (d / f"notes{i}.txt").write_text(f"my precious notes {i}\n" * 200)
    (d / "sub" / "draft.md").write_text("# draft\n")
    return d


def wait_for(cond, timeout=300.0, what="") -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def logged(run_dir: Path) -> int:
    try:
        return max((json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                    if line.strip().endswith("}")), default=0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


# 1. user files


def test_data_path_holding_user_texts_is_refused_and_untouched(data_dir, tmp_path):
    texts = user_folder(tmp_path)
    before = digest(tmp_path)
    r = run(TRAIN + tiny(data_dir, tmp_path / "run", f"data.path={texts}", "data.max_bytes=32000000"))
    one_line(r, 1, f"data.path={texts}", "data.prepare_from=")
    assert digest(tmp_path, skip=[tmp_path / "run"]) == before


def test_prepare_from_a_folder_that_matches_nothing_is_one_line(data_dir, tmp_path):
    """data.prepare_from=<a folder of .txt> with the default glob *.py: one line saying what is there."""
    texts = user_folder(tmp_path)
    before = digest(tmp_path)
    r = run(TRAIN + tiny(data_dir, tmp_path / "run", f"data.path={tmp_path / 'prepared'}", f"data.prepare_from={texts}"))
    one_line(r, 1, "*.py", ".txt")
    assert digest(tmp_path, skip=[tmp_path / "run"]) == before


def test_prepare_from_with_a_data_path_prepared_from_other_data_is_refused(data_dir, tmp_path):
    """data.path already holds data prepared from the standard library: data.prepare_from=<my texts>
    is not silently ignored (the run would train on the old data), nor prepared over it."""
    texts = user_folder(tmp_path)
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    before = digest(tmp_path)
    r = run(TRAIN + tiny(data, tmp_path / "run", f"data.prepare_from={texts}", "data.glob=*.txt"))
    one_line(r, 1, f"data.path={data} holds data prepared from 'stdlib'", f"not from data.prepare_from='{texts}'",
             "pick a new data.path")
    assert digest(tmp_path, skip=[tmp_path / "run"]) == before


# 2. damaged checkpoints


def test_a_flipped_checkpoint_is_named_never_trained_on_and_last_good_falls_back(data_dir, tmp_path):
    ref, run_dir = tmp_path / "ref", tmp_path / "run"
    assert run(TRAIN + tiny(data_dir, ref, "train.steps=6", "train.ckpt_every=2")).returncode == 0
    assert run(TRAIN + tiny(data_dir, run_dir, "train.steps=4", "train.ckpt_every=2")).returncode == 0
    data = run_dir / "step_0000004" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    mid = len(raw) // 2  # inside the tensors' bytes
    raw[mid:mid + 64] = bytes(b ^ 0xFF for b in raw[mid:mid + 64])
    data.write_bytes(raw)
    before = digest(run_dir)
    r = run(TRAIN + tiny(data_dir, run_dir, "train.steps=6", "train.ckpt_every=2"))
    one_line(r, 1, "step_0000004", "__0_0.distcp", "train.resume=last_good")
    assert digest(run_dir) == before  # nothing written, the damaged checkpoint not trained on
    r = run(TRAIN + tiny(data_dir, run_dir, "train.steps=6", "train.ckpt_every=2", "train.resume=last_good"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "passed over step_0000004" in r.stdout and "resumed from" in r.stdout and "step_0000002" in r.stdout
    got, want = losses(run_dir), losses(ref)
    assert sorted(got) == list(range(1, 7)) and got == want  # steps 3-6 retrained from step 2: the same curve


# 3. run directories


def test_multirun_jobs_get_their_own_run_dirs_and_resume_them(data_dir, tmp_path):
    out = tmp_path / "sweep"
    args = TRAIN + ["-m", *tiny(data_dir, out, "train.steps=2", "train.ckpt_every=0"), "optim.lr=1e-3,2e-3"]
    r = run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted(p for p in (tmp_path / "sweep-sweep").iterdir() if p.is_dir())
    assert len(jobs) == 2
    lrs = set()
    for job in jobs:
        assert (job / "latest").read_text().strip() == "step_0000002"
        lrs.add(next(line.split(":")[1].strip() for line in (job / "config.yaml").read_text().splitlines()
                     if line.strip().startswith("lr:")))
    assert lrs == {"0.001", "0.002"}
    r = run(args)  # the same sweep again: each job finds its own finished run
    assert r.returncode == 0 and r.stdout.count("already at step 2") == 2, r.stdout[-3000:]


def test_job_dir_names_are_flat_and_bounded():
    assert job_dir_name("optim.lr=1e-3") == "optim.lr=1e-3"
    assert "/" not in job_dir_name("data.path=/a/b,optim.lr=2")
    long = "x=" + "y" * 300
    assert len(job_dir_name(long)) <= 120 and job_dir_name(long) != job_dir_name(long + "z")


def test_a_second_run_in_the_same_dir_stops_with_one_line(data_dir, tmp_path):
    out = tmp_path / "run"
    first = subprocess.Popen(TRAIN + tiny(data_dir, out, "train.steps=100000", "train.ckpt_every=0"), cwd=REPO,
                             env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: logged(out) >= 2 or first.poll() is not None, what="the first run's step 2")
        assert first.poll() is None
        r = run(TRAIN + tiny(data_dir, out, "train.steps=100000", "train.ckpt_every=0"))
        owner = json.loads((out / "lock.json").read_text())
        one_line(r, 1, "another run owns it", f"pid {first.pid}", "lock.json")
        assert owner["pid"] == first.pid
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == EXIT_STOPPED, err[-3000:]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # one writer
    assert not (out / "lock.json").exists()


def test_stale_locks_are_taken_over_live_ones_are_not(tmp_path):
    from moefp8.rundir import STALE_S, RunDirError, RunLock

    said = []
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    me = RunLock(tmp_path, said.append).me
    (tmp_path / "lock.json").write_text(json.dumps({**me, "pid": int(dead.stdout), "proc_start": "1"}))
    with RunLock(tmp_path, said.append):  # its owner has ended (same host and boot)
        assert json.loads((tmp_path / "lock.json").read_text())["pid"] == os.getpid()
    assert not (tmp_path / "lock.json").exists() and "process has ended" in said[0]
    (tmp_path / "lock.json").write_text(json.dumps({**me, "host": "elsewhere", "pid": 1}))
    with pytest.raises(RunDirError, match="another run owns it .pid 1 on elsewhere"):
        RunLock(tmp_path, said.append).acquire()  # another host, heartbeat fresh: may be alive
    old = time.time() - STALE_S - 10
    os.utime(tmp_path / "lock.json", (old, old))
    with RunLock(tmp_path, said.append):
        assert "no heartbeat" in said[-1]


def test_resume_none_in_a_run_dir_is_refused_and_changes_nothing(data_dir, tmp_path):
    out = tmp_path / "run"
    assert run(TRAIN + tiny(data_dir, out, "train.steps=2")).returncode == 0
    before = digest(tmp_path)
    r = run(TRAIN + tiny(data_dir, out, "train.steps=2", "train.resume=none"))
    one_line(r, 1, "train.resume=none", "already holds a run", "train.out_dir")
    assert digest(tmp_path) == before


def test_out_dir_holding_user_files_is_refused(data_dir, tmp_path):
    texts = user_folder(tmp_path)
    before = digest(tmp_path)
    r = run(TRAIN + tiny(data_dir, texts, "train.steps=2"))
    one_line(r, 1, f"train.out_dir={texts}", "not a moefp8 run")
    assert digest(tmp_path) == before


# 4. nothing changes before a checkpoint has loaded


def test_a_refused_checkpoint_load_changes_nothing_in_the_run_dir(data_dir, tmp_path):
    out = tmp_path / "run"
    assert run(TRAIN + tiny(data_dir, out, "train.steps=2")).returncode == 0
    before = digest(tmp_path)
    r = run(TRAIN + tiny(data_dir, out, "train.steps=4", "model.n_experts=16"))
    one_line(r, 1, "does not fit this model", "step_0000002")
    assert digest(tmp_path) == before  # config.yaml, metrics.jsonl, starts.jsonl as they were


def test_resuming_on_other_data_is_refused(data_dir, tmp_path):
    from moefp8.data import prepare

    out, other = tmp_path / "run", tmp_path / "other"
    assert run(TRAIN + tiny(data_dir, out, "train.steps=2")).returncode == 0
    prepare("stdlib", str(other), max_bytes=300_000)
    before = digest(tmp_path)
    r = run(TRAIN + tiny(data_dir, out, "train.steps=4", f"data.path={other}", "data.prepare_from="))
    one_line(r, 1, "trained on other data", f"data.path={other}")
    assert digest(tmp_path) == before


# 5. nan_policy=skip is bounded


def test_skipping_non_finite_steps_is_bounded(data_dir, tmp_path):
    r = run(TRAIN + tiny(data_dir, tmp_path / "run", "train.steps=12", "optim.lr=1e30", "optim.grad_clip=0",
                         "train.nan_policy=skip", "train.max_skipped_steps=3", "train.ckpt_every=0"))
    one_line(r, 1, "4 steps skipped in a row", "train.max_skipped_steps=3", "last good checkpoint")


# 6. preemption


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_with_a_checkpoint_and_the_same_command_resumes_bit_exact(data_dir, tmp_path, sig):
    ref, out = tmp_path / "ref", tmp_path / "run"
    args = ["train.steps=16", "train.ckpt_every=0"]
    assert run(TRAIN + tiny(data_dir, ref, *args)).returncode == 0
    p = subprocess.Popen(TRAIN + tiny(data_dir, out, *args), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: logged(out) >= 4 or p.poll() is not None, what="step 4")
        p.send_signal(sig)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == EXIT_STOPPED, (p.returncode, stderr[-3000:])
    stopped = logged(out)
    assert 4 <= stopped < 16 and (out / "latest").read_text().strip() == f"step_{stopped:07d}"
    assert f"stopped by {sig.name} after step {stopped}" in stdout and "Traceback" not in stderr
    r = run(TRAIN + tiny(data_dir, out, *args))
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(out) == losses(ref)


def test_a_second_signal_stops_at_once(tmp_path):
    code = ("import os, signal, time\n"
            "from moefp8.stop import StopSignals\n"
            "with StopSignals() as s:\n"
            "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.1)\n"
            "    assert s.requested == 'SIGTERM'\n"
            "    os.kill(os.getpid(), signal.SIGINT)  # a copy of the same request: ignored\n"
            "    time.sleep(2.5)\n"
            "    print('still running', flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
            "print('not reached')\n")
    r = run([sys.executable, "-c", code])
    assert r.returncode == 128 + signal.SIGTERM and "still running" in r.stdout and "not reached" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and "stopping after this step" in lines[0] and "stopping at once" in lines[1], r.stderr


@pytest.mark.slow
def test_sigterm_to_one_rank_of_two_stops_both_and_resume_is_bit_exact(data_dir, tmp_path):
    """torchrun, 2 gloo processes, EP 2: SIGTERM to rank 1 alone stops both ranks after the same step
    with one checkpoint (exit status 75); the same command resumes, and the losses equal an
    uninterrupted run's bit for bit."""
    from moefp8.testing import torchrun_worker_pid

    ref, out = tmp_path / "ref", tmp_path / "run"
    common = TORCHRUN + ["--nproc_per_node", "2", "-m", "moefp8.train", "dispatch=all_to_all", "dispatch.ep_size=2"]
    args = ["train.steps=12", "train.ckpt_every=0", "train.micro_batch=2"]
    r = run(common + tiny(data_dir, ref, *args))
    assert r.returncode == 0, r.stderr[-3000:]
    p = subprocess.Popen(common + tiny(data_dir, out, *args), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: logged(out) >= 3 or p.poll() is not None, what="step 3")
        victim = torchrun_worker_pid(p.pid, 1)
        assert victim and p.poll() is None
        os.kill(victim, signal.SIGTERM)
        log, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    stopped = logged(out)
    assert stopped < 12 and (out / "latest").read_text().strip() == f"step_{stopped:07d}", log[-3000:]
    # the first rank to exit reports 75; torchrun then SIGTERMs the other, which may be exiting already
    assert f"stopped by a signal to another rank after step {stopped}" in log and "exitcode  : 75" in log
    r = run(common + tiny(data_dir, out, *args))
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(out) == losses(ref)


# 7. one line for every bad input, also under torchrun


def test_out_dir_that_is_a_file(data_dir, tmp_path):
    (tmp_path / "afile").write_text("mine")
    r = run(TRAIN + tiny(data_dir, tmp_path / "afile", "train.steps=2"))
    one_line(r, 1, "is a file")
    assert (tmp_path / "afile").read_text() == "mine"


def test_out_dir_that_cannot_be_written(data_dir, tmp_path):
    if os.access("/sys", os.W_OK) and os.geteuid() != 0:
        pytest.skip("no read-only folder to try")
    r = run(TRAIN + tiny(data_dir, "/sys/moefp8-test-run", "train.steps=2"))
    one_line(r, 1, "train.out_dir=/sys/moefp8-test-run: cannot write there")


def test_online_logging_without_a_wandb_key(data_dir, tmp_path):
    env = {k: v for k, v in ENV.items() if not k.startswith("WANDB_") and k != "NETRC"} | {"HOME": str(tmp_path)}
    r = run(TRAIN + tiny(data_dir, tmp_path / "run", "train.steps=2", "logger.mode=online"), env=env)
    one_line(r, 1, "logger.mode=online: no wandb API key", "logger.mode=offline")


def test_copy_engine_on_the_cpu(data_dir, tmp_path):
    r = run(TRAIN + tiny(data_dir, tmp_path / "run", "dispatch=all_to_all", "dispatch.ep_size=2",
                         "dispatch.transport=copy_engine", "dispatch.mode=capacity"))
    one_line(r, 1, "dispatch.transport=copy_engine", "dispatch.transport=collective")


def test_token_ids_beyond_the_model_vocabulary(data_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    index = json.loads((data / "index.json").read_text())
    (data / "index.json").write_text(json.dumps({**index, "vocab_size": 1000}))
    r = run(TRAIN + tiny(data, tmp_path / "run", "train.steps=2"))
    one_line(r, 1, "model.vocab_size", "1000")


def test_a_corrupt_data_index(data_dir, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    (data / "index.json").write_text("{")
    before = digest(tmp_path)
    r = run(TRAIN + tiny(data, tmp_path / "run", "train.steps=2"))
    one_line(r, 1, str(data / "index.json"))
    assert digest(tmp_path, skip=[tmp_path / "run"]) == before


def test_a_file_size_limit_during_a_save_is_one_line(data_dir, tmp_path):
    """The real DCP write path failing (RLIMIT_FSIZE: EFBIG) names the reason; nothing partial stays."""
    import resource

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # 1 MiB: the checkpoint's data is ~8 MB

    out = tmp_path / "run"
    r = run(TRAIN + tiny(data_dir, out, "train.steps=2"), preexec_fn=limit)
    one_line(r, 1, "step_0000002", "File too large")
    assert not (out / "latest").exists() and not list(out.glob("step_*"))


def test_capacity_too_small_under_torchrun_is_printed_once_and_is_the_root_cause(data_dir, tmp_path):
    r = run(TORCHRUN + ["--nproc_per_node", "2", "-m", "moefp8.train", "dispatch=all_to_all", "dispatch.ep_size=2",
                        "dispatch.capacity=10", *tiny(data_dir, tmp_path / "run")])
    out = r.stdout + r.stderr
    ours = [line for line in out.splitlines() if line.startswith("config error: dispatch.capacity=10")]
    assert r.returncode != 0 and len(ours) == 1, out[-4000:]
    assert "set dispatch.capacity >= 256" in ours[0]
    root = out.split("Root Cause", 1)[1]
    assert "dispatch.capacity=10" in root, out[-4000:]  # the launcher's report names it
    assert "moefp8/" not in out  # no traceback from our code


# 8. small traps


def test_a_run_shorter_than_the_warmup_trains(data_dir, tmp_path):
    r = run(TRAIN + [a for a in tiny(data_dir, tmp_path / "run", "train.steps=3") if not a.startswith("optim.warmup")])
    # (optim.warmup_steps: its default, 10)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3]


def test_old_checkpoints_are_pruned_but_pinned_ones_kept(data_dir, tmp_path):
    out = tmp_path / "run"
    assert run(TRAIN + tiny(data_dir, out, "train.steps=5", "train.ckpt_every=1", "train.keep_last=2")).returncode == 0
    assert sorted(p.name for p in out.glob("step_*")) == ["step_0000004", "step_0000005"]
    (out / "step_0000005" / "keep").touch()  # the user's pin
    assert run(TRAIN + tiny(data_dir, out, "train.steps=8", "train.ckpt_every=1", "train.keep_last=2")).returncode == 0
    assert sorted(p.name for p in out.glob("step_*")) == ["step_0000005", "step_0000007", "step_0000008"]


def test_a_sigkilled_run_keeps_its_wandb_records(data_dir, tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    p = subprocess.Popen(TRAIN + tiny(data_dir, out, "train.steps=100000", "train.ckpt_every=0",
                                      "logger.mode=offline"), cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: logged(out) >= 3 or p.poll() is not None, what="step 3")
        time.sleep(5)  # > the 2 s flush interval
        p.kill()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    [log] = out.glob("wandb/offline-run-*/run-*.wandb")
    assert log.stat().st_size > 1000  # records, not just the 7-byte header (wandb's default flushes every 15 s)


def test_help_describes_the_options():
    r = run(TRAIN + ["--help"])
    assert r.returncode == 0 and "train.keep_last" in r.stdout and "train.max_skipped_steps" in r.stdout

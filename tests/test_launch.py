"""Tests of the ``hp-run`` launcher and of the multi-rank test harness.

Design note
-----------
Both are exercised with framework-free scripts and targets, so these tests run anywhere and fast.
What matters most is checked on real processes: the rendezvous environment each rank sees, that
a failure or timeout ends every other rank (and what it spawned) by pid, and that the reports
name the failing rank with its own error text.  Ranks report their pids through files so the
test can verify afterwards that nothing is left running.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hyper_parallel.launch import RankProcesses, core_slices
from tests.multirank import REPO_ROOT, RankFailure, run_ranks

_SCRIPT_HELPERS = """
import os, sys, time
def write_pid(path, pid=None):  # atomically, so a reader never sees an empty file
    tmp = os.path.join(os.path.dirname(path), "tmp-" + os.path.basename(path))
    with open(tmp, "w") as file:
        file.write(str(pid or os.getpid()))
    os.replace(tmp, path)
def wait_for(paths, limit=20):
    deadline = time.monotonic() + limit
    while not all(os.path.exists(p) for p in paths):
        if time.monotonic() > deadline:
            sys.exit("gave up waiting for " + repr(paths))
        time.sleep(0.02)
"""


def _hp_run(*argv, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "hyper_parallel.launch", *map(str, argv)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def _write_script(tmp_path, body):
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT_HELPERS + textwrap.dedent(body))
    return script


def _alive(pid):
    """Whether ``pid`` still runs; a zombie nobody reaped yet counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _assert_gone(pids, grace_s=5.0):
    deadline = time.monotonic() + grace_s
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _alive(pid)], "processes left running"


def _read_pids(tmp_path, pattern):
    return [int(path.read_text()) for path in sorted(tmp_path.glob(pattern))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nodes, first_rank", [([], 0), (["--nnodes", 2, "--node-rank", 1,
                                                          "--master-port", 29531], 3)])
def test_hp_run_sets_rank_environment_and_prefixes_output(tmp_path, nodes, first_rank):
    script = _write_script(tmp_path, """
        e = os.environ
        print(f"RANK={e['RANK']} WORLD_SIZE={e['WORLD_SIZE']} LOCAL_RANK={e['LOCAL_RANK']} "
              f"LOCAL_WORLD_SIZE={e['LOCAL_WORLD_SIZE']} MASTER_PORT={e['MASTER_PORT']} "
              f"MASTER_ADDR={e['MASTER_ADDR']} HP_BACKEND={e.get('HP_BACKEND')} "
              f"OMP={e['OMP_NUM_THREADS']} ARGS={sys.argv[1:]}")
        print("to stderr", file=sys.stderr)
    """)
    result = _hp_run("--nproc", 3, "--backend", "mindspore", *nodes, script, "--flag", "x")
    assert result.returncode == 0, result.stderr
    out_lines = result.stdout.splitlines()
    assert len(out_lines) == 3
    world = 3 if not nodes else 6
    ports = set()
    for local in range(3):
        rank = first_rank + local
        (line,) = [line for line in out_lines if line.startswith(f"[rank {rank}] ")]
        fields = dict(item.split("=", 1) for item in line.split("] ", 1)[1].split(" ", 8))
        assert fields["RANK"] == str(rank) and fields["LOCAL_RANK"] == str(local)
        assert fields["WORLD_SIZE"] == str(world) and fields["LOCAL_WORLD_SIZE"] == "3"
        assert fields["MASTER_ADDR"] == "127.0.0.1" and fields["HP_BACKEND"] == "mindspore"
        assert fields["OMP"] == "1" and fields["ARGS"] == "['--flag', 'x']"
        ports.add(int(fields["MASTER_PORT"]))
        assert f"[rank {rank}] to stderr" in result.stderr.splitlines()
    assert len(ports) == 1 and (not nodes or ports == {29531})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("user_level, argv, expected", [
    (None, [], ("3", "{DISTRIBUTED:3}", "ERROR", None)),
    ("1", [], ("1", None, "ERROR", None)),
    (None, ["--verbose"], (None, None, None, "verbose")),
], ids=["quiet_by_default", "user_level_kept", "verbose"])
def test_hp_run_keeps_native_logs_at_errors_unless_asked(tmp_path, user_level, argv, expected):
    """The frameworks' native loggers show errors only, unless the user set a level of that
    framework or passed --verbose (then the frameworks' own defaults apply, and
    HP_NATIVE_LOG=verbose keeps init_distributed from quieting MindSpore's)."""
    names = ("GLOG_v", "MS_SUBMODULE_LOG_v", "TORCH_CPP_LOG_LEVEL", "HP_NATIVE_LOG")
    script = _write_script(tmp_path, f"""
        print(" ".join(str(os.environ.get(name)) for name in {names!r}))
    """)
    env = {k: v for k, v in os.environ.items() if k not in names}
    if user_level is not None:
        env["GLOG_v"] = user_level
    result = _hp_run("--nproc", 2, *argv, script, env=env)
    assert result.returncode == 0, result.stderr
    want = " ".join(str(level) for level in expected)
    assert [line.split("] ", 1)[1] for line in result.stdout.splitlines()] == [want, want]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [[], ["--verbose"]], ids=["quiet", "verbose"])
def test_hp_run_drops_native_lines_below_error_unless_verbose(tmp_path, argv):
    """MindSpore's start-up threads can log before its level is read: a quiet hp-run drops
    the lines in MindSpore's native format below error level, and nothing else."""
    native_info = "[INFO] DISTRIBUTED(7,7f11b129d6c0,python):2026-12-02 [tcp_client.cc:367] up"
    native_error = "[ERROR] DISTRIBUTED(7,7f11b129d6c0,python):2026-12-02 [tcp_client.cc:9] down"
    own = "[INFO] the script's own line"
    script = _write_script(tmp_path, f"""
        for line in {[native_info, native_error, own]!r}:
            print(line, file=sys.stderr)
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("GLOG_v", "MS_SUBMODULE_LOG_v")}
    result = _hp_run("--nproc", 1, *argv, script, env=env)
    assert result.returncode == 0, result.stderr
    relayed = [line.split("] ", 1)[1] for line in result.stderr.splitlines()]
    assert relayed == ([native_info] if argv else []) + [native_error, own]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bind", [True, False])
def test_hp_run_bind_cores_pins_every_thread_of_each_rank(tmp_path, bind):
    # A thread the rank starts later (as a framework's kernel or communication threads are)
    # must carry the binding too, so each rank reports its main thread's and a new thread's.
    script = _write_script(tmp_path, """
        import threading
        seen = []
        thread = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))
        thread.start(); thread.join()
        print(f"main={sorted(os.sched_getaffinity(0))} thread={seen[0]}")
    """)
    result = _hp_run("--nproc", 3, *(["--bind-cores"] if bind else []), script)
    assert result.returncode == 0, result.stderr
    expected = core_slices(3) if bind else [os.sched_getaffinity(0)] * 3
    for rank, cores in enumerate(expected):
        (line,) = [line for line in result.stdout.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert line.split("] ", 1)[1] == f"main={sorted(cores)} thread={sorted(cores)}"


def test_core_slices_are_equal_disjoint_and_shared_only_when_short():
    assert core_slices(2, [3, 1, 2, 0]) == [{0, 1}, {2, 3}]
    assert core_slices(3, range(8)) == [{0, 1}, {2, 3}, {4, 5}]  # cores 6, 7 stay unused
    assert core_slices(1, [5, 7]) == [{5, 7}]
    assert core_slices(4, [0, 1]) == [{0}, {0}, {1}, {1}]  # neighbours share
    assert core_slices(3, [4, 6]) == [{4}, {4}, {6}]
    assert core_slices(2) == core_slices(2, os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="at least 1"):
        core_slices(0)
    with pytest.raises(ValueError, match="no cores"):
        core_slices(2, [])


def test_bind_cores_where_the_os_cannot_is_a_clear_error(tmp_path, monkeypatch, capsys):
    import hyper_parallel.launch as launch

    monkeypatch.setattr(launch, "CAN_BIND_CORES", False)
    with pytest.raises(NotImplementedError, match="sched_setaffinity"):
        launch.core_slices(2)
    script = _write_script(tmp_path, "pass")
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["--nproc", "2", "--bind-cores", str(script)])
    assert exit_info.value.code == 2
    assert "--bind-cores needs os.sched_setaffinity" in capsys.readouterr().err
    # this process's Ctrl-C is as main() found it (the suite's interruption tests need it)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers


@pytest.mark.parametrize("cores", [[{0}], [{0}, set()]])
def test_rank_processes_rejects_bad_core_sets_before_starting_anything(cores):
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(ValueError, match="non-empty set of cores"):
        RankProcesses([command] * 2, [dict(os.environ)] * 2, cores=cores)


@pytest.mark.timeout(60)
def test_hp_run_failing_rank_ends_the_others(tmp_path):
    script = _write_script(tmp_path, f"""
        rank, pids = int(os.environ["RANK"]), {str(tmp_path)!r}
        if rank == 1:
            wait_for([f"{{pids}}/pid.{{r}}" for r in (0, 2)] + [f"{{pids}}/grandchild.0"])
            print("boom: rank one gives up", file=sys.stderr)
            sys.exit(3)
        if rank == 0:  # a grandchild in the rank's group must be ended with it
            import subprocess
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            write_pid(f"{{pids}}/grandchild.0", child.pid)
        write_pid(f"{{pids}}/pid.{{rank}}")
        time.sleep(60)
    """)
    start = time.monotonic()
    result = _hp_run("--nproc", 3, script)
    assert time.monotonic() - start < 30
    assert result.returncode == 3, result.stderr
    assert "hp-run: rank 1 failed with exit code 3; ended ranks [0, 2]" in result.stderr
    summary = result.stderr.split("hp-run: rank 1 failed", 1)[1]
    assert "boom: rank one gives up" in summary
    _assert_gone(_read_pids(tmp_path, "pid.*") + _read_pids(tmp_path, "grandchild.*"))


@pytest.mark.timeout(60)
def test_hp_run_timeout_ends_all_ranks(tmp_path):
    script = _write_script(tmp_path, f"""
        import signal
        rank = int(os.environ["RANK"])
        if rank == 1:  # the launcher must escalate to SIGKILL
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        write_pid(f"{str(tmp_path)}/pid.{{rank}}")
        while True:
            time.sleep(1)
    """)
    result = _hp_run("--nproc", 2, "--timeout", 3, script)
    assert result.returncode == 124, result.stderr
    assert "hp-run: timed out after 3 s; ended ranks [0, 1]" in result.stderr
    pids = _read_pids(tmp_path, "pid.*")
    assert len(pids) == 2
    _assert_gone(pids)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_hp_run_signal_ends_all_ranks(tmp_path, signum):
    script = _write_script(tmp_path, f"""
        write_pid(f"{str(tmp_path)}/pid.{{os.environ['RANK']}}")
        time.sleep(60)
    """)
    launcher = subprocess.Popen([sys.executable, "-m", "hyper_parallel.launch", "--nproc", "2",
                                 str(script)], cwd=REPO_ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(list(tmp_path.glob("pid.*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        launcher.send_signal(signum)
        _, stderr = launcher.communicate(timeout=30)
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum, stderr
    assert f"interrupted by {signal.Signals(signum).name}" in stderr
    _assert_gone(_read_pids(tmp_path, "pid.*"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, message", [
    (["--nproc", 0], "--nproc must be at least 1"),
    (["--nproc", 2, "--nnodes", 2], "--master-port is required when --nnodes > 1"),
    (["--nproc", 2, "--nnodes", 2, "--node-rank", 2, "--master-port", 1234], "--node-rank"),
])
def test_hp_run_rejects_bad_arguments(tmp_path, argv, message):
    script = _write_script(tmp_path, "print('must not run')")
    result = _hp_run(*argv, script)
    assert result.returncode == 2
    assert message in result.stderr and "must not run" not in result.stdout


@pytest.mark.timeout(60)
def test_hp_run_rejects_missing_script(tmp_path):
    result = _hp_run("--nproc", 1, tmp_path / "absent.py")
    assert result.returncode == 2 and "script not found" in result.stderr


def _echo_rank(value):
    return int(os.environ["RANK"]), value


def _fail_on_rank_1(pid_dir):
    if int(os.environ["RANK"]) == 0:
        Path(pid_dir, "tmp-pid.0").write_text(str(os.getpid()))
        os.replace(Path(pid_dir, "tmp-pid.0"), Path(pid_dir, "pid.0"))  # readers see all or nothing
        time.sleep(60)
    deadline = time.monotonic() + 20
    while not Path(pid_dir, "pid.0").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    raise ValueError("deliberate failure on rank 1")


def _sleep_forever():
    print("rank going to sleep", flush=True)
    time.sleep(3600)


_NO_DIST = {"HP_TEST_NO_DIST": "1"}


@pytest.mark.timeout(60)
def test_run_ranks_returns_per_rank_values():
    results = run_ranks("tests.test_launch:_echo_rank", 2, "torch", 5, env=_NO_DIST)
    assert results == [(0, 5), (1, 5)]


@pytest.mark.timeout(60)
def test_run_ranks_reports_failing_rank_and_ends_the_others(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks("tests.test_launch:_fail_on_rank_1", 2, "torch", str(tmp_path), env=_NO_DIST)
    assert time.monotonic() - start < 30
    message = str(info.value)
    assert "rank 1 failed" in message and "ended ranks [0]" in message
    assert "ValueError: deliberate failure on rank 1" in message
    _assert_gone(_read_pids(tmp_path, "pid.*"))


@pytest.mark.timeout(60)
def test_run_ranks_timeout_reports_every_log(tmp_path):
    with pytest.raises(RankFailure) as info:
        run_ranks("tests.test_launch:_sleep_forever", 2, "mindspore", timeout_s=3, env=_NO_DIST)
    message = str(info.value)
    assert "timed out after 3 s" in message and "ended ranks [0, 1]" in message
    assert "log lines of rank 0" in message and "log lines of rank 1" in message
    assert message.count("rank going to sleep") == 2

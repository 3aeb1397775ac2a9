"""The raytrain-x command end to end, and through `ray job submit`."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from raytrain_x.testing.waiting import free_port
from tests import limits
from tests.conftest import REPO, TEMP_PREFIX

BIN = Path(sys.executable).parent


def _cli(*args: str, work_s: float = 30, env: dict | None = None):
    """`raytrain-x ARGS` whose run takes `work_s` on an idle runner (tests/limits.py)."""
    return limits.run([str(BIN / "raytrain-x"), *args], work_s, f"raytrain-x {args[0]}",
                      cwd=REPO, env={**os.environ, "RAY_AUTH_MODE": "disabled", **(env or {})})


def test_cli_reports_the_failing_rank(ray_cluster, tmp_path):
    """Also: a config file as autotune_experiments writes it (best_config.json) gives the
    ranks its knobs and its training settings."""
    script = tmp_path / "fail.py"
    script.write_text(
        "import sys, torch, raytrain_x, raytrain_x.torch as rx\n"
        "rx.init()\n"
        "print('hello from', rx.rank(), raytrain_x.training_settings(), rx.knobs().cycle_time_ms)\n"
        "if rx.rank() == 1:\n"
        "    sys.exit(7)\n"
        "rx.allreduce(torch.ones(1), name='x')\n")
    best = tmp_path / "best_config.json"
    best.write_text('{"config": {"zero_stage": 2, "micro_batch_size": 8, "cycle_time_ms": 3}, '
                    '"samples_per_sec": 123.0}')
    out = _cli("run", "-np", "2", "--address", ray_cluster, "--config-file", str(best),
               "python", str(script))
    assert out.returncode == 7
    assert "[1]<stdout>:hello from 1 {'zero_stage': 2, 'micro_batch_size': 8} 3.0" in out.stdout
    assert "rank 1 exited with code 7" in out.stderr
    # rank 0's collective ends saying a peer left (pending, or submitted after the engines
    # stopped), not advising about a shutdown() no one called
    assert "make every rank finish its collectives" not in out.stdout + out.stderr
    assert "InternalError: another rank left the job" in out.stdout, out.stdout[-3000:]


def test_a_failed_rank_ends_the_launch_even_with_a_stuck_peer_and_leaves_no_process(
        ray_cluster, tmp_path):
    """The launcher joined every rank with no deadline: one rank failing while another was
    stuck outside any collective hung the CLI; the stuck script outlived its worker; and
    one byte that is not UTF-8 in a rank's output killed its reader thread."""
    import subprocess

    marker = f"rtx-stuck-{os.getpid()}"
    script = tmp_path / "stuck.py"
    script.write_text(
        "import os, sys, time, raytrain_x.torch as rx\n"
        "rx.init()\n"
        "sys.stdout.buffer.write(b'bytes \\xff\\xfe from ' + str(rx.rank()).encode() + b'\\n')\n"
        "sys.stdout.flush()\n"
        "if rx.rank() == 1:\n"
        "    sys.exit(3)\n"
        "os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(1000)', "
        f"'{marker}'])  # stuck, outside any collective\n")
    began = time.monotonic()
    out = _cli("run", "-np", "2", "--address", ray_cluster, "--timeout", "2", "python",
               str(script), work_s=40)
    assert out.returncode == 3, out.stderr[-2000:]
    assert time.monotonic() - began < limits.limit(40)
    assert "[0]<stdout>:bytes \\xff\\xfe from 0" in out.stdout, out.stdout
    assert "[1]<stdout>:bytes \\xff\\xfe from 1" in out.stdout, out.stdout
    assert "rank 1 exited with code 3" in out.stderr
    assert "still running after another rank failed; stopping it" in out.stdout + out.stderr
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"the stuck script outlived its worker: {left.stdout}"


@pytest.mark.parametrize(
    "args,message",
    [
        (["run", "-np", "2"], "needs a command"),
        (["run", "-np", "0", "python", "x.py"], "-np must be >= 1"),
        (["run", "-np", "2", "--cycle-time-ms", "fast", "python", "x.py"], "invalid float"),
        (["run", "-np", "2", "--fusion-threshold-mb", "-1", "python", "x.py"], "out of range"),
        (["run", "--bogus", "-np", "2", "python", "x.py"], "unrecognized arguments"),
        (["run", "-np", "2", "--config-file", "/nope.yaml", "python", "x.py"], "does not exist"),
        (["run", "-np", "2", "-H", "a:1", "-hostfile", "h", "python", "x.py"], "not both"),
        (["run", "-np", "2", "-H", "a:x", "python", "x.py"], "is not 'host:slots'"),
        (["run", "--log-level", "LOUD", "-np", "2", "python", "x.py"], "invalid choice"),
        (["run", "python", "x.py"], "required: -np"),
        (["run", "-np", "2", "pyhton", "x.py"], "command 'pyhton' not found on PATH"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, message):
    out = _cli(*args, work_s=5)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.slow
def test_ray_job_submit():
    """`ray job submit --working-dir . -- raytrain-x run -np 2 python examples/torch_digits.py`,
    the README's command as written, against a `ray start --head` cluster of the README's
    machine's size (2 CPUs) with token authentication, Ray's recommended setting: the user
    sets `RAY_AUTH_MODE=token` where they submit (the token from Ray's own places; here
    `RAY_AUTH_TOKEN_PATH`, so that the test writes nothing in the home folder) and the job's
    driver, `raytrain-x run`, connects with the cluster's token like any Ray driver."""
    gcs, dash = free_port(), free_port()
    temp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}job", dir="/tmp"))  # short socket paths
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
           "RAY_API_SERVER_ADDRESS": f"http://127.0.0.1:{dash}",
           "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    try:  # the start too: a start that fails or times out half-way leaves processes behind
        # the job API needs the dashboard, which the session's shared cluster runs without
        start = limits.run(
            [str(BIN / "ray"), "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}",
             "--dashboard-host=127.0.0.1", "--num-cpus=2", "--include-dashboard=true",
             # own agent ports: the defaults are taken by the test session's cluster
             f"--dashboard-agent-listen-port={free_port()}",
             f"--dashboard-agent-grpc-port={free_port()}",
             f"--metrics-export-port={free_port()}",
             f"--runtime-env-agent-port={free_port()}",
             f"--temp-dir={temp}", "--disable-usage-stats"],
            10, "ray start --head with the dashboard", ray_starts=1, env=env)
        assert start.returncode == 0, start.stderr[-2000:]
        # the job agent starts after `ray start` returns, slowly on a busy machine
        deadline = time.monotonic() + limits.limit(15)
        submit = None
        while time.monotonic() < deadline:
            submit = limits.run(
                [str(BIN / "ray"), "job", "submit", "--working-dir", ".", "--", "raytrain-x",
                 "run", "-np", "2", "python", "examples/torch_digits.py"],
                40, "ray job submit", env=env, cwd=REPO)
            if not any(transient in submit.stderr + submit.stdout for transient in
                       ("Connection refused", "No available agent")):
                break
            time.sleep(3)
        assert submit is not None and submit.returncode == 0, \
            (submit.stdout[-3000:], submit.stderr[-3000:])
        assert re.search(r"\[0\]<stdout>:test accuracy 0\.[89]", submit.stdout), submit.stdout
        assert "succeeded" in submit.stdout
        assert "raytrain-x: joined the Ray cluster at" in submit.stdout, submit.stdout[-3000:]
        unauthenticated = limits.run([str(BIN / "ray"), "job", "list"], 20,
                                     "ray job list without the token",
                                     env={**env, "RAY_AUTH_MODE": "disabled"}, cwd=REPO)
        assert unauthenticated.returncode != 0  # the cluster does check the token
        _a_stopped_job_resumes_when_submitted_again(dash, env)
    finally:
        _stop_cluster(temp, gcs)


def _a_stopped_job_resumes_when_submitted_again(dash: int, env: dict) -> None:
    """`ray job stop` ends a job's entrypoint (its driver) mid-training; the same job
    submitted again resumes from its latest durable checkpoint."""
    from raytrain_x.common.checkpoint_config import CheckpointConfig
    from raytrain_x.elastic.checkpoints import CheckpointStore

    out = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}resume", dir="/tmp"))
    try:
        (out / "job.py").write_text(_RESUMABLE)
        store_path = str(out / "checkpoints")
        address = f"--address=http://127.0.0.1:{dash}"
        job = ["--", "raytrain-x", "run", "-np", "2", "--job-name", "submitted",
               "--checkpoint-path", store_path, "--checkpoint-every", "0.2", "python",
               str(out / "job.py"), str(out)]
        first = limits.run([str(BIN / "ray"), "job", "submit", address, "--no-wait",
                            "--submission-id", "resumable-1", *job, "100000"], 20,
                           "ray job submit --no-wait", env=env, cwd=REPO)
        assert first.returncode == 0, first.stderr[-2000:]
        store = CheckpointStore(CheckpointConfig(store_path, name="submitted"))
        limits.wait_until(lambda: any(c.values.get("step", 0) >= 5
                                      for c in store.checkpoints()), 60,
                          "a checkpoint of the submitted job after 5 steps")
        stop = limits.run([str(BIN / "ray"), "job", "stop", address, "resumable-1"], 30,
                          "ray job stop", env=env, cwd=REPO)
        assert stop.returncode == 0, stop.stderr[-2000:]
        pids = [int(p.name.split(".")[1]) for p in out.glob("pid*")]
        assert len(pids) == 2
        limits.wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids),
                          30, "the stopped job's ranks to exit")
        resumed_from = store.checkpoints()[0].values["step"]
        # to 20 steps past where it stopped, however far the first job got before its stop
        again = limits.run([str(BIN / "ray"), "job", "submit", address, *job,
                            str(resumed_from + 20)], 40, "ray job submit, resumed", env=env,
                           cwd=REPO)
        assert again.returncode == 0, again.stdout[-3000:]
        began = re.findall(r"<stdout>:began (\d+) done (\w+)", again.stdout)
        assert len(began) == 2, again.stdout[-3000:]
        assert all(int(b) >= resumed_from and ok == "True" for b, ok in began), began
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _stop_cluster(temp: Path, gcs_port: int) -> None:
    """Stops only the processes of the cluster under `temp` or with GCS port `gcs_port`
    (`ray stop` would also stop the test session's shared cluster). The port catches the
    Ray client server, whose command line does not name the temp dir."""
    from raytrain_x.testing.processes import cluster_processes, stop

    stop(cluster_processes([str(temp), f":{gcs_port} "]))
    shutil.rmtree(temp, ignore_errors=True)


_HOROVODRUN_SCRIPT = """\
import logging, os, torch, raytrain_x.torch as rx
rx.init()
names = ["RANK", "SIZE", "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"]
print("horovod", rx.rank(), [os.environ["HOROVOD_" + n] for n in names],
      bool(os.environ["HOROVOD_HOSTNAME"]),
      os.environ.get("RAYTRAIN_X_STALL_CHECK_TIME_SECONDS"),
      os.environ.get("RAYTRAIN_X_TIMELINE_MARK_CYCLES"),
      logging.getLogger("raytrain_x").getEffectiveLevel(),
      rx.allreduce(torch.tensor(rx.rank() + 1.0)).item())
"""


def test_a_horovodrun_command_line_runs_with_the_launchers_name_changed(ray_cluster, tmp_path):
    """horovodrun's flags and worker variables: -H, --output-filename, the stall check, the
    timeline's cycle marks, --log-level, --gloo-timeout-seconds; its flags that mean nothing
    on Ray are taken with a warning; --check-build."""
    script, out_dir = tmp_path / "hvd.py", tmp_path / "out"
    script.write_text(_HOROVODRUN_SCRIPT)
    out = _cli("run", "-np", "2", "-H", "localhost:2", "--address", ray_cluster, "--gloo",
               "--ssh-port", "22", "--output-filename", str(out_dir), "--log-level", "debug",
               "--no-stall-check", "--timeline-mark-cycles", "--gloo-timeout-seconds", "20",
               "--prefix-output-with-timestamp", "python", str(script))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--ssh-port does nothing here: Ray starts the workers, not SSH" in out.stderr
    for rank in (0, 1):
        line = f"horovod {rank} ['{rank}', '2', '{rank}', '2', '0', '1'] True 0.0 1 10 1.5"
        assert re.search(rf"\d\d:\d\d:\d\d \d{{4}}:\[{rank}\]<stdout>:{re.escape(line)}",
                         out.stdout), out.stdout
        assert line in (out_dir / f"rank.{rank}" / "stdout").read_text()
    build = _cli("run", "--check-build", work_s=5)
    assert build.returncode == 0 and "[X] Gloo" in build.stdout and "[X] PyTorch" in build.stdout
    missing = _cli("run", "-np", "1", "-H", "no-such-host:1", "--address", ray_cluster,
                   "python", str(script))
    assert missing.returncode == 2
    assert "host 'no-such-host' of -H/--hosts is not an alive Ray node" in missing.stderr


def test_cli_elastic_job(ray_cluster, tmp_path):
    """Horovod's elastic command line: a discovery script printing bare host names, their
    slots from --slots (`localhost`: the driver's node)."""
    script = tmp_path / "discover_hosts.sh"
    script.write_text("#!/bin/sh\necho localhost\n")
    script.chmod(0o755)
    out = _cli("run", "-np", "2", "--min-np", "1", "--max-np", "2", "--address", ray_cluster,
               "--host-discovery-script", str(script), "--slots", "2",
               "python", "examples/elastic_digits.py", work_s=20)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"test accuracy 0\.9", out.stdout + out.stderr), out.stdout[-2000:]


def test_an_fsdp2_script_trains_on_when_a_worker_exits(ray_cluster, tmp_path):
    """examples/elastic_fsdp.py through `raytrain-x run --min-np 1 --max-np 2`: the last
    rank exits at step 5; the survivor gets its chunks from their copy and finishes."""
    marker = tmp_path / "exited"
    out = _cli("run", "-np", "2", "--min-np", "1", "--max-np", "2", "--address", ray_cluster,
               "--blacklist-cooldown-range", "600", "900", "python",
               "examples/elastic_fsdp.py", "--steps", "12", "--exit-once", str(marker),
               work_s=40)
    assert out.returncode == 0, out.stderr[-3000:]
    assert marker.exists()
    assert re.search(r"after 12 steps; workers \[2, 1\]; restored 1 time", out.stdout), \
        out.stdout[-2000:]


_JOB_WAITS_FOR_OUTSIDER = """\
import os, sys, time, torch, raytrain_x.torch as rx
from pathlib import Path
rx.init()
rx.autotune_batch_size(4)
for _ in range(3):
    rx.mark_step()
here = Path(sys.argv[1])
if rx.rank() == 0:
    addr = os.environ["RAYTRAIN_X_STORE_ADDR"] + " " + os.environ["RAYTRAIN_X_STORE_PORT"]
    (here / "store.tmp").write_text(addr)
    os.replace(here / "store.tmp", here / "store")
while not (here / "go").exists():
    time.sleep(0.05)
total = rx.allreduce(torch.full((3,), float(rx.rank() + 1)), op=rx.Sum, name="after")
rx.barrier()
if rx.rank() == 0:
    from raytrain_x.common.process import PROCESS
    server = PROCESS.store_servers[0]
    print("refused", server.refused, "intruder key", server.table.check(["intruder"]))
print("sum", total.tolist())
"""

_OUTSIDER = """\
import json, sys
from datetime import timedelta
import torch.distributed as dist
from raytrain_x.comm.job_store import JobStoreClient
host, port = sys.argv[1], int(sys.argv[2])
seen = {}
try:
    s = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=2))
    s.set("intruder", "x")
    seen["torch"] = "wrote a key; keys: %d" % s.num_keys()
except Exception as exc:
    seen["torch"] = type(exc).__name__
try:
    JobStoreClient(host, port, "guessed-" * 4, timeout_s=2).set("intruder", b"x")
    seen["guess"] = "wrote a key"
except Exception as exc:
    seen["guess"] = type(exc).__name__
print(json.dumps(seen))
"""


def test_launched_jobs_store_refuses_a_process_without_the_jobs_secret(ray_cluster, tmp_path):
    """A process outside the job, on the network, connects to the running job's store: with
    torch's TCPStore client and with raytrain-x's own client and a guessed secret. Neither
    reads or writes a key; the job goes on and ends as if nothing happened.

    Also: the progress line. The ranks mark 3 steps before they wait, and each writes its
    status for its worker actor (`RAYTRAIN_X_STATUS_FILE`); the driver prints what rank 0
    reports, with the world size."""
    script = tmp_path / "job.py"
    script.write_text(_JOB_WAITS_FOR_OUTSIDER)
    job = subprocess.Popen(
        [str(BIN / "raytrain-x"), "run", "-np", "2", "--address", ray_cluster,
         "--progress-every", "0.3", "python", str(script), str(tmp_path)], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled",
             "RAYTRAIN_X_METRICS_INTERVAL_S": "0.2"})  # passed on to the ranks
    outputs: list[str] = []
    errors: list[str] = []
    readers = [threading.Thread(target=lines.extend, args=(pipe,), daemon=True)
               for pipe, lines in ((job.stdout, outputs), (job.stderr, errors))]
    for reader in readers:
        reader.start()
    try:
        limits.wait_until(lambda: (tmp_path / "store").exists() or job.poll() is not None, 20,
                          "rank 0 to write its store's address")
        assert job.poll() is None, "".join(errors)[-3000:]
        limits.wait_until(
            lambda: any("raytrain-x: 3 steps" in line and "2 workers" in line
                        for line in errors), 10, "a progress line with rank 0's 3 steps",
            state=lambda: [line for line in errors if "steps" in line][-2:])
        host, port = (tmp_path / "store").read_text().split()
        assert host not in ("0.0.0.0", "", "localhost")  # the node's address, named
        outsider = limits.run([sys.executable, "-c", _OUTSIDER, host, port], 10,
                              "the outsider's attempts", env=os.environ)
        (tmp_path / "go").touch()
        job.wait(timeout=limits.limit(20))
        for reader in readers:
            reader.join(limits.limit(5))
        out, err = "".join(outputs), "".join(errors)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert outsider.returncode == 0, outsider.stderr[-3000:]
    assert json.loads(outsider.stdout.splitlines()[-1]) == {
        "torch": "DistNetworkError", "guess": "StoreAuthError"}
    assert job.returncode == 0, err[-3000:]
    assert "[0]<stdout>:sum [3.0, 3.0, 3.0]" in out and "[1]<stdout>:sum [3.0, 3.0, 3.0]" in out
    refused = re.search(r"refused (\d+) intruder key (\w+)", out)
    assert refused and int(refused.group(1)) >= 2 and refused.group(2) == "False", out


_RESUMABLE = """
import os, sys, time, torch, raytrain_x.torch as rx
out, steps = sys.argv[1], int(sys.argv[2])
rx.init()
with open(os.path.join(out, f"pid{rx.rank()}.{os.getpid()}"), "w"):
    pass
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
opt = rx.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                              named_parameters=model.named_parameters())
state = rx.elastic.TorchState(model, opt, step=0, done=[])
began = []

@rx.elastic.run
def train(state):
    began.append(state.step)
    while state.step < steps:
        opt.zero_grad()
        model(torch.full((2, 4), float(state.step))).sum().backward()
        opt.step()
        state.done = [*state.done, state.step]
        state.step += 1
        state.commit()
        if rx.rank() == 0:
            with open(os.path.join(out, "step.tmp"), "w") as f:
                f.write(str(state.step))
            os.replace(os.path.join(out, "step.tmp"), os.path.join(out, "step"))
        time.sleep(0.05)

train(state)
print("began", began[0], "done", state.done == list(range(steps)))
"""


def test_a_killed_driver_resumes_from_its_checkpoint_when_the_command_runs_again(
        ray_cluster, tmp_path):
    """`raytrain-x run --checkpoint-path` is killed (SIGKILL) mid-training: its workers go
    with it, and the same command run again resumes from the latest checkpoint, doing every
    step once in the state it ends with."""
    from raytrain_x.common.checkpoint_config import CheckpointConfig
    from raytrain_x.elastic.checkpoints import CheckpointStore

    script = tmp_path / "job.py"
    script.write_text(_RESUMABLE)
    store_path = str(tmp_path / "checkpoints")
    command = [str(BIN / "raytrain-x"), "run", "-np", "2", "--address", ray_cluster,
               "--job-name", "resumable", "--checkpoint-path", store_path,
               "--checkpoint-every", "0.2", "python", str(script), str(tmp_path)]
    store = CheckpointStore(CheckpointConfig(store_path, name="resumable"))
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    output = tmp_path / "first.out"  # the ranks' output, for a run that ends early
    with open(output, "w") as out:
        first = subprocess.Popen([*command, "100000"], cwd=REPO, env=env, stdout=out,
                                 stderr=subprocess.PIPE, text=True)
    try:
        def checkpointed() -> bool:
            assert first.poll() is None, \
                first.stderr.read()[-3000:] + output.read_text()[-5000:]
            kept = store.checkpoints()
            return bool(kept) and kept[0].values.get("step", 0) >= 5
        limits.wait_until(checkpointed, 30, "a checkpoint after 5 steps")
    finally:
        first.kill()  # SIGKILL: no cleanup of its own
        first.wait()
    pids = [int(p.name.split(".")[1]) for p in tmp_path.glob("pid*")]
    assert len(pids) == 2

    def gone() -> bool:
        return not any(Path(f"/proc/{pid}").exists() for pid in pids)
    limits.wait_until(gone, 30, "the killed run's ranks to exit")
    resumed_from = store.checkpoints()[0].values["step"]
    second = _cli(*command[1:], "40", work_s=40)
    assert second.returncode == 0, second.stderr[-3000:]
    began = re.findall(r"<stdout>:began (\d+) done (\w+)", second.stdout)
    assert len(began) == 2, second.stdout[-3000:]
    assert all(int(b) >= resumed_from and ok == "True" for b, ok in began), began
    assert "restored checkpoint" in second.stderr + second.stdout


def test_a_checkpoint_path_that_cannot_be_written_fails_the_start_naming_it(
        ray_cluster, tmp_path):
    """`--checkpoint-path` at a file: the start fails at once (the driver probes the path),
    naming it and the cause, before any worker runs the script."""
    script = tmp_path / "never.py"
    script.write_text("print('the script ran')\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = _cli("run", "-np", "2", "--min-np", "1", "--max-np", "2", "--address", ray_cluster,
               "--job-name", "probed", "--checkpoint-path", str(blocker), "python",
               str(script))
    assert out.returncode == 1, out.stderr[-3000:]
    assert f"durable checkpoints cannot be written at {blocker}/probed" in out.stderr
    assert "--checkpoint-path on the command line" in out.stderr  # what this user gave
    assert "the script ran" not in out.stdout


def test_a_command_that_cannot_run_is_one_line_per_rank(ray_cluster, tmp_path):
    """A command the workers could not start was two threads' interleaved tracebacks (61
    lines, the cause in the middle); now each rank says it in one line, with the shell's
    exit code (126: not executable)."""
    script = tmp_path / "not_executable.sh"
    script.write_text("echo hi\n")
    out = _cli("run", "-np", "2", "--address", ray_cluster, str(script), work_s=15)
    assert out.returncode == 126, out.stderr[-2000:]
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:raytrain-x: cannot run {str(script)!r}: Permission denied" \
            in out.stdout, out.stdout


def test_a_job_starts_its_own_ray_and_says_at_once_what_cannot_fit(tmp_path):
    """Without --address or RAY_ADDRESS the job joined any Ray running on the machine (the
    suite's own cluster runs here now); and more workers than a local Ray can place waited
    out the placement timeout (108 s of silence). Now it starts its own Ray, says so first,
    and refuses what cannot fit in one line with the arithmetic."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    too_many = (os.cpu_count() or 1) + 3
    began = time.monotonic()
    out = limits.run([str(BIN / "raytrain-x"), "run", "-np", str(too_many), "python", "x.py"],
                     15, "a job too big for its local Ray", ray_starts=1, cwd=tmp_path,
                     env={**env, "RAY_AUTH_MODE": "disabled"})
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[0].startswith(f"raytrain-x: started a local Ray of {os.cpu_count()} CPUs"), \
        out.stderr
    assert lines[-1] == (f"raytrain-x: error: {too_many} workers need {too_many} CPUs (1 each) "
                         f"and the local Ray this job started has {os.cpu_count()}: give -np "
                         f"{os.cpu_count()} or fewer, a smaller --cpus-per-worker, or "
                         "--address of a cluster with room"), out.stderr
    assert len(lines) == 2, out.stderr
    assert time.monotonic() - began < 60  # not the placement timeout (100 s)


def test_ctrl_c_stops_the_job_with_exit_130_and_one_line(ray_cluster, tmp_path):
    """Ctrl-C was clean underneath but printed a KeyboardInterrupt traceback and "this
    worker's actor died" per rank, and exited 1."""
    marker = f"rtx-ctrl-c-{os.getpid()}"
    script = tmp_path / "long.py"
    script.write_text(
        "import sys, time, raytrain_x.torch as rx\n"
        "rx.init()\n"
        "print('training', rx.rank(), flush=True)\n"
        f"time.sleep(1000)  # {marker}\n")
    # faulthandler: a launcher that does not end is made to print its threads' stacks.
    # Ctrl-C's default disposition, as a terminal gives it: a suite started as a background
    # job (`make test &`, some CI runners) ignores SIGINT, and its children inherit that
    proc = subprocess.Popen([str(BIN / "raytrain-x"), "run", "-np", "2", "--address", ray_cluster,
                             "python", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled",
                                 "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen: list[str] = []
        reader = threading.Thread(target=lambda: seen.extend(proc.stdout), daemon=True)
        reader.start()
        limits.wait_until(lambda: sum("training" in line for line in seen) == 2, 20,
                          "both ranks training")
        proc.send_signal(2)  # what Ctrl-C sends
        try:
            code = proc.wait(timeout=limits.limit(20))
        except subprocess.TimeoutExpired:
            proc.send_signal(6)  # SIGABRT: faulthandler writes every thread's stack
            _, stacks = proc.communicate(timeout=30)
            raise AssertionError("raytrain-x run did not end after Ctrl-C; where its "
                                 f"threads were:\n{stacks[-8000:]}") from None
        err = proc.stderr.read()
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "actor died" not in "".join(seen) + err, err[-3000:]
    assert err.strip().splitlines()[-1] == \
        "raytrain-x: interrupted; the job's workers are stopped", err
    limits.wait_until(lambda: subprocess.run(["pgrep", "-f", marker], capture_output=True,
                                             text=True).stdout.strip() == "", 10,
                      "the scripts to end with their workers")


@pytest.mark.parametrize("exit_mode", ["exception", "kill"])
def test_horovods_elastic_script_survives_a_rank_that_fails(ray_cluster, tmp_path, exit_mode):
    """Horovod's elastic integration scenario (`test_single_rank_failure`), its script's
    shape run through `raytrain-x run` with horovodrun's elastic flags: the script names
    attributes `commits` and `rendezvous`, which collided with the state's own members and
    failed its first commit. Start rank 1 raises (or kills itself) at epoch 1's first
    batch; the survivor restores its last commit, meets again (rendezvous 2) and finishes
    every epoch alone, its counters as committed."""
    logfile = tmp_path / "log.jsonl"
    out = _cli("run", "-np", "2", "--min-np", "1", "--max-np", "2", "--address", ray_cluster,
               "--blacklist-cooldown-range", "600", "900", "python",
               str(Path(REPO) / "tests" / "scripts" / "horovod_elastic_train.py"),
               "--logfile", str(logfile), "--exit-schedule", json.dumps({"(1, 0)": [1]}),
               "--exit-mode", exit_mode, work_s=40)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in logfile.read_text().splitlines()]
    assert [r["epoch"] for r in lines] == [0, 1, 2], lines
    assert (lines[0]["size"], lines[0]["rendezvous"]) == (2, 1), lines[0]
    for r in lines[1:]:
        assert (r["start_rank"], r["size"], r["rendezvous"]) == (0, 1, 2), r
    # 4 batches and the epoch's end per epoch: the commits as committed, none twice
    assert [r["commits"] for r in lines] == [4, 9, 14], lines
    assert all(r["host_messages"] for r in lines)  # no host update pending at an epoch end

"""The launcher: process specs, and the supervisor driving dummy children (no model involved)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kettle.hub import ModelNotFound, ResolvedModel
from kettle.launcher import config as launcher_config
from kettle.launcher import main as launcher_main
from kettle.launcher.config import LauncherConfig
from kettle.launcher.specs import child_env, config_argv, kettle_command, router_spec, shard_specs

# A dummy shard: serves a Unix socket, records its pid, and notes when SIGTERM arrives.
SHARD = """
import os, signal, socket, sys, time
path, log = sys.argv[1], sys.argv[2]
def stop(*_):
    open(log, "a").write(f"shard {time.monotonic()}\\n"); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
server = socket.socket(socket.AF_UNIX); server.bind(path); server.listen()
open(log, "a").write(f"pid {os.getpid()}\\n")
time.sleep(120)
"""
# A dummy router: records its pid and SIGTERM; exits with argv[2] after argv[3] seconds if that is given.
ROUTER = """
import os, signal, sys, time
log = sys.argv[1]
def stop(*_):
    open(log, "a").write(f"router {time.monotonic()}\\n"); sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(log, "a").write(f"pid {os.getpid()}\\n")
if len(sys.argv) > 2:
    time.sleep(float(sys.argv[3])); sys.exit(int(sys.argv[2]))
time.sleep(120)
"""
DRIVER = """
import json, sys
from kettle.launcher.specs import ProcessSpec
from kettle.launcher.supervisor import Supervisor
from kettle.logging_setup import setup_logging
setup_logging()
plan = json.load(open(sys.argv[1]))
env = dict(__import__("os").environ)
specs = [ProcessSpec(s["name"], tuple(s["argv"]), env, s.get("socket")) for s in plan["specs"]]
margin = plan["router_exit_margin"]
sys.exit(Supervisor(specs[:-1], specs[-1], plan["timeout"], start_timeout=10, router_exit_margin=margin).run())
"""


def test_shard_specs_carry_the_distributed_environment():
    config = LauncherConfig(master_addr="10.0.0.1", master_port=1234, shard_uds_path="/tmp/k")
    (spec,) = shard_specs(config, "/models/m")
    assert spec.argv[: len(kettle_command()) + 2] == (*kettle_command(), "serve", "/models/m")
    assert {k: spec.env[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
    }
    assert spec.socket == "/tmp/k-0"
    assert "--rank" in spec.argv and "--world-size" in spec.argv


def test_router_spec_points_at_shard_zero_and_the_resolved_model():
    config = LauncherConfig(shard_uds_path="/tmp/k", port=8080, json_output=True)
    spec = router_spec(config, ResolvedModel(Path("/cache/m"), "org/m", "deadbeef"))
    argv = list(spec.argv)
    assert argv[len(kettle_command())] == "router"
    for flag, value in [
        ("--master-shard-uds-path", "/tmp/k-0"),
        ("--tokenizer-name", "/cache/m"),
        ("--model-id", "org/m"),
        ("--model-sha", "deadbeef"),
        ("--port", "8080"),
    ]:
        assert argv[argv.index(flag) + 1] == value
    assert "--json-output" in argv
    assert spec.socket is None


def test_config_argv_leaves_out_none_and_false_and_repeats_tuples():
    config = LauncherConfig(cors_allow_origin=("a", "b"))
    argv = config_argv(config.router_config("/t", "m"))
    assert argv.count("--cors-allow-origin") == 2
    assert "--api-key" not in argv and "--json-output" not in argv


@pytest.fixture
def keep_sigterm_handler():
    """launch() installs a SIGTERM handler; give pytest its own back."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_inactive_flags_are_warned_about(monkeypatch, caplog, keep_sigterm_handler):
    def missing(_config, meanwhile=None):
        raise ModelNotFound("Model 'x' is missing")

    monkeypatch.setattr(launcher_main, "prepare_model", missing)
    monkeypatch.setattr(launcher_main, "setup_logging", lambda _json: None)
    # No flag is inactive today (the last, --kv-cache-dtype on CUDA, now applies): one stands in for the next.
    monkeypatch.setitem(launcher_config.INACTIVE_FLAGS, "rope_factor", None)
    code = launcher_main.launch(LauncherConfig(rope_factor=2.0))
    assert code == 1
    assert "--rope-factor is not active yet" in caplog.text
    assert "Model 'x' is missing" in caplog.text


def test_a_missing_model_stops_the_launcher_with_one_line(tmp_path):
    command = [sys.executable, "-m", "kettle.cli", "launch", "--model-id", str(tmp_path / "missing-model")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    (line,) = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert "missing-model" in line and "does not exist" in line


def test_a_preparation_that_fails_stops_the_launcher_with_one_line_and_no_traceback(tmp_path):
    (tmp_path / "broken.gguf").write_text("not a GGUF")
    command = [sys.executable, "-m", "kettle.cli", "launch", "--model-id", str(tmp_path / "broken.gguf")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr  # the child's traceback is for LOG_LEVEL=debug
    (line,) = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert f"{tmp_path / 'broken.gguf'} is not a GGUF file" in line


def test_a_launcher_that_stops_early_leaves_no_compiler_running(tmp_path):
    """A first start compiles the CPU kernels beside the model's preparation; stopping on a bad model before that
    build is done kills the compilers with it (they held the caller's output pipes open for their ~5 s)."""
    cache = tmp_path / "cache"  # empty, and the install's build ignored: the kernels are to be built
    env = os.environ | {"KETTLE_CACHE": str(cache), "KETTLE_TUNING": "installed-kernels=off"}
    command = [sys.executable, "-m", "kettle.cli", "launch", "--model-id", str(tmp_path / "missing-model")]
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert launcher.wait(timeout=60) == 1
    assert list(cache.glob("kernels/.tmp-*/")), "the launcher stopped before the build started: nothing tested"
    deadline = time.monotonic() + 2.0
    while (compilers := _processes_naming(cache)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not compilers


def _processes_naming(path: Path) -> list[str]:
    """The command lines of live processes (not zombies) that name `path`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if state != "Z" and str(path) in line:
            found.append(line)
    return found


class Server:
    """Runs the supervisor in its own process (so it can receive signals) over dummy children."""

    def __init__(self, tmp_path: Path, router_args: tuple[str, ...] = (), timeout: float = 5.0, shard=SHARD):
        self.log = tmp_path / "events.log"
        self.socket = str(tmp_path / "s-0")
        specs = [
            {"name": "shard-0", "argv": [sys.executable, "-c", shard, self.socket, str(self.log)]},
            {"name": "router", "argv": [sys.executable, "-c", ROUTER, str(self.log), *router_args]},
        ]
        specs[0]["socket"] = self.socket
        plan = tmp_path / "plan.json"
        # The router's extra time to exit after its drain (10 s in a server) kept short: a test waits it out.
        plan.write_text(json.dumps({"specs": specs, "timeout": timeout, "router_exit_margin": 1.0}))
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
        self.process = subprocess.Popen([sys.executable, "-c", DRIVER, str(plan)], env=env, stderr=subprocess.PIPE)

    def events(self) -> list[str]:
        return self.log.read_text().split("\n") if self.log.exists() else []

    def pids(self) -> list[int]:
        return [int(line.split()[1]) for line in self.events() if line.startswith("pid")]

    def wait_for_children(self, count: int = 2) -> None:
        deadline = time.monotonic() + 20
        while len(self.pids()) < count:
            assert time.monotonic() < deadline, "children did not start"
            assert self.process.poll() is None, self.process.stderr.read().decode()
            time.sleep(0.05)

    def finish(self, timeout: float = 20) -> tuple[int, str]:
        _, stderr = self.process.communicate(timeout=timeout)
        return self.process.returncode, stderr.decode()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped by its dead parent yet) counts as gone.
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "zombie" in status.read_text())


def assert_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"orphans left: {[p for p in pids if alive(p)]}"
        time.sleep(0.05)


def test_a_dying_router_takes_everything_down(tmp_path):
    server = Server(tmp_path, router_args=("3", "0.5"))
    server.wait_for_children()
    started = time.monotonic()
    code, stderr = server.finish()
    assert code == 1
    assert time.monotonic() - started < 10
    assert "router exited with code 3" in stderr
    assert_all_gone(server.pids())
    assert not Path(server.socket).exists()


def test_a_shard_dying_during_startup_fails_fast(tmp_path):
    server = Server(tmp_path, shard="import sys; sys.exit(3)")
    code, stderr = server.finish()
    assert code == 1
    assert "shard-0 exited with code 3 before the shards were ready" in stderr


def test_sigterm_stops_the_router_then_the_shards(tmp_path):
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "s-0"))
    stale.close()  # leaves the socket file behind, like a crashed run
    server = Server(tmp_path)
    server.wait_for_children()
    server.process.send_signal(signal.SIGTERM)
    code, stderr = server.finish()
    assert code == 0, stderr
    stops = [line.split()[0] for line in server.events() if line.startswith(("router", "shard"))]
    assert stops == ["router", "shard"]
    assert_all_gone(server.pids())
    assert not Path(server.socket).exists()


def test_a_child_ignoring_sigterm_is_killed_after_the_timeout(tmp_path):
    server = Server(tmp_path, timeout=1.0)
    server.wait_for_children()
    router_pid = server.pids()[-1]
    os.kill(router_pid, signal.SIGSTOP)  # a hung router: SIGTERM does nothing until it is killed
    server.process.send_signal(signal.SIGINT)
    code, stderr = server.finish()
    assert code == 0
    assert "still running after SIGTERM" in stderr
    assert_all_gone(server.pids())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_children_die_with_a_killed_launcher(tmp_path):
    server = Server(tmp_path)
    server.wait_for_children()
    server.process.kill()
    server.finish()
    assert_all_gone(server.pids())


def test_a_live_socket_is_never_stolen(tmp_path):
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(tmp_path / "s-0"))
    live.listen()
    try:
        server = Server(tmp_path)
        code, stderr = server.finish()
        assert code == 1
        assert "another server is listening" in stderr
        assert Path(tmp_path / "s-0").exists()
    finally:
        live.close()


def test_a_model_on_this_machine_starts_the_shards_beside_its_look_up_at_once(tiny_llama_path, tmp_path):
    """A local folder's look-up takes a Python start: the shards' imports begin with it, not after it. A Hub id
    (which may be mistyped) waits for the preparation's first half second, so its failure starts nothing."""
    from kettle.launcher.prepare import ModelRequest, prepare_model

    assert ModelRequest().on_this_machine()  # the bundled model
    assert ModelRequest(model_id=str(tiny_llama_path)).on_this_machine()
    assert ModelRequest(model_id="org/model", weights_cache_override=str(tiny_llama_path)).on_this_machine()
    assert not ModelRequest(model_id="org/model").on_this_machine()
    assert not ModelRequest(model_id=str(tmp_path / "missing")).on_this_machine()
    # A Hub id's GGUF pick already in the Hub cache (a later start): nothing to download, and it resolved before.
    snapshot = tmp_path / "hub" / "models--org--model" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("abc123")
    (snapshot / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    hub = str(tmp_path / "hub")
    assert ModelRequest(model_id="org/model:Q4_K_M", hub_cache=hub).on_this_machine()
    assert not ModelRequest(model_id="org/model:Q8_0", hub_cache=hub).on_this_machine()
    assert not ModelRequest(model_id="org/model", hub_cache=hub).on_this_machine()  # no config: a GGUF repository
    # A Hub id without a pick whose snapshot holds the model's config (safetensors beside it): on this machine too.
    (snapshot / "config.json").write_text("{}")
    assert ModelRequest(model_id="org/model", hub_cache=hub).on_this_machine()
    assert not ModelRequest(model_id="org/model", revision="v2", hub_cache=hub).on_this_machine()
    assert not ModelRequest(model_id="org/other", hub_cache=hub).on_this_machine()
    started = []
    model = prepare_model(LauncherConfig(model_id=str(tiny_llama_path)), meanwhile=lambda: started.append(True))
    assert started == [True] and (model.path / "config.json").is_file()


def test_a_child_starts_at_its_specs_lower_cpu_priority():
    """The router's niceness applies from its first instruction (its imports run beside a first start's
    preparation), not from when its own code gets to lower it."""
    from kettle.launcher.child import Child
    from kettle.launcher.specs import ProcessSpec

    argv = (sys.executable, "-c", "import os, sys; sys.exit(os.nice(0))")
    child = Child(ProcessSpec("niced", argv, dict(os.environ), niceness=5))
    assert child.process.wait(30) == min(os.nice(0) + 5, 19)
    assert router_spec(LauncherConfig(), None).niceness == 10  # KETTLE_TUNING's router-nice default


def test_a_child_runs_the_launcher_s_own_kettle_whatever_its_working_directory_holds(tmp_path):
    """Started from a folder that holds another `kettle` package (a checkout of another version, say), a child still
    imports the launcher's: `python -m` alone would put that folder first on its path. What a child of the launcher
    imports is this very package."""
    decoy = tmp_path / "kettle"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the decoy kettle in the working directory')\n")
    code = "import kettle, sys; print(kettle.__file__)"
    python = kettle_command()[:-2]  # the interpreter and its flags, before `-m kettle.cli`
    found = subprocess.run(
        [*python, "-c", code], cwd=tmp_path, env=child_env({}), capture_output=True, text=True, check=True
    ).stdout.strip()
    assert Path(found).resolve() == Path(launcher_main.__file__).resolve().parent.parent / "__init__.py"
    shown = subprocess.run([*kettle_command(), "--help"], cwd=tmp_path, env=child_env({}), capture_output=True)
    assert shown.returncode == 0, shown.stderr


def test_an_installed_kettle_s_site_packages_stays_off_the_children_s_pythonpath(monkeypatch):
    """Installed (not a checkout), the package's folder is a site-packages the child finds by itself; put on
    PYTHONPATH it would come before the standard library. What the parent's PYTHONPATH had still goes on."""
    import site

    import kettle

    root = os.path.dirname(os.path.dirname(os.path.abspath(kettle.__file__)))
    assert kettle.child_pythonpath("/elsewhere") == os.pathsep.join([root, "/elsewhere"])  # a checkout: first
    monkeypatch.setattr(site, "getsitepackages", lambda: [root])
    assert kettle.child_pythonpath(None) == ""
    assert kettle.child_pythonpath("/elsewhere") == "/elsewhere"

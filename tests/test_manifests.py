"""The Kubernetes manifests (deploy/kubernetes/) and the image recipe (Containerfile).

Every YAML document is validated offline, strictly (unknown fields fail), against the
schemas kubernetes-validate bundles for Kubernetes 1.34 (the first with DRA v1) and the
newest it bundles; a kind without a schema fails, it is never skipped. Then what an
operator would notice: the sidecar really is a native sidecar, one GPU claim is shared by
every container, the socket is where every client looks, the grace periods cover the
bounds their comments name (read from the code's defaults), and every command line
names a console script and options that exist (parsed by the real click commands, so a
misspelt flag fails here, not in a cluster). For the pool (pool/): one pool on the Redis
Service, a Redis that fsyncs every write, fronts and NetworkPolicy on the right labels and
ports, one ReadWriteMany checkpoint volume at one path.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import tomllib
from importlib.metadata import distribution
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import kubernetes_validate
import pytest
import yaml

from gpu_slicer.dispatcher import main as dispatch_main
from gpu_slicer.dispatcher import poolconn, turns
from gpu_slicer.dispatcher.model import TurnConfig
from gpu_slicer.launcher import main as launch_main
from gpu_slicer.launcher.config import LaunchConfig, VllmConfig
from gpu_slicer.slicer import config as slicer_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
VERSIONS = ("1.34.0", "1.37.0")
SCRIPTS = {"slicerd", "slicerctl", "slicer-launch", "slicer-dispatch"}
# Programs of the base image or the workload's that the manifests may also run.
OTHER_PROGRAMS = {"test", "python3", "vllm", "python", "sh", "redis-server", "redis-cli"}
MODES = ("node", "pod", "pool")
POOL_SET = "sampler-pool"  # the pool's StatefulSet of job pods (pool/20-replicas.yaml)
GPU_RESOURCE = "nvidia.com/gpu"


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


# What each term of a "grace budget:" / "startup budget:" comment stands for. `stop` is a
# margin of our own (how long slicerd takes to exit), checked only to be positive.
GRACE_TERMS: dict[str, float | None] = {
    "park_timeout": slicer_config.Config().park_timeout,
    "restore_timeout": slicer_config.Config().restore_timeout,
    "sleep_timeout": _defaults(TurnConfig)["sleep_timeout"],
    "RELEASE_TIMEOUT_S": turns.RELEASE_TIMEOUT_S,
    "EVENTS_CLOSE_GRACE_S": dispatch_main.EVENTS_CLOSE_GRACE_S,
    "SHUTDOWN_MARGIN_S": dispatch_main.SHUTDOWN_MARGIN_S,
    "CALL_TIMEOUT_S": poolconn.CALL_TIMEOUT_S,
    "kill_grace": _defaults(LaunchConfig)["kill_grace"],
    "stop": None,
}
# A pool dispatcher's --reclaim-idle: at least a turn's whole bound (slicer-dispatch's
# default for it, dispatcher/main.py), `margin` its 10 s.
RECLAIM_TERMS: dict[str, float | None] = {
    "turn_seconds": _defaults(TurnConfig)["turn_seconds"],
    "turn_grace": _defaults(TurnConfig)["turn_grace"],
    "sleep_timeout": _defaults(TurnConfig)["sleep_timeout"],
    "RELEASE_TIMEOUT_S": turns.RELEASE_TIMEOUT_S,
    "margin": None,
}
STARTUP_TERMS: dict[str, float | None] = {
    "boot_timeout": VllmConfig.boot_timeout,
    "health_timeout": VllmConfig.health_timeout,
    "sleep_timeout": VllmConfig.sleep_timeout,
}


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


FILES = sorted(DEPLOY.rglob("*.yaml"))
DOCS = [(f, d) for f in FILES for d in _load(f)]


def _one(mode: str, kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for f, d in DOCS
        if f.parent.name == mode and d["kind"] == kind
        and (name is None or d["metadata"]["name"] == name)
    ]  # fmt: skip
    assert len(found) == 1, f"{mode}/: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The pod spec a document runs: a Pod's, or a DaemonSet's or StatefulSet's template."""
    # The document's own object (not a copy): callers compare specs by identity.
    spec: dict[str, Any] | None = None
    if doc["kind"] == "Pod":
        spec = doc["spec"]
    elif doc["kind"] in ("DaemonSet", "StatefulSet"):
        spec = doc["spec"]["template"]["spec"]
    return spec


def _pods(mode: str) -> list[dict[str, Any]]:
    """The pod specs of `mode`: Pods, and the DaemonSets' and StatefulSets' templates."""
    specs = []
    for f, d in DOCS:
        if f.parent.name == mode and (spec := _pod_spec(d)) is not None:
            specs.append(spec)
    return specs


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def _argv(container: dict[str, Any]) -> list[str]:
    """The container's command line; `sh -c 'exec ...'` read as the line it execs."""
    argv = [*container.get("command", []), *container.get("args", [])]
    if argv[:2] == ["sh", "-c"]:
        argv = shlex.split(argv[2])
        if argv[0] == "exec":
            argv = argv[1:]
    return argv


def _expand(argv: list[str], container: dict[str, Any]) -> list[str]:
    """`argv` as the kubelet runs it: each `$(VAR)` replaced by the container's env var
    VAR (a field reference by a sample value). An undefined VAR would stay literal in a
    cluster: it fails here."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        else:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            env[e["name"]] = {"metadata.name": "sampler-pool-0"}.get(field, "x")

    def one(m: re.Match[str]) -> str:
        assert m.group(1) in env, f"{container['name']}: $({m.group(1)}) is not in its env"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, a) for a in argv]


def _config(mode: str) -> dict[str, Any]:
    cm = _one(mode, "ConfigMap")
    return tomllib.loads(cm["data"]["slicer.toml"])


def _mount_of(container: dict[str, Any], volume: str) -> dict[str, Any] | None:
    for m in container.get("volumeMounts", []):
        if m["name"] == volume:
            return m
    return None


def _volume(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (vol,) = [v for v in spec["volumes"] if v["name"] == name]
    return vol


def _socket_volume(spec: dict[str, Any], socket: str) -> str:
    """The name of the volume whose mount holds `socket` in the slicerd container."""
    for c in _containers(spec):
        for m in c.get("volumeMounts", []):
            if socket.startswith(m["mountPath"].rstrip("/") + "/"):
                return str(m["name"])
    raise AssertionError(f"no volume mount holds the socket {socket}")


def _budget(path: Path, label: str, terms: dict[str, float | None]) -> list[tuple[str, int]]:
    """Each `# LABEL budget: a N + b M ... = TOTAL` comment of `path`, checked term by
    term against the code's defaults, as (the field it precedes, TOTAL)."""
    lines = path.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        m = re.search(rf"# {label} budget: (.*) = (\d+)$", line)
        if not m:
            continue
        total = 0.0
        for term in m.group(1).split(" + "):
            name, value = term.split()
            assert name in terms, f"{path.name}:{i + 1}: unknown term {name!r}"
            want = terms[name]
            if want is None:
                assert float(value) > 0, f"{path.name}:{i + 1}: {name} must be > 0"
            else:
                assert float(value) == want, (
                    f"{path.name}:{i + 1}: the comment says {name} {value}, the code's "
                    f"default is {want}"
                )
            total += float(value)
        assert total == int(m.group(2)), f"{path.name}:{i + 1}: the terms add up to {total}"
        field = next(x for x in lines[i + 1 :] if not x.strip().startswith("#"))
        found.append((field.strip(), int(m.group(2))))
    return found


# --- schema validation -------------------------------------------------------------


def test_every_manifest_file_parses_into_kubernetes_objects() -> None:
    assert {f.parent.name for f in FILES} == set(MODES)
    for f in FILES:
        docs = _load(f)
        assert docs, f"{f} holds no document"
        for d in docs:
            assert {"apiVersion", "kind", "metadata"} <= d.keys(), f"{f}: not an object"


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(
    ("path", "doc"), DOCS, ids=[f"{f.parent.name}/{f.name}:{d['kind']}" for f, d in DOCS]
)
def test_manifest_validates_strictly(path: Path, doc: dict[str, Any], version: str) -> None:
    # SchemaNotFoundError is not caught: a kind without a schema fails loudly.
    assert kubernetes_validate.validate(doc, version, strict=True)


def test_newest_bundled_release_is_checked() -> None:
    assert kubernetes_validate.latest_version() == VERSIONS[-1]


def test_a_kind_without_a_schema_is_an_error_not_a_skip() -> None:
    bogus = {"apiVersion": "resource.k8s.io/v1", "kind": "GpuTurn", "metadata": {"name": "x"}}
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(bogus, VERSIONS[0], strict=True)


def test_strict_validation_catches_a_misspelt_field() -> None:
    pod = _one("pod", "Pod")
    broken = {**pod, "spec": {**pod["spec"], "shareProcessNamespaces": True}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


# --- command lines -------------------------------------------------------------------


def _scripts() -> dict[str, click.Command]:
    eps = distribution("gpu-slicer").entry_points.select(group="console_scripts")
    return {ep.name: ep.load() for ep in eps if ep.name in SCRIPTS}


class _Launched(Exception):
    """What the stubbed-out `trio.run` of slicer-launch raises: the line was accepted."""


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """slicer-launch's callbacks run for real up to the launch, which raises _Launched:
    its COMMAND argument takes unknown options (`ignore_unknown_options`), so a misspelt
    flag is caught by the callback, not by click's parser."""

    def launched(*_: object) -> None:
        raise _Launched

    monkeypatch.setattr(launch_main, "trio", SimpleNamespace(run=launched))
    monkeypatch.setattr(launch_main, "setup_logging", lambda *_: None)


def _parse(cmd: click.Command, name: str, args: list[str], parent: Any = None) -> None:
    """Parse `args` as the command line would be (param callbacks included); for the
    launcher's subcommands, also its own checks (see `no_launch`)."""
    ctx = cmd.make_context(name, list(args), parent=parent)
    with ctx:
        if isinstance(cmd, click.Group):
            # The group's options are parsed; the rest is the subcommand's line.
            rest = [*ctx._protected_args, *ctx.args]
            sub_name, sub, sub_args = cmd.resolve_command(ctx, rest)
            assert sub is not None and sub_name is not None
            _parse(sub, sub_name, sub_args, parent=ctx)
        elif parent is not None and parent.info_name == "slicer-launch":
            with pytest.raises(_Launched):
                cmd.invoke(ctx)


def _command_lines() -> list[tuple[str, list[str]]]:
    lines = []
    for f, d in DOCS:
        spec = _pod_spec(d)
        if spec is None:
            continue
        for c in _containers(spec):
            where = f"{f.parent.name}/{f.name}:{c['name']}"
            lines.append((where, _expand(_argv(c), c)))
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if "exec" in c.get(probe, {}):
                    lines.append((f"{where}:{probe}", c[probe]["exec"]["command"]))
            pre = c.get("lifecycle", {}).get("preStop", {})
            if "exec" in pre:
                lines.append((f"{where}:preStop", pre["exec"]["command"]))
    return lines


def test_every_command_names_an_existing_script_with_existing_options(no_launch: None) -> None:
    scripts = _scripts()
    assert set(scripts) == SCRIPTS, "a console script is missing from the installed wheel"
    checked = set()
    for where, argv in _command_lines():
        prog = argv[0]
        assert prog in SCRIPTS | OTHER_PROGRAMS, f"{where}: unknown program {prog!r}"
        if prog in SCRIPTS:
            try:
                _parse(scripts[prog], prog, argv[1:])
            except click.ClickException as e:
                pytest.fail(f"{where}: {shlex.join(argv)}: {e.format_message()}")
            checked.add(prog)
    assert checked == SCRIPTS


def test_a_misspelt_flag_fails_the_check(no_launch: None) -> None:
    scripts = _scripts()
    with pytest.raises(click.UsageError, match="no such option: --ready-flie"):
        _parse(
            scripts["slicer-launch"],
            "slicer-launch",
            ["vllm", "--workload", "s", "--ready-flie", "/r", "--", "vllm", "serve"],
        )
    with pytest.raises(click.NoSuchOption):
        _parse(
            scripts["slicer-dispatch"],
            "slicer-dispatch",
            ["--workload", "s", "--replica", "http://127.0.0.1:8000", "--listn", ":1"],
        )
    with pytest.raises(click.BadParameter):
        _parse(
            scripts["slicer-dispatch"],
            "slicer-dispatch",
            ["--workload", "s", "--replica", "127.0.0.1:8000"],
        )
    with pytest.raises(click.NoSuchOption):
        _parse(scripts["slicerd"], "slicerd", ["--confg", "/etc/slicer/slicer.toml"])


def _prestop_wait(container: dict[str, Any]) -> tuple[float, str]:
    argv = container["lifecycle"]["preStop"]["exec"]["command"]
    assert argv[:2] == ["python3", "-c"], argv
    compile(argv[2], "preStop", "exec")  # a syntax error would only show in a cluster
    return float(argv[3]), argv[4]


# --- the config files ---------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_config_file_is_one_slicerd_loads(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cm = _one(mode, "ConfigMap")
    path = tmp_path / "slicer.toml"
    path.write_text(cm["data"]["slicer.toml"])
    monkeypatch.delenv("SLICER_SOCKET", raising=False)
    # The group is the image's (Containerfile), not necessarily this machine's.
    monkeypatch.setattr(slicer_config.grp, "getgrnam", lambda name: name)
    cfg = slicer_config.load(str(path))
    assert cfg.census == "auto"
    assert cfg.socket_group == cfg.allow_group == "slicer"
    assert "--gid 10001 slicer" in (ROOT / "Containerfile").read_text()


# --- node mode ----------------------------------------------------------------------


def test_node_mode_daemonset_sees_host_pids_and_requests_no_gpu() -> None:
    ds = _one("node", "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True
    assert "resourceClaims" not in spec
    (c,) = spec["containers"]
    assert _argv(c)[0] == "slicerd"
    res = c.get("resources", {})
    assert "claims" not in res
    for part in ("requests", "limits"):
        assert GPU_RESOURCE not in res.get(part, {}), f"slicerd {part} a GPU"
    assert any(t["key"] == GPU_RESOURCE for t in spec["tolerations"])
    # Two daemons on one node would fight over the socket and the state dir.
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0
    assert c["securityContext"].get("privileged") is not True
    assert "SYS_PTRACE" in c["securityContext"]["capabilities"]["add"]


def test_node_mode_socket_and_state_are_host_paths_shared_with_the_workloads() -> None:
    cfg = _config("node")
    ds_spec = _one("node", "DaemonSet")["spec"]["template"]["spec"]
    (slicerd,) = ds_spec["containers"]
    sock_vol = _volume(ds_spec, _socket_volume(ds_spec, cfg["socket"]))
    host_dir = sock_vol["hostPath"]["path"]
    state = _volume(ds_spec, _mount_name_at(slicerd, cfg["state_dir"]))
    assert "hostPath" in state, "the journal must outlive the DaemonSet's pod"
    tool = _volume(ds_spec, _mount_name_at(slicerd, cfg["cuda_checkpoint"]))
    assert "hostPath" in tool and _mount_of(slicerd, tool["name"])["readOnly"] is True
    workload_pods = [s for s in _pods("node") if s is not ds_spec]
    assert len(workload_pods) == 2
    clients = 0
    for spec in workload_pods:
        for c in spec["containers"]:
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            if _argv(c)[0] not in SCRIPTS:
                continue
            clients += 1
            assert env.get("SLICER_SOCKET") == cfg["socket"], c["name"]
            name = _socket_volume({"containers": [c]}, cfg["socket"])
            assert _volume(spec, name)["hostPath"]["path"] == host_dir, c["name"]
    assert clients == 3  # trainer, replica, dispatcher


def _mount_name_at(container: dict[str, Any], path: str) -> str:
    for m in container["volumeMounts"]:
        mp = m["mountPath"].rstrip("/")
        if path == mp or path.startswith(mp + "/"):
            return str(m["name"])
    raise AssertionError(f"{container['name']}: nothing mounted at {path}")


# --- pod mode (and each pod of a pool) -------------------------------------------------

JOB_MODES = ("pod", "pool")


def _job_spec(mode: str) -> dict[str, Any]:
    """The job pod's spec: pod mode's Pod, or the pool's StatefulSet template (its every
    replica is a pod-mode job pod)."""
    if mode == "pool":
        return dict(_one("pool", "StatefulSet", POOL_SET)["spec"]["template"]["spec"])
    return dict(_one(mode, "Pod")["spec"])


@pytest.mark.parametrize("mode", JOB_MODES)
def test_pod_mode_slicerd_is_a_native_sidecar_in_a_shared_pid_namespace(mode: str) -> None:
    spec = _job_spec(mode)
    assert spec["shareProcessNamespace"] is True
    (sidecar,) = spec["initContainers"]
    assert _argv(sidecar)[0] == "slicerd"
    assert sidecar["restartPolicy"] == "Always"
    # The startup probe holds the main containers back until slicerd answers.
    assert _argv({"command": sidecar["startupProbe"]["exec"]["command"]})[-1] == "ping"
    assert not spec.get("hostPID")
    # Elimination lists /proc/<pid>/fd of other uids' workloads (the GPU's device node).
    assert "DAC_READ_SEARCH" in sidecar["securityContext"]["capabilities"]["add"]


@pytest.mark.parametrize("mode", JOB_MODES)
def test_pod_mode_one_gpu_claim_is_referenced_by_every_container(mode: str) -> None:
    spec = _job_spec(mode)
    (claim,) = spec["resourceClaims"]
    template = _one(mode, "ResourceClaimTemplate", claim["resourceClaimTemplateName"])
    assert template["apiVersion"] == "resource.k8s.io/v1"
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    assert request["exactly"].get("count", 1) == 1
    for c in _containers(spec):
        res = c.get("resources", {})
        assert res.get("claims") == [{"name": claim["name"]}], c["name"]
        for part in ("requests", "limits"):
            assert GPU_RESOURCE not in res.get(part, {}), c["name"]


@pytest.mark.parametrize("mode", JOB_MODES)
def test_pod_mode_socket_is_a_memory_emptydir_in_every_client(mode: str) -> None:
    cfg = _config(mode)
    spec = _job_spec(mode)
    name = _socket_volume(spec, cfg["socket"])
    assert _volume(spec, name)["emptyDir"]["medium"] == "Memory"
    for c in _containers(spec):
        assert _argv(c)[0] in SCRIPTS
        mount = _mount_of(c, name)
        assert mount is not None, f"{c['name']} does not mount the socket directory"
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env["SLICER_SOCKET"] == cfg["socket"], c["name"]
        assert env["SLICER_SOCKET"].startswith(mount["mountPath"] + "/")
    assert {"emptyDir"} & _volume(spec, _mount_name_at(spec["initContainers"][0],
                                                       cfg["state_dir"])).keys()  # fmt: skip


# --- probes and grace periods -------------------------------------------------------


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("mode", MODES)
def test_replica_startup_probe_reads_the_launchers_ready_marker(mode: str) -> None:
    (path,) = [f for f in FILES if f.parent.name == mode and "startupProbe:" in f.read_text()
               and "slicer-launch" in f.read_text()]  # fmt: skip
    (startup_budget,) = _budget(path, "startup", STARTUP_TERMS)
    assert startup_budget[0] == "startupProbe:"
    replicas = [c for s in _pods(mode) for c in s["containers"] if _argv(c)[1:2] == ["vllm"]]
    (replica,) = replicas
    marker = _flag(_argv(replica), "--ready-file")
    probe = replica["startupProbe"]
    assert probe["exec"]["command"] == ["test", "-f", marker]
    assert replica["readinessProbe"]["exec"]["command"] == ["test", "-f", marker]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= startup_budget[1]
    assert _mount_name_at(replica, marker)


@pytest.mark.parametrize("mode", MODES)
def test_dispatcher_readiness_is_get_ready_on_its_listen_port(mode: str) -> None:
    (d,) = [c for s in _pods(mode) for c in s["containers"] if _argv(c)[0] == "slicer-dispatch"]
    port = int(_flag(_argv(d), "--listen").rsplit(":", 1)[1])
    assert d["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}


@pytest.mark.parametrize("mode", MODES)
def test_slicerd_probes_ping_its_socket(mode: str) -> None:
    cfg = _config(mode)
    (c,) = [c for s in _pods(mode) for c in _containers(s) if _argv(c)[0] == "slicerd"]
    assert _flag(_argv(c), "--config") == "/etc/slicer/slicer.toml"
    assert _mount_name_at(c, "/etc/slicer/slicer.toml")
    for probe in ("startupProbe", "livenessProbe"):
        argv = c[probe]["exec"]["command"]
        assert argv == ["slicerctl", "--socket", cfg["socket"], "ping"], probe
    bound, socket = _prestop_wait(c)
    assert bound == cfg["park_timeout"] == slicer_config.Config().park_timeout
    assert socket == cfg["socket"]


@pytest.mark.parametrize(
    ("mode", "kind", "required"),
    [
        ("node", "DaemonSet", {"park_timeout"}),
        ("node", "Pod", {"sleep_timeout", "RELEASE_TIMEOUT_S"}),
        ("pod", "Pod", {"sleep_timeout", "RELEASE_TIMEOUT_S", "park_timeout"}),
        (
            "pool",
            "StatefulSet",
            {"CALL_TIMEOUT_S", "sleep_timeout", "RELEASE_TIMEOUT_S", "park_timeout"},
        ),
    ],
)
def test_termination_grace_covers_the_bounds_its_comment_names(
    mode: str, kind: str, required: set[str]
) -> None:
    for path in [f for f in FILES if f.parent.name == mode]:
        text = path.read_text()
        for field, total in _budget(path, "grace", GRACE_TERMS):
            seconds = int(field.split(":")[1])
            assert field.startswith("terminationGracePeriodSeconds:"), field
            assert seconds >= total, f"{path.name}: {seconds} s < the budget {total} s"
        budgets = re.findall(r"# grace budget: (.*) =", text)
        for d in _load(path):
            if d["kind"] != kind or "terminationGracePeriodSeconds" not in _spec(d):
                continue
            if not any(_argv(c)[0] in SCRIPTS for c in _containers(_spec(d))):
                continue  # the pool's Redis: test_pool_redis_grace_covers_its_shutdown
            named = {t.split()[0] for b in budgets for t in b.split(" + ")}
            assert required <= named, f"{path.name}: the budget omits {required - named}"


def _spec(doc: dict[str, Any]) -> dict[str, Any]:
    spec = _pod_spec(doc)
    return spec if spec is not None else dict(doc.get("spec", {}))


def test_every_pod_has_a_grace_budget_where_a_park_may_be_running() -> None:
    for mode in MODES:
        for spec in _pods(mode):
            if any(_argv(c)[0] in {"slicerd", "slicer-dispatch"} for c in _containers(spec)):
                assert "terminationGracePeriodSeconds" in spec


# --- pool mode ----------------------------------------------------------------------


def _pool_set() -> dict[str, Any]:
    return _one("pool", "StatefulSet", POOL_SET)


def _redis() -> tuple[dict[str, Any], dict[str, Any]]:
    """The pool's Redis StatefulSet and its container."""
    sts = _one("pool", "StatefulSet", "slicer-redis")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return sts, c


def _options(argv: list[str]) -> dict[str, str]:
    """`--flag value` pairs of a command line without `--flag=value` forms."""
    assert not any(a.startswith("--") and "=" in a for a in argv), argv
    return {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pool_dispatchers() -> list[tuple[dict[str, Any], list[str]]]:
    """Every slicer-dispatch of pool/ with its pod's labels, its line as the kubelet runs it."""
    found = []
    for f, d in DOCS:
        spec = _pod_spec(d)
        if f.parent.name != "pool" or spec is None:
            continue
        labels = d["spec"]["template"]["metadata"]["labels"] if "template" in d["spec"] else {}
        for c in _containers(spec):
            argv = _expand(_argv(c), c)
            if argv[0] == "slicer-dispatch":
                found.append((labels, argv))
    return found


def test_pool_dispatchers_share_one_pool_on_the_redis_service() -> None:
    sts, redis = _redis()
    redis_labels = sts["spec"]["template"]["metadata"]["labels"]
    redis_port = int(_options(_argv(redis))["--port"])
    dispatchers = _pool_dispatchers()
    assert dispatchers, "pool/ runs no dispatcher"
    pools, queues = set(), set()
    for labels, argv in dispatchers:
        opts = _options(argv)
        pools.add(opts["--pool"])
        queues.add(opts["--queue"])
        # The label the Service and the NetworkPolicy select the pool's pods by.
        assert labels["gpu-slicer/pool"] == opts["--pool"]
    assert len(pools) == 1, f"the pool's dispatchers name different pools: {pools}"
    (queue,) = queues
    m = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)/(\d+)", queue)
    assert m, f"--queue {queue!r} is not redis://SERVICE:PORT/DB"
    service = _one("pool", "Service", m.group(1))
    assert service["spec"].get("clusterIP") != "None", "--queue names the headless Service"
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == int(m.group(2))]
    assert port["targetPort"] == redis_port
    assert _selects(service["spec"]["selector"], redis_labels)
    assert {"containerPort": redis_port, "name": "redis"} in redis["ports"]
    # Each replica is its own consumer: the pod's name, which the kubelet fills in.
    (d,) = [c for c in _containers(_job_spec("pool")) if _argv(c)[0] == "slicer-dispatch"]
    assert "$(POD_NAME)" in _argv(d)
    (env,) = [e for e in d["env"] if e["name"] == "POD_NAME"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_pool_reclaim_idle_covers_a_whole_turn() -> None:
    (path,) = [f for f in FILES if f.parent.name == "pool" and "reclaim budget:" in f.read_text()]
    (field, total) = _budget(path, "reclaim", RECLAIM_TERMS)[0]
    assert field == "- --reclaim-idle", field
    for _, argv in _pool_dispatchers():
        # Shorter, a live replica's claims would be taken from it mid-turn.
        assert float(_options(argv)["--reclaim-idle"]) >= total
    # The dispatcher's own default, which the comment spells out.
    turn = TurnConfig(workload="x")
    whole = turn.turn_seconds + turn.turn_grace + turn.sleep_timeout + turns.RELEASE_TIMEOUT_S
    assert total >= whole


def test_pool_redis_persists_every_write_before_it_answers() -> None:
    sts, redis = _redis()
    opts = _options(_argv(redis))
    assert opts["--appendonly"] == "yes"
    assert opts["--appendfsync"] == "always"  # nothing acknowledged is lost on a crash
    assert opts["--save"] == ""  # no RDB: the AOF is the one copy
    assert opts["--maxmemory-policy"] == "noeviction"  # an evicted key is a lost request
    # A served request frees its stream node: a backlog with holes costs what a dense one
    # does (README "Pools across nodes", Memory).
    assert opts["--stream-node-max-entries"] == "1"
    assert sts["spec"]["replicas"] == 1
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert _mount_name_at(redis, opts["--dir"]) == claim["metadata"]["name"]
    assert redis["image"].split(":")[1], "the Redis image has a pinned tag"
    # redis-cli exits 0 on "-LOADING": readiness compares the reply.
    ready = redis["readinessProbe"]["exec"]["command"]
    assert ready[:2] == ["sh", "-c"] and "= PONG" in ready[2], ready
    assert _argv({"command": redis["livenessProbe"]["exec"]["command"]})[-1] == "ping"


def test_pool_redis_grace_covers_its_shutdown() -> None:
    sts, redis = _redis()
    shutdown = float(_options(_argv(redis))["--shutdown-timeout"])
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 2 * shutdown


def test_pool_redis_is_reachable_from_the_pool_pods_only() -> None:
    sts, redis = _redis()
    policy = _one("pool", "NetworkPolicy")
    assert _selects(policy["spec"]["podSelector"]["matchLabels"],
                    sts["spec"]["template"]["metadata"]["labels"])  # fmt: skip
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "only pods of this namespace, by label"
    assert _selects(peer["podSelector"]["matchLabels"],
                    _pool_set()["spec"]["template"]["metadata"]["labels"])  # fmt: skip
    assert rule["ports"] == [{"protocol": "TCP", "port": int(_options(_argv(redis))["--port"])}]


def test_pool_service_reaches_every_dispatchers_front() -> None:
    service = _one("pool", "Service", "sampler")
    assert service["spec"].get("clusterIP") != "None"
    for labels, argv in _pool_dispatchers():
        assert _selects(service["spec"]["selector"], labels)
        listen_port = int(_options(argv)["--listen"].rsplit(":", 1)[1])
        (port,) = service["spec"]["ports"]
        assert port["targetPort"] == listen_port
    # The Redis pods are not fronts.
    redis_labels = _redis()[0]["spec"]["template"]["metadata"]["labels"]
    assert not _selects(service["spec"]["selector"], redis_labels)


def test_pool_checkpoints_are_one_shared_volume_at_one_path() -> None:
    spec = _job_spec("pool")
    (vol,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    pvc = _one("pool", "PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"])
    assert pvc["metadata"]["name"] == "checkpoints"
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "every replica reads revisions"
    mounts = {c["name"]: _mount_of(c, vol["name"]) for c in _containers(spec)}
    users = {name: m for name, m in mounts.items() if m is not None}
    assert set(users) == {"trainer", "replica", "dispatcher"}
    (path,) = {m["mountPath"] for m in users.values()}
    # The trainer writes; the replica loads and the dispatcher checks paths, read-only.
    assert not users["trainer"].get("readOnly")
    assert users["replica"]["readOnly"] and users["dispatcher"]["readOnly"]
    by_name = {c["name"]: c for c in _containers(spec)}
    trainer = _expand(_argv(by_name["trainer"]), by_name["trainer"])
    assert _flag(trainer, "--ckpt-dir").startswith(path + "/")
    replica = _argv(by_name["replica"])
    assert replica[replica.index("serve") + 1].startswith(path + "/")


# --- the image recipe ---------------------------------------------------------------


def _final_stage(text: str) -> str:
    return re.split(r"^FROM ", text, flags=re.M)[-1]


def test_containerfile_installs_the_wheel_only() -> None:
    text = (ROOT / "Containerfile").read_text()
    final = _final_stage(text)
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    for word in ("gcc", "g++", "clang", "build-essential", "make ", "-dev ", "cc "):
        assert word not in code, f"the recipe installs a compiler or headers: {word!r}"
    assert "stubs" not in code, "the test doubles do not belong in the image"
    assert "[dev" not in code and ".[" not in code, "no extras in the image"
    assert "--only-binary=:all:" in final, "a dependency could be compiled"
    assert re.search(r"pip install .*\n?.*gpu_slicer-\*\.whl", final)
    assert "COPY --from=wheel /wheels/" in final
    assert re.search(r"^ENTRYPOINT \[\"slicerd\"\]$", final, flags=re.M)
    assert re.search(r"^USER 10001", final, flags=re.M)

"""slicerd configuration: defaults, `/etc/slicer/slicer.toml` (or `--config`), then flags.

Precedence: flag > environment (`SLICER_SOCKET`) > file > default. Unknown keys and bad
values are refused with a message naming the key, so a typo never silently changes policy.
A malformed or out-of-range value given as a flag is a `FlagError` (slicerd exits 64, a
usage error); the same value in the file, and a flag of `HOST_KEYS` (what names things of
this host: a GPU backend, a group, the metrics address), a plain `ConfigError` (78). The
file must be a regular file of at most `MAX_CONFIG_BYTES` (a FIFO or a device would block
or never end).
"""

from __future__ import annotations

import dataclasses
import grp
import os
import stat
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_slicer.proto import ProtocolError, parse_size
from gpu_slicer.slicer.errors import ConfigError, GpuBackendError
from gpu_slicer.slicer.gpu import check_backend_name

DEFAULT_CONFIG = Path("/etc/slicer/slicer.toml")
DEFAULT_SOCKET = "/run/slicer/slicer.sock"
MAX_CONFIG_BYTES = 1 << 20
# Keys whose value names something of this host (a plugin, a group, an address to bind;
# it may be right on another host): a bad one is a configuration error even as a flag,
# as the metrics address's other failures (a host that does not resolve) are.
HOST_KEYS = frozenset({"gpu_backend", "socket_group", "allow_group", "metrics_listen"})


class FlagError(ConfigError):
    """A command-line flag has a bad value (the file and the environment are fine)."""


@dataclass(frozen=True)
class Config:
    """Every setting of the daemon (see README, "Configuration")."""

    socket: str = DEFAULT_SOCKET
    socket_mode: int = 0o660
    socket_group: str | None = None
    allow_group: str | None = None
    state_dir: str = "/var/lib/slicer"
    gpu_backend: str = "nvml"
    cuda_checkpoint: str = "cuda-checkpoint"
    # Who parks: the cuda-checkpoint CLI (`cli`), one long-lived helper on the driver's
    # checkpoint API (`driver`, r570+: no driver initialisation per step), or `auto`: the
    # driver API when `libcuda` is there and exports it, else the CLI (`slicer.driverpark`).
    parker: str = "auto"
    libcuda: str = "libcuda.so.1"
    # Fit-aware turns (`slicer.fit`): freeze (lock) instead of park when the next
    # workload's known need fits in what is free, keeping `fit_headroom` bytes spare.
    fit_aware: bool = False
    fit_headroom: int = 2 * 1024**3
    # Early starts (`slicer.early`): a waiter that asked `ACQUIRE ... early=N` may start
    # the part of its work that fits in N bytes while the workload before it, locked, is
    # checkpointed (vLLM wakes and loads its weights during the trainer's park).
    early_start: bool = True
    park_timeout: float = 120.0
    restore_timeout: float = 120.0
    fault_kill_after: float = 60.0
    foreign: str = "block"
    # How device memory is attributed to workloads: by the backend's pids (`pids`), or by
    # elimination against the workloads' budgets where those pids are not slicerd's to
    # read (`elimination`: slicerd in a pod, NVML speaking host pids); `auto` picks.
    census: str = "auto"
    log_level: str = "info"
    max_connections: int = 1024
    # Per uid; root and allow_group members are exempt. The last `reserved_connections`
    # of `max_connections` are kept for them, so a flood of one user never locks out an
    # operator's slicerctl or a root launcher's re-REGISTER.
    max_connections_per_uid: int = 64
    reserved_connections: int = 32
    max_workloads: int = 256
    max_queue: int = 4096
    write_timeout: float = 10.0
    # How long a registrant asked to PARK its cooperative workload has to answer.
    registrant_park_timeout: float = 60.0
    # Each journal save is fsynced (file and directory) before it counts as written.
    journal_fsync: bool = True
    # A grant check may reuse a clean reading of its GPU this young (0: always read);
    # the trade is argued in `slicer.reuse`.
    verify_reuse_ms: float = 20.0
    # HOST:PORT of the Prometheus metrics listener (`slicer.metrics`); empty: none.
    metrics_listen: str = ""

    def validate(self) -> Config:
        """Return self, or raise ConfigError naming the first bad value."""
        if not self.socket:
            raise ConfigError("socket must not be empty (give a path, or leave it out)")
        for key in (
            "park_timeout",
            "restore_timeout",
            "fault_kill_after",
            "write_timeout",
            "registrant_park_timeout",
        ):
            value = getattr(self, key)
            if not (0 < value < 86400):
                raise ConfigError(f"{key} must be in (0, 86400) seconds, got {value}")
        for key in ("max_connections", "max_connections_per_uid", "max_workloads", "max_queue"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1")
        if not (0 <= self.verify_reuse_ms <= 1000):
            raise ConfigError(
                f"verify_reuse_ms must be in [0, 1000] ms, got {self.verify_reuse_ms}"
            )
        if not 0 <= self.fit_headroom <= 1 << 50:
            raise ConfigError(f"fit_headroom must be in [0, 1 PiB] bytes, got {self.fit_headroom}")
        if self.reserved_connections < 0:
            raise ConfigError("reserved_connections must be >= 0")
        try:
            check_backend_name(self.gpu_backend)
        except GpuBackendError as e:
            raise ConfigError(f"gpu_backend: {e}") from None
        if self.foreign not in ("block", "ignore"):
            raise ConfigError(f"foreign must be block or ignore, got {self.foreign!r}")
        if self.parker not in ("auto", "cli", "driver"):
            raise ConfigError(f"parker must be auto, cli or driver, got {self.parker!r}")
        if not self.libcuda or "\0" in self.libcuda:
            raise ConfigError("libcuda must name a library (a soname or a path)")
        if self.census not in ("auto", "pids", "elimination"):
            raise ConfigError(f"census must be auto, pids or elimination, got {self.census!r}")
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError("log_level must be debug, info, warning or error")
        for key in ("socket_group", "allow_group"):
            group = getattr(self, key)
            if group is not None:
                try:
                    grp.getgrnam(group)
                except KeyError:
                    raise ConfigError(f"{key}: no group named {group!r}") from None
        if self.metrics_listen:
            parse_listen(self.metrics_listen)
        if not 0 <= self.socket_mode <= 0o777:
            raise ConfigError(f"socket_mode must be an octal mode, got {self.socket_mode:o}")
        return self


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); raise ConfigError naming the key and the form."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if sep and host and port.isdigit() and int(port) <= 65535 and " " not in host:
        return host, int(port)
    raise ConfigError(
        f"metrics_listen must be HOST:PORT (e.g. 127.0.0.1:9403, port 0 for any free one), "
        f"got {value!r}"
    )


def _coerce(key: str, value: Any) -> Any:
    kind = _FIELDS[key].type
    try:
        if key == "socket_mode" and isinstance(value, str):
            return int(value, 8)
        if key == "fit_headroom" and isinstance(value, str):
            return parse_size(value)  # "2GiB" as REGISTER's parked_max= reads it
        if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind == "bool" and isinstance(value, bool):
            return value
        if kind.startswith("str") and isinstance(value, str):
            return value
    except (ValueError, ProtocolError):
        pass
    expected = "an octal mode such as 660" if key == "socket_mode" else kind
    if key == "fit_headroom":
        expected = "bytes, or a size such as 2GiB"
    raise ConfigError(f"config key {key}: bad value {value!r} (expected {expected})")


def load(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build the Config from the file at `path` (default if present), env and overrides."""
    values: dict[str, Any] = {}
    file = Path(path) if path else DEFAULT_CONFIG
    if path or file.exists():
        try:
            doc = tomllib.loads(_read(file))
        except OSError as e:
            raise ConfigError(
                f"cannot read config {file}: {e.strerror or e} (check the --config path and "
                "that slicerd may read it)"
            ) from e
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"cannot read config {file}: not valid TOML: {e} (fix the file; see "
                "systemd/slicer.toml.example)"
            ) from e
        section = doc.get("slicer", doc)
        if not isinstance(section, dict):
            raise ConfigError(f"{file}: [slicer] must be a table (fix the file)")
        for key, value in section.items():
            if key not in _FIELDS:
                raise ConfigError(
                    f"{file}: unknown key {key!r} (the keys are listed in the README, "
                    '"Configuration")'
                )
            values[key] = _coerce(key, value)
    if os.environ.get("SLICER_SOCKET"):
        values["socket"] = os.environ["SLICER_SOCKET"]
    flags: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if value is not None:
            try:
                flags[key] = _coerce(key, value)
            except ConfigError as e:
                raise FlagError(f"Invalid value for {_flag(key)}: {e}") from None
    try:
        return Config(**{**values, **flags}).validate()
    except ConfigError as e:
        raise _blame(str(e), values, flags) from None


def _flag(key: str) -> str:
    return "'--" + key.replace("_", "-") + "'"


def _blame(why: str, values: dict[str, Any], flags: dict[str, Any]) -> ConfigError:
    # Whose value is `why` about? The file's (and the environment's) when they alone fail
    # the same way; else the flag whose key, left at its default, makes the failure go.
    # Only on a failure, so validating a few more times costs nothing that matters.
    def fails(settings: dict[str, Any]) -> str | None:
        try:
            Config(**settings).validate()
        except ConfigError as e:
            return str(e)
        return None

    if not flags or fails(values) == why:
        return ConfigError(why)
    merged = {**values, **flags}
    for key in flags:
        if fails({k: v for k, v in merged.items() if k != key}) != why:
            if key in HOST_KEYS:
                return ConfigError(why)
            return FlagError(f"Invalid value for {_flag(key)}: {why}")
    return FlagError(why)


def _read(file: Path) -> str:
    # Non-blocking open: a FIFO given as --config must not wait for a writer forever.
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory")
        if not stat.S_ISREG(mode):
            raise ConfigError(
                f"cannot read config {file}: not a regular file (give the path of a TOML file)"
            )
        data = f.read(MAX_CONFIG_BYTES + 1)
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"cannot read config {file}: larger than {MAX_CONFIG_BYTES >> 20} MiB (is it the "
            "right file? a slicer.toml is a few lines)"
        )
    return data.decode()

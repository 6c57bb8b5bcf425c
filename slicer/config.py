"""slicerd configuration: defaults, `/etc/slicer/slicer.toml` (or `--config`), then flags.

Precedence: flag > environment (`SLICER_SOCKET`) > file > default. Unknown keys and bad
values are refused with a message naming the key, so a typo never silently changes policy.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_slicer.slicer.errors import ConfigError, GpuBackendError
from gpu_slicer.slicer.gpu import check_backend_name

DEFAULT_CONFIG = Path("/etc/slicer/slicer.toml")
DEFAULT_SOCKET = "/run/slicer/slicer.sock"


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
    park_timeout: float = 120.0
    restore_timeout: float = 120.0
    fault_kill_after: float = 60.0
    foreign: str = "block"
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
        if self.reserved_connections < 0:
            raise ConfigError("reserved_connections must be >= 0")
        try:
            check_backend_name(self.gpu_backend)
        except GpuBackendError as e:
            raise ConfigError(f"gpu_backend: {e}") from None
        if self.foreign not in ("block", "ignore"):
            raise ConfigError(f"foreign must be block or ignore, got {self.foreign!r}")
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
        if kind == "float" and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind == "bool" and isinstance(value, bool):
            return value
        if kind.startswith("str") and isinstance(value, str):
            return value
    except ValueError:
        pass
    raise ConfigError(f"config key {key}: bad value {value!r} (expected {kind})")


def load(path: str | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build the Config from the file at `path` (default if present), env and overrides."""
    values: dict[str, Any] = {}
    file = Path(path) if path else DEFAULT_CONFIG
    if path or file.exists():
        try:
            doc = tomllib.loads(file.read_text())
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
    for key, value in (overrides or {}).items():
        if value is not None:
            values[key] = _coerce(key, value)
    return Config(**values).validate()

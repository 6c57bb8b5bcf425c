"""Boot, serve and shut down: the life of the stub's API server process.

Boot order (each step logged to stderr): start the engine-core child, let it allocate
context, weights and KV cache (and sit through ``--boot-delay``) while SIGTERM is
ignored, only then bind the port and log ``stub: healthy``. The port is served by
hypercorn's trio worker, or with ``--http-server lean`` by the dispatcher's lean HTTP/1.1
server (``gpu_slicer.dispatcher.httpserver.serve_asgi``: the same app, routes and bodies,
about a tenth of hypercorn's CPU per request) for a replica that must not be the ceiling.
After that SIGTERM/SIGINT shut down cleanly (exit 0: the core frees its memory and
exits); the core dying makes the server exit after a short grace during which /health
answers 503, with code 0, as vLLM 0.32's API server does when its engine core dies.
"""

from __future__ import annotations

import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve as hypercorn_serve

from stubs.vllm_stub.app import AccessLog, AppConfig, build_app
from stubs.vllm_stub.config import Config
from stubs.vllm_stub.core import read_identity
from stubs.vllm_stub.corelink import CoreDead, CoreError, CoreLink
from stubs.vllm_stub.engine import Engine, log

__all__ = ["DEAD_GRACE_S", "serve"]

DEAD_GRACE_S = 0.5
SHUTDOWN_GRACE_S = 2.0


def _identity(model: str) -> str:
    return read_identity(model) if Path(model).is_dir() else model


async def serve(cfg: Config) -> int:
    """Run the server until SIGTERM (0), engine death (1) or boot failure (1)."""
    t0 = time.monotonic()
    link = CoreLink(outlives_server=cfg.core_outlives_server)
    exit_code = 0
    async with trio.open_nursery() as nursery:
        log(f"starting engine core (model={cfg.model} gpu={cfg.gpu} workload={cfg.workload})")
        try:
            pid = await nursery.start(link.run)
        except CoreDead as e:
            print(f"RuntimeError: Engine core initialization failed: {e}", file=sys.stderr)
            return 1
        log(f"engine core pid={pid}")
        try:
            sizes = await link.call(
                "boot",
                gpu=cfg.gpu,
                workload=cfg.workload,
                context_bytes=cfg.context_bytes,
                weights_bytes=cfg.weights_bytes,
                boot_delay=cfg.boot_delay,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
            )
        except (CoreError, CoreDead) as e:
            print(f"{e}", file=sys.stderr)
            log(f"boot failed: {e}")
            await link.shutdown()
            nursery.cancel_scope.cancel()
            return 1
        log(
            f"engine core allocated context={sizes['context']} weights={sizes['weights']} "
            f"kv={sizes['kv']}"
        )
        engine = Engine(
            link,
            identity=_identity(cfg.model),
            tokens_per_s=cfg.tokens_per_s,
            reload_seconds=cfg.reload_seconds,
            sleep_mode=cfg.enable_sleep_mode,
            hang_requests=cfg.hang_requests,
            fail_reload=cfg.fail_reload,
            model_path=cfg.model,
            hold_scheduler=cfg.hold_scheduler,
        )
        app = build_app(
            engine,
            AppConfig(
                served_model_names=cfg.served_model_names,
                model=cfg.model,
                max_model_len=cfg.max_model_len,
                dev_mode=cfg.dev_mode,
            ),
        )
        hconf = HyperConfig()
        hconf.bind = [f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"]
        hconf.accesslog = None
        hconf.graceful_timeout = SHUTDOWN_GRACE_S
        asgi: Any = AccessLog(app)  # hypercorn's ASGI types are narrower than starlette's
        stop = trio.Event()

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log(f"received {signal.Signals(signum).name}: shutting down")
                    stop.set()

        async def on_core_death() -> None:
            await link.dead.wait()
            if stop.is_set():
                return
            log(f"engine core died (exit {link.returncode}); server exits")
            engine.on_dead()  # every request fails now: nothing left to drain
            await trio.sleep(DEAD_GRACE_S)
            stop.set()

        nursery.start_soon(on_signal)
        nursery.start_soon(on_core_death)
        if cfg.http_server == "lean":
            # Imported here: the stub runs (hypercorn) on trees without the lean server.
            from gpu_slicer.dispatcher.httpserver import serve_asgi

            front: Any = partial(serve_asgi, asgi, hconf.bind[0], stop, grace=SHUTDOWN_GRACE_S)
        else:
            front = partial(hypercorn_serve, asgi, hconf, shutdown_trigger=stop.wait)
        try:
            binds = await nursery.start(front)
        except OSError as e:
            print(f"OSError: {e}", file=sys.stderr)
            exit_code = 1
        else:
            log(f"listening on {' '.join(binds)}")
            log(f"healthy after {time.monotonic() - t0:.3f}s")
            await stop.wait()
        if exit_code == 0:
            for req in list(engine.requests):
                req.abort()
        with trio.move_on_after(SHUTDOWN_GRACE_S + 1):
            # the front returns once its connections are closed
            while engine.requests:
                await trio.sleep(0.01)
        stop.set()
        await link.shutdown()
        log("engine core stopped")
        nursery.cancel_scope.cancel()
    log(f"exit {exit_code}")
    return exit_code

"""A scheduler for the real vLLM server of the tier that can hold a request mid-run.

    vllm serve ... --scheduler-cls vllm_tier.hold.HoldScheduler   (CPU: no async scheduling)
    vllm serve ... --scheduler-cls vllm_tier.hold.HoldAsyncScheduler  (async scheduling)

A request whose ``vllm_xargs`` (``SamplingParams.extra_args``) carry
``tier_hold_after: K`` is scheduled as usual until it has K output tokens; from then on
it stays *running* (in the scheduler's running list, its KV blocks kept, its tokens
streamed) but is never scheduled again, so it cannot end by itself: only an abort (a
``/sleep`` or ``/pause`` with ``mode=abort``, a client that goes away) ends it. Every
other request is scheduled exactly as by vLLM's own scheduler.

Why: the contract case "a sleep with mode=abort ends a running request" needs a request
that is still running when the sleep lands. On the CPU build, 8 x 120 tokens of the tiny
model take well under a second, so under load the request could end by length first
(the case then saw ``finish: length``): a race no window length removes. A held request
makes the order certain: its tokens are out, it cannot finish, the sleep must abort it.
The stub takes the same flag (``--scheduler-cls vllm_tier.hold.HoldScheduler``) and the
same xarg, so both sides of the contract are driven alike.

Runs inside vLLM's engine-core process (vLLM resolves the name with
``resolve_obj_by_qualname``); imported only there, never by the product.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

HOLD_XARG = "tier_hold_after"


def _held(request: Any) -> bool:
    params = request.sampling_params
    extra = getattr(params, "extra_args", None) if params is not None else None
    if not extra or HOLD_XARG not in extra:
        return False
    return bool(request.num_output_tokens >= int(extra[HOLD_XARG]))


class _Hold:
    """Leaves the requests past their ``tier_hold_after`` out of every schedule."""

    running: list[Any]  # the scheduler's list of running requests
    scheduler_config: Any
    ASYNC = False  # the scheduling mode the base class keeps its books for

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if bool(self.scheduler_config.async_scheduling) != self.ASYNC:
            # A base class run in the other mode keeps the wrong bookkeeping (vLLM's CPU
            # platform turns async scheduling off; GPUs default to it on).
            other = "HoldScheduler" if self.ASYNC else "HoldAsyncScheduler"
            raise RuntimeError(f"{type(self).__name__}: this server's scheduling needs {other}")

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        held = [r for r in self.running if _held(r)]
        if not held:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        self.running = [r for r in self.running if not _held(r)]
        try:
            return super().schedule(*args, **kwargs)  # type: ignore[misc]
        finally:
            # schedule() may rebind self.running (preemption, finished requests): put the
            # held requests back in whatever list it left.
            self.running.extend(held)


class HoldScheduler(_Hold, Scheduler):  # type: ignore[misc]
    """vLLM's scheduler without async scheduling (the CPU build's only mode), holding."""


class HoldAsyncScheduler(_Hold, AsyncScheduler):  # type: ignore[misc]
    """vLLM's async scheduler (the GPU default), holding."""

    ASYNC = True

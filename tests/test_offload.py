"""`slicer.offload.Offloader`: every tensor of a model and its optimizer goes to host memory
and comes back bit-exactly, keeping its identity; a training step after the round trip is
the same as one without it. Runs on the CPU (the "device" is then the CPU too: the storages
are still replaced); the GPU check runs where CUDA is present."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

with warnings.catch_warnings():
    # A torch wheel without numpy warns at import; the suite turns warnings into errors.
    warnings.simplefilter("ignore")
    torch = pytest.importorskip("torch")

from gpu_slicer.slicer.offload import Moved, Offloader

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(device: str = DEVICE, seed: int = 0) -> tuple[Any, Any]:
    """Linear + BatchNorm (running stats, an int64 counter) + a frozen layer (grad None) and
    an extra float16 buffer, with Adam after two steps (exp_avg, exp_avg_sq, step)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.BatchNorm1d(16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 4),
    )
    frozen = torch.nn.Linear(4, 4)
    frozen.requires_grad_(False)
    model.append(frozen)
    model.register_buffer("scale", torch.rand(5).half())
    model.to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        step(model, opt, seed=len(opt.state))
    return model, opt


def batch(seed: int, device: str = DEVICE) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 + seed)
    return (
        torch.randn(32, 8, generator=g).to(device),
        torch.randn(32, 4, generator=g).to(device),
    )


def step(model: Any, opt: Any, seed: int) -> float:
    x, y = batch(seed, device=next(model.parameters()).device.type)
    opt.zero_grad(set_to_none=False)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return float(loss.detach().item())


def snapshot(model: Any, opt: Any) -> dict[str, Any]:
    """Clones of every tensor, keyed by where it lives."""
    snap: dict[str, Any] = {}
    for name, p in model.named_parameters():
        snap[f"param:{name}"] = p.detach().clone()
        snap[f"grad:{name}"] = None if p.grad is None else p.grad.clone()
    for name, b in model.named_buffers():
        snap[f"buffer:{name}"] = b.clone()
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            snap[f"state:{names[id(p)]}:{k}"] = v.clone()
    return snap


def live(model: Any, opt: Any) -> dict[str, Any]:
    """The live tensors, keyed like `snapshot`."""
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        out[f"param:{name}"] = p
        out[f"grad:{name}"] = p.grad
    for name, b in model.named_buffers():
        out[f"buffer:{name}"] = b
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"state:{names[id(p)]}:{k}"] = v
    return out


def assert_bit_exact(snap: dict[str, Any], now: dict[str, Any]) -> None:
    assert snap.keys() == now.keys()
    for key, want in snap.items():
        got = now[key]
        if want is None:
            assert got is None, key
            continue
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got.cpu(), want.cpu()), key


def ptrs(tensors: dict[str, Any]) -> dict[str, int]:
    return {k: t.data_ptr() for k, t in tensors.items() if t is not None}


def test_round_trip_is_bit_exact_and_keeps_identity() -> None:
    model, opt = make()
    params = list(model.parameters())
    grads = {id(p): p.grad for p in params}
    requires = [p.requires_grad for p in params]
    snap = snapshot(model, opt)
    objects = live(model, opt)
    before = ptrs(objects)
    kinds = {k.split(":")[0] for k in snap if snap[k] is not None}
    assert kinds == {"param", "grad", "buffer", "state"}
    assert any(v is None for v in snap.values())  # the frozen layer's grads
    assert {k.rsplit(":", 1)[1] for k in snap if k.startswith("state:")} == {
        "exp_avg",
        "exp_avg_sq",
        "step",
    }
    assert snap["buffer:1.num_batches_tracked"].dtype == torch.int64
    assert snap["buffer:scale"].dtype == torch.float16

    off = Offloader(model, opt)
    moved = off.offload()
    assert off.offloaded and isinstance(moved, Moved) and moved.direction == "offload"
    assert moved.tensors == len(before)
    assert moved.bytes == sum(
        t.numel() * t.element_size() for t in objects.values() if t is not None
    )
    assert moved.ms >= 0
    during = live(model, opt)
    for key, obj in objects.items():
        assert during[key] is obj, key  # the same tensor objects, storage swapped
    assert all(t.device.type == "cpu" for t in off.tensors())
    offloaded_ptrs = ptrs(during)
    assert all(offloaded_ptrs[k] != p for k, p in before.items())  # storages replaced
    assert off.device_bytes() == 0
    assert_bit_exact(snap, during)
    assert off.offload().tensors == 0  # idempotent

    back = off.restore(DEVICE)
    assert not off.offloaded and back.direction == "restore"
    assert back.tensors == moved.tensors and back.bytes == moved.bytes
    now = live(model, opt)
    for key, obj in objects.items():
        assert now[key] is obj, key
    assert all(now[k].data_ptr() != offloaded_ptrs[k] for k in before)  # replaced again
    assert_bit_exact(snap, now)
    assert [p.requires_grad for p in model.parameters()] == requires
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert opt.param_groups[0]["params"] == params
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params, strict=True))
    assert all(any(p is q for q in params) for p in opt.state)
    assert {id(p): p.grad for p in params} == grads  # the grad objects themselves
    # Adam keeps `step` on the CPU unless capturable/fused: it goes back where it was
    for st in opt.state.values():
        assert st["step"].device.type == "cpu"
        assert st["exp_avg"].device.type == DEVICE
    assert off.restore(DEVICE).tensors == 0  # idempotent


def test_training_after_a_round_trip_matches_training_without_one() -> None:
    ref_model, ref_opt = make(seed=3)
    model, opt = make(seed=3)
    assert_bit_exact(snapshot(ref_model, ref_opt), snapshot(model, opt))
    off = Offloader(model, [opt])
    for round_ in range(3):
        off.offload()
        off.restore(DEVICE)
        assert step(model, opt, seed=10 + round_) == step(ref_model, ref_opt, seed=10 + round_)
        assert_bit_exact(snapshot(ref_model, ref_opt), snapshot(model, opt))
    ref_model.eval()
    model.eval()
    x, _ = batch(99)
    with torch.no_grad():
        assert torch.equal(model(x), ref_model(x))


def test_optimizer_state_created_after_construction_is_moved() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.Adam(model.parameters())
    off = Offloader(model, opt)  # before any step: the optimizer has no state yet
    assert len(off.tensors()) == 2
    step(torch.nn.Sequential(model), opt, seed=0)
    assert len(off.tensors()) == 2 + 2 + 2 * 3  # params, grads, Adam state
    snap = snapshot(model, opt)
    off.offload()
    off.restore("cpu")
    assert_bit_exact(snap, live(model, opt))


def test_report_for_the_test_model(capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = make()
    off = Offloader(model, opt)
    out, back = off.offload(), off.restore(DEVICE)
    with capsys.disabled():
        print(
            f"\noffload: {out.tensors} tensors {out.bytes} B {out.ms:.3f} ms; "
            f"restore: {back.ms:.3f} ms ({DEVICE})"
        )
    assert out.bytes == back.bytes > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_memory_drops_after_offload_and_comes_back() -> None:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.BatchNorm1d(2048)).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 2048, device="cuda")
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    snap = snapshot(model, opt)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    reserved = torch.cuda.memory_reserved()
    off = Offloader(model, opt)
    assert off.device_bytes() >= 4 * 2048 * 2048 * 4  # weight, grad, exp_avg, exp_avg_sq
    moved = off.offload()
    for p in model.parameters():
        assert p.device.type == "cpu" and p.is_pinned() and p.grad.is_pinned()
    for st in opt.state.values():
        assert st["exp_avg"].is_pinned() and st["exp_avg_sq"].is_pinned()
    after = torch.cuda.memory_allocated() - base
    assert after <= held - moved.bytes + (1 << 20)  # the device storage is freed
    assert torch.cuda.memory_reserved() <= reserved - moved.bytes // 2  # empty_cache ran
    off.restore("cuda")
    assert_bit_exact(snap, live(model, opt))
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert torch.cuda.memory_allocated() - base >= held - (1 << 20)
    print(f"\nGPU: offload {moved.bytes} B in {moved.ms:.2f} ms; restore {off.last.ms:.2f} ms")

"""Contract cases: plain routes, errors, dev routes without dev mode, weights,
completion parameters and streams (see ``contract``)."""

from __future__ import annotations

import json
from typing import Any

from vllm_tier.contract import (
    Obs,
    Side,
    case,
    complete,
    err,
    shape,
    text_of,
)

# -- plain routes -------------------------------------------------------------------


@case
async def case_health_version_models(s: Side) -> Obs:
    h = await s.dev.get("/health")
    v = await s.dev.get("/version")
    m = await s.dev.get("/v1/models")
    return {
        "health": (h.status_code, h.text),
        "version": (v.status_code, shape(v.json())),
        "models": (m.status_code, shape(m.json())),
        "model_id": m.json()["data"][0]["id"],
    }


@case
async def case_completion(s: Side) -> Obs:
    r = await complete(s.dev)
    body = r.json()
    ids = await complete(s.dev, return_token_ids=True)
    c = ids.json()["choices"][0]
    return {
        "status": r.status_code,
        "shape": shape(body),
        "finish": body["choices"][0]["finish_reason"],
        "usage": body["usage"]["completion_tokens"],
        "ids": (len(c["token_ids"]), all(isinstance(t, int) for t in c["prompt_token_ids"])),
        "deterministic": text_of(await complete(s.dev)) == body["choices"][0]["text"],
    }


@case
async def case_completion_weight_versions(s: Side) -> Obs:
    c = (await complete(s.dev, return_weight_versions=True)).json()["choices"][0]
    return {"weight_versions": c.get("weight_versions")}


@case
async def case_completion_n2_token_ids_prompt(s: Side) -> Obs:
    greedy = await complete(s.dev, prompt=[5, 6, 7], n=2, temperature=0)
    r = await complete(s.dev, prompt=[5, 6, 7], n=2, temperature=0.8, seed=3)
    out: Obs = {"greedy": err(greedy) if greedy.status_code != 200 else 200}
    out["sampled"] = err(r) if r.status_code != 200 else len(r.json()["choices"])
    return out


@case
async def case_completion_stream(s: Side) -> Obs:
    r = await complete(s.dev, max_tokens=3, stream=True)
    events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    return {
        "status": r.status_code,
        "done": events[-1],
        "chunks": len(chunks),
        "first": shape(chunks[0]),
        "last": shape(chunks[-1]),
        "finish": chunks[-1]["choices"][0]["finish_reason"],
    }


@case
async def case_chat(s: Side) -> Obs:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    r = await s.dev.post("/v1/chat/completions", json=body)
    return {"status": r.status_code, "shape": shape(r.json())}


@case
async def case_bad_requests(s: Side) -> Obs:
    post = s.dev.post
    return {
        "unknown_model": err(await complete(s.dev, model="other")),
        "no_prompt": err(await post("/v1/completions", json={"max_tokens": 4})),
        "max_tokens": err(await complete(s.dev, max_tokens=200)),
        "temperature": err(await complete(s.dev, temperature=-1)),
        "not_json": err(
            await post(
                "/v1/completions", content=b"notjson", headers={"content-type": "application/json"}
            )
        ),
        "unknown_path": err(await s.dev.get("/no/such/route")),
        "pause_mode": err(await post("/pause", params={"mode": "bogus"})),
        "sleep_level": err(await post("/sleep", params={"level": 7})),
        "sleep_mode": err(await post("/sleep", params={"mode": "bogus"})),
        "version_body": err(await post("/update_weight_version", json={})),
        "rpc_no_method": err(await post("/collective_rpc", json={})),
        "rpc_unknown": err(await post("/collective_rpc", json={"method": "nosuch"})),
    }


@case
async def case_dev_routes_without_dev_mode(s: Side) -> Obs:
    out: Obs = {}
    for method, path in [
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_paused"),
        ("POST", "/reset_prefix_cache"),
        ("POST", "/collective_rpc"),
        ("POST", "/update_weight_version"),
        ("GET", "/weight_info"),
        ("POST", "/start_weight_update"),
        ("POST", "/finish_weight_update"),
    ]:
        r = await s.nodev.request(method, path)
        out[path] = err(r)
    out["completion"] = (await complete(s.nodev)).status_code  # serving still works
    return out


# -- weights ------------------------------------------------------------------------


@case
async def case_weights_reload_and_version(s: Side) -> Obs:
    before = text_of(await complete(s.dev))
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(s.models / "rev-1")}}
    r1 = await s.dev.post("/collective_rpc", json=rpc)
    after = text_of(await complete(s.dev))
    v = await s.dev.post("/update_weight_version", json={"new_version": "rev-1"})
    info = await s.dev.get("/weight_info")
    reset = await s.dev.post("/reset_prefix_cache")
    back = {"method": "reload_weights", "kwargs": {"weights_path": str(s.models / "base")}}
    r2 = await s.dev.post("/collective_rpc", json=back)
    again = text_of(await complete(s.dev))
    await s.dev.post("/update_weight_version", json={"new_version": "base"})
    return {
        "reload": (r1.status_code, r1.json()),
        "changed": before != after,
        "version": (v.status_code, v.json()),
        "info": info.json(),
        "reset": (reset.status_code, reset.json()),
        "reload_back": r2.status_code,
        "restored": again == before,
    }


@case
async def case_boot_weights_reload_from_the_models_root(s: Side) -> Obs:
    # slicer-dispatch --base-revision: the weights vLLM booted with are a revision whose
    # path is the model directory /v1/models names (`root`); a reload_weights with no
    # weights_path is no way back to them.
    boot = text_of(await complete(s.dev))
    root = (await s.dev.get("/v1/models")).json()["data"][0]["root"]
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(s.models / "rev-1")}}
    r1 = await s.dev.post("/collective_rpc", json=rpc)
    other = text_of(await complete(s.dev))
    r0 = await s.dev.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {}})
    bare = text_of(await complete(s.dev))
    back = {"method": "reload_weights", "kwargs": {"weights_path": root}}
    r2 = await s.dev.post("/collective_rpc", json=back)
    again = text_of(await complete(s.dev))
    return {
        "root_is_the_model_dir": root == str(s.models / "base"),
        "reload": r1.status_code,
        "changed": other != boot,
        "bare_reload": r0.status_code,
        "bare_is_boot": bare == boot,
        "bare_is_other": bare == other,
        "root_reload": r2.status_code,
        "root_restores": again == boot,
    }


@case
async def case_failed_reload_then_good_reload(s: Side) -> Obs:
    bad = {"method": "reload_weights", "kwargs": {"weights_path": str(s.models / "nope")}}
    r = await s.dev.post("/collective_rpc", json=bad)
    good = {"method": "reload_weights", "kwargs": {"weights_path": str(s.models / "base")}}
    g = await s.dev.post("/collective_rpc", json=good)
    after = await complete(s.dev)
    return {
        "bad": err(r),
        "worker_error": "Worker failed with error" in r.text,
        "good": g.status_code,
        "serves": after.status_code,
    }


@case
async def case_bare_finish_weight_update(s: Side) -> Obs:
    return {"finish": err(await s.dev.post("/finish_weight_update"))}


@case
async def case_start_weight_update(s: Side) -> Obs:
    r = await s.dev.post("/start_weight_update")
    if r.status_code == 200:  # the stub opened an update: close it again
        await s.dev.post("/finish_weight_update")
        return {"start": (200, r.json())}
    return {"start": err(r), "not_configured": "Weight transfer not configured" in r.text}


@case
async def case_finish_weight_update_with_a_version(s: Side) -> Obs:
    r = await s.dev.post("/finish_weight_update", json={"weight_version": "x"})
    return {"finish": err(r), "label": (await s.dev.get("/weight_info")).json()}


@case
async def case_completion_parameters(s: Side) -> Obs:
    out: Obs = {}
    cases: dict[str, dict[str, Any]] = {
        "str_list": {"prompt": ["hello", "world"]},
        "ids_list": {"prompt": [[5, 6], [7, 8]]},
        "stop": {"stop": ["\n"], "max_tokens": 8},
        "logprobs_2": {"logprobs": 2},
        "logprobs_0": {"logprobs": 0},
        "logprobs_21": {"logprobs": 21},
        "top_p": {"temperature": 0.7, "top_p": 0.9, "seed": 4},
        "request_id": {"request_id": "my-req-1"},
        "stream": {"stream": True, "max_tokens": 3},
        "bad_top_p": {"top_p": 0},
        "bad_logprobs": {"logprobs": -1},
        "bad_n": {"n": 0},
    }
    for name, kw in cases.items():
        r = await complete(s.dev, **kw)
        if r.status_code != 200:
            out[name] = err(r)
        elif kw.get("stream"):
            events = [e for e in r.text.split("\n\n") if e.startswith("data: {")]
            out[name] = [shape(json.loads(e.removeprefix("data: "))) for e in events[-1:]]
        else:
            choice = r.json()["choices"][0]
            lp = choice.get("logprobs")
            if isinstance(lp, dict):  # its top_logprobs are keyed by token: count them
                choice["logprobs"] = {
                    **lp,
                    "top_logprobs": [len(t or {}) for t in lp["top_logprobs"]],
                }
            out[name] = (
                len(r.json()["choices"]),
                shape(choice),
                choice.get("logprobs") and choice["logprobs"]["top_logprobs"][:1],
            )
    return out


@case
async def case_chat_stream(s: Side) -> Obs:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "stream": True,
    }
    r = await s.dev.post("/v1/chat/completions", json=body)
    events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    return {
        "status": r.status_code,
        "done": events[-1],
        "first": shape(chunks[0]),
        "last": shape(chunks[-1]),
        "n": len(chunks),
    }

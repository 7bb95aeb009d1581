"""Hostile requests against a keyed ``agentrl serve`` (issue 43), for ``benchmarks/faults.py``.

One ``agentrl serve --model tiny`` subprocess on loopback with ``--api-key env:...``,
``--admin-api-key file:...`` and ``--weights-dir W``. Every request of the issue's list goes to
it raw (any header, any body) and is checked: its status, its time against its bound, the
server's RSS before and right after it and its peak during it (VmHWM, reset through
``/proc/PID/clear_refs`` first), and the weight label and pause state after it. A refused request
that changed either, or a state-changing request without the right key that got a 2xx, is an
open door (``unauth_accepted``). The admin key's own requests come last, as the control that
the state check sees a change.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import pickle
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch
import torch.multiprocessing as torch_mp
from _serve import start_server, stop_server
from transformers.utils import logging as hf_logging

from agentrl.inference.api_keys import ADMIN_ROUTES, bearer
from agentrl.inference.weight_group import open_group
from agentrl.inference.weight_ipc import dump_named_tensors
from agentrl.tiny import build_tiny_model, build_tiny_tokenizer

ADMIN_POSTS = [
    "/pause_generation", "/continue_generation", "/abort_request", "/flush_cache",
    "/update_weights_from_disk", "/update_weights_from_tensor", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group",
]  # fmt: skip
GEN = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}
EMBED = "model.embed_tokens.weight"


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


@dataclass
class Req:
    """One hostile (or control) request and what it must get."""

    name: str
    path: str
    body: bytes | None = None
    key: str | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    expect: int = 400
    bound_s: float = 5.0
    rss_cap_mb: float = 512.0
    changes: bool = False  # a control that must change the state (the check works)
    check: Callable[[Any], bool] | None = None  # more to ask of the answer's JSON

    @property
    def unauth(self) -> bool:
        """Sent to a state-changing route without its key: a 2xx there is an open door."""
        return self.expect == 401 and (self.path in ADMIN_ROUTES or self.path == "/generate")


@dataclass
class Row:
    req: Req
    got: int | None  # None: no answer within the bound and its slack
    ms: float
    rss_mb: float  # after - before
    peak_mb: float  # peak during the request - before
    changed: bool
    answer: Any = None

    @property
    def faults(self) -> list[str]:
        r, out = self.req, []
        if self.got is None or self.ms > r.bound_s * 1000:
            out.append("slow" if self.got is not None else "no answer")
        if self.got is not None and self.got != r.expect:
            out.append(f"status {self.got}")
        if self.changed != r.changes:
            out.append("state changed" if self.changed else "state unchanged")
        if self.peak_mb > r.rss_cap_mb:
            out.append(f"RSS over {r.rss_cap_mb:g} MB")
        if r.check is not None and self.got == r.expect and not r.check(self.answer):
            out.append("answer")
        return out


class Memory:
    """The server's resident memory from /proc/PID/status, in MB."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def _mb(self, key: str) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
        return 0.0

    def rss(self) -> float:
        return self._mb("VmRSS")

    def reset_peak(self) -> bool:
        """VmHWM back to the current RSS (Linux >= 4.0), so it is this request's peak."""
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            return True
        except OSError:
            return False

    def peak(self) -> float:
        return self._mb("VmHWM")


class Hostile:
    """The keyed server, the requests sent to it, and their rows by scenario."""

    def __init__(self, url: str, pid: int, api: str, admin: str) -> None:
        self.url, self.mem, self.api, self.admin = url, Memory(pid), api, admin
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=32))
        self.state0: tuple[str, int] = ("", 0)
        self.rows: dict[str, list[Row]] = {}

    async def send(self, r: Req) -> tuple[int | None, Any, float]:
        headers = bearer(r.key)
        if r.body is not None:
            headers["Content-Type"] = "application/json"
        headers |= r.headers
        timeout = aiohttp.ClientTimeout(total=r.bound_s + 20)  # late answers still counted
        t = time.perf_counter()
        try:
            async with self.http.request(
                r.method, self.url + r.path, data=r.body, headers=headers, timeout=timeout
            ) as resp:
                status, text = resp.status, await resp.text()
        except (TimeoutError, aiohttp.ClientError):
            return None, None, (time.perf_counter() - t) * 1000
        ms = (time.perf_counter() - t) * 1000
        try:
            return status, json.loads(text), ms
        except ValueError:
            return status, text, ms

    async def state(self) -> tuple[str, int]:
        """The live weight label and /ready's status (503 while paused)."""
        _, info, _ = await self.send(Req("", "/model_info", key=self.api, method="GET"))
        ready, _, _ = await self.send(Req("", "/ready", method="GET"))
        label = info.get("weight_version", "?") if isinstance(info, dict) else "?"
        return str(label), ready or 0

    async def changed(self) -> bool:
        now = await self.state()
        changed, self.state0 = now != self.state0, now
        return changed

    async def run(self, scenario: str, reqs: list[Req]) -> None:
        """Send ``reqs`` one after another, measuring each."""
        for r in reqs:
            peaked = self.mem.reset_peak()
            before = self.mem.rss()
            got, answer, ms = await self.send(r)
            after = self.mem.rss()
            peak = max(self.mem.peak() if peaked else after, after)
            row = Row(r, got, ms, after - before, peak - before, await self.changed(), answer)
            self.rows.setdefault(scenario, []).append(row)

    async def together(self, scenario: str, joins: list[Req], probe: Req) -> None:
        """``joins`` at once, ``probe`` 0.3 s later; the memory figures cover them all."""
        peaked = self.mem.reset_peak()
        before = self.mem.rss()
        tasks = [asyncio.create_task(self.send(r)) for r in joins]
        await asyncio.sleep(0.3)
        probed = await self.send(probe)
        answers = await asyncio.gather(*tasks)
        after = self.mem.rss()
        peak = max(self.mem.peak() if peaked else after, after)
        changed = await self.changed()  # on the last row only: one check covers them all
        reqs = [*joins, probe]
        for r, (got, answer, ms) in zip(reqs, [*answers, probed], strict=True):
            last = changed and r is probe
            row = Row(r, got, ms, after - before, peak - before, last, answer)
            self.rows.setdefault(scenario, []).append(row)

    async def aclose(self) -> None:
        await self.http.close()


# ---- the requests ------------------------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket closes


def group_body(port: int, **change: Any) -> dict[str, Any]:
    return {"master_address": "127.0.0.1", "master_port": port, "world_size": 2,
            "rank_offset": 1, "backend": "gloo", "timeout_s": 1, **change}  # fmt: skip


class _Alloc:
    def __reduce__(self) -> Any:
        return (torch.Tensor, (2**28,))  # 1 GiB from a few bytes of pickle


@contextmanager
def tensor_payloads(model: torch.nn.Module) -> Iterator[dict[str, str]]:
    """``serialized_named_tensors`` entries by name; the shared storages live until exit."""
    before = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")  # storages another process can open by name
    try:
        base = torch.zeros(1).share_memory_()
        big = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(2**30))
        weights = [(k, v.detach()) for k, v in model.state_dict().items()]
        yield {
            "valid weights (seed 1)": dump_named_tensors(weights),
            "pickle REDUCE torch.Tensor(2**28)": base64.b64encode(
                pickle.dumps([(EMBED, _Alloc())])
            ).decode(),
            "stride-0 view of 2**28": dump_named_tensors([(EMBED, base.expand(2**28))]),
            "shared storage of 2**30 B": dump_named_tensors([(EMBED, big)]),  # sparse: no RSS
            "wrong shape": dump_named_tensors([(EMBED, torch.zeros(3, 3))]),
            "unknown name": dump_named_tensors([("nope", torch.zeros(2))]),
        }
    finally:
        torch_mp.set_sharing_strategy(before)


def weight_dirs(tmp: Path) -> tuple[Path, Path]:
    """``W`` (allowed; ``v3`` inside, and the traps) and a model directory outside it."""
    allowed, outside = tmp / "weights", tmp / "outside"
    hf_logging.disable_progress_bar()  # no "Writing model shards" bars in the benchmark's output
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(tokenizer, seed=1).save_pretrained(allowed / "v3")
    build_tiny_model(tokenizer, seed=5).save_pretrained(outside)
    (allowed / "link").symlink_to(outside)  # a link out of the allowed tree
    (allowed / "filelink").mkdir()
    (allowed / "filelink" / "model.safetensors").symlink_to(outside / "model.safetensors")
    (allowed / "fifo").mkdir()
    os.mkfifo(allowed / "fifo" / "model.safetensors")  # once froze the whole server
    return allowed, outside


def _failed(answer: Any) -> bool:
    return isinstance(answer, dict) and answer.get("success") is False


async def send_all(h: Hostile, allowed: Path, outside: Path, payloads: dict[str, str]) -> None:
    api, admin, port = h.api, h.admin, closed_port()
    v3 = str(allowed / "v3")
    harmful = {  # each would change what the server serves (or stop it) if let through
        "/pause_generation": {}, "/continue_generation": {}, "/abort_request": {"abort_all": True},
        "/flush_cache": {}, "/update_weights_from_disk": {"model_path": v3, "weight_version": "66"},
        "/update_weights_from_tensor": {
            "serialized_named_tensors": [payloads["valid weights (seed 1)"]],
            "weight_version": "67",
        },
        "/init_weights_update_group": group_body(port),
        "/update_weights_from_distributed": {
            "names": [EMBED], "dtypes": ["float32"], "shapes": [[1]], "weight_version": "68",
        },
        "/destroy_weights_update_group": {},
    }  # fmt: skip
    keys = {"no key": None, "wrong key": "wrong-" + api, "API key": api}
    await h.run("admin routes without the admin key", [
        *(Req(f"{p} {k}", p, _json(body), key=v, expect=401)
          for p, body in harmful.items() for k, v in keys.items()),
        *(Req(f"GET /flush_cache {k}", "/flush_cache", key=v, method="GET", expect=401)
          for k, v in keys.items()),
    ])  # fmt: skip
    users = {"no key": None, "wrong key": "wrong-" + api, "admin key": admin}
    await h.run("generate and model_info, wrong key", [
        *(Req(f"/generate {k}", "/generate", _json(GEN), key=v, expect=401)
          for k, v in users.items()),
        *(Req(f"GET /model_info {k}", "/model_info", key=v, method="GET", expect=401)
          for k, v in users.items()),
    ])  # fmt: skip
    pause = _json({})
    await h.run("foreign Host", [
        *(Req(f"/pause_generation Host: {host}", "/pause_generation", pause, key=admin,
              headers={"Host": host}, expect=421)
          for host in ("evil.example", "evil.example:80", "localhost.evil.example")),
        Req("/generate Host: evil.example", "/generate", _json(GEN), key=api,
            headers={"Host": "evil.example"}, expect=421),
    ])  # fmt: skip
    load = _json(harmful["/update_weights_from_disk"])
    await h.run("foreign Origin", [
        *(Req(f"/pause_generation Origin: {o}", "/pause_generation", pause, key=admin,
              headers={"Origin": o}, expect=403) for o in ("http://evil.example", "null")),
        Req("/update_weights_from_disk Origin: http://evil.example", "/update_weights_from_disk",
            load, key=admin, headers={"Origin": "http://evil.example"}, expect=403),
    ])  # fmt: skip
    kinds = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")
    await h.run("non-JSON POST", [
        *(Req(f"{p} {kind}", p, b"{}", key=k, headers={"Content-Type": kind}, expect=415)
          for p, k in (("/pause_generation", admin), ("/generate", api)) for kind in kinds),
        Req("/update_weights_from_disk text/plain", "/update_weights_from_disk", load, key=admin,
            headers={"Content-Type": "text/plain"}, expect=415),
    ])  # fmt: skip
    deep = {
        "[ x1000": b"[" * 1000 + b"]" * 1000,
        '{"a": x1000': b'{"a":' * 1000 + b"1" + b"}" * 1000,
    }
    await h.run("JSON nested 1000 deep", [
        Req(f"{p} {name}", p, body, key=api if p == "/generate" else admin)
        for p in ("/generate", *ADMIN_POSTS) for name, body in deep.items()
    ])  # fmt: skip
    surrogate = b'{"text": "2 + 2 = \\ud800", "sampling_params": {"max_new_tokens": 1}}'
    await h.run("lone surrogate", [Req("/generate text with \\ud800", "/generate", surrogate,
                                       key=api)])  # fmt: skip
    big_text = _json({"text": "x" * 30_000_000, "sampling_params": {"max_new_tokens": 1}})
    ids = _json({"input_ids": [7] * 10_000_000})
    await h.run("huge prompts", [  # each twice: a second RSS rise would be a leak
        Req(f"/generate {what}{again}", "/generate", body, key=api, bound_s=10)
        for what, body in (("text of 30,000,000 chars", big_text), ("10,000,000 input_ids", ids))
        for again in ("", " (again)")
    ])  # fmt: skip
    del big_text, ids
    paths = {"a dir outside W": str(outside), "a symlink out of W": str(allowed / "link"),
             "a FIFO model.safetensors": str(allowed / "fifo"),
             "a file symlinked out of W": str(allowed / "filelink"), "/dev": "/dev",
             "W/../outside": str(allowed / ".." / "outside"), "a relative path": "v3"}  # fmt: skip
    await h.run("weights from disk", [
        Req(f"/update_weights_from_disk {what}", "/update_weights_from_disk",
            _json({"model_path": p, "weight_version": "66"}), key=admin, check=_failed)
        for what, p in paths.items()
    ])  # fmt: skip
    bad: dict[str, dict[str, Any]] = {
        "timeout_s 1e8": {"timeout_s": 1e8}, "timeout_s -1": {"timeout_s": -1},
        "master_port 70000": {"master_port": 70000}, "world_size 1": {"world_size": 1},
        "rank_offset 0": {"rank_offset": 0}, "backend mpi": {"backend": "mpi"},
        "master_address not a string": {"master_address": ["x"]}}  # fmt: skip
    await h.run("weight group fields", [
        Req(f"/init_weights_update_group {what}", "/init_weights_update_group",
            _json(group_body(port, **change)), key=admin, bound_s=2)
        for what, change in bad.items()
    ])  # fmt: skip
    await h.together(
        "8 joins of a closed port",
        [Req(f"/init_weights_update_group closed port #{i}", "/init_weights_update_group",
             _json(group_body(port)), key=admin, bound_s=10) for i in range(8)],
        Req("/generate meanwhile", "/generate", _json(GEN), key=api, expect=200, bound_s=2.5),
    )  # fmt: skip
    await distributed_bucket(h)
    await h.run("tensor payloads", [
        Req(f"/update_weights_from_tensor {what}", "/update_weights_from_tensor",
            _json({"serialized_named_tensors": [entry], "weight_version": "69"}), key=admin,
            rss_cap_mb=64) for what, entry in payloads.items() if not what.startswith("valid")
    ])  # fmt: skip
    await h.run("control: the right keys", [
        Req("/generate API key", "/generate", _json(GEN), key=api, expect=200),
        Req("/pause_generation admin key", "/pause_generation", pause, key=admin, expect=200,
            changes=True),
        Req("/continue_generation admin key", "/continue_generation", pause, key=admin,
            expect=200, changes=True),
        Req("/update_weights_from_disk W/v3 admin key", "/update_weights_from_disk",
            _json({"model_path": v3, "weight_version": "7"}), key=admin, expect=200,
            changes=True),
    ])  # fmt: skip


async def distributed_bucket(h: Hostile) -> None:
    """No group: 400. Then a group this process hosts (rank 0) and a 1 GiB bucket: 400 before
    any buffer exists, the server leaving the group."""
    bucket = _json({"names": [EMBED], "dtypes": ["float32"], "shapes": [[32768, 8192]]})
    scenario, admin = "distributed bucket", h.admin
    path = "/update_weights_from_distributed"
    await h.run(scenario, [Req(f"{path} no group", path, bucket, key=admin)])
    port = closed_port()
    host = asyncio.to_thread(open_group, master_address="127.0.0.1", master_port=port, rank=0,
                             world_size=2, backend="gloo", device="cpu", timeout_s=30)  # fmt: skip
    init = "/init_weights_update_group"
    join = Req(f"{init} a group hosted here", init, _json(group_body(port, timeout_s=30)),
               key=admin, expect=200, bound_s=30)  # fmt: skip
    group, _ = await asyncio.gather(host, h.run(scenario, [join]), return_exceptions=True)
    if isinstance(group, BaseException):  # the join's row says why
        return
    try:
        await h.run(scenario, [
            Req(f"{path} shapes [[32768, 8192]]", path, bucket, key=admin, rss_cap_mb=64),
            Req("/destroy_weights_update_group (already left)", "/destroy_weights_update_group",
                _json({}), key=admin),
        ])  # fmt: skip
    finally:
        await asyncio.to_thread(group.close, 5)


# ---- the scenarios -----------------------------------------------------------------------------


def summarise(rows: list[Row]) -> dict[str, Any]:
    """One scenario in faults.py's shape, plus the server counters."""
    failed: dict[str, int] = {}
    for row in rows:
        for fault in row.faults:
            failed[fault] = failed.get(fault, 0) + 1
    return {
        "expected": len(rows),
        "written": sum(row.got is not None for row in rows),
        "duplicated": 0,
        "lost": 0,
        "failed": failed,
        "hung": any(row.got is None or row.ms > row.req.bound_s * 1000 for row in rows),
        "server_5xx": sum(row.got is not None and row.got >= 500 for row in rows),
        "unauth_accepted": sum(
            (row.req.unauth and row.got is not None and 200 <= row.got < 300)
            or (row.changed and not row.req.changes)
            for row in rows
        ),
        "rss_growth_mb": round(max((row.peak_mb for row in rows), default=0.0), 1),
        "requests": [
            {
                "request": row.req.name,
                "expected": row.req.expect,
                "got": row.got,
                "ms": round(row.ms, 1),
                "rss_mb": round(row.rss_mb, 1),
                "peak_mb": round(row.peak_mb, 1),
                "faults": row.faults,
            }
            for row in rows
        ],  # fmt: skip
    }


async def hostile_scenarios(tmp: Path, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every hostile request against one keyed server: ``{"hostile: <group>": scenario}``."""
    api, admin = "api-" + secrets.token_hex(8), "admin-" + secrets.token_hex(8)
    allowed, outside = weight_dirs(tmp)
    keyfile = tmp / "admin.key"
    keyfile.write_text(admin + "\n")
    source = ["--model", "tiny", "--torch-threads", "1", "--api-key", "env:AGENTRL_FAULTS_KEY",
              "--admin-api-key", f"file:{keyfile}", "--weights-dir", str(allowed)]  # fmt: skip
    env = {"AGENTRL_FAULTS_KEY": api, "OMP_NUM_THREADS": "1"}
    proc, url = start_server(source, tmp / "hostile-serve.log", timeout_s=180, env=env)
    h = Hostile(url, proc.pid, api, admin)
    try:
        model = build_tiny_model(build_tiny_tokenizer(), seed=1)
        h.state0 = await h.state()
        with tensor_payloads(model) as payloads:
            await send_all(h, allowed, outside, payloads)
    finally:
        await h.aclose()
        stop_server(proc)
    server_log = (tmp / "hostile-serve.log").read_text(errors="replace")
    if "Traceback" in server_log:
        log("server log (tail):\n" + server_log[-3000:])
    return {f"hostile: {name}": summarise(rows) for name, rows in h.rows.items()}


def hostile_table(results: dict[str, Any]) -> list[str]:
    """The hostile requests, one line each: request, expected, got, ms, RSS growth."""
    head = (
        f"{'hostile request':<62} {'expect':>6} {'got':>4} {'ms':>8} {'RSS +MB':>8} {'peak +MB':>8}"
    )
    lines = [head]
    for name, scenario in results.items():
        if not name.startswith("hostile: "):
            continue
        lines.append(f"-- {name[len('hostile: ') :]}")
        for r in scenario["requests"]:
            faults = "  !! " + ", ".join(r["faults"]) if r["faults"] else ""
            got = "-" if r["got"] is None else r["got"]
            lines.append(f"{r['request'][:62]:<62} {r['expected']:>6} {got:>4} {r['ms']:>8.1f} "
                         f"{r['rss_mb']:>8.1f} {r['peak_mb']:>8.1f}{faults}")  # fmt: skip
    return lines

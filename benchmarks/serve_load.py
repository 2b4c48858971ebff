"""Load test of ``teamrl serve`` with the official ``openai`` client: throughput, latency, tokens/s and errors.

A ``teamrl serve`` process (loopback only, a free port) serves the team; for each way of batching (``--batching``:
``continuous``, a window in ms such as 10, and 0 = no batching) and each number of concurrent clients
(``--concurrency``: 1, 8 and 32), a bounded number of requests (``--requests``, at least one per client) is sent by
that many concurrent clients of ``openai.AsyncOpenAI`` (no retries, so that every failure counts), each client
sending its next request when its last is answered (closed loop), for two methods:

* team: ``model: TEAM``, the task's input (a held-out item's fields as JSON), each agent answering its own
  observation with its own ``max_new_tokens``, concurrently (the decentralised execution MAGRPO trains for);
* single: the single-model baseline, one agent (``TEAM/FIRST_AGENT``) writing every part in sequence from the
  task's single-agent prompt (``env.single_agent_observation``, under ``env.single_agent_role``), with the sum of
  the agents' ``max_new_tokens``.

``--open-loop RATE:COUNT`` adds, per batching and method, COUNT requests sent at a fixed RATE per second whether
or not the earlier ones were answered (open loop: arrivals staggered, as independent users send them; near
capacity a window cannot gather a whole burst).

Per cell: requests/s, latency p50/p95/p99 (of the answered requests), completion tokens/s (usage from the
responses, over the cell's wall time), errors, and requests per generate call (from the server's ``/metrics``); then,
for every batching, each cell's requests/s and p50 as a ratio to the same cell under the first window of
``--batching`` (today's default, 10 ms). The load average of the machine is recorded with every cell: on a shared
machine other work slows the numbers.

By default the team is a tiny one trained here for a step (digit_sum, two LoRA agents on one random tiny base,
``max_new_tokens`` 16); ``--team RUN_DIR/team`` serves a real one, e.g. a bundled-model team from
``teamrl train demo_tldr_cpu steps=1 run_dir=runs/servteam eval.every_steps=0`` (docs/serving.md).

    python benchmarks/serve_load.py [--team PATH] [--concurrency 1,8,32] [--requests 32]
        [--batching continuous,10,0] [--open-loop 2:32] [--methods team,single] [--threads N] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from teamrl.envs.base import rebuild_env
from teamrl.evaluation.report import markdown_table

TINY_MAX_NEW_TOKENS = 16


def tiny_team(folder: Path) -> Path:
    """A digit_sum team of two LoRA agents on one tiny random base, trained for a step by ``teamrl train``."""
    run_dir = folder / "tiny"
    command = [sys.executable, "-m", "teamrl.cli", "train", "tiny_digit_sum", "steps=1", f"run_dir={run_dir}",
               "team.training=lora", f"team.sampling.max_new_tokens={TINY_MAX_NEW_TOKENS}", "eval.every_steps=0",
               "checkpoint.save_every=0", "logging.progress_bar=false", "--threads", "1"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return run_dir / "team"


class Server:
    """A ``teamrl serve`` subprocess on 127.0.0.1 and a free port; stopped with SIGTERM (its exit code kept)."""

    def __init__(self, team: Path, batching: str, max_new_tokens: int, threads: int | None):
        how = ["--batching", "continuous"] if batching == "continuous" else ["--batch-window-ms", batching]
        command = [sys.executable, "-m", "teamrl.cli", "serve", str(team), "--port", "0", "--host", "127.0.0.1",
                   *how, "--max-new-tokens", str(max_new_tokens), "--name", "team"]
        command += ["--threads", str(threads)] if threads else []
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], 600)
        line = self.process.stdout.readline() if ready else ""
        if " on http://" not in line:
            self.process.kill()
            raise RuntimeError(f"teamrl serve did not start: {line!r}")
        self.url = line.split(" on ")[1].strip()  # .../v1
        self.exit_code: int | None = None

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url.removesuffix("/v1") + "/metrics", timeout=30) as response:
            return json.load(response)

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        self.exit_code = self.process.wait(120)
        return self.exit_code


def requests_for(env, team_json: dict, method: str) -> list[dict[str, Any]]:
    """The chat completion requests of ``method``, one per held-out item (cycled through by the clients)."""
    agents = team_json["agents"]
    own = max(agent["sampling"]["max_new_tokens"] for agent in agents)
    both = sum(agent["sampling"]["max_new_tokens"] for agent in agents)
    requests = []
    for item in env.items("eval"):
        if method == "team":
            fields = {key: value for key, value in item.items() if key not in ("id", "reference")}
            requests.append({"model": "team", "max_tokens": own,
                             "messages": [{"role": "user", "content": json.dumps(fields)}]})
        else:
            system = [{"role": "system", "content": env.single_agent_role}] if env.single_agent_role else []
            requests.append({"model": f"team/{agents[0]['name']}", "max_tokens": both,
                             "messages": [*system, {"role": "user", "content": env.single_agent_observation(item)}]})
    return requests


async def run_cell(url: str, requests: list[dict], clients: int, total: int, timeout: float,
                   rate: float | None = None) -> dict[str, Any]:
    """``total`` requests from ``clients`` concurrent openai clients, each sending its next when its last is answered;
    or, with ``rate``, one request every 1/rate seconds whatever is answered (open loop): latencies, tokens, errors."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=timeout)
    latencies: list[float] = []
    tokens, errors, next_request = 0, Counter(), 0

    async def send(request: dict) -> None:
        nonlocal tokens
        start = time.perf_counter()
        try:
            response = await client.chat.completions.create(**request)
        except openai.APIStatusError as err:
            errors[f"{err.status_code} {type(err).__name__}"] += 1
            return
        except openai.APIError as err:
            errors[type(err).__name__] += 1
            return
        latencies.append(time.perf_counter() - start)
        tokens += response.usage.completion_tokens

    async def one_client() -> None:
        nonlocal next_request
        while next_request < total:
            request = requests[next_request % len(requests)]
            next_request += 1
            await send(request)

    async def open_loop() -> None:
        sent = []
        for index in range(total):
            sent.append(asyncio.ensure_future(send(requests[index % len(requests)])))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*sent)

    start = time.perf_counter()
    await (open_loop() if rate else asyncio.gather(*(one_client() for _ in range(clients))))
    wall = time.perf_counter() - start
    await client.close()
    latencies.sort()

    def percentile(fraction: float) -> float | None:
        return latencies[max(0, math.ceil(fraction * len(latencies)) - 1)] if latencies else None

    return {"clients": f"{rate:g}/s open" if rate else clients, "requests": total, "answered": len(latencies),
            "errors": dict(errors),
            "wall_s": wall, "requests_per_s": len(latencies) / wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall, "tokens_per_request": tokens / max(len(latencies), 1),
            "p50_s": percentile(0.50), "p95_s": percentile(0.95), "p99_s": percentile(0.99)}


def measure(args: argparse.Namespace, team: Path) -> dict[str, Any]:
    team_json = json.loads((team / "team.json").read_text())
    env = rebuild_env(team_json["env"])
    both = sum(agent["sampling"]["max_new_tokens"] for agent in team_json["agents"])
    methods = {method: requests_for(env, team_json, method) for method in args.methods}
    cells, servers = [], []
    loads = [(clients, None, max(args.requests, clients)) for clients in args.concurrency]
    if args.open_loop:
        loads.append((1, args.open_loop[0], args.open_loop[1]))
    for batching in args.batching:
        server = Server(team, batching, both, args.threads)
        try:
            for requests in methods.values():  # warm-up: first-call allocations and kernel choices
                asyncio.run(run_cell(server.url, requests, 1, 2, args.timeout))
            for method, requests in methods.items():
                for clients, rate, total in loads:
                    before, load_before = server.metrics()["batching"], os.getloadavg()[0]
                    cell = asyncio.run(run_cell(server.url, requests, clients, total, args.timeout, rate))
                    after = server.metrics()["batching"]
                    calls = after["generate_calls"] - before["generate_calls"]
                    cell.update(method=method, batching=batching, generate_calls=calls,
                                requests_per_call=(cell["answered"] / calls) if calls else None,
                                load_before=load_before, load_after=os.getloadavg()[0])
                    cells.append(cell)
                    print(f"  {method:6s} {_batching_name(batching)}, {cell['clients']} clients: "
                          f"{cell['requests_per_s']:.2f} req/s, p50 {cell['p50_s']:.3f} s, load {load_before:.1f}",
                          file=sys.stderr, flush=True)
        finally:
            servers.append({"batching": batching, "exit_code": server.stop()})
    return {"cells": cells, "servers": servers}


def _batching_name(batching: str) -> str:
    return batching if batching == "continuous" else "no batching" if float(batching) == 0 else f"window {batching} ms"


def ratios(cells: list[dict[str, Any]], reference: str) -> list[list[str]]:
    """Each cell's requests/s and p50 against the same method and load under ``reference`` batching."""
    base = {(cell["method"], str(cell["clients"])): cell for cell in cells if cell["batching"] == reference}
    rows = []
    for cell in cells:
        other = base.get((cell["method"], str(cell["clients"])))
        if cell["batching"] == reference or other is None or not other["requests_per_s"] or not cell["p50_s"]:
            continue
        rows.append([cell["method"], _batching_name(cell["batching"]), str(cell["clients"]),
                     f"{cell['requests_per_s'] / other['requests_per_s']:.2f}x",
                     f"{cell['p50_s'] / other['p50_s']:.2f}x" if other["p50_s"] else "-"])
    return rows


def render(results: dict[str, Any]) -> str:
    """The Markdown table of every cell, then the server's exit codes."""
    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    rows = [[cell["method"], _batching_name(cell["batching"]), str(cell["clients"]),
             f"{cell['answered']}/{cell['requests']}", str(sum(cell["errors"].values())),
             number(cell["requests_per_s"], 2), number(cell["p50_s"], 3), number(cell["p95_s"], 3),
             number(cell["p99_s"], 3), number(cell["tokens_per_s"], 1), number(cell["tokens_per_request"], 1),
             number(cell["requests_per_call"], 1), f"{cell['load_before']:.1f}-{cell['load_after']:.1f}"]
            for cell in results["cells"]]
    table = markdown_table(["method", "batching", "clients", "answered", "errors", "req/s", "p50 s", "p95 s", "p99 s",
                            "tokens/s", "tokens/req", "req/generate call", "load avg"], rows)
    reference = next((b for b in results["batchings"] if b != "continuous" and float(b) > 0), None)
    relative = ""
    if reference is not None and len(results["batchings"]) > 1:
        relative = (f"\n\nAgainst {_batching_name(reference)} (same method and load):\n\n"
                    + markdown_table(["method", "batching", "clients", "req/s ratio", "p50 ratio"],
                                     ratios(results["cells"], reference)))
    exits = ", ".join(f"{_batching_name(s['batching'])}: {s['exit_code']}" for s in results["servers"])
    return f"{table}{relative}\n\nserver exit codes after SIGTERM: {exits}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--team", type=Path, default=None, help="a saved team (RUN_DIR/team); default: a tiny one")
    parser.add_argument("--concurrency", default="1,8,32", help="concurrent clients per cell (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=32,
                        help="requests per cell, at least one per client (default: %(default)s)")
    parser.add_argument("--batching", default="continuous,10,0",
                        help="continuous, or a batching window in ms (0 = off), comma-separated (default: %(default)s)")
    parser.add_argument("--open-loop", default=None,
                        help="RATE:COUNT: also COUNT requests at RATE per second, whatever is answered (e.g. 2:32)")
    parser.add_argument("--methods", default="team,single", help="team and/or single (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads (default: torch's)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take before it fails")
    parser.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.batching = [b.strip() for b in args.batching.split(",")]
    for batching in args.batching:
        if batching != "continuous":
            try:
                float(batching)
            except ValueError:
                parser.error(f"--batching: continuous or a window in ms, not {batching!r}")
    if args.open_loop:
        rate, _, count = args.open_loop.partition(":")
        try:
            args.open_loop = (float(rate), int(count))
        except ValueError:
            parser.error(f"--open-loop: RATE:COUNT, e.g. 2:32 (got {args.open_loop!r})")
    args.methods = [m.strip() for m in args.methods.split(",")]
    if not set(args.methods) <= {"team", "single"}:
        parser.error(f"--methods: team and/or single (got {','.join(args.methods)})")

    with tempfile.TemporaryDirectory(prefix="serve-load-") as scratch:
        start = time.perf_counter()
        team = args.team or tiny_team(Path(scratch))
        load_start = os.getloadavg()
        results = {**measure(args, team), "batchings": args.batching}
        header = (f"{datetime.date.today().isoformat()}, {args.team or 'tiny digit_sum team (LoRA, trained 1 step)'}, "
                  f"{platform.machine()} {os.cpu_count()} cores, server torch threads {args.threads or 'default'}, "
                  f"load average {load_start[0]:.1f} at the start (other work on the machine), "
                  f"{time.perf_counter() - start:.0f} s in all")
    print(f"{header}\n\n{render(results)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"header": header, "args": {k: str(v) for k, v in vars(args).items()},
                                        **results}, indent=2))


if __name__ == "__main__":
    main()

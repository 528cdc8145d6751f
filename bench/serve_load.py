"""Serving under load, in one run: ``elmo serve`` with batching on and off, ``mlflow models serve`` of the same
model, and the batch job's ``embed_sentences`` on the same sentences (the ceiling), then an open-loop burst.

    .venv/bin/python bench/serve_load.py [--shape small] [--precision fp32] [--seconds 10]
                                         [--concurrency 1,8,64,256] [--burst-seconds 30] [--skip mlflow,off,burst]
    .venv/bin/python bench/serve_load.py --replicas 2 [--replica-clients 64] [--seconds 10]   # behind HAProxy

The model: random bilm-tf-initialised weights of the preset shape, written as options.json + weights.hdf5. The
sentences: real English with its long-tailed lengths (Python's help topics, the unicode tokenizer; 1 to 100+
tokens), and, at the highest concurrency, synthetic ones (10-40 Zipfian made-up words). One sentence a request,
as a search box or a tagger sends them; every server answers the sentence's pooled vector (``/embed`` output
``mean`` as base64; the pyfunc model with ``pooled``), and ``elmo serve`` once more with every token's mixed vector.
In fp32 the same model exported with ``elmo onnx`` is served too (``elmo serve FILE.onnx``: ONNX Runtime in the model
process, no torch), at every concurrency and with every layer per token.

Closed loop: C clients, each sending its next request when the last is answered, for ``--seconds`` after a
warm-up; printed per server and C: tokens/s of answered sentences, p50/p95/p99 latency, non-200 answers. The
ceiling is ``embed_sentences`` over the whole sentence pool at once, in this process, with the cores the server
gets (the clients share those cores with the server: the figures include their cost).

The burst: requests fired at 4x the capacity measured at the highest concurrency, for ``--burst-seconds``,
whatever the answers; then every request must have been answered 200 or 429 (none lost, none hung past 60 s),
and the server's peak RSS (its processes together) is set beside its idle RSS.

``--replicas N`` measures something else instead: N servers (the cores split between them) behind the shipped HAProxy
configuration (``deploy/haproxy.cfg``, HAProxy from the system), ``--replica-clients`` closed-loop clients that retry
429 and 503 as OpenAI's client does, for ``--seconds``, then through a rolling restart of every replica and a
``kill -9`` of one (``bench/replicas.py``, what ``tests/test_deploy.py`` runs), then ``--seconds`` again; printed:
tokens/s and latency before, through and after, and the requests lost (not answered 200 in the end).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from embed_throughput import describe_machine, make_sentences, real_sentences  # noqa: E402

from elmo_core import BiLM  # noqa: E402
from elmo_core.bilm.initialization import init_bilm_tf  # noqa: E402
from elmo_core.config import preset  # noqa: E402

# isort: split
import torch  # noqa: E402

CLIENT_TIMEOUT_S = 60.0
SERVER_ENV: dict[str, str] = {}  # --server-env: set for the servers alone, not for the baselines in this process


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}) before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} did not answer 200 in {timeout} s")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server and what it started (mlflow's runs uvicorn in a shell of its own session)."""
    import signal

    try:
        os.killpg(process.pid, signal.SIGTERM) if os.getpgid(process.pid) == process.pid else process.terminate()
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
    except ProcessLookupError:
        pass


def tree_rss(pid: int) -> int:
    """The resident memory of a process and its children, in bytes."""
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


class Target:
    """A server under test: how to ask it for one sentence's vector."""

    def __init__(self, name: str, url: str, body) -> None:  # noqa: ANN001
        self.name, self.url, self.body = name, url, body


def serve_target(name: str, base: str, output: str = "mean") -> Target:
    return Target(name, f"{base}/embed", lambda s: {"sentences": [s], "output": output, "encoding": "base64"})


def layers_target(name: str, base: str, encoding: str) -> Target:
    """Every layer of each token (what a tagger wants), in ``encoding``: float (JSON), base64 or binary."""
    return Target(name, f"{base}/embed", lambda s: {"sentences": [s], "output": "layers", "encoding": encoding})


def mlflow_target(base: str) -> Target:
    return Target(
        "mlflow models serve",
        f"{base}/invocations",
        lambda s: {"dataframe_records": [{"sentence": " ".join(s)}], "params": {"pooled": True}},
    )


def cpu_seconds(pid: int | None) -> dict[str, float]:
    """CPU seconds so far (user + system) of this process (the clients), and of the server's processes: the one
    given (HTTP) and its children (the model processes), so that a row says where the two cores went."""

    def used(process: psutil.Process) -> float:
        times = process.cpu_times()
        return times.user + times.system

    seconds = {"clients": used(psutil.Process())}
    if pid is not None:
        try:
            root = psutil.Process(pid)
            seconds["http"] = used(root)
            seconds["model"] = sum(used(child) for child in root.children(recursive=True))
        except psutil.Error:
            pass
    return seconds


async def closed_loop(
    target: Target, sentences: list[list[str]], clients: int, seconds: float, server_pid: int | None = None
) -> dict:
    """``clients`` clients, each sending its next sentence when the last is answered; the CPU each side used while
    measured (``cpu``: seconds per second of the run, by process)."""
    latencies: list[float] = []
    statuses: dict[int | str, int] = {}
    tokens = 0
    counter = iter(range(10**9))
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=clients), timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    ) as client:

        async def one(measure: bool) -> None:
            nonlocal tokens
            sentence = sentences[next(counter) % len(sentences)]
            started = time.perf_counter()
            try:
                async with client.post(target.url, json=target.body(sentence)) as answer:
                    await answer.read()
                    status = answer.status
            except (TimeoutError, aiohttp.ClientError) as exc:  # no answer: say which kind
                status = type(exc).__name__
            if measure:
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    latencies.append(time.perf_counter() - started)
                    tokens += len(sentence)

        async def client_loop(until: float, measure: bool) -> None:
            while time.perf_counter() < until:
                await one(measure)

        warm = time.perf_counter() + min(2.0, seconds / 4)
        await asyncio.gather(*(client_loop(warm, False) for _ in range(clients)))
        cpu_before = cpu_seconds(server_pid)
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(started + seconds, True) for _ in range(clients)))
        elapsed = time.perf_counter() - started
        cpu_after = cpu_seconds(server_pid)
    q = np.percentile(latencies, [50, 95, 99]) * 1000 if latencies else [float("nan")] * 3
    return {
        "tokens_per_s": tokens / elapsed,
        "requests_per_s": len(latencies) / elapsed,
        "p50": q[0],
        "p95": q[1],
        "p99": q[2],
        "errors": {k: v for k, v in statuses.items() if k != 200},
        "cpu": {k: (cpu_after[k] - cpu_before[k]) / elapsed for k in cpu_after if k in cpu_before},
    }


async def burst(
    target: Target, sentences: list[list[str]], rate: float, seconds: float, pid: int, connections: int
) -> dict:
    """Requests fired at ``rate`` per second for ``seconds``, whatever the answers, over at most ``connections``
    connections at once (a request waits for one inside its 60 s, as behind a load balancer's per-replica cap);
    the server's RSS sampled."""
    statuses: dict[str, int] = {}
    peak = [tree_rss(pid)]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(pid))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections), timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    ) as client:

        async def one(sentence: list[str]) -> None:
            try:
                async with client.post(target.url, json=target.body(sentence)) as answer:
                    await answer.read()
                    key = str(answer.status)
            except TimeoutError:
                key = "hung (no answer in 60 s)"
            except aiohttp.ClientError as exc:
                key = f"lost ({type(exc).__name__})"
            statuses[key] = statuses.get(key, 0) + 1

        tasks = []
        started = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = started + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(sentences[i % len(sentences)])))
        await asyncio.gather(*tasks)
    done.set()
    sampler.join()
    return {"sent": n, "statuses": statuses, "peak_rss": peak[0]}


def ceiling(model_dir: Path, sentences: list[list[str]], precision: str, threads: int, repeats: int = 3) -> float:
    """The batch job's throughput on the same sentences: ``embed_sentences`` over all of them at once."""
    torch.set_num_threads(threads)
    bilm = BiLM.from_pretrained(str(model_dir), precision=precision)
    bilm.embed_sentences(sentences[:64])
    tokens = sum(len(s) for s in sentences)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        bilm.embed_sentences(sentences)
        best = min(best, time.perf_counter() - started)
    return tokens / best


def embedder_batches(
    model_dir: Path, sentences: list[list[str]], precision: str, threads: int, size: int = 64
) -> float:
    """The drop-in's throughput on the same sentences: ``ElmoEmbedder.embed_batch`` of ``size`` at a time, in order
    (what issue 65 sets the server beside: a user's loop over its batches), its word cache warm from a first round."""
    from elmo_core.allennlp import ElmoEmbedder

    torch.set_num_threads(threads)
    embedder = ElmoEmbedder(str(model_dir / "options.json"), str(model_dir / "weights.hdf5"), precision=precision)
    batches = [[sentences[(i + j) % len(sentences)] for j in range(size)] for i in range(0, 20 * size, size)]
    for batch in batches:
        embedder.embed_batch(batch)
    started = time.perf_counter()
    for batch in batches:
        embedder.embed_batch(batch)
    return sum(len(s) for b in batches for s in b) / (time.perf_counter() - started)


def start_serve(model_dir: Path, precision: str, log: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-m", "elmo_core.cli", "serve", str(model_dir), "--port", str(port)]
    command += ["--precision", precision, *flags]
    env = {**os.environ, **SERVER_ENV}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    wait_for(f"http://127.0.0.1:{port}/ready", process)
    return process, f"http://127.0.0.1:{port}"


def start_mlflow(model_dir: Path, work: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """The same model logged as the pyfunc model training logs, served by ``mlflow models serve``."""
    from elmo_core.tracking import MLflowTracker

    uri = f"sqlite:///{work / 'mlflow.db'}"
    tracker = MLflowTracker(experiment="serve-bench", tracking_uri=uri)
    model_uri = tracker.log_model_dir(model_dir, None)
    tracker.close()
    port = free_port()
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"  # it runs `uvicorn` from PATH
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_DISABLE_TELEMETRY": "true", "PATH": path}
    command = [sys.executable, "-m", "mlflow", "models", "serve", "-m", model_uri, "-p", str(port)]
    command += ["--env-manager", "local", "--workers", "1"]
    process = subprocess.Popen(
        command, cwd=work, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )
    wait_for(f"http://127.0.0.1:{port}/ping", process)
    return process, f"http://127.0.0.1:{port}"


def row(name: str, clients: int, result: dict, batch_job: float) -> str:
    errors = ", ".join(f"{k}: {v}" for k, v in result["errors"].items()) or "-"
    cpu = " ".join(f"{k} {v:.2f}" for k, v in result["cpu"].items())
    return (
        f"{name:<28}{clients:>5}{result['tokens_per_s']:>11,.0f}{result['tokens_per_s'] / batch_job:>9.2f}"
        f"{result['p50']:>9.1f}{result['p95']:>9.1f}{result['p99']:>9.1f}  {errors}  cores: {cpu}"
    )


def server_figures(base: str) -> str:
    """What the server's /metrics say of the run: batch sizes, a batch's time in the model process, word cache."""
    values = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if not line.startswith("#") and "{" not in name:
            values[name] = float(value)
    batches = max(values["elmo_batch_tokens_count"], 1)
    return (
        f"  server: {values['elmo_batch_tokens_count']:,.0f} batches, mean {values['elmo_batch_requests_sum'] / batches:.1f} "
        f"requests / {values['elmo_batch_tokens_sum'] / batches:.0f} tokens, {1000 * values['elmo_batch_seconds_sum'] / batches:.0f} ms "
        f"in the model process; words through the char CNN {values['elmo_new_words_total']:,.0f} of "
        f"{values['elmo_words_total']:,.0f} distinct per batch (the rest kept from earlier batches)"
    )


def worker_alone(model_dir: Path, sentences: list[list[str]], size: int, precision: str, rounds: int = 20) -> float:
    """What the model process does alone with random batches of ``size`` sentences (its word cache warm): the most
    a server can give when C clients make batches of about C/2."""
    import random

    from elmo_core.runtime import place, resolve_model
    from elmo_core.serve.api import Batch, Output
    from elmo_core.serve.compute import BatchEmbedder

    placed = place("cpu", precision)  # as `elmo serve` places it before it binds, once
    embedder = BatchEmbedder(
        resolve_model(str(model_dir)).pinned(), placed.device, placed.precision, placed.precision.why, 4096
    )
    rng = random.Random(0)
    batches = [rng.choices(sentences, k=size) for _ in range(rounds)]
    for batch in batches:
        embedder.run(Batch(0, batch, [0] * size, [Output("mean", encoding="base64")]))
    started = time.perf_counter()
    for batch in batches:
        embedder.run(Batch(0, batch, [0] * size, [Output("mean", encoding="base64")]))
    return sum(len(s) for b in batches for s in b) / (time.perf_counter() - started)


def check_answer(base: str, model_dir: Path, sentence: list[str]) -> float:
    """|served - lone embed_sentences| of one sentence's token vectors (fp32: within 1e-6)."""
    answer = httpx.post(f"{base}/embed", json={"sentences": [sentence], "output": "layers", "encoding": "base64"})
    item = answer.json()["data"][0]
    served = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").reshape(item["shape"])
    lone = BiLM.from_pretrained(str(model_dir)).embed_sentences([sentence])[0]
    return float(np.abs(served - lone).max())


def replicas_run(model_dir: Path, work: Path, sentences: list[list[str]], args: argparse.Namespace) -> None:
    """``--replicas N``: the servers behind HAProxy through a rolling restart and a kill, under closed-loop load."""
    from replicas import Balancer, Load, Replica, core_shares, roll_and_kill

    flags = ["--precision", args.precision]
    shares = core_shares(args.replicas)
    replicas = [
        Replica(f"elmo{i}", model_dir, work / f"elmo{i}.log", flags, cores=cores) for i, cores in enumerate(shares, 1)
    ]
    balancer = Balancer(replicas, work)
    bodies = [{"sentences": [s], "output": "mean", "encoding": "base64"} for s in sentences]
    pinned = ", ".join(f"{r.name} on cores {sorted(r.cores)}" for r in replicas if r.cores) or "not pinned"
    print(f"{args.replicas} replicas behind haproxy ({pinned}), {args.replica_clients} clients (httpx, asyncio)")
    started = time.monotonic()
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready(300)
        balancer.start()
        for replica in replicas:
            balancer.wait_state(replica.name, "UP")
        load = Load(f"{balancer.url}/embed", bodies, clients=args.replica_clients, keep_answers=False).start()
        try:
            time.sleep(args.seconds)
            roll_and_kill(
                replicas, balancer, load, say=lambda line: print(f"  {time.monotonic() - started:6.1f} s  {line}")
            )
            load.mark("all back")
            time.sleep(args.seconds)
        finally:
            outcomes = load.stop()
        stats = balancer.stats()
    finally:
        balancer.close()
        for replica in replicas:
            replica.close()
    times = dict((what, t) for t, what in load.marks)
    first = next(t for t, what in load.marks if what.startswith("SIGTERM"))
    phases = [("before", times["load starts"], first), ("through", first, times["all back"])]
    phases.append(("after", times["all back"], times["load stops"]))
    print(f"{'phase':<9}{'seconds':>9}{'answered':>10}{'tok/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
    for name, start, end in phases:
        done = [o for o in outcomes if o.status == 200 and start <= o.ended < end]
        tokens = sum(len(sentences[o.index % len(sentences)]) for o in done)
        q = np.percentile([o.ended - o.started for o in done], [50, 99]) * 1000 if done else [float("nan")] * 2
        print(f"{name:<9}{end - start:>9.1f}{len(done):>10,}{tokens / (end - start):>9,.0f}{q[0]:>9.1f}{q[1]:>9.1f}")
    lost: dict[str, int] = {}
    for o in outcomes:
        if o.status != 200:
            lost[str(o.status)] = lost.get(str(o.status), 0) + 1
    retried = sum(o.attempts > 1 for o in outcomes)
    backend = stats["BACKEND"]
    per_replica = ", ".join(f"{r.name} {int(stats[r.name]['hrsp_2xx'] or 0):,}" for r in replicas)
    print(
        f"requests {len(outcomes):,}, lost {sum(lost.values())}{f' {lost}' if lost else ''}; sent again by the clients (429/503): "
        f"{retried}; by haproxy: {backend['wretr'] or 0} retries, {backend['wredis'] or 0} redispatched; "
        f"answered 200 per replica: {per_replica}"
    )
    zero = times["load starts"]
    print("events: " + ", ".join(f"{t - zero:.1f} s {what}" for t, what in load.marks))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="small")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", default="1,8,64,256")
    parser.add_argument("--burst-seconds", type=float, default=30.0)
    parser.add_argument(
        "--burst-connections",
        type=int,
        default=2048,
        help="the burst's connections open at once at most (0: no cap; each holds a file descriptor on both sides)",
    )
    parser.add_argument("--sentences", type=int, default=3000, help="the pool of real sentences requests cycle over")
    parser.add_argument(
        "--baseline",
        choices=["embed_sentences", "embedder"],
        default="embed_sentences",
        help="x batch against embed_sentences over the whole pool, or ElmoEmbedder.embed_batch of 64 (issue 65)",
    )
    parser.add_argument(
        "--server-env", action="append", default=[], help="KEY=VALUE in the servers' environment alone (repeatable)"
    )
    parser.add_argument("--skip", default="", help="any of mlflow, off, burst, synthetic, onnx")
    parser.add_argument(
        "--token-encodings", default="float,base64,binary", help="every layer per token at the top concurrency, as"
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="N: instead, N servers behind deploy/haproxy.cfg through a rolling restart and a kill -9",
    )
    parser.add_argument("--replica-clients", type=int, default=64, help="--replicas' closed-loop clients")
    args = parser.parse_args()
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)  # burst: sockets
    SERVER_ENV.update(item.split("=", 1) for item in args.server_env)
    skip = set(filter(None, args.skip.split(",")))
    levels = [int(c) for c in args.concurrency.split(",")]
    threads = torch.get_num_threads()
    real = real_sentences(args.sentences)
    synthetic = make_sentences(args.sentences)
    lengths = sorted(len(s) for s in real)
    print(describe_machine())
    print(
        f"shape {args.shape}, precision {args.precision}; {len(real)} real sentences, lengths {lengths[0]}-{lengths[-1]} "
        f"(median {lengths[len(lengths) // 2]}, 99th percentile {lengths[int(len(lengths) * 0.99)]}); "
        f"{args.seconds:.0f} s per row after a warm-up"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        torch.manual_seed(0)
        model_dir = work / "model"
        fresh = BiLM(preset(args.shape))
        init_bilm_tf(fresh)
        fresh.save_pretrained(str(model_dir))
        del fresh
        if args.replicas:
            replicas_run(model_dir, work, real, args)
            return
        batch_job = ceiling(model_dir, real, args.precision, threads)
        batch_job_synthetic = ceiling(model_dir, synthetic, args.precision, threads)
        print(
            f"batch job ceiling (embed_sentences, {threads} threads): real {batch_job:,.0f} tok/s, synthetic "
            f"{batch_job_synthetic:,.0f} tok/s"
        )
        if args.baseline == "embedder":  # the rows' "x batch" against the drop-in
            batch_job = embedder_batches(model_dir, real, args.precision, threads)
            print(f"ElmoEmbedder.embed_batch of 64 ({threads} threads): {batch_job:,.0f} tok/s (the x batch below)")
        for clients in levels:
            size = max(1, clients // 2)
            rate = worker_alone(model_dir, real, size, args.precision)
            print(
                f"model process alone, random batches of {size} real sentences: {rate:,.0f} tok/s ({rate / batch_job:.2f}x)"
            )
        header = f"{'server':<28}{'C':>5}{'tok/s':>11}{'x batch':>9}{'p50 ms':>9}{'p95 ms':>9}{'p99 ms':>9}  non-200"
        print(header)
        print("-" * len(header))
        results: dict[tuple[str, int], dict] = {}

        server_pid: int | None = None  # the server measured now: its processes' CPU goes in each row

        def run(target: Target, clients: int, sentences: list[list[str]], ceiling_: float, label: str = "") -> dict:
            result = asyncio.run(closed_loop(target, sentences, clients, args.seconds, server_pid))
            results[(target.name + label, clients)] = result
            print(row(target.name + label, clients, result, ceiling_), flush=True)
            return result

        server, base = start_serve(model_dir, args.precision, work / "serve.log")
        server_pid = server.pid
        try:
            if args.precision == "fp32":
                print(
                    f"  answer check: max |served - lone embed_sentences| = {check_answer(base, model_dir, real[0]):.2e}"
                )
            target = serve_target("elmo serve", base)
            for clients in levels:
                run(target, clients, real, batch_job)
            top = max(levels)
            run(serve_target("elmo serve, token vectors", base, "mix"), top, real, batch_job)
            for encoding in [
                e for e in args.token_encodings.split(",") if e
            ]:  # every layer, per token, as a tagger asks
                run(layers_target(f"elmo serve, layers as {encoding}", base, encoding), top, real, batch_job)
            if "synthetic" not in skip:
                run(target, top, synthetic, batch_job_synthetic, " (synthetic)")
            print(server_figures(base))
            if "burst" not in skip:
                capacity = results[("elmo serve", top)]["requests_per_s"]
                idle = tree_rss(server.pid)
                outcome = asyncio.run(
                    burst(target, real, 4 * capacity, args.burst_seconds, server.pid, args.burst_connections)
                )
                lost = {k: v for k, v in outcome["statuses"].items() if k not in ("200", "429")}
                print(
                    f"burst: {outcome['sent']:,} requests at {4 * capacity:,.0f}/s (4x capacity) for "
                    f"{args.burst_seconds:.0f} s: {outcome['statuses']}; lost or hung: {sum(lost.values())}; "
                    f"RSS idle {idle / 2**20:,.0f} MiB, peak {outcome['peak_rss'] / 2**20:,.0f} MiB "
                    f"({outcome['peak_rss'] / idle:.2f}x)"
                )
        finally:
            stop(server)
        if "off" not in skip:
            server, base = start_serve(model_dir, args.precision, work / "serve-off.log", "--no-batching")
            server_pid = server.pid
            try:
                for clients in levels:
                    run(serve_target("elmo serve, batching off", base), clients, real, batch_job)
            finally:
                stop(server)
        if "onnx" not in skip and args.precision == "fp32":  # the torch-free server on `elmo onnx`'s file
            from elmo_core.options import OnnxConfig
            from elmo_core.runtime.onnx_file import export_onnx

            export_onnx(OnnxConfig(model=str(model_dir), out=str(work / "model.onnx")))
            server, base = start_serve(work / "model.onnx", "fp32", work / "serve-onnx.log")
            server_pid = server.pid
            try:
                for clients in levels:
                    run(serve_target("elmo serve FILE.onnx", base), clients, real, batch_job)
                top = max(levels)
                for encoding in [e for e in args.token_encodings.split(",") if e]:
                    run(layers_target(f"FILE.onnx, layers as {encoding}", base, encoding), top, real, batch_job)
            finally:
                stop(server)
        if "mlflow" not in skip:
            server, base = start_mlflow(model_dir, work, work / "mlflow.log")
            server_pid = server.pid
            try:
                for clients in levels:
                    run(mlflow_target(base), clients, real, batch_job)
            finally:
                stop(server)
        print(json.dumps({f"{k[0]} @ {k[1]}": round(v["tokens_per_s"]) for k, v in results.items()}))


if __name__ == "__main__":
    main()

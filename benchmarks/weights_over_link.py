"""Weight sync of the real policy from a learner on one test host to a replica on another,
over a 1 and a 10 Gbit/s link, against a plain TCP transfer of the same bytes on that link.

    .venv/bin/python benchmarks/weights_over_link.py           # full run, ~5 min on 2 cores
    .venv/bin/python benchmarks/weights_over_link.py --quick   # 10M synthetic, 2 repeats, <1 min
    .venv/bin/python benchmarks/weights_over_link.py --render docs/benchmarks/weights_over_link.json

The hosts are network namespaces on this machine (:class:`asyncrl.testbed.TestBed`, needs
root): host a (10.77.0.1) runs learner rank 0's publish side, host b (10.77.0.2) one
replica. Each is a process that enters its host's namespace (``setns``) before it opens
a socket; the paths are driven exactly as ``weights_publish.py`` drives them
(``weights_paths.py``: the path's sink built as ``learner_sink`` builds it, the replica
syncing with the path's ``WeightSource.sync_into`` into a module of the policy's
shapes). Per link (plain veth, then ``tbf`` on b's cable at 1 and at 10 Gbit/s,
``TestBed.limit``) and per path:

- ``zmq``: the learner's ZeroMQ publisher listening on 10.77.0.1 with CURVE, as a run
  must beyond loopback (``cluster.bind`` not loopback forces it; keys from
  ``asyncrl.core.security.generate_keys``), the replica connecting as a generator;
- ``zmq (no CURVE)``: the same without authentication (what ``weights_publish.py``
  measures on loopback; a run cannot do this across hosts): the cost of CURVE;
- ``collective``: the shm sink with the gloo broadcast beside it, group store on
  10.77.0.1, the replica's gloo pair on 10.77.0.2 (signed messages, as a run; gloo's
  bytes are not encrypted). shm cannot cross hosts, so it is not measured.

"publish to loaded": from the learner's ``publish`` call to the replica's tensors
loaded, the replica already waiting (``time.monotonic``, one clock for every process on
Linux, whatever its network namespace); the median, min and max of ``--repeats``
publishes after ``--warmups`` untimed ones (the replica's loaded bytes are checked
against the learner's by crc32 after the first and the last of those). Gbit/s = bytes
x 8 / seconds; "x raw TCP" = that time over the link's own: one TCP connection from a
to b, ``sendall`` of a buffer of the same size, timed from the sender's call to the
receiver's last byte (the median of ``--repeats`` transfers before the paths and as
many after, each after one untimed one).

Writes ``docs/benchmarks/weights_over_link.json`` (``--quick``: the temp folder) and
prints the markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # (benchmarks/ is not a package: found on sys.path)
from weights_paths import Replicas, enter_netns, measure_path, trim_memory

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from asyncrl.config import ClusterConfig

JSON_OUT = common.REPO / "docs" / "benchmarks" / "weights_over_link.json"
REAL = "SmolLM2-135M"
LINKS: tuple[tuple[str, str | None], ...] = (
    ("veth (no limit)", None),
    ("1 Gbit/s", "1gbit"),
    ("10 Gbit/s", "10gbit"),
)
PATHS: dict[str, tuple[str, bool]] = {
    "zmq": ("zmq", True),
    "zmq (no CURVE)": ("zmq", False),
    "collective": ("collective", False),
}
"""The measured rows: name -> (the path of ``weights_paths``, with the run's CURVE keys)."""
REPLY_S = 1800.0
"""The longest the benchmark waits for one measurement before it gives up."""
RECV_BYTES = 4 << 20


# --------------------------------------------------------------------------
# the learner's side, on host a


def load_model(name: str) -> dict:
    """The tensors the learner publishes: the real policy's, or a synthetic model's."""
    import weights_publish

    if name == REAL:
        return weights_publish.real_params()
    return weights_publish.build_model(*weights_publish.SIZES[name])


def learner_main(conn: Connection, netns: str, replica_netns: str, settings: dict) -> None:
    """Learner rank 0's side on host ``netns``, with one replica on ``replica_netns``:
    answers ``(row, host)`` with that row's :func:`measure_path` result; None ends it."""
    import torch

    enter_netns(netns)
    torch.set_num_threads(settings["threads"])
    params = load_model(settings["model"])
    replicas = Replicas(1, netns=replica_netns)
    try:
        shapes = [(n, tuple(t.shape), t.dtype) for n, t in params.items()]
        replicas.ask(1, ("model", shapes))
        nbytes = sum(t.numel() * t.element_size() for t in params.values())
        count = sum(t.numel() for t in params.values())
        conn.send(("ready", {"bytes": nbytes, "params": count, "tensors": len(params)}))
        version = 0
        while (command := conn.recv()) is not None:
            row, host = command
            path, curve = PATHS[row]
            try:
                result, version = measure_path(
                    path,
                    params,
                    replicas,
                    [1],
                    repeats=settings["repeats"],
                    warmups=settings["warmups"],
                    version=version,
                    bucket_bytes=settings["bucket_bytes"],
                    chunk_bytes=settings["chunk_bytes"],
                    host=host,
                    cluster=settings["cluster"] if curve else None,
                )
                conn.send(("ok", result))
            except Exception:
                conn.send(("error", traceback.format_exc()))
            trim_memory()
    finally:
        replicas.close()


class Learner:
    """The learner's process on host a, driven over a pipe."""

    def __init__(self, netns: str, replica_netns: str, settings: dict):
        spawn = mp.get_context("spawn")
        self.conn, theirs = spawn.Pipe()
        # not a daemon: it spawns the replica
        self.process = spawn.Process(
            target=learner_main, args=(theirs, netns, replica_netns, settings), name="learner"
        )
        self.process.start()
        theirs.close()
        kind, self.model = self._reply()
        if kind != "ready":
            raise RuntimeError(f"the learner did not start: {self.model}")

    def _reply(self) -> tuple[str, object]:
        if not self.conn.poll(REPLY_S):
            raise TimeoutError(f"the learner gave no answer in {REPLY_S:.0f}s")
        return self.conn.recv()

    def measure(self, row: str, host: str) -> dict:
        self.conn.send((row, host))
        kind, reply = self._reply()
        if kind != "ok":
            raise RuntimeError(f"{row}: {reply}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.process.join(timeout=60)
        if self.process.is_alive():  # ours: ended by its own handle
            self.process.kill()
            self.process.join(timeout=10)


# --------------------------------------------------------------------------
# the link's own rate: one TCP connection, the same bytes


def tcp_receiver(conn: Connection, netns: str, address: str, nbytes: int, rounds: int) -> None:
    """On host b: accept one connection, receive ``nbytes`` ``rounds`` times (acking each
    with one byte); sends the port, then the moment each round's last byte arrived."""
    enter_netns(netns)
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    with socket.create_server((address, 0)) as server:
        conn.send(server.getsockname()[1])
        peer, _ = server.accept()
        ends = []
        with peer:
            for _ in range(rounds):
                got = 0
                while got < nbytes:
                    received = peer.recv_into(view[got:], min(RECV_BYTES, nbytes - got))
                    if not received:
                        raise ConnectionError(f"the sender left after {got} of {nbytes} bytes")
                    got += received
                ends.append(time.monotonic())
                peer.sendall(b"k")
    conn.send(ends)


def tcp_sender(conn: Connection, netns: str, address: str, port: int, nbytes: int, rounds: int):
    """On host a: connect to ``address:port`` and ``sendall`` ``nbytes`` ``rounds`` times,
    each after the previous one's ack; sends the moment each ``sendall`` began."""
    enter_netns(netns)
    data = b"\xa5" * nbytes  # real pages, not the zero page a fresh buffer maps
    starts = []
    with socket.create_connection((address, port), timeout=REPLY_S) as peer:
        for _ in range(rounds):
            starts.append(time.monotonic())
            peer.sendall(data)
            if peer.recv(1) != b"k":
                raise ConnectionError("the receiver did not ack")
    conn.send(starts)


def raw_tcp(a, b, nbytes: int, repeats: int) -> list[float]:
    """Seconds of ``repeats`` TCP transfers of ``nbytes`` from host ``a`` to host ``b``
    (after one untimed)."""
    spawn = mp.get_context("spawn")
    rounds = repeats + 1
    ours_b, theirs_b = spawn.Pipe()
    ours_a, theirs_a = spawn.Pipe()
    receiver = spawn.Process(
        target=tcp_receiver, args=(theirs_b, b.netns, b.address, nbytes, rounds), daemon=True
    )
    receiver.start()
    sender = None
    try:
        if not ours_b.poll(60):
            raise TimeoutError("the TCP receiver did not start")
        port = ours_b.recv()
        sender = spawn.Process(
            target=tcp_sender, args=(theirs_a, a.netns, b.address, port, nbytes, rounds),
            daemon=True,
        )  # fmt: skip
        sender.start()
        if not ours_a.poll(REPLY_S) or not ours_b.poll(REPLY_S):
            raise TimeoutError("the TCP transfer did not finish")
        starts, ends = ours_a.recv(), ours_b.recv()
    finally:
        for process in (receiver, sender):
            if process is None:
                continue
            process.join(timeout=30)
            if process.is_alive():  # ours: ended by its own handle
                process.kill()
    return [end - start for start, end in zip(starts, ends, strict=True)][1:]


# --------------------------------------------------------------------------
# the run


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes * 8 / seconds / 1e9


def summary(times: list[float], nbytes: int) -> dict:
    median = statistics.median(times)
    return {
        "times_s": times,
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "gbps": gbps(nbytes, median),
    }


def machine() -> dict:
    import zmq

    return common.machine_info() | {
        "kernel": platform.release(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "curve": zmq.has("curve"),
        "loadavg_start": common.loadavg(),
    }


def run(args: argparse.Namespace) -> dict:
    from asyncrl.config import ClusterConfig
    from asyncrl.core.security import generate_keys
    from asyncrl.testbed.hosts import TestBed, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot make test hosts here: {reason}")
    rows = args.paths.split(",")
    report: dict = {
        "command": " ".join([".venv/bin/python", "benchmarks/weights_over_link.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "config": {
            "model": args.model,
            "repeats": args.repeats,
            "warmups": args.warmups,
            "chunk_bytes": args.chunk_mib << 20,
            "bucket_bytes": args.bucket_mib << 20,
            "learner_threads": args.threads,
            "paths": rows,
        },
        "links": [],
    }
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="asyncrl-link-"))
    try:
        with TestBed(("a", "b")) as bed:
            a, b = bed["a"], bed["b"]
            cluster: ClusterConfig = ClusterConfig(
                host=a.address, keys_dir=str(generate_keys(work))
            )
            assert cluster.uses_curve  # beyond loopback a run has no choice
            settings = {
                "model": args.model,
                "threads": args.threads,
                "repeats": args.repeats,
                "warmups": args.warmups,
                "bucket_bytes": args.bucket_mib << 20,
                "chunk_bytes": args.chunk_mib << 20,
                "cluster": cluster,
            }
            learner = Learner(a.netns, b.netns, settings)
            try:
                report["model"] = {"name": args.model, **learner.model}
                nbytes = report["model"]["bytes"]
                print(
                    f"[{args.model}] {nbytes / 1e9:.3f} GB, {a.name} {a.address} -> "
                    f"{b.name} {b.address}",
                    flush=True,
                )
                for label, rate in LINKS:
                    bed.limit("b", rate)
                    link: dict = {"link": label, "tbf_rate": rate, "paths": {}}
                    before = raw_tcp(a, b, nbytes, args.repeats)
                    for row in rows:
                        result = learner.measure(row, a.address)
                        times = [r["loaded_s"] for r in result["replicas_1"]["runs"]]
                        link["paths"][row] = summary(times, nbytes) | {
                            "curve": PATHS[row][1],
                            "result": result,
                        }
                    after = raw_tcp(a, b, nbytes, args.repeats)
                    link["raw_tcp"] = summary(before + after, nbytes) | {
                        "before_median_s": statistics.median(before),
                        "after_median_s": statistics.median(after),
                    }
                    raw = link["raw_tcp"]["median_s"]
                    for path in link["paths"].values():
                        path["x_raw_tcp"] = path["median_s"] / raw
                    print(f"  {label}: raw TCP {raw:.3f}s ({gbps(nbytes, raw):.2f} Gbit/s)", end="")
                    for row, path in link["paths"].items():
                        print(f", {row} {path['median_s']:.3f}s", end="")
                    print(flush=True)
                    report["links"].append(link)
            finally:
                learner.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["wall_s"] = time.monotonic() - began
    report["machine"]["loadavg_end"] = common.loadavg()
    return report


# --------------------------------------------------------------------------
# the markdown


def markdown(report: dict) -> str:
    m, cfg, model = report["machine"], report["config"], report["model"]
    nbytes = model["bytes"]
    lines = [
        f"Machine: {m['cpu']}, {m['nproc']} cores, {m['memory_gib']} GiB, kernel "
        f"{m['kernel']} (load average {m['loadavg_start'][0]:.1f} at the start, "
        f"{m.get('loadavg_end', [float('nan')])[0]:.1f} at the end); Python {m['python']}, "
        f"torch {m['torch']}, pyzmq {m['pyzmq']} / libzmq {m['libzmq']}. Two test hosts "
        f"(network namespaces on a private bridge, `asyncrl.testbed`) on the same "
        f"{m['nproc']} cores: the learner's publish side on a (10.77.0.1), one replica on "
        f"b (10.77.0.2); the links are plain veth, or `tbf` on both ends of b's cable.",
        "",
        f"Command: `{report['command']}` ({report['date']}, {report['wall_s']:.0f} s). "
        f"{model['name']}: {model['tensors']} tensors, {nbytes:,} bytes "
        f"({nbytes / 1e9:.3f} GB) per sync. zmq chunks of {cfg['chunk_bytes'] >> 20} MiB, "
        f"collective buckets of {cfg['bucket_bytes'] >> 20} MiB; medians (min to max) of "
        f"{cfg['repeats']} publishes after {cfg['warmups']} untimed "
        f"{'one' if cfg['warmups'] == 1 else 'ones'}, the replica's loaded bytes checked by "
        f"crc32 against the learner's after the first and the last untimed publish. Raw TCP: "
        f"one connection, `sendall` of "
        f"the same number of bytes from a to b, timed to the receiver's last byte "
        f"({cfg['repeats']} transfers before the paths and {cfg['repeats']} after).",
        "",
        "| link | path | publish to loaded, median (min to max) | Gbit/s | x raw TCP |",
        "|---|---|---|---|---|",
    ]
    for link in report["links"]:
        raw = link["raw_tcp"]
        lines.append(
            f"| {link['link']} | raw TCP (the link) | {raw['median_s']:.3f} s "
            f"({raw['min_s']:.3f} to {raw['max_s']:.3f}) | {raw['gbps']:.2f} | 1 |"
        )
        for row, path in link["paths"].items():
            lines.append(
                f"|  | {row} | {path['median_s']:.3f} s ({path['min_s']:.3f} to "
                f"{path['max_s']:.3f}) | {path['gbps']:.2f} | **{path['x_raw_tcp']:.2f}** |"
            )
    return "\n".join(lines + notes(report)) + "\n"


def notes(report: dict) -> list[str]:
    """What the table says, from this run's figures."""
    nbytes = report["model"]["bytes"]
    lines = ["", "Notes:", ""]
    for link in report["links"]:
        rate = link["tbf_rate"]
        raw = link["raw_tcp"]
        if rate is None:
            lines.append(
                f"- Plain veth: the raw TCP transfer reaches {raw['gbps']:.2f} Gbit/s, a "
                f"limit of this machine's cores (the kernel copies every byte on both ends) "
                f"rather than of a cable."
            )
            continue
        limit = float(rate.removesuffix("gbit"))
        if raw["gbps"] < 0.9 * limit:
            lines.append(
                f"- {link['link']}: `tbf rate {rate}` is not reached here: the raw TCP "
                f"transfer gets {raw['gbps']:.2f} Gbit/s ({raw['gbps'] / limit:.0%} of the "
                f"limit), so this row measures this machine's cores, not a {link['link']} "
                f"link."
            )
        else:
            lines.append(
                f"- {link['link']}: the raw TCP transfer gets {raw['gbps']:.2f} Gbit/s "
                f"({raw['gbps'] / limit:.0%} of the `tbf` rate)."
            )
    for link in report["links"]:
        plain, curve = link["paths"].get("zmq (no CURVE)"), link["paths"].get("zmq")
        if plain and curve:
            lines.append(
                f"- {link['link']}: CURVE costs zmq {curve['median_s'] / plain['median_s']:.2f}x "
                f"the time without it ({gbps(nbytes, curve['median_s']):.2f} against "
                f"{gbps(nbytes, plain['median_s']):.2f} Gbit/s)."
            )
    lines.append(
        "- zmq is measured with CURVE because a run must use it beyond loopback "
        "(`cluster.bind` not loopback forces `cluster.curve`); `zmq (no CURVE)` is the same "
        "path without authentication, as `weights_publish.py` runs it on loopback, to show "
        "what the encryption costs. The collective path's messages are signed, its gloo "
        "bytes are not encrypted."
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10M synthetic, 2 repeats")
    parser.add_argument("--model", default=REAL, help=f"{REAL}, or a synthetic size: 10M, 100M")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"of: {', '.join(PATHS)}")
    parser.add_argument("--repeats", type=int, default=5, help="timed publishes (and transfers)")
    parser.add_argument("--warmups", type=int, default=2, help="untimed publishes first")
    parser.add_argument("--chunk-mib", type=int, default=None, help="zmq chunk (default: a run's)")
    parser.add_argument("--bucket-mib", type=int, default=64, help="weights.bucket_bytes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the learner")
    parser.add_argument("--json", default=None, help=f"results file (default {JSON_OUT})")
    parser.add_argument("--render", default=None, help="print the markdown of a results file")
    args = parser.parse_args()
    if args.render:
        print(markdown(json.loads(Path(args.render).read_text())), end="")
        return
    if args.chunk_mib is None:
        from asyncrl.weights import DEFAULT_CHUNK_BYTES

        args.chunk_mib = DEFAULT_CHUNK_BYTES >> 20
    unknown = set(args.paths.split(",")) - set(PATHS)
    if unknown:
        parser.error(f"unknown paths {sorted(unknown)}: of {', '.join(PATHS)}")
    if args.quick:
        args.model, args.repeats, args.warmups = "10M", 2, 1
    default = Path(tempfile.gettempdir()) / JSON_OUT.name if args.quick else JSON_OUT
    json_path = Path(args.json) if args.json else default
    report = run(args)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    print("\n" + markdown(report), end="")
    print(f"\nwrote {json_path}")


if __name__ == "__main__":
    main()

"""Chaos: mixed load on the default server while its vLLM engines are killed one at a time.

``make serve``'s server (every demo mode on vLLM's engines) gets ``--clients`` clients sending a mix of requests
for ``--baseline-minutes`` and then ``--minutes``: plain completions, streamed chats, requests pinned to a random
mode, bad requests (expected 400) and streams the client drops after their first chunk. The first span is the
baseline: no kills. Then every ``--kill-every`` seconds one engine that is up gets SIGKILL on its engine-core
process (an engine is one process); the policy is reloaded once, half-way.

Every request ends in exactly one counted outcome (:func:`stream_outcome`, :func:`failure_outcome`): ``ok``;
``http_<status> <code>``; ``error_event`` (a stream that ended with an error event: a 500 sent inside the stream);
``truncated`` (a stream that ended, or whose connection broke, before ``[DONE]``); ``stranded`` (no response
headers within ``--timeout``); ``stalled`` (headers, then nothing for ``--timeout``); ``hung`` (a client thread
still inside its request after the load stopped and its join timed out); ``connection_error``; ``dropped`` (the
streams the client drops on purpose). Each request is attributed to the replica and engine that served or failed
it (the ``X-ModeSwitch-Replica`` header, the engine its mode runs on in that replica's ``/v1/modes``, the engines
of the modes it failed on, an error naming a dead engine).

Per kill: seconds until the server reports the death, until the engine is up again, and the requests that were
on that engine of that replica when it died, by outcome (``retried``: failed there and answered by another mode).
Overall: requests by outcome; ``unanswered`` (stranded, stalled or hung; the target is 0); ``5xx other than 503``
(HTTP statuses and in-stream error events; target 0); ``truncated`` (target 0); the process tree's PSS at the start
and the end; p50 latency of plain requests in the baseline, and of those that began and ended after it outside
every kill window (kill to engine up again) and inside one: outside over baseline is what the kills cost the
requests they did not hit (the target is at most 1.1x).

With ``--replicas N`` the same runs against the Ray Serve cluster (``python -m modeswitch.cluster``, N
replicas of the default server, each with its vLLM engines), and the engine killed is any replica's.

    .venv/bin/python benchmarks/chaos.py [--baseline-minutes 5] [--minutes 15] [--kill-every 120] [--clients 4]
                                         [--replicas N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeswitch.bench.report import processor, save_results  # noqa: E402
from modeswitch.serving.launcher import ROOT, start_server, wait_stopped  # noqa: E402

PROMPTS = ["The hacker ethic holds that", "A kludge is a clever programming trick that",
           "Write a short poem about rivers.", "List three uses of a paperclip:"]


def views(url: str) -> list[dict]:
    """Each server's ``/v1/modes``: the one server's, or every replica's behind a cluster's ingress."""
    info = requests.get(url + "/v1/modes", timeout=30).json()
    return info["replicas"] if "replicas" in info else [info]


def engines(url: str) -> dict[str, dict]:
    """Every vLLM engine, by ``replica/key`` (``key`` alone for one server)."""
    return {"/".join(filter(None, (view.get("replica"), key))): engine
            for view in views(url) for key, engine in view.get("engines", {}).items()}


def tree_pss(url: str) -> int:
    """The PSS of every server's process tree (a replica's: its actor and its engines)."""
    return sum(view["memory"]["process_tree"]["pss_bytes"] for view in views(url) if "memory" in view)


def wait_all_up(url: str, replicas: int, wait_s: float = 1800) -> None:
    """Until every server (every replica) answers and has no mode still loading."""
    deadline = time.monotonic() + wait_s
    while True:
        got = views(url)
        if len(got) >= max(replicas, 1) and all("modes" in v and all(m["status"] != "loading" for m in v["modes"])
                                                for v in got):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}: not every replica up after {wait_s:.0f} s")
        time.sleep(2)


#: an error that names the engine it died on: ``vLLM engine <key> died: ...`` / ``... did not start again``
DEAD_ENGINE = re.compile(r"vLLM engine (\S+) (?:died|did not start)")


def failure_outcome(exc: requests.RequestException, after_headers: bool) -> str:
    """The outcome of a request that raised: no headers within the timeout is ``stranded``; headers and then a read
    that timed out is ``stalled`` (requests raises ``ConnectionError`` for it, not ``Timeout``, once a stream has
    begun); a connection that broke after the headers ``truncated``; anything else ``connection_error``."""
    timed_out = isinstance(exc, requests.Timeout) or "timed out" in str(exc).lower()
    if not after_headers:
        return "stranded" if timed_out else "connection_error"
    return "stalled" if timed_out else "truncated"


def stream_outcome(lines: Iterable[bytes | str]) -> dict[str, Any]:
    """The outcome of a server-sent-event stream read to its end: ``ok`` when it ended with ``[DONE]`` and no error
    event, ``error_event`` (with the error's ``code`` and the message) when it carried one, ``truncated`` when it
    ended without ``[DONE]``. Exceptions raised while reading are the caller's (:func:`failure_outcome`)."""
    out: dict[str, Any] = {"outcome": "truncated"}
    for raw in lines:
        line = raw.decode() if isinstance(raw, bytes) else raw
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            if out["outcome"] == "truncated":
                out["outcome"] = "ok"
            continue
        event = json.loads(data)
        if "error" in event:
            out.update(outcome="error_event", code=event["error"].get("code"), error=event["error"].get("message", ""))
        elif "modeswitch" in event and "mode" in event["modeswitch"]:
            out.setdefault("mode", event["modeswitch"]["mode"])
    return out


class Load:
    """``clients`` threads sending the mix until stopped; every request recorded with its outcome, and with the
    replica and mode that served it (or failed it) for :func:`attribute`."""

    def __init__(self, url: str, clients: int, timeout: float, mode_names: list[str]) -> None:
        self.url, self.timeout, self.mode_names = url, timeout, mode_names
        self.records: list[dict] = []
        #: each client's request under way (a thread hung in it past its join still has its record counted)
        self.pending: dict[int, dict] = {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        rng = random.Random(i)
        while not self.stop.is_set():
            kind = rng.choices(["plain", "stream", "pinned", "bad", "dropped"], [4, 3, 2, 1, 1])[0]
            record = self._one(i, kind, rng)
            if self.pending.pop(i, None) is not None:  # not counted as hung by finish() meanwhile
                self.records.append(record)

    def finish(self, join_s: float) -> None:
        """Stop the clients and wait ``join_s`` for each; a request still under way then is counted ``hung``."""
        self.stop.set()
        for t in self.threads:
            t.join(join_s)
        for i in list(self.pending):
            if (record := self.pending.pop(i, None)) is not None:  # a copy: its thread may still write to it
                self.records.append({**record, "outcome": "hung", "end": time.time()})

    def _one(self, i: int, kind: str, rng: random.Random) -> dict:
        prompt = rng.choice(PROMPTS) + f" ({rng.randrange(10**6)})"
        body: dict = {"model": "demo", "max_tokens": rng.randrange(24, 49), "temperature": 0}
        path = "/v1/completions"
        if kind == "stream" or kind == "dropped":
            path, body["messages"], body["stream"] = "/v1/chat/completions", [{"role": "user", "content": prompt}], True
        else:
            body["prompt"] = prompt
        if kind == "pinned":
            body["mode"] = rng.choice(self.mode_names)
        if kind == "bad":
            body["max_tokens"] = -1
        record = self.pending[i] = {"kind": kind, "start": time.time(), "mode": body.get("mode")}
        resp = None
        try:
            resp = requests.post(self.url + path, json=body, timeout=self.timeout, stream=body.get("stream", False))
            record["status"] = resp.status_code
            record["replica"] = resp.headers.get("X-ModeSwitch-Replica")
            record["mode"] = resp.headers.get("X-ModeSwitch-Mode") or record["mode"]
            if body.get("stream") and resp.status_code == 200:
                if kind == "dropped":
                    next(resp.iter_lines(), None)
                    resp.close()
                    record["outcome"] = "dropped"
                else:
                    record.update(stream_outcome(resp.iter_lines()))
            elif resp.status_code == 200:
                info = resp.json()["modeswitch"]
                record["outcome"], record["mode"] = "ok", info["mode"]
                record["replica"] = info.get("replica", record["replica"])
                record["failed_on"] = [attempt.split(":", 1)[0] for attempt in info.get("attempts", ())]
            else:  # with the error's code: a 400 for a bad field, or for a mode pinned past a gate
                error = resp.json()["error"]
                record["outcome"], record["error"] = f"http_{resp.status_code} {error.get('code')}", error["message"]
        except requests.RequestException as exc:
            record["outcome"], record["error"] = failure_outcome(exc, resp is not None), str(exc)[:300]
        record["end"] = time.time()
        return record


def engine_of(views_: list[dict]) -> dict[tuple[str | None, str], str]:
    """(replica, mode) -> the engine it runs on, named as :func:`engines` names it (``replica/key``)."""
    return {(view.get("replica"), m["name"]): "/".join(filter(None, (view.get("replica"), m["vllm_engine"])))
            for view in views_ for m in view.get("modes", ()) if m.get("vllm_engine")}


def attribute(record: dict, placement: dict[tuple[str | None, str], str]) -> list[str]:
    """The engines a request was on: the one its mode runs on in the replica that answered it, those of the modes
    it failed on there, and one an error names as dead (in a cluster without the replica's header it could be any
    replica's engine of that key: every one is listed)."""
    replica, found = record.get("replica"), []
    for mode in filter(None, [record.get("mode"), *record.get("failed_on", ())]):
        found += [engine for (r, m), engine in placement.items() if m == mode and (replica is None or r == replica)]
    if named := DEAD_ENGINE.search(record.get("error", "")):
        found += [engine for engine in set(placement.values())
                  if engine.rsplit("/", 1)[-1] == named.group(1) and (replica is None or engine.startswith(f"{replica}/"))]
    return sorted(set(found))


def summarize_outcomes(records: list[dict]) -> dict[str, Any]:
    """Every outcome counted, and the totals the run is judged by."""
    outcomes = {o: sum(r["outcome"] == o for r in records) for o in sorted({r["outcome"] for r in records})}
    count = outcomes.get
    return {
        "requests": len(records), "outcomes": outcomes,
        "unanswered": count("stranded", 0) + count("stalled", 0) + count("hung", 0),
        "stranded": count("stranded", 0), "stalled": count("stalled", 0), "hung": count("hung", 0),
        "truncated": count("truncated", 0), "connection_errors": count("connection_error", 0),
        "error_events": count("error_event", 0),
        "unexpected_5xx": sum(r.get("status", 0) >= 500 and r["status"] != 503 for r in records)
        + count("error_event", 0),
        "bad_requests_answered_400": sum(r["kind"] == "bad" and r.get("status") == 400 for r in records),
        "bad_requests": sum(r["kind"] == "bad" for r in records),
        "dropped_streams": sum(r["kind"] == "dropped" for r in records),
    }


def on_kill(records: list[dict], kill: dict, placement: dict[tuple[str | None, str], str]) -> dict[str, int]:
    """The requests under way on the killed engine (of that replica) when it died, by outcome (``retried``: failed
    there, answered by another mode). In a cluster, an error answered without the replica's header could have come
    from any replica's engine of that key: its outcome says ``(replica not known)``."""
    replicas = {r for r, _ in placement}
    outcomes = []
    for r in records:
        if not (r["start"] <= kill["killed"] <= r["end"] and kill["engine"] in attribute(r, placement)):
            continue
        outcome = "retried" if r["outcome"] == "ok" and r.get("failed_on") else r["outcome"]
        outcomes.append(outcome + (" (replica not known)" if r.get("replica") is None and len(replicas) > 1 else ""))
    return {o: outcomes.count(o) for o in sorted(set(outcomes))}


def kill_one(url: str, rng: random.Random) -> dict:
    """SIGKILL the engine core of one engine that is up; follow it until it is up again."""
    up = {k: e for k, e in engines(url).items() if e["status"] == "up"}
    key = rng.choice(sorted(up))
    before = up[key]
    killed = time.time()
    os.kill(before["pids"][0], signal.SIGKILL)
    out = {"engine": key, "modes": before["modes"], "killed": killed}
    while time.time() - killed < 600:
        now = engines(url)[key]
        if "detected_s" not in out and now["deaths"] > before["deaths"]:
            out["detected_s"] = round(time.time() - killed, 2)
        if now["status"] == "up" and now["restarts"] > before["restarts"]:
            out["back_s"] = round(time.time() - killed, 1)
            break
        time.sleep(0.25)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-minutes", type=float, default=5, help="the same load first, with no kills")
    ap.add_argument("--minutes", type=float, default=15)
    ap.add_argument("--kill-every", type=float, default=120)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=120, help="a request unanswered this long counts as stranded")
    ap.add_argument("--replicas", type=int, default=0, help="run against a cluster of this many replicas")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ("--replicas", str(args.replicas)) if args.replicas else ()
        proc, url, _ = start_server(Path(tmp), "--model", "demo", *cluster, wait_s=1800, all_modes=False,
                                    **({"entry": ("-m", "modeswitch.cluster")} if args.replicas else {}))
        try:
            wait_all_up(url, args.replicas)
            names = sorted({m["name"] for v in views(url) for m in v["modes"] if m["status"] == "available"})
            placement = engine_of(views(url))
            pss_loaded = tree_pss(url)
            load = Load(url, args.clients, args.timeout, names)
            for t in load.threads:
                t.start()
            time.sleep(args.baseline_minutes * 60)
            pss_start = tree_pss(url)  # served for a while: the kills' start
            began, kills, reloaded = time.time(), [], False
            while time.time() - began < args.minutes * 60:
                time.sleep(min(args.kill_every, max(1.0, args.minutes * 60 - (time.time() - began))))
                if time.time() - began >= args.minutes * 60:
                    break
                kills.append(kill_one(url, rng))
                print(f"kill {len(kills)}: {kills[-1]}", flush=True)
                if not reloaded and time.time() - began > args.minutes * 30:
                    reloaded = requests.post(url + "/admin/policy", json={}, timeout=30).status_code == 200
            load.finish(args.timeout + 10)
            time.sleep(5)
            pss_end = tree_pss(url)
            health = requests.get(url + "/health", timeout=30).json()
        finally:
            proc.terminate()
            wait_stopped(proc, 300)
    records = load.records
    for kill in kills:
        kill["running_on_it"] = on_kill(records, kill, placement)
    windows = [(k["killed"], k["killed"] + k.get("back_s", 600)) for k in kills]
    plain = [r for r in records if r["outcome"] == "ok" and r["kind"] == "plain"]
    baseline = [r["end"] - r["start"] for r in plain if r["end"] < began]
    ok = [r for r in plain if r["start"] >= began]
    outside = [r["end"] - r["start"] for r in ok if not any(r["end"] >= a and r["start"] <= b for a, b in windows)]
    inside = [r["end"] - r["start"] for r in ok if any(r["end"] >= a and r["start"] <= b for a, b in windows)]
    summary = {
        **summarize_outcomes(records),
        "pss_loaded_gb": round(pss_loaded / 1e9, 2), "pss_start_gb": round(pss_start / 1e9, 2), "pss_end_gb": round(pss_end / 1e9, 2),
        "p50_plain_baseline_s": round(statistics.median(baseline), 3) if baseline else None,
        "p50_plain_outside_kill_windows_s": round(statistics.median(outside), 3) if outside else None,
        "outside_over_baseline": round(statistics.median(outside) / statistics.median(baseline), 2)
        if outside and baseline else None,
        "p50_plain_inside_kill_windows_s": round(statistics.median(inside), 3) if inside else None,
        "policy_reloaded": reloaded, "health_at_end": health["status"],
    }
    lines = ["| kill | engine | detected (s) | back (s) | requests running on it, by outcome |", "|---|---|---|---|---|"]
    for i, k in enumerate(kills, 1):
        lines.append(f"| {i} | {k['engine']} | {k.get('detected_s')} | {k.get('back_s')} | {k['running_on_it']} |")
    table = "\n".join(lines) + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in summary.items())
    print(table)
    stem = save_results(args.out, "chaos_demo", args.tag or (f"cluster-{args.replicas}" if args.replicas else ""),
                        {"processor": processor(), "args": vars(args), "summary": summary, "kills": kills},
                        f"# Chaos ({processor()}, {f'{args.replicas} replicas, ' if args.replicas else ''}"
                        f"{args.baseline_minutes} min without kills, then {args.minutes} min "
                        f"with a kill every {args.kill_every:.0f} s, "
                        f"{args.clients} clients)\n\n{table}\n")
    print(f"wrote {stem}.json/.md")
    return 0 if summary["unanswered"] == summary["truncated"] == summary["unexpected_5xx"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The load generator's client: streamed OpenAI-style completions, one record per request, and the closed-
and open-loop drivers that send a trace."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import requests

from .workloads import Slot


def stream_completion(url: str, prompt, max_tokens: int, mode: str | None = None, timeout: float = 900,
                      **fields) -> dict[str, Any]:
    """One streamed greedy completion. Client-side TTFT and latency; the server's report (mode, reason,
    features, prediction) and usage (tokens, energy) from the stream. Errors become ``ok: False`` records."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **fields}
    if mode is not None:
        body["mode"] = mode
    t0 = time.perf_counter()
    first = last = None
    report: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    text = []
    try:
        resp = requests.post(url + "/v1/completions", stream=True, timeout=timeout, json=body)
        if resp.status_code != 200:
            return {"ok": False, "status": resp.status_code, "error": resp.text[:300],
                    "latency_s": time.perf_counter() - t0}
        for line in resp.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"ok": False, "status": 500, "error": chunk["error"]["message"][:300],
                        "latency_s": time.perf_counter() - t0}
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                last = time.perf_counter()
                first = first or last
                text.append(chunk["choices"][0]["text"])
            if "modeswitch" in chunk:
                report.update(chunk["modeswitch"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    except requests.RequestException as exc:
        return {"ok": False, "status": None, "error": str(exc)[:300], "latency_s": time.perf_counter() - t0}
    end = time.perf_counter()
    tokens = usage.get("completion_tokens", 0)
    ttft = (first or end) - t0
    return {
        "ok": True, "latency_s": end - t0, "ttft_s": ttft,
        "tpot_s": (end - first) / (tokens - 1) if first and tokens > 1 else None,
        "tokens": tokens, "text": "".join(text),
        "energy_j": usage.get("energy_j"), "energy_source": usage.get("energy_source"),
        "mode": report.get("mode"), "reason": report.get("reason"), "policy": report.get("policy"),
        "features": report.get("features"), "prediction": report.get("prediction"),
        "decision_us": report.get("decision_us"), "decision_wall_us": report.get("decision_wall_us"),
        "features_us": report.get("features_us"), "cached_tokens": report.get("cached_tokens", 0),
        "speculative": report.get("speculative"), "replica": report.get("replica"),
    }


def send(url: str | list[str], slots: list[Slot], mode: str | None = None, concurrency: int = 1,
         progress: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Send a trace: closed loop with ``concurrency`` workers (slots without arrival times), or open loop at
    each slot's arrival time; to several servers (a list of URLs) in turn, by slot. Records come back in slot
    order, each tagged with its slot and workload."""
    urls = [url] if isinstance(url, str) else url

    def one(slot: Slot) -> dict[str, Any]:
        record = stream_completion(urls[slot.index % len(urls)], slot.prompt_ids, slot.max_tokens, mode)
        record.update(slot=slot.index, workload=slot.workload, prompt_tokens=len(slot.prompt_ids),
                      max_tokens=slot.max_tokens, sent_at=slot.at)
        record.pop("text", None)
        if progress is not None:
            progress()
        return record

    if all(s.at is None for s in slots):
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(one, slots))
    records: list[dict[str, Any] | None] = [None] * len(slots)
    start = time.perf_counter()

    def at_time(i: int, slot: Slot) -> None:
        time.sleep(max(0.0, slot.at - (time.perf_counter() - start)))
        records[i] = one(slot)

    threads = [threading.Thread(target=at_time, args=(i, s), daemon=True) for i, s in enumerate(slots)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records  # type: ignore[return-value]


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``values``; NaN when empty."""
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")

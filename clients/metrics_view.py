"""`lmdctl metrics` as text: the control API's `/v1/metrics` reply in four short tables."""

from __future__ import annotations

from typing import Any

from lmd_client.tables import human_bytes, latency, table

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "E2E"))


def _statuses(requests: dict[str, int]) -> str:
    return ", ".join(f"{status}: {n}" for status, n in requests.items()) or "-"


def _api_text(api: dict[str, Any]) -> str:
    if api.get("error"):
        return f"api: {api['error']}"
    win, total = api["window"], api["since_start"]
    last = f"LAST {win['seconds']:.1f}s"
    rows = [
        [
            "generation",
            f"{win['generation_tokens_per_s']:.1f} tok/s",
            f"{total['generation_tokens']} tok",
        ],
        ["prompt", f"{win['prompt_tokens_per_s']:.1f} tok/s", f"{total['prompt_tokens']} tok"],
        [
            "requests",
            f"{win['requests_per_s']:.1f} req/s",
            str(sum(total["requests"].values())),
        ],
        ["  by status", _statuses(win["requests"]), _statuses(total["requests"])],
        ["open in api", str(api["requests_running"]), ""],
    ]
    text = table(rows, ["THROUGHPUT", last, "SINCE START"])
    if win.get("restarted"):
        text += "\n(the api restarted during the window: it counts from its restart)"
    lat_rows = []
    for key, label in LATENCIES:
        w, t = win[key], total[key]
        window = [str(w["count"]), latency(w["p50_s"]), latency(w["p99_s"])]
        since = [str(t["count"]), latency(t["p50_s"]), latency(t["p99_s"]), latency(t["mean_s"])]
        lat_rows.append([label, *window, *since])
    header = ["LATENCY", "N", "P50", "P99", "N TOTAL", "P50 TOTAL", "P99 TOTAL", "MEAN TOTAL"]
    return (
        f"{text}\n\n{table(lat_rows, header)}\n"
        f"N, P50, P99: the last {win['seconds']:.1f}s; TOTAL: since the daemon started.\n"
        "P50/P99 are estimates from the /metrics histogram buckets; means are exact."
    )


def _engines_text(engines: list[dict[str, Any]], running: int, waiting: int) -> str:
    if not engines:
        return "no engine workers"
    rows = []
    for e in engines:
        kv = e["kv"]
        rows.append(
            [
                e["name"],
                e["state"],
                "-" if e["running"] is None else str(e["running"]),
                "-" if e["waiting"] is None else str(e["waiting"]),
                f"{kv['used_blocks']}/{kv['total_blocks']}" if kv else "-",
                f"{kv['usage'] * 100:.1f}%" if kv else "-",
            ]
        )
    rows.append(["total", "", str(running), str(waiting), "", ""])
    return table(rows, ["ENGINE", "STATE", "RUNNING", "WAITING", "KV BLOCKS USED", "KV USE"])


def _gpu_text(gpu: dict[str, Any]) -> str:
    if not gpu["available"]:
        return f"GPU: none: {gpu['reason']}"
    rows = []
    for d in gpu["devices"]:
        util = d["utilization_percent"]
        used, total = d["memory_used_bytes"], d["memory_total_bytes"]
        rows.append(
            [
                str(d["index"]),
                d["name"],
                f"{human_bytes(used)} / {human_bytes(total)}",
                f"{used / total * 100:.0f}%" if total else "-",
                "-" if util is None else f"{util}%",
            ]
        )
    return table(rows, ["GPU", "NAME", "MEMORY USED", "MEM %", "UTIL"])


def metrics_text(m: dict[str, Any]) -> str:
    api = m["api"]
    sources = ", ".join(api["sources"]) or "no api worker"
    head = f"lmdd {m['state']}   model {m['model']}   from {sources} over {m['interval_s']:g}s"
    sections = [
        head,
        _api_text(api),
        _engines_text(m["engines"], m["running"], m["waiting"]),
        _gpu_text(m["gpu"]),
    ]
    return "\n\n".join(sections)

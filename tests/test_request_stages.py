"""One request, read back from the trace: exactly these stages, in this causal order,
in these three processes, and nothing else (seed §22).

    client      SUBMIT ─────────────────────────────────────── WAKE ┐
    supervisor          ENQUEUE ─ QUEUED                             │ ends after
    device                                 EXEC ⊃ MAP ─── SIGNAL ────┘ the signal
"""

from __future__ import annotations

from hetproc import trace


def _role(names: dict[int, str], pid: int) -> str:
    name = names[pid]
    if name.startswith("client"):
        return "client"
    return "supervisor" if "supervisor" in name else "device"


def test_one_request_leaves_exactly_its_stages_in_causal_order(client):
    npu = client.context("npu0")
    x, y = client.alloc(64, "float32"), client.alloc(64, "float32")
    npu.submit("relu", [x], [y], ms=1).wait(5)  # warm: the first map of a buffer differs
    fence = npu.submit("relu", [x], [y], ms=1)
    fence.wait(5)
    doc = trace.chrome_trace(client)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    # A part of a stage drawn apart for its arrow (``args.marks``: SENT, WOKE) is not a
    # stage of its own.
    mine = [e for e in doc["traceEvents"] if e.get("ph") in ("X", "i")
            and (e.get("args") or {}).get("cid") == fence.cid
            and "marks" not in e["args"]]
    got = sorted((_role(names, e["pid"]), e["name"]) for e in mine)
    assert got == sorted([("client", "SUBMIT"), ("supervisor", "ENQUEUE"),
                          ("supervisor", "QUEUED"), ("device", "EXEC"), ("device", "MAP"),
                          ("device", "HOST_EXEC"), ("device", "SIGNAL"), ("client", "WAKE")])
    at = {e["name"]: (e["ts"], e["ts"] + e.get("dur", 0)) for e in mine}
    # The host's own path, in causal order: SUBMIT, ENQUEUE, QUEUED, the device's host
    # start (HOST_EXEC's a0, in ns), MAP.
    host = next(e for e in mine if e["name"] == "HOST_EXEC")["args"]
    origin = at["EXEC"][1] - host["a2"] / 1e3  # a2 is the modeled end, where EXEC ends
    host_start = host["a0"] / 1e3 + origin
    chain = [at["SUBMIT"][0], at["ENQUEUE"][0], at["QUEUED"][0], host_start, at["MAP"][0]]
    assert chain == sorted(chain), f"stages out of order: {chain}"
    assert at["QUEUED"][1] <= host_start + 1e-3, "the device took it after it was queued"
    assert at["MAP"][1] <= at["HOST_EXEC"][0], "the host's work ended after its map"
    # EXEC is drawn at its modeled times (invariant 8): it starts no earlier than the
    # submit (the host latency after it is absorbed), lasts the modeled 1 ms plus the
    # modeled memory work, and its fence is signalled at its modeled end.
    assert at["SUBMIT"][0] <= at["EXEC"][0] + 1e-3
    assert at["EXEC"][1] - at["EXEC"][0] >= 1000.0 - 1e-3
    assert at["EXEC"][1] <= at["SIGNAL"][0] + 1e-3, "signalled at the modeled end"
    assert at["SIGNAL"][0] <= at["WAKE"][1], "the client woke after the signal"

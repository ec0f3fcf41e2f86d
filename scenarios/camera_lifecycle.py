"""Camera buffer lifecycle (seed §17): pool -> ISP -> NPU -> GPU -> back to the pool.

Three clients, as on a phone: the *camera* service owns a pool of frame buffers and the
ISP context; an *app* runs its model on the NPU; the *display* compositor renders a
preview on the GPU. Per frame::

    camera: buf = pool.acquire()          (only when every release fence of its last
                                           frame completed)
            ISP writes the frame           -> acquire fence, exported
    app:    (imported buf once per slot)   NPU waits on the acquire fence, reads the
                                           frame (checksum), -> release fence #1
    display:(imported buf once per slot)   GPU waits on #1, renders a preview (resize)
                                           -> release fence #2
    camera: pool.release(buf, [#1, #2])    imported fences: the pool frees the slot
                                           when both completed

The imports are references that keep the memory alive; only the fences order the writes.
Evidence: every NPU checksum and every preview matches the frame the ISP wrote for that
frame (no consumer read too early, no stale cache line); the ISP never started writing a
buffer before both release fences of the buffer's previous frame had signalled (device
timestamps); the memory outlived the camera's free while imports held it.

Two variants: ``dense`` frames (every device takes them: zero explicit copies) and
``padded`` frames (a row pitch padded to 64 bytes, as ISPs produce: the NPU takes only
dense buffers, so the runtime inserts an internal copy on every frame, visible in the
``handoff`` and DDR metrics, while the GPU still reads the frame in place).

Options: ``frames`` (default 60 per variant), ``variant`` (dense, padded or both).
"""

from __future__ import annotations

import numpy as np

import hetproc
from device_workers import read_checksum
from hetproc.drills import Option, Scenario

H, W, C = 120, 160, 3
PADDED_PITCH = 512          # 160 * 3 = 480 bytes of pixels, padded to a multiple of 64
POOL = 3
OPTIONS = {
    "frames": Option(60, "frames per variant (more than the pool's 3 buffers)", min=POOL + 1,
                     max=100_000),
    "variant": Option("both", "which frames to run", choices=("both", "dense", "padded")),
}
QUICK = {"frames": 20}
ISP_MS, NPU_MS, GPU_MS = 3.0, 8.0, 4.0


class Variant:
    def __init__(self, s, name: str) -> None:
        self.s = s
        self.name = name
        plat = s.platform
        self.camera = plat.connect("camera")
        self.app = plat.connect("app")
        self.display = plat.connect("display")
        self.isp = self.camera.context("isp0", name="camera")
        self.npu = self.app.context("npu0", name="app model")
        self.gpu = self.display.context("gpu0", name="preview")
        strides = (H * PADDED_PITCH, PADDED_PITCH, C, 1) if name == "padded" else None
        self.pool = hetproc.BufferPool(self.camera, POOL, (1, H, W, C), "uint8",
                                       strides=strides, usage=("isp", "npu", "gpu"))
        self.app_view: dict[int, hetproc.Buffer] = {}
        self.display_view: dict[int, hetproc.Buffer] = {}
        self.results: dict[int, hetproc.Buffer] = {}
        self.previews: dict[int, hetproc.Buffer] = {}
        for buf in self.pool.buffers:
            self.isp.map(buf, "w")  # the camera maps its pool once, for good
            token = buf.export(read_only=True)  # consumers may read, never write
            a, d = self.app.import_buffer(token), self.display.import_buffer(token)
            self.npu.map(a, "r")
            self.gpu.map(d, "r")
            self.app_view[buf.handle], self.display_view[buf.handle] = a, d
            self.results[buf.handle] = self.app.alloc(8, "uint8")
            self.previews[buf.handle] = self.display.alloc((1, H // 2, W // 2, C), "uint8")
        self.last: dict[int, dict] = {}  # slot -> its frame in flight or last completed

    def frame(self, i: int) -> dict:
        buf = self.pool.acquire(timeout=10.0)
        t_acquired = hetproc.now()
        prev = self.last.pop(buf.handle, None)
        checked = self.verify(prev) if prev else None
        value = i % 250 + 1
        f_isp = self.isp.submit("fill", [], [buf], params={"value": value}, ms=ISP_MS)
        acq = self.app.import_fence(f_isp.export())
        f_npu = self.npu.submit("checksum", [self.app_view[buf.handle]],
                                [self.results[buf.handle]], wait=[acq], ms=NPU_MS)
        acq.release()  # the command holds the fence now; the app's import is not needed
        seen = self.display.import_fence(f_npu.export())
        f_gpu = self.gpu.submit("resize", [self.display_view[buf.handle]],
                                [self.previews[buf.handle]], wait=[seen],
                                params={"mode": "nearest"}, ms=GPU_MS)
        seen.release()
        releases = [self.camera.import_fence(f.export()) for f in (f_npu, f_gpu)]
        self.pool.release(buf, releases)
        self.last[buf.handle] = {"i": i, "value": value, "slot": buf.handle, "isp": f_isp,
                                 "npu": f_npu, "gpu": f_gpu, "t_submit": t_acquired}
        return {"checked": checked, "isp_cid": f_isp.cid,
                "prev_release_ns": checked["release_ns"] if checked else 0}

    def verify(self, rec: dict) -> dict:
        """A frame whose release fences completed: did every consumer see its data?"""
        rec["npu"].wait(10)
        rec["gpu"].wait(10)
        info = self.camera.fences.info
        release_ns = max(info(rec["npu"].handle)["t_host"], info(rec["gpu"].handle)["t_host"])
        npu_ok = read_checksum(self.results[rec["slot"]].array()) == rec["value"] * H * W * C
        gpu_ok = bool((self.previews[rec["slot"]].array() == rec["value"]).all())
        latency_ms = (info(rec["gpu"].handle)["t_host"] - rec["t_submit"]) / 1e6
        for key in ("isp", "npu", "gpu"):
            rec[key].release()
        return {"ok": npu_ok and gpu_ok, "release_ns": release_ns, "latency_ms": latency_ms,
                "done_ns": info(rec["gpu"].handle)["t_host"]}

    def run(self, frames: int) -> dict:
        before = self.camera.metrics()
        out = [self.frame(i) for i in range(frames)]
        tail = [self.verify(self.last.pop(h)) for h in sorted(self.last,
                                                              key=lambda h: self.last[h]["i"])]
        checks = [o["checked"] for o in out if o["checked"]] + tail
        # The device's own clock says when the ISP started writing each reused buffer.
        ev = self.camera.memory_events(cids=[o["isp_cid"] for o in out], timeout=30)["events"]
        isp_start = {e["cid"]: e["t0"] for e in ev if e["kind"] == "exec"}
        reused = [o for o in out if o["prev_release_ns"]]
        early = [o for o in reused if isp_start.get(o["isp_cid"], 0) < o["prev_release_ns"]]
        after = self.camera.metrics()
        stats = self.pool.statistics()
        lat = np.array([c["latency_ms"] for c in checks])
        done = np.sort(np.array([c["done_ns"] for c in checks]))
        return {"frames": frames, "ok": sum(c["ok"] for c in checks), "checked": len(checks),
                "reused": len(reused), "reused_early": len(early),
                "missing_isp_events": sum(1 for o in out if o["isp_cid"] not in isp_start),
                "pool_waited": stats.waited, "recycled": stats.recycled,
                "copies": after["handoff"]["copies"] - before["handoff"]["copies"],
                "reasons": {k: v - before["handoff"]["by_reason"].get(k, 0)
                            for k, v in after["handoff"]["by_reason"].items()},
                "copy_bytes": after["ddr"]["copy_bytes"] - before["ddr"]["copy_bytes"],
                "ddr_bytes": after["ddr"]["bytes"] - before["ddr"]["bytes"],
                "invalidates": after["cache"]["invalidates"] - before["cache"]["invalidates"],
                "cleans": after["cache"]["cleans"] - before["cache"]["cleans"],
                "latency_p50_ms": float(np.median(lat)),
                "period_p50_ms": float(np.median(np.diff(done))) / 1e6 if len(done) > 2 else 0.0}

    def close(self) -> dict:
        """Tear down in §17's order; returns what the platform holds afterwards."""
        self.pool.close()
        mid = self.camera.metrics()  # the camera freed its pool; the imports hold it
        for views, ctx in ((self.app_view, self.npu), (self.display_view, self.gpu)):
            for b in views.values():
                ctx.unmap(b)
                b.free()
        unimported = self.camera.metrics()
        for b in list(self.results.values()) + list(self.previews.values()):
            b.free()
        after = self.camera.metrics()
        for c in (self.camera, self.app, self.display):
            c.close()
        return {"held_by_imports": mid["pool"]["live_blocks"] - unimported["pool"]["live_blocks"],
                "pool_blocks_after": after["pool"]["live_blocks"]}


def run(s: Scenario) -> None:
    frames = s.option("frames")
    which = s.option("variant")
    names = ["dense", "padded"] if which == "both" else [which]
    base = s.client.metrics()["pool"]["live_blocks"]
    results = {}
    for name in names:
        s.progress(f"{name} frames: {frames}")
        v = Variant(s, name)
        try:
            r = v.run(frames)
        finally:
            t = v.close()
        results[name] = r
        for key in ("copies", "copy_bytes", "ddr_bytes", "invalidates", "cleans",
                    "latency_p50_ms", "period_p50_ms", "pool_waited", "reused"):
            s.metric(f"{name}_{key}", r[key])
        s.metric(f"{name}_copy_reasons", r["reasons"])
        s.check(f"{name}: every consumer saw the frame the ISP wrote (NPU checksum, GPU preview)",
                r["ok"] == r["checked"] == frames, f"{r['ok']} of {r['checked']} of {frames}")
        s.check(f"{name}: a pool buffer is never rewritten before every release fence of its "
                "last frame signalled (device timestamps)",
                r["reused"] == frames - POOL and r["reused_early"] == 0
                and r["missing_isp_events"] == 0,
                f"{r['reused_early']} of {r['reused']} reuses early, "
                f"{r['missing_isp_events']} ISP slices missing")
        s.check(f"{name}: every reused buffer came back through its release fences",
                r["recycled"] >= frames - POOL, f"recycled {r['recycled']}, the camera "
                f"waited for release fences {r['pool_waited']} times")
        s.check(f"{name}: the imports kept the pool's memory alive after the camera freed it, "
                "and nothing was left after the last importer let go",
                t["held_by_imports"] == POOL and t["pool_blocks_after"] == base, str(t))
        s.check(f"{name}: the non-coherent ISP and NPU cleaned and invalidated every frame",
                r["cleans"] >= 2 * frames and r["invalidates"] >= frames,
                f"{r['cleans']} cleans, {r['invalidates']} invalidates")
    if "dense" in results:
        s.check("dense frames: zero explicit copies from ISP to NPU to GPU",
                results["dense"]["copies"] == 0, str(results["dense"]["reasons"]))
    if "padded" in results:
        p = results["padded"]
        s.check("padded frames: the NPU's internal copy shows, once per frame, for the stride",
                p["copies"] == frames and p["reasons"].get("stride", 0) == frames
                and p["copy_bytes"] > 0,
                f"{p['copies']} copies, reasons {p['reasons']}, {p['copy_bytes']} bytes")
    if len(results) == 2:
        s.metric("padded_extra_ddr_bytes_per_frame",
                 (results["padded"]["ddr_bytes"] - results["dense"]["ddr_bytes"]) / frames)
    s.note(f"time scale {s.time_scale}: ISP {ISP_MS} ms, NPU {NPU_MS} ms, GPU {GPU_MS} ms "
           f"per frame before scaling; {POOL} pool buffers")

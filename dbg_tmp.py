import os, time, socket, hetproc
from ipc import pack_frame, encode
from tests.test_fd_segments import _memfd_fds
with hetproc.Platform(time_scale=1.0) as p:
    c=p.client; x=c.alloc(64)
    print(_memfd_fds(p.pid, p.prefix))
    deaf = socket.socket(socket.AF_UNIX); deaf.connect("\0"+p.prefix+"ctl")
    deaf.sendall(pack_frame(encode({"op": "hello", "id": 1, "name": "deaf", "owner": False})))
    frames = b"".join(pack_frame(encode({"op": "alloc", "id": i, "shape": [1024], "dtype": "uint8", "exportable": True})) for i in range(240, 278))
    fill = b"".join(pack_frame(encode({"op": "metrics", "id": i})) for i in range(2, 240))
    deaf.sendall(fill+frames)
    time.sleep(1)
    print(len(_memfd_fds(p.pid, p.prefix)), c.metrics()["pool"]["own_segments"])
    deaf.close()
    time.sleep(1)
    print(_memfd_fds(p.pid, p.prefix), c.metrics()["pool"]["own_segments"], c.metrics()["clients"])
    q = socket.socket(socket.AF_UNIX); q.connect("\0"+p.prefix+"ctl")
    q.sendall(pack_frame(encode({"op": "hello", "id": 1, "name": "q", "owner": False}))+frames)
    q.close()
    time.sleep(1)
    print("after q", _memfd_fds(p.pid, p.prefix), c.metrics()["pool"])
    c.context("cpu0").submit("fill", [], [x], params={"value": 2}).wait(5)
    time.sleep(1)
    print("after fill", _memfd_fds(p.pid, p.prefix), c.metrics()["pool"])

"""What goes out to clients: replies, notices, and what a slow reader has not taken yet.

Nothing here blocks: a client's socket is non-blocking, and what it does not take now is
buffered (up to ``MAX_OUTBUF``) and sent when the socket is writable again. A segment's
descriptors travel with the first byte of the reply that hands it over (SCM_RIGHTS).
A reply is kept for a while (``ANSWERED_KEPT``), so a retried request id is answered
again, never run again. When a client cannot be written to any more, the loop is told
(``gone``) and tears it down; this module never does.
"""

from __future__ import annotations

import selectors
import socket
from collections.abc import Callable, Sequence

from ipc import close_all, encode, errors, pack_frame

from .. import _protocol
from ._failures import record_of
from ._records import ClientRec

MAX_OUTBUF = 8 << 20  # replies buffered for a client that does not read them
ANSWERED_KEPT = 16          # replies kept per client to answer a retried request id again
ANSWERED_MAX_BYTES = 16 << 10  # larger replies are not kept (a retry is refused instead)


class Outbox:
    """``gone(client, why)``: the client cannot be served any more (``why``: an error
    worth noting, or None for a connection that broke)."""

    def __init__(self, sel: selectors.BaseSelector,
                 gone: Callable[[ClientRec, errors.HetprocError | None], None]) -> None:
        self.sel = sel
        self.gone = gone

    def reply(self, client: ClientRec, req_id: int, *, result: dict | None = None,
              error: errors.HetprocError | None = None, window: int = 0,
              fds: Sequence[int] = ()) -> None:
        """Answer request ``req_id``: its result, or its error (naming ``window``)."""
        msg = (_protocol.reply(req_id, result) if error is None
               else _protocol.refusal(req_id, record_of(error, window)))
        frame = pack_frame(encode(msg))
        # A reply that hands descriptors over is not kept: sent again without them it
        # would announce what never comes (a retry of it is refused instead).
        if req_id > 0 and len(frame) <= ANSWERED_MAX_BYTES and not fds:
            client.answered[req_id] = frame
            if len(client.answered) > ANSWERED_KEPT:
                client.answered.popitem(last=False)
        self.send(client, frame, fds)

    def answer_again(self, client: ClientRec, req_id: int) -> bool:
        """Request ids only grow on a connection. One seen before is a retry (the client
        timed out waiting): it gets the answer already given, and never runs twice; one
        whose answer is no longer kept is refused. True when answered here."""
        if req_id > client.last_id:
            client.last_id = req_id
            return False
        frame = client.answered.get(req_id)
        if frame is None:
            self.reply(client, req_id, error=errors.InvalidRequest(
                f"request id {req_id} was used already; its answer is no longer kept "
                "(the request ran once, and is not run again)"))
        else:
            self.send(client, frame)
        return True

    def send(self, client: ClientRec, frame: bytes, fds: Sequence[int] = ()) -> None:
        """Send now what the socket takes, buffer the rest. Descriptors go with the
        frame's first byte (SCM_RIGHTS). They are the outbox's from here on (taken for
        this reply, ``_requests.hand_segment``): closed once sent or when the client is
        gone, so a segment dropped meanwhile cannot turn them into someone else's."""
        out = client.outbuf
        fds = list(fds)
        if not out:
            try:
                sent = _send(client.conn, frame, fds)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                close_all(fds)
                self.gone(client, None)
                return
            if sent:
                close_all(fds)  # they went with the first byte
                fds = []
            if sent == len(frame):
                return
            frame = frame[sent:]
            self._want_write(client, True)
        if fds:
            client.outfds.append((len(out), fds))
        out += frame
        if len(out) > MAX_OUTBUF:
            self.gone(client, errors.PlatformError(
                f"client {client.name!r} stopped reading its replies; disconnected"))

    def tell(self, client: ClientRec, msg: dict) -> None:
        """A notice nobody asked for (a failure record, sent ahead of its fence's wake).
        Sent now, so it is in the client's socket before the wake; never tears anything
        down from here (this runs inside recovery): a broken connection is found by the
        loop's next read of it, and a client that stopped reading gets no more notices
        (its waiters then ask for the record instead)."""
        frame = pack_frame(encode(msg))
        if client.outbuf:
            if len(client.outbuf) + len(frame) <= MAX_OUTBUF:
                client.outbuf += frame
            return
        try:
            sent = client.conn.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return
        if sent < len(frame):
            client.outbuf += frame[sent:]
            self._want_write(client, True)

    def on_writable(self, client: ClientRec) -> None:
        """Send what is buffered, up to the next descriptors or with them."""
        out = client.outbuf
        fds: list[int] = []
        end = len(out)
        if client.outfds:
            pos, pending = client.outfds[0]
            if pos == 0:
                fds = pending
                end = client.outfds[1][0] if len(client.outfds) > 1 else len(out)
            else:
                end = pos
        try:
            sent = _send(client.conn, bytes(out[:end]), fds)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.gone(client, None)
            return
        if fds and sent:
            close_all(client.outfds.pop(0)[1])
        del out[:sent]
        if client.outfds:
            client.outfds = [(pos - sent, f) for pos, f in client.outfds]
        if not out:
            self._want_write(client, False)

    def _want_write(self, client: ClientRec, want: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want else 0)
        self.sel.modify(client.conn, events, ("client", client.conn))


def _send(conn: socket.socket, data: bytes, fds: Sequence[int]) -> int:
    if fds:
        return socket.send_fds(conn, [data], fds)
    return conn.send(data)


def refuse_connection(conn: socket.socket, why: errors.HetprocError) -> None:
    """Tell a peer we will not serve why (best effort, never blocking), and close."""
    try:
        conn.setblocking(False)
        conn.send(pack_frame(encode(_protocol.notice(why.to_dict()))))
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1 << 16)  # what it sent already: closing over unread data would reset
    except OSError:  # the connection, and lose the answer before the peer reads it
        pass
    conn.close()

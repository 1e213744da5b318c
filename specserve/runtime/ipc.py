"""ZeroMQ plumbing: typed PUSH/PULL endpoints over IPC sockets in a private 0700 directory.

Receivers block in `zmq.Poller.poll(timeout)`; nothing here busy-waits.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import msgspec
import zmq


def make_ipc_dir() -> str:
    # mkdtemp creates the directory with mode 0700: no other local user can reach the sockets
    path = tempfile.mkdtemp(prefix="specserve-ipc-")
    os.chmod(path, 0o700)
    return path


def ipc_addr(ipc_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(ipc_dir, name)}"


class Sender:
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool) -> None:
        self.sock = ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr) if bind else self.sock.connect(addr)
        self._enc = msgspec.msgpack.Encoder()

    def send(self, msg: msgspec.Struct) -> None:
        self.sock.send(self._enc.encode(msg), copy=False)

    def close(self) -> None:
        self.sock.close(0)


class Receiver:
    def __init__(self, ctx: zmq.Context, addr: str, bind: bool, msg_type: Any) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr) if bind else self.sock.connect(addr)
        self._dec = msgspec.msgpack.Decoder(msg_type)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)

    def recv(self, timeout_ms: int | None = None):
        """Next message, or None after `timeout_ms` (None blocks until one arrives)."""
        if timeout_ms is not None and not self._poller.poll(timeout_ms):
            return None
        return self._dec.decode(self.sock.recv(copy=False).buffer)

    def recv_nowait(self):
        try:
            return self._dec.decode(self.sock.recv(zmq.NOBLOCK, copy=False).buffer)
        except zmq.Again:
            return None

    def drain(self) -> list:
        out = []
        while (msg := self.recv_nowait()) is not None:
            out.append(msg)
        return out

    def close(self) -> None:
        self.sock.close(0)

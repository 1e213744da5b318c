"""Tensor parallelism's collectives (torch.distributed: gloo on the CPU) and the commands the
leading rank sends the others.

Rank 0 (the model-runner process) runs the scheduler's batches and the speculative worker; every
other rank only follows: for each target forward rank 0 broadcasts the batch's index arrays
(`send_forward`), every rank runs its shard, and the ranks meet in `reduce` after the embedding
and each row-parallel projection, and in `gather_vocab` for the logits. KV moves of a
speculative commit are broadcast the same way (`send_move`), since each rank holds its own
heads' KV.

`reduce` sums in a fixed rank order, so a row's result does not depend on which rows share its
forward (or on how a collective chunks the tensor): with 2 ranks the sum is one commutative
addition (gloo's all_reduce gives both ranks the same bits); with more, the ranks' partials are
gathered and added in rank order.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

OP_FORWARD, OP_MOVE_KV, OP_STOP = 1, 2, 3
_HEADER = 16
# the int64 arrays of a forward, in order; their lengths are in the header
_I64 = ("input_ids", "positions", "out_loc")
_I32_T = ("tok_req", "tok_local")


TP_COMMS = ("auto", "shm", "gloo")
SHM_SLOT_BYTES = 4 << 20  # per rank and generation; larger collectives go in pieces


class TpGroup:
    """This process's place in the tensor-parallel group. `comm` "shm" (what "auto" means when
    every rank is on this host) carries the collectives through a shared-memory segment
    (kernels/cpu/csrc/shm_comm.h: ~10x faster than gloo over loopback here); "gloo" through
    torch.distributed, which also spans hosts. The group itself always starts over gloo."""

    def __init__(self, rank: int, world: int, init_addr: str, comm: str = "gloo") -> None:
        self.rank, self.world = rank, world
        self.shm = None
        t0 = time.perf_counter()
        # an idle server sends no collective for hours: the followers' wait for the next
        # command must not time out, so the group's timeout is long (start-up is bounded by
        # the caller's own watchdog)
        dist.init_process_group(
            "gloo", init_method=f"tcp://{init_addr}", rank=rank, world_size=world,
            timeout=datetime.timedelta(days=365))
        if comm == "shm":
            self.shm = self._open_shm(init_addr)
        logger.info("tensor-parallel rank %d of %d joined at %s in %.1fs (collectives: %s)",
                    rank, world, init_addr, time.perf_counter() - t0, comm)

    def _open_shm(self, init_addr: str):
        from kernels import cpu

        name = torch.zeros(64, dtype=torch.uint8)
        if self.leader:
            text = f"/specserve-tp-{os.getpid()}-{init_addr.rsplit(':', 1)[1]}".encode()
            name[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
            shm = cpu.load().ShmComm(text.decode(), 0, self.world, SHM_SLOT_BYTES)
        dist.broadcast(name, src=0)
        if not self.leader:
            text = bytes(name.tolist()).rstrip(b"\0").decode()
            shm = cpu.load().ShmComm(text, self.rank, self.world, SHM_SLOT_BYTES)
        dist.barrier()
        if self.leader:
            shm.unlink()  # every rank has it mapped; nothing is left in /dev/shm at exit
        return shm

    def _broadcast(self, t: torch.Tensor) -> None:
        if self.shm is not None:
            self.shm.broadcast_(t)
        else:
            dist.broadcast(t, src=0)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place, in rank order."""
        if self.shm is not None:
            self.shm.allreduce_(t)
            return
        if self.world == 2:
            dist.all_reduce(t)
            return
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        acc = parts[0]
        for p in parts[1:]:
            acc += p
        t.copy_(acc)

    def gather_vocab(self, shard: torch.Tensor,
                     vocab: list[tuple[int, int]]) -> torch.Tensor | None:
        """Rank 0: the whole [R, V] logits from every rank's [R, V_r] (vocab[r] = rank r's
        rows); other ranks: None."""
        width = max(e - b for b, e in vocab)
        rows = shard.shape[0]
        padded = shard
        if shard.shape[1] < width:
            padded = torch.zeros(rows, width, dtype=shard.dtype)
            padded[:, :shard.shape[1]] = shard
        if self.shm is not None:
            parts = self.shm.gather(padded.contiguous())
        else:
            parts = [torch.empty(rows, width, dtype=shard.dtype) for _ in range(self.world)] \
                if self.leader else None
            dist.gather(padded.contiguous(), parts, dst=0)
        if not self.leader:
            return None
        return torch.cat([p[:, :e - b] for p, (b, e) in zip(parts, vocab)], dim=1)

    # -- commands (rank 0 sends, the others receive) --------------------------------------

    def _header(self, values: list[int]) -> None:
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[:len(values)] = torch.tensor(values, dtype=torch.int64)
        self._broadcast(h)

    def send_forward(self, a: dict) -> None:
        """Rank 0: the arguments of one CpuModel.forward (see `recv`)."""
        masks, hidden = a["masks"], a["hidden_in"]
        ints = [a[k].reshape(-1).to(torch.int64) for k in (*_I64, *_I32_T)]
        ints += [a["kv_indptr"], a["kv_indices"], a["prefix_len"].to(torch.int64),
                 a["extend_len"].to(torch.int64), a["mask_indptr"], a["logits_rows"],
                 torch.tensor(a["capture"], dtype=torch.int64)]
        sizes = [t.numel() for t in ints[5:]]
        self._header([OP_FORWARD, a["input_ids"].numel(), masks.numel(),
                      int(a["final_hidden"]), a["layer_begin"], a["layer_end"],
                      int(hidden is not None), a["logit_top"], *sizes])
        self._broadcast(torch.cat(ints))
        if masks.numel():
            self._broadcast(masks.contiguous())
        if hidden is not None:
            self._broadcast(hidden.contiguous().float())

    def send_move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._header([OP_MOVE_KV, src.numel()])
        self._broadcast(torch.cat([src.reshape(-1), dst.reshape(-1)]).to(torch.int64))

    def send_stop(self) -> None:
        self._header([OP_STOP])

    def recv(self, hidden_size: int) -> tuple[int, dict]:
        """The others: the next command, as (op, arguments)."""
        h = torch.zeros(_HEADER, dtype=torch.int64)
        self._broadcast(h)
        v = h.tolist()
        op = v[0]
        if op == OP_MOVE_KV:
            buf = torch.empty(2 * v[1], dtype=torch.int64)
            self._broadcast(buf)
            return op, {"src": buf[:v[1]], "dst": buf[v[1]:]}
        if op != OP_FORWARD:
            return op, {}
        t, n_masks, final_hidden, begin, end, has_hidden, logit_top = v[1:8]
        sizes = v[8:15]
        buf = torch.empty(5 * t + sum(sizes), dtype=torch.int64)
        self._broadcast(buf)
        parts = list(torch.split(buf, [t] * 5 + sizes))
        a = dict(zip(_I64, parts[:3]))
        a.update({k: p.to(torch.int32) for k, p in zip(_I32_T, parts[3:5])})
        kv_indptr, kv_indices, prefix_len, extend_len, mask_indptr, rows, capture = parts[5:]
        a.update(kv_indptr=kv_indptr, kv_indices=kv_indices, prefix_len=prefix_len.to(torch.int32),
                 extend_len=extend_len.to(torch.int32), mask_indptr=mask_indptr, logits_rows=rows,
                 capture=capture.tolist(), final_hidden=bool(final_hidden), layer_begin=begin,
                 layer_end=end, logit_top=logit_top)
        a["masks"] = torch.empty(n_masks, dtype=torch.uint8)
        if n_masks:
            self._broadcast(a["masks"])
        a["hidden_in"] = None
        if has_hidden:
            a["hidden_in"] = torch.empty(t, hidden_size, dtype=torch.float32)
            self._broadcast(a["hidden_in"])
        return op, a

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

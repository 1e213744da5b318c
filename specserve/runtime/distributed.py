"""Tensor parallelism's collectives (a shared-memory segment on one host, else
torch.distributed: gloo on the CPU, NCCL on CUDA) and the commands the leading rank sends the
others.

Rank 0 (the model-runner process) runs the scheduler's batches and the speculative worker; every
other rank only follows: for each target forward rank 0 broadcasts the `ForwardBatch`
(`send_forward`, from `ModelRunner.forward`), every rank runs its shard, and the ranks meet
in `reduce` after the embedding and each row-parallel projection, and in `gather_vocab` for
the logits. KV moves of a speculative commit are broadcast the same way (`send_move`), since
each rank holds its own heads' KV.

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

from specserve.runtime.forward_batch import ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

OP_FORWARD, OP_MOVE_KV, OP_STOP = 1, 2, 3
_HEADER = 16
_MODES = list(ForwardMode)

SHM_SLOT_BYTES = 4 << 20  # per rank and generation; larger collectives go in pieces


class TpGroup:
    """This process's place in the tensor-parallel group. On the CPU, `comm` "shm" (what
    "auto" means when every rank is on this host) carries the collectives through a
    shared-memory segment (specserve/kernels/cpu/csrc/shm_comm.h: ~10x faster than gloo over
    loopback here), "gloo" through torch.distributed, which also spans hosts. On CUDA (`device`) the
    sums and the logits go over NCCL and the commands over a gloo group beside it."""

    def __init__(self, rank: int, world: int, init_addr: str, comm: str = "gloo",
                 device: torch.device | str = "cpu") -> None:
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.shm = None
        t0 = time.perf_counter()
        cuda = self.device.type == "cuda"
        # an idle server sends no collective for hours: the followers' wait for the next
        # command must not time out, so the group's timeout is long (start-up is bounded by
        # the caller's own watchdog)
        timeout = datetime.timedelta(days=365)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{init_addr}",
                                rank=rank, world_size=world, timeout=timeout)
        self.cpu_group = dist.new_group(backend="gloo", timeout=timeout) if cuda else None
        if comm == "shm" and not cuda:
            self.shm = self._open_shm(init_addr)
        logger.info("tensor-parallel rank %d of %d joined at %s in %.1fs (collectives: %s)",
                    rank, world, init_addr, time.perf_counter() - t0,
                    "nccl" if cuda else "shm" if self.shm is not None else "gloo")

    def _open_shm(self, init_addr: str):
        from specserve.kernels import cpu

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
        """Rank 0's CPU tensor `t` into every rank's."""
        if self.shm is not None:
            self.shm.broadcast_(t)
        else:
            dist.broadcast(t, src=0, group=self.cpu_group)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place, in rank order."""
        if self.shm is not None:
            if t.dtype == torch.float32:
                self.shm.allreduce_(t)
            else:  # (the torch engine in bf16 / fp16: summed in float32, rounded once)
                wide = t.float()
                self.shm.allreduce_(wide)
                t.copy_(wide)
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
            padded = torch.zeros(rows, width, dtype=shard.dtype, device=shard.device)
            padded[:, :shard.shape[1]] = shard
        if self.shm is not None:
            parts = self.shm.gather(padded.contiguous())
        elif self.cpu_group is not None:  # NCCL has all_gather, not gather
            parts = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(parts, padded.contiguous())
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

    def send_forward(self, batch: ForwardBatch, final_hidden: bool,
                     layers: tuple[int, int] | None, hidden_in: torch.Tensor | None) -> None:
        """Rank 0: one `ModelRunner.forward`'s arguments (see `recv`), before it runs them."""
        masks = batch.custom_masks if batch.mode.uses_custom_mask else None
        ints = [batch.input_ids, batch.positions, batch.out_cache_loc,
                torch.tensor(batch.extend_lens + batch.prefix_lens + list(batch.capture_layers),
                             dtype=torch.int64), batch.kv_indices, batch.logits_indices]
        begin, end = layers if layers is not None else (0, -1)
        self._header([OP_FORWARD, _MODES.index(batch.mode), batch.batch_size, batch.num_tokens,
                      len(batch.capture_layers), batch.kv_indices.numel(),
                      batch.logits_indices.numel(), int(final_hidden), int(layers is not None),
                      begin, end, int(hidden_in is not None), batch.logit_top,
                      int(masks is not None)])
        self._broadcast(torch.cat([t.reshape(-1).to(torch.int64) for t in ints]))
        if masks is not None:
            self._broadcast(torch.cat([m.reshape(-1) for m in masks]).to(torch.uint8))
        if hidden_in is not None:
            self._broadcast(hidden_in.detach().to("cpu", torch.float32).contiguous())

    def send_move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._header([OP_MOVE_KV, src.numel()])
        self._broadcast(torch.cat([src.reshape(-1), dst.reshape(-1)]).to("cpu", torch.int64))

    def send_stop(self) -> None:
        self._header([OP_STOP])

    def recv(self, hidden_size: int) -> tuple[int, dict]:
        """The others: the next command, as (op, arguments): OP_FORWARD's are
        `ModelRunner.forward`'s (batch, return_final_hidden, layers, hidden_in)."""
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
        (mode, b, t, n_cap, n_kv, n_logits, final, has_layers, begin, end, has_hidden,
         logit_top, has_masks) = v[1:14]
        buf = torch.empty(3 * t + 2 * b + n_cap + n_kv + n_logits, dtype=torch.int64)
        self._broadcast(buf)
        ids, pos, loc, lens, kv, rows = torch.split(buf, [t, t, t, 2 * b + n_cap, n_kv,
                                                          n_logits])
        lens = lens.tolist()
        extend, prefix = lens[:b], lens[b:2 * b]
        masks = None
        if has_masks:
            flat = torch.empty(sum(e * e for e in extend), dtype=torch.uint8)
            self._broadcast(flat)
            masks = [m.view(e, e).bool() for m, e in
                     zip(torch.split(flat, [e * e for e in extend]), extend)]
        hidden = None
        if has_hidden:
            hidden = torch.empty(t, hidden_size, dtype=torch.float32)
            self._broadcast(hidden)
        batch = ForwardBatch(mode=_MODES[mode], input_ids=ids, positions=pos, out_cache_loc=loc,
                             extend_lens=extend, prefix_lens=prefix, kv_indices=kv,
                             logits_indices=rows, custom_masks=masks,
                             capture_layers=tuple(lens[2 * b:]), logit_top=logit_top)
        return op, {"batch": batch, "return_final_hidden": bool(final),
                    "layers": (begin, end) if has_layers else None, "hidden_in": hidden}

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

"""1F1B pipeline schedule over micro-batches, with batched P2P between neighbouring stages.

Stage r runs min(PP - r - 1, M) warm-up forwards, then alternates one forward / one backward (sending
its activation forward while receiving the gradient from the next stage in one batched exchange), then
drains the remaining backwards. With PP = 1 it degenerates to forward+backward per micro-batch.
"""

from __future__ import annotations



import torch

from mconvert.trainer import comm
from mconvert.trainer.model import GPTModel
from mconvert.trainer.parallel import ParallelState


class P2P:
    """Activation/gradient exchange between adjacent pipeline stages (tensors of one fixed shape)."""

    def __init__(self, st: ParallelState, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.st, self.shape, self.dtype = st, shape, dtype

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.st.device)

    def recv_forward(self) -> torch.Tensor | None:
        if self.st.is_first_stage:
            return None
        t = self._empty()
        comm.p2p([], [(t, self.st.prev_rank)])
        return t.requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        if not self.st.is_last_stage:
            comm.p2p([(y.detach(), self.st.next_rank)], [])

    def recv_backward(self) -> torch.Tensor | None:
        if self.st.is_last_stage:
            return None
        t = self._empty()
        comm.p2p([], [(t, self.st.next_rank)])
        return t

    def send_backward(self, g: torch.Tensor | None) -> None:
        if not self.st.is_first_stage and g is not None:
            comm.p2p([(g, self.st.prev_rank)], [])

    def send_forward_recv_backward(self, y: torch.Tensor) -> torch.Tensor | None:
        if self.st.is_last_stage:
            return None
        t = self._empty()
        comm.p2p([(y.detach(), self.st.next_rank)], [(t, self.st.next_rank)])
        return t

    def send_backward_recv_forward(self, g: torch.Tensor | None) -> torch.Tensor | None:
        if self.st.is_first_stage:
            return None
        t = self._empty()
        comm.p2p([(g, self.st.prev_rank)], [(t, self.st.prev_rank)])
        return t.requires_grad_()


def forward_backward_1f1b(model: GPTModel, micro_batches: list[dict[str, torch.Tensor]], st: ParallelState,
                          dtype: torch.dtype, forward_only: bool = False) -> list[float]:
    """Run every micro-batch through this stage, 1F1B order; gradients accumulate in `.grad`.

    Each micro-batch holds `tokens` [b, s] (first stage) and `labels` [b, s] (last stage). Returns the
    per-micro-batch mean losses on the last stage (empty elsewhere). The loss is divided by M for backward."""
    M = len(micro_batches)
    b, s = micro_batches[0]["labels"].shape
    if st.sequence_parallel:
        s //= st.tp
    p2p = P2P(st, (b, s, model.spec.hidden_size), dtype)
    losses: list[float] = []
    pending: list[tuple[torch.Tensor | None, torch.Tensor]] = []

    def forward(x: torch.Tensor | None, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        inp = mb["tokens"] if st.is_first_stage else x
        with torch.set_grad_enabled(not forward_only):
            out = model(inp, mb["labels"] if st.is_last_stage else None)
        if st.is_last_stage:
            loss = out.mean()
            losses.append(float(loss.detach()))
            return loss / M
        return out

    def backward(x: torch.Tensor | None, y: torch.Tensor, gy: torch.Tensor | None) -> torch.Tensor | None:
        if forward_only:
            return None
        torch.autograd.backward(y, grad_tensors=gy)
        return None if x is None else x.grad

    warmup = 0 if forward_only else min(st.pp - st.pp_rank - 1, M)
    if forward_only:
        for mb in micro_batches:
            y = forward(p2p.recv_forward(), mb)
            p2p.send_forward(y)
        return losses
    for i in range(warmup):
        x = p2p.recv_forward()
        y = forward(x, micro_batches[i])
        p2p.send_forward(y)
        pending.append((x, y))
    remaining = M - warmup
    x = p2p.recv_forward() if remaining > 0 else None
    for i in range(remaining):
        y = forward(x, micro_batches[warmup + i])
        gy = p2p.send_forward_recv_backward(y)
        pending.append((x, y))
        x0, y0 = pending.pop(0)
        gx = backward(x0, y0, gy)
        if i == remaining - 1:
            p2p.send_backward(gx)
        else:
            x = p2p.send_backward_recv_forward(gx)
    for _ in range(warmup):
        x0, y0 = pending.pop(0)
        gy = p2p.recv_backward()
        p2p.send_backward(backward(x0, y0, gy))
    return losses


def schedule_plan(pp: int, pp_rank: int, M: int) -> list[str]:
    """The order of F/B steps stage `pp_rank` runs (for docs and tests): e.g. ['F0', 'F1', 'B0', 'F2', ...]."""
    warmup = min(pp - pp_rank - 1, M)
    out = [f"F{i}" for i in range(warmup)]
    for i in range(M - warmup):
        out += [f"F{warmup + i}", f"B{i}"]
    out += [f"B{M - warmup + i}" for i in range(warmup)]
    return out




"""Next-token cross-entropy fused with the LM head, computed in row chunks.

    loss = -1/N sum_t log softmax(W h_t)[y_t]           (N = number of targets != ignore_index)
    dL/dz_t = (softmax(z_t) - onehot(y_t)) / N,          z_t = W h_t
    dL/dh_t = W^T dL/dz_t,      dL/dW = sum_t dL/dz_t h_t^T

The logits z have shape (N, vocab): for a batch of 8 x 256 tokens and a 32000-token vocabulary
that is 262 MB in float32, written and re-read by a plain ``cross_entropy(head(h))`` four times
(logits, log-softmax, its gradient, the logits' gradient). Here each chunk of rows computes its
logits, its loss and both gradients at once, so the full logit matrix never exists; backward
only scales the stored gradients. Results equal the unfused computation up to float rounding.
Rows whose target is ignore_index add nothing to the loss and get a zero gradient, so only the other
rows go through the head at all: in supervised fine-tuning, where prompt and user tokens are masked,
that skips their share of the head's three (rows, d) x (d, vocab) matmuls and softmax passes.
h: (N, d), W: (vocab, d), targets: (N,) -> scalar loss.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 2**23  # logits per chunk: 32 MB in float32, small enough to stay in cache-friendly sizes


def drop_ignored(h: torch.Tensor, targets: torch.Tensor, ignore_index: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows of h (N, d) and targets (N,) whose target is not ``ignore_index`` (they add nothing to the loss), and
    the indices kept (None when every row has a target: nothing dropped). One host read; eager only."""
    valid = targets != ignore_index
    if bool(valid.all()):
        return h, targets, None
    rows_kept = valid.nonzero().squeeze(1)
    return h.index_select(0, rows_kept), targets.index_select(0, rows_kept), rows_kept


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int):
        h_all = h
        h, targets, rows_kept = drop_ignored(h, targets, ignore_index)
        n_valid = torch.tensor(max(targets.shape[0], 1), dtype=torch.float32, device=h.device)
        # from here on every row has a target: no per-row mask is needed
        n_rows, vocab = h.shape[0], weight.shape[0]
        # a frozen head (LoRA) needs no weight gradient: skipping it saves a third of the head's work
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_grad = want_h or want_w
        grad_h = torch.empty_like(h) if want_h else None
        # accumulate in float32 at least (float64 stays float64) whatever the compute dtype
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        n_valid = n_valid.to(acc)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        w = weight.to(h.dtype)
        total = torch.zeros((), dtype=acc, device=h.device)
        # equal chunks of at most CHUNK_ELEMENTS logits: a small last chunk would re-read the whole head
        # weight for a handful of rows (a matrix-vector product, bound by memory bandwidth)
        n_chunks = max(1, -(-n_rows * vocab // CHUNK_ELEMENTS))
        rows = max(1, -(-n_rows // n_chunks))
        # one logits buffer and one log-softmax buffer serve every chunk: a fresh (rows, vocab) tensor per chunk
        # is a fresh mapping at this size (32 MB and more: glibc's malloc maps it and unmaps it on free), and
        # first-touch page faults on it made the head's GEMM and log-softmax about a quarter slower
        z_buf = h.new_empty(min(rows, n_rows), vocab)
        logp_buf = torch.empty(min(rows, n_rows), vocab, dtype=acc, device=h.device)
        for start in range(0, n_rows, rows):
            stop = min(start + rows, n_rows)
            hc, tc = h[start:stop], targets[start:stop]
            z = torch.mm(hc, w.T, out=z_buf[:stop - start]).to(acc)  # (rows, vocab)
            logp = torch.log_softmax(z, dim=-1, out=logp_buf[:stop - start])  # one fused pass: z - logsumexp(z)
            total -= logp.gather(1, tc[:, None]).sum()
            if want_grad:
                p = logp.exp_()  # softmax, in place
                p.scatter_add_(1, tc[:, None], p.new_full((stop - start, 1), -1.0))  # minus one-hot at the target
                p.mul_(1 / n_valid)
                if want_h:
                    grad_h[start:stop] = (p.to(h.dtype) @ w).to(h.dtype)
                if want_w:
                    grad_w.addmm_(p.T, hc.to(acc))
        if want_h and rows_kept is not None:  # ignored rows: zero gradient
            grad_h = torch.zeros_like(h_all).index_copy_(0, rows_kept, grad_h)
        if want_grad:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if want_w else None)
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        if grad_out.numel() == 1 and bool(grad_out == 1):  # the usual loss.backward(): no scaling pass
            return grad_h, grad_w, None, None
        return (grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None,
                grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None, None, None)


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of logits ``h @ weight.T`` against ``targets`` without materialising the logits.
    h (..., d) and targets (...) are flattened.

    Under ``torch.compile`` (the compiled training loss, training/trainer.py) the plain formula instead:
    the compiler fuses the log-softmax with its gradient itself, and the eager function above would end the
    graph (it reads from the device which rows to keep, and runs a Python loop over chunks)."""
    if torch.compiler.is_compiling():
        logits = torch.nn.functional.linear(h.reshape(-1, h.shape[-1]), weight.to(h.dtype))  # (N, vocab)
        if logits.dtype not in (torch.float32, torch.float64):  # half precision: softmax in float32
            logits = logits.float()
        targets = targets.reshape(-1)
        total = torch.nn.functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
        return total / (targets != ignore_index).sum().clamp(min=1)  # no target at all: 0, as the eager form
    return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), ignore_index)

"""A preallocated key/value cache for incremental decoding.

During decoding, position t needs the keys and values of positions 0..t of every layer. They
are computed once and kept here, so each new token costs one row of projections instead of a
whole forward pass over the prefix. Buffers are allocated once for ``max_len`` positions
(no reallocation or concatenation per step): per layer k and v of shape (B, H_kv, max_len, d_head).
Memory: 2 * n_layer * B * max_len * H_kv * d_head * bytes — GQA shrinks it by n_head / n_kv_head.

Rolling buffers (sliding-window layers): a layer whose queries see only the last W keys
(``ModelConfig.layer_window``) needs only W slots when ``max_len`` > W; position p is kept in slot
p mod W, overwriting position p - W, which no later query can see. Such a layer costs O(W) memory
whatever the length; ``rolling[l]`` marks it, and the model masks each slot by the position it holds.
``rolling=False`` keeps full buffers for every layer (the window is then a mask only).
"""

from __future__ import annotations

import torch

from tinyformer.config import ModelConfig


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int,
        max_len: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        n_layer: int | None = None,
        rolling: bool = True,
    ) -> None:
        self.max_len = max_len or cfg.max_seq_len
        self.batch_size = batch_size
        layers = cfg.n_layer if n_layer is None else n_layer
        windows = [cfg.layer_window(i) if n_layer is None else None for i in range(layers)]
        self.rolling = [rolling and w is not None and w < self.max_len for w in windows]
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for w, roll in zip(windows, self.rolling):
            shape = (batch_size, cfg.n_kv_head, w if roll else self.max_len, cfg.head_dim)
            self.layers.append((torch.zeros(shape, device=device, dtype=dtype),
                                torch.zeros(shape, device=device, dtype=dtype)))
        self.length = 0  # positions filled so far (the same for every row; padding is masked instead)

    def reset(self) -> None:
        self.length = 0

    def remaining(self) -> int:
        return self.max_len - self.length

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k, _ in self.layers)

    def row_view(self, start: int, stop: int | None = None) -> KVCache:
        """A cache over rows [start, stop) that shares storage with this one (writes go through),
        starting empty. Continuous batching prefills one request into its slot this way."""
        stop = start + 1 if stop is None else stop
        view = KVCache.__new__(KVCache)
        view.max_len, view.batch_size, view.length = self.max_len, stop - start, 0
        view.rolling = list(self.rolling)
        view.layers = [(k[start:stop], v[start:stop]) for k, v in self.layers]
        return view

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (beam search reorders hypotheses), in place."""
        self.layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.layers]
        self.batch_size = int(index.numel())

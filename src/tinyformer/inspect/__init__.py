"""Look inside a model: attention maps, the next-token distribution, per-token loss, RoPE rotations.

Each module computes tensors first (testable without any plotting library) and draws them second:

    attention_maps.py   softmax(q k^T / sqrt(d_h) + M) of every layer and head, recomputed from the
                        model's own modules by a forward pre-hook (the model code is not changed)
    next_token.py       p = softmax(logits / temperature) and the set top-k / top-p keep
    token_loss.py       -log p(x_{t+1} | x_{<=t}) for every position of a text
    rope_plot.py        RoPE's rotation of each pair of dimensions and <RoPE(q, m), RoPE(k, n)> against m - n
    plotting.py         lazy matplotlib import, token labels, atomic PNG writes

``tinyformer inspect`` (cli/inspect.py) runs all four on a run folder.
"""

"""Decode steps under ``torch.compile(fullgraph=True)``: kvgates' attention breaks no graph.

Compiled with the ``aot_eager`` backend (the graph capture is what is tested; inductor's code generation takes
tens of seconds on the CPU and is what ``bench/decode_speed.py --compiled`` measures).
"""

from __future__ import annotations

import torch
from transformers import StaticCache

BACKEND = "aot_eager"


def _decode_steps(forward, cache, token: torch.Tensor, start: int, steps: int) -> torch.Tensor:
    """Logits ``[B, steps, V]`` of ``steps`` greedy decode steps from ``token`` at position ``start``."""
    outs = []
    with torch.no_grad():
        for t in range(start, start + steps):
            pos = torch.tensor([t])
            logits = forward(token, position_ids=pos[None].expand(token.shape[0], 1), cache_position=pos, past_key_values=cache).logits
            outs.append(logits)
            token = logits[:, -1:].argmax(-1)
    return torch.cat(outs, dim=1)


def test_static_cache_compiles_with_kvgates_attention(tiny):
    """A transformers StaticCache on a model whose attention is kvgates' (plain sdpa there) compiles fullgraph and
    decodes what the sdpa model decodes."""
    ref, model = tiny
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, net, compile_ in (("sdpa", ref, False), ("kvgates", model, True)):
        torch._dynamo.reset()
        cache = StaticCache(config=net.config, max_cache_len=32)
        with torch.no_grad():
            token = net(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        forward = torch.compile(net.forward, fullgraph=True, backend=BACKEND) if compile_ else net.forward
        runs[name] = _decode_steps(forward, cache, token, ids.shape[1], 4)
    torch.testing.assert_close(runs["kvgates"], runs["sdpa"], atol=1e-5, rtol=1e-5)

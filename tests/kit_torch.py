"""The torch side of tests/kit.py (its docstring says what a kit is for)."""

from __future__ import annotations

import numpy as np

from tests.kit import init_values


class TorchKit:
    name = "torch"

    def __init__(self):
        import torch
        import torch.nn as nn
        from torch.utils.checkpoint import checkpoint

        self.torch, self.nn = torch, nn

        class Block(nn.Module):
            """``view_output``: returns a view of its result (FSDP2 then only warns that an
            in-place op on it skips the re-gather before backward)."""

            def __init__(self, d_in, d_hidden, d_out, view_output=False):
                super().__init__()
                self.fc1, self.fc2 = nn.Linear(d_in, d_hidden), nn.Linear(d_hidden, d_out)
                self.view_output = view_output

            def forward(self, x):
                out = self.fc2(torch.relu(self.fc1(x)))
                return out.view(-1, out.shape[-1]) if self.view_output else out

        class Stack(nn.Module):
            """blocks in sequence, then a head; ``twice`` calls the last block twice;
            ``in_place`` adds 1 to each block's output in place; ``recompute`` ("reentrant"
            or "non_reentrant") runs every block but the first under activation
            checkpointing (reentrant checkpointing cannot differentiate a block whose input,
            the data, needs no gradient)."""

            def __init__(self, blocks, head, twice=False, in_place=False, recompute=None):
                super().__init__()
                self.blocks, self.head, self.twice = nn.ModuleList(blocks), head, twice
                self.in_place, self.recompute = in_place, recompute

            def forward(self, x):
                for i, block in enumerate(self.blocks):
                    if self.recompute and i > 0:
                        x = checkpoint(block, x, use_reentrant=self.recompute == "reentrant")
                    else:
                        x = block(x)
                    if self.in_place:
                        x += 1.0
                    if self.twice and i == len(self.blocks) - 1:
                        x = block(torch.tanh(x))
                return self.head(x)

        class LMBlock(nn.Module):
            """Pre-norm residual block: softmax attention over the sequence and an MLP."""

            def __init__(self, dim, hidden):
                super().__init__()
                self.norm, self.attn = nn.LayerNorm(dim), nn.Linear(dim, dim)
                self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

            def forward(self, x):
                h = self.norm(x)
                scores = torch.softmax(h @ h.transpose(-1, -2) / h.shape[-1] ** 0.5, -1)
                return x + scores @ self.attn(h) + self.down(torch.relu(self.up(h)))

        class LM(nn.Module):
            """A small language model; ``forward`` stops at the final norm, so the head (a
            separate call, possibly per chunk) is the caller's: the chunked-loss pattern."""

            def __init__(self, vocab, dim, hidden, n_blocks, tie=False, recompute=False):
                super().__init__()
                self.embed = nn.Embedding(vocab, dim)
                self.blocks = nn.ModuleList([LMBlock(dim, hidden) for _ in range(n_blocks)])
                self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)
                self.recompute = recompute
                if tie:
                    self.head.weight = self.embed.weight

            def forward(self, ids):
                x = self.embed(ids)
                for block in self.blocks:
                    x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
                return self.norm(x)

        class MoEBlock(nn.Module):
            """A dense (attention-shaped) layer, a router, and ``experts`` feed-forward
            experts whose weights are one tensor each, ``(experts, ...)``, mixed by the
            router's softmax. ``expert_bias``: the experts' output bias is used (else no
            backward reaches it)."""

            def __init__(self, dim, hidden, experts, expert_bias=True):
                super().__init__()
                self.attn, self.router = nn.Linear(dim, dim), nn.Linear(dim, experts, bias=False)
                self.w_in = nn.Parameter(torch.empty(experts, dim, hidden))
                self.w_out = nn.Parameter(torch.empty(experts, hidden, dim))
                self.b_out = nn.Parameter(torch.empty(experts, dim))
                self.expert_bias = expert_bias

            def experts(self):
                return [self.w_in, self.w_out, self.b_out]

            def forward(self, x):
                h = x + torch.tanh(self.attn(x))
                gates = torch.softmax(self.router(h), -1).T.unsqueeze(-1)  # (experts, batch, 1)
                out = torch.relu(h.unsqueeze(0) @ self.w_in) @ self.w_out
                if self.expert_bias:
                    out = out + self.b_out.unsqueeze(1)
                return h + (gates * out).sum(0)

        class MoE(nn.Module):
            """An input projection, MoE blocks (the last without its expert bias), a head."""

            def __init__(self, d_in, dim, hidden, experts, n_blocks, d_out):
                super().__init__()
                self.proj, self.head = nn.Linear(d_in, dim), nn.Linear(dim, d_out)
                self.blocks = nn.ModuleList([MoEBlock(dim, hidden, experts, i < n_blocks - 1)
                                             for i in range(n_blocks)])

            def forward(self, x):
                x = self.proj(x)
                for block in self.blocks:
                    x = block(x)
                return self.head(x)

        self.Block, self.Stack, self.LM, self.MoE = Block, Stack, LM, MoE

    def linear(self, d_in, d_out):
        return self.nn.Linear(d_in, d_out)

    def norm_then_linear(self, d_in, d_out):
        """LayerNorm(d_in) followed by a linear layer (a transformer's output head)."""
        return self.nn.Sequential(self.nn.LayerNorm(d_in), self.nn.Linear(d_in, d_out))

    def ids(self, array):
        return self.torch.from_numpy(array.astype(np.int64))

    def chunks(self, tensor, n, dim):
        return tensor.chunk(n, dim)

    def lm_loss(self, logits, targets):
        """Mean cross-entropy over every token, computed in float32."""
        vocab = logits.shape[-1]
        return self.nn.functional.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))

    def no_grad(self):
        return self.torch.no_grad()

    def grad_step(self, model, opt, loss_fn):
        """loss_fn() -> loss; backward, one optimizer step; returns the loss as a float."""
        loss = loss_fn()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.item())

    def activation(self):
        return self.nn.ReLU()

    def tensor(self, array):
        return self.torch.from_numpy(array)

    def tie(self, module_a, module_b):
        module_b.weight = module_a.weight

    def params(self, model):
        return list(model.parameters())

    def load(self, model, seed):
        with self.torch.no_grad():
            params = list(model.parameters())
            for p, v in zip(params, init_values([tuple(p.shape) for p in params], seed)):
                p.copy_(self.torch.from_numpy(v))

    def optimizer(self, params, lr=0.05, kind="sgd"):
        if kind == "sgd":
            return self.torch.optim.SGD(params, lr=lr, momentum=0.9)
        return self.torch.optim.AdamW(params, lr=lr, weight_decay=0.01)

    def train_step(self, model, opt, x, y, micro_batches=1, sync_fn=None, grad_scale=1.0,
                   use_main_grad=False):
        """One optimizer step over ``micro_batches`` slices of (x, y); returns the mean loss.
        ``grad_scale`` scales the gradients (not the reported loss); ``use_main_grad`` steps
        on the ``main_grad`` attributes (and checks ``.grad`` stayed None)."""
        total = 0.0
        xs, ys = np.array_split(x, micro_batches), np.array_split(y, micro_batches)
        for i, (mx, my) in enumerate(zip(xs, ys)):
            if sync_fn is not None:
                sync_fn(i, i == micro_batches - 1)
            out = model(self.torch.from_numpy(mx))
            loss = ((out.float() - self.torch.from_numpy(my)) ** 2).mean() / micro_batches
            (loss * grad_scale).backward()
            total += loss.item()
        if use_main_grad:
            for p in opt.param_groups[0]["params"]:
                assert p.grad is None, "a gradient reached .grad while main_grad was requested"
                p.grad, p.main_grad = p.main_grad.to(p.dtype), None
        opt.step()
        opt.zero_grad()
        return total

    def to_numpy(self, t):
        return t.detach().float().numpy().copy()

    def storage_bytes(self, t):
        """Bytes ``t``'s storage holds now (0 once ``release_storage`` freed it)."""
        return t.untyped_storage().size()

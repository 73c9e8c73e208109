"""The MindSpore side of tests/kit.py (its docstring says what a kit is for)."""

from __future__ import annotations

import numpy as np

from tests.kit import init_values


class MindSporeKit:
    name = "mindspore"

    def __init__(self):
        import mindspore as ms
        from mindspore import nn, ops

        ms.set_context(mode=ms.PYNATIVE_MODE)
        self.ms, self.nn, self.ops = ms, nn, ops

        class Block(nn.Cell):
            def __init__(self, d_in, d_hidden, d_out, view_output=False):
                super().__init__()
                self.fc1, self.fc2 = nn.Dense(d_in, d_hidden), nn.Dense(d_hidden, d_out)
                self.view_output = view_output

            def construct(self, x):
                out = self.fc2(ops.relu(self.fc1(x)))
                return out.view(-1, out.shape[-1]) if self.view_output else out

        class Stack(nn.Cell):
            def __init__(self, blocks, head, twice=False, in_place=False, recompute=None):
                super().__init__()
                self.blocks, self.head, self.twice = nn.CellList(blocks), head, twice
                self.in_place, self.recompute = in_place, recompute

            def construct(self, x):
                for i, block in enumerate(self.blocks):
                    if self.recompute and i > 0:  # see the torch kit's Stack
                        x = ms.recompute(block, x, use_reentrant=self.recompute == "reentrant")
                    else:
                        x = block(x)
                    if self.in_place:
                        x += 1.0
                    if self.twice and i == len(self.blocks) - 1:
                        x = block(ops.tanh(x))
                return self.head(x)

        class LMBlock(nn.Cell):
            """Pre-norm residual block: softmax attention over the sequence and an MLP."""

            def __init__(self, dim, hidden):
                super().__init__()
                self.norm, self.attn = nn.LayerNorm((dim,)), nn.Dense(dim, dim)
                self.up, self.down = nn.Dense(dim, hidden), nn.Dense(hidden, dim)

            def construct(self, x):
                h = self.norm(x)
                scores = ops.softmax(ops.matmul(h, h.swapaxes(-1, -2)) / h.shape[-1] ** 0.5, -1)
                return x + ops.matmul(scores, self.attn(h)) + self.down(ops.relu(self.up(h)))

        class LM(nn.Cell):
            """See the torch kit's LM."""

            def __init__(self, vocab, dim, hidden, n_blocks, tie=False, recompute=False):
                super().__init__()
                self.embed = nn.Embedding(vocab, dim)
                self.blocks = nn.CellList([LMBlock(dim, hidden) for _ in range(n_blocks)])
                self.norm, self.head = nn.LayerNorm((dim,)), nn.Dense(dim, vocab, has_bias=False)
                self.recompute = recompute
                if tie:
                    self.head.weight = self.embed.embedding_table

            def construct(self, ids):
                x = self.embed(ids)
                for block in self.blocks:
                    x = ms.recompute(block, x) if self.recompute else block(x)
                return self.norm(x)

        class MoEBlock(nn.Cell):
            """See the torch kit's MoEBlock."""

            def __init__(self, dim, hidden, experts, expert_bias=True):
                super().__init__()
                self.attn = nn.Dense(dim, dim)
                self.router = nn.Dense(dim, experts, has_bias=False)
                self.w_in = ms.Parameter(ms.Tensor(np.zeros((experts, dim, hidden), np.float32)))
                self.w_out = ms.Parameter(ms.Tensor(np.zeros((experts, hidden, dim), np.float32)))
                self.b_out = ms.Parameter(ms.Tensor(np.zeros((experts, dim), np.float32)))
                self.expert_bias = expert_bias

            def experts(self):
                return [self.w_in, self.w_out, self.b_out]

            def construct(self, x):
                h = x + ops.tanh(self.attn(x))
                gates = ops.softmax(self.router(h), -1).swapaxes(0, 1).expand_dims(-1)
                out = ops.matmul(ops.relu(ops.matmul(h.expand_dims(0), self.w_in)), self.w_out)
                if self.expert_bias:
                    out = out + self.b_out.expand_dims(1)
                return h + (gates * out).sum(0)

        class MoE(nn.Cell):
            """See the torch kit's MoE."""

            def __init__(self, d_in, dim, hidden, experts, n_blocks, d_out):
                super().__init__()
                self.proj, self.head = nn.Dense(d_in, dim), nn.Dense(dim, d_out)
                self.blocks = nn.CellList([MoEBlock(dim, hidden, experts, i < n_blocks - 1)
                                           for i in range(n_blocks)])

            def construct(self, x):
                x = self.proj(x)
                for block in self.blocks:
                    x = block(x)
                return self.head(x)

        self.Block, self.Stack, self.LM, self.MoE = Block, Stack, LM, MoE

    def linear(self, d_in, d_out):
        return self.nn.Dense(d_in, d_out)

    def norm_then_linear(self, d_in, d_out):
        """LayerNorm(d_in) followed by a linear layer (a transformer's output head)."""
        return self.nn.SequentialCell([self.nn.LayerNorm((d_in,)), self.nn.Dense(d_in, d_out)])

    def ids(self, array):
        return self.ms.Tensor(array.astype(np.int32))

    def chunks(self, tensor, n, dim):
        return self.ops.chunk(tensor, n, dim)

    def lm_loss(self, logits, targets):
        vocab = logits.shape[-1]
        return self.ops.cross_entropy(logits.astype(self.ms.float32).reshape(-1, vocab),
                                      targets.reshape(-1))

    def no_grad(self):
        return self.ms._no_grad()

    def grad_step(self, model, opt, loss_fn):
        params = [p for p in self.params(model) if p.requires_grad]
        loss, grads = self.ms.value_and_grad(loss_fn, None, params)()
        opt(grads)
        return float(loss.asnumpy())

    def activation(self):
        return self.nn.ReLU()

    def tensor(self, array):
        return self.ms.Tensor(array)

    def tie(self, module_a, module_b):
        module_b.weight = module_a.weight

    def params(self, model):
        return list(model.trainable_params())

    def load(self, model, seed):
        params = list(model.trainable_params())
        for p, v in zip(params, init_values([tuple(p.shape) for p in params], seed)):
            p.set_data(self.ms.Tensor(v))

    def optimizer(self, params, lr=0.05, kind="sgd"):
        from mindspore.experimental.optim import SGD, AdamW

        if kind == "sgd":
            return SGD(params, lr=lr, momentum=0.9)
        return AdamW(params, lr=lr, weight_decay=0.01)

    def train_step(self, model, opt, x, y, micro_batches=1, sync_fn=None, grad_scale=1.0,
                   use_main_grad=False):
        """One optimizer step: value_and_grad per micro-batch, the returned gradients summed
        after the last one (gradients of a backward with is_last_backward off are complete
        only after a later backward), one update."""
        ms = self.ms
        params = [p for p in self.params(model) if p.requires_grad]

        def forward(mx, my):
            out = model(mx)
            loss = ((out.astype(ms.float32) - my) ** 2).mean() / micro_batches
            return loss * grad_scale, loss

        grad_fn = ms.value_and_grad(forward, None, params, has_aux=True)
        total, returned = 0.0, []
        xs, ys = np.array_split(x, micro_batches), np.array_split(y, micro_batches)
        for i, (mx, my) in enumerate(zip(xs, ys)):
            if sync_fn is not None:
                sync_fn(i, i == micro_batches - 1)
            (_, loss), g = grad_fn(ms.Tensor(mx), ms.Tensor(my))
            returned.append(g)
            total += float(loss.asnumpy())
        grads = returned[0]
        for g in returned[1:]:
            grads = tuple(a + b for a, b in zip(grads, g))
        if use_main_grad:
            assert all(float(abs(g).max().asnumpy()) == 0.0 for g in grads), \
                "value_and_grad returned gradients while main_grad was requested"
            grads = tuple(p.main_grad for p in params)
            for p in params:
                p.main_grad = None
        opt(grads)
        return total

    def to_numpy(self, t):
        return t.astype(self.ms.float32).asnumpy().copy()

    def storage_bytes(self, t):
        """Bytes ``t``'s storage holds now (0 once ``release_storage`` freed it)."""
        return t.untyped_storage().nbytes()

"""Models, data and single-process oracles shared by the DDP tests (a helper module, not a test file)."""
import torch
from torch import nn

GLOBAL_BATCH = 16


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(12, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(h, mask=mask, is_causal=True))


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return TinyLM()


MODELS = {"mlp": mlp, "lm": tiny_lm}


def batch(kind: str, step: int, n: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "lm":
        tokens = torch.randint(0, 50, (n, 12), generator=g)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per = t.shape[0] // world
    return t[rank * per: (rank + 1) * per]


def loss_fn(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "lm":
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return ((out - y) ** 2).mean()


class SGD:
    """SGD with momentum as torch.optim.SGD computes it. Hand-written because importing torch.optim pulls in
    torch._dynamo, 5-15 s per worker process on a busy 2-core machine."""

    def __init__(self, params, lr: float = 0.05, momentum: float = 0.9):
        self.params, self.lr, self.momentum, self.bufs = list(params), lr, momentum, {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            buf = self.bufs.get(i)
            buf = p.grad.clone() if buf is None else buf.mul_(self.momentum).add_(p.grad)
            self.bufs[i] = buf
            p.add_(buf, alpha=-self.lr)


def optimizer(model: nn.Module, lr: float = 0.05, momentum: float = 0.9) -> SGD:
    return SGD(model.parameters(), lr, momentum)


def single_process(kind: str, steps: int) -> list[torch.Tensor]:
    """The oracle: the same steps on the full global batch in one process."""
    model = MODELS[kind]()
    opt = optimizer(model)
    for step in range(steps):
        x, y = batch(kind, step)
        opt.zero_grad()
        loss_fn(kind, model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def single_process_grads(kind: str, micro_steps: int = 1) -> list[torch.Tensor]:
    """Gradients of the sum over micro-steps of the full-batch mean loss."""
    model = MODELS[kind]()
    for step in range(micro_steps):
        x, y = batch(kind, step)
        loss_fn(kind, model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def train_ddp(ddp: nn.Module, model: nn.Module, kind: str, steps: int) -> list[torch.Tensor]:
    """``steps`` SGD steps of ``ddp`` (wrapping ``model``) on this rank's shard of each global batch; the final
    parameters."""
    import torch.distributed as dist

    r, n = dist.get_rank(), dist.get_world_size()
    opt = optimizer(model)
    for step in range(steps):
        x, y = batch(kind, step)
        opt.zero_grad()
        loss_fn(kind, ddp(shard(x, r, n)), shard(y, r, n)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]

"""Float64 (F32=1: float32) reference of `sparsync bench tta`'s top-k runs in one process, no distribution: P = 4
simulated ranks, each its own error feedback (or DGC velocity), their sent tensors averaged, SGD (momentum 0.9 after
compression; none with DGC). Same weights (build_model) and samples (Stream.batch) as the bench.
Usage: python tta_topk_reference.py MODEL STEPS VARIANT[,VARIANT...]; prints each variant's loss at every step."""
import sys, math, time, copy
import torch
from sparsync_bench.tta import TTAConfig, Stream, build_model
import os
DT = torch.float32 if os.environ.get("F32") else torch.float64
torch.set_default_dtype(DT)

def run(method, cfg, P=4, steps=60, ratio=0.01, warmup=0, dgc=False, mom=0.9, clip=None, glob=False, dense_below=0):
    stream = Stream(cfg)
    model = build_model(cfg.spec, cfg.seed).to(DT)
    params = [p for p in model.parameters()]
    n = len(params)
    ef = [[torch.zeros_like(p) for p in params] for _ in range(P)]
    vel = [[torch.zeros_like(p) for p in params] for _ in range(P)]
    buf = [torch.zeros_like(p) for p in params]
    lr = cfg.spec.lr
    losses = []
    for s in range(steps):
        agg = [torch.zeros_like(p) for p in params]
        ls = 0.0
        if warmup and s < warmup:
            r = max(ratio, 0.25 ** (1 + 4 * s // warmup))
        else:
            r = ratio
        for rank in range(P):
            x, y = stream.batch(rank, s)
            model.zero_grad()
            loss = model(x.to(DT) if x.is_floating_point() else x, y)
            loss.backward()
            ls += loss.item()
            comps = []
            for i, p in enumerate(params):
                g = p.grad.detach().clone()
                if method == "dense" or g.numel() < dense_below:
                    agg[i] += g / P
                    continue
                if dgc:
                    vel[rank][i].mul_(mom).add_(g)
                    c = ef[rank][i] + vel[rank][i]
                else:
                    c = ef[rank][i] + g
                comps.append((i, c))
            if method == "dense":
                continue
            if glob:
                cat = torch.cat([c.reshape(-1) for _, c in comps])
                k = max(1, math.ceil(r * cat.numel()))
                tau = torch.topk(cat.abs(), k, sorted=False).values.min()
            for i, c in comps:
                flat = c.reshape(-1)
                if glob:
                    idx = torch.nonzero(flat.abs() >= tau, as_tuple=True)[0]
                else:
                    k = max(1, math.ceil(r * c.numel()))
                    idx = torch.topk(flat.abs(), k, sorted=False).indices
                sent = torch.zeros_like(flat); sent[idx] = flat[idx]
                ef[rank][i] = (flat - sent).view_as(c)
                if dgc:
                    vel[rank][i].view(-1)[idx] = 0
                agg[i] += sent.view_as(c) / P
        losses.append(ls / P)
        with torch.no_grad():
            for i, p in enumerate(params):
                if dgc:
                    p -= lr * agg[i]
                else:
                    buf[i].mul_(mom).add_(agg[i])
                    p -= lr * buf[i]
    return losses

if __name__ == "__main__":
    model = sys.argv[1]
    steps = int(sys.argv[2])
    cfg = TTAConfig(model=model, steps=steps)
    variants = {
        "dense": dict(method="dense"),
        "topk1": dict(method="topk"),
        "dgc1w20": dict(method="topk", dgc=True, warmup=20),
        "topk10": dict(method="topk", ratio=0.1),
        "glob1": dict(method="topk", glob=True),
        "dgc1w60": dict(method="topk", dgc=True, warmup=60),
        "dgc10": dict(method="topk", dgc=True, ratio=0.1),
        "topk1w20": dict(method="topk", warmup=20),
        "small1": dict(method="topk", dense_below=65536),
        "bias1": dict(method="topk", dense_below=4096),
        "small10": dict(method="topk", ratio=0.1, dense_below=65536),
        "glob10": dict(method="topk", ratio=0.1, glob=True),
        "topk25": dict(method="topk", ratio=0.25),
        "topk10m5": dict(method="topk", ratio=0.1, mom=0.5),
        "dgc25": dict(method="topk", dgc=True, ratio=0.25),
    }
    sel = sys.argv[3].split(",")
    for name in sel:
        t0 = time.time()
        l = run(cfg=cfg, steps=steps, **variants[name])
        print(name, f"{time.time()-t0:.0f}s", " ".join(f"{v:.3f}" for v in l), "last5", sum(l[-5:])/5, flush=True)

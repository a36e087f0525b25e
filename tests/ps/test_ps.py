"""The parameter server on real server processes over loopback: optimizers against torch, the wire format's
refusals, timeouts, sync/async semantics (sums in worker order), checkpoint and restart. Hostile inputs,
authentication and corrupt checkpoints: test_ps_hostile.py."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from _ps_workers import RawClient
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsync.launch import launch
from sparsync.ps import (
    OptimizerConfig,
    PSClient,
    PSError,
    PSTable,
    PSTimeoutError,
    ServerConfig,
    ServerProcess,
    WireError,
    measure_server,
    save_servers,
    start_servers,
    wire,
)
from sparsync.ps.wire import Header, Op

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def two() -> Iterator[list[ServerProcess]]:
    """Two servers shared by this module's tests (starting a pair costs an interpreter each): every test names
    its tables apart, so no test sees another's rows, configs or sync steps."""
    sv = start_servers(2, wait_timeout=3.0)
    yield sv
    for s in sv:
        s.kill()


# --- wire format (single process) ----------------------------------------------------------------------------
@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 20), dim=st.integers(1, 5), rid=st.integers(0, 2**63), step=st.integers(0, 2**40))
def test_wire_round_trip(n: int, dim: int, rid: int, step: int) -> None:
    rows = np.arange(n, dtype=np.int64) * 3
    vals = np.random.default_rng(n).standard_normal((n, dim)).astype(np.float32)
    h = Header(op=Op.PUSH, rid=rid, step=step, n=n, dim=dim, sender=n)
    got, body = wire.decode(wire.encode(h, *wire.rows_body(rows, vals)))
    assert (got.op, got.rid, got.step, got.n, got.dim, got.sender) == (Op.PUSH, rid, step, n, dim, n)
    r2, v2 = wire.parse_rows(got, body, with_values=True)
    assert np.array_equal(r2, rows) and v2 is not None and np.array_equal(v2, vals)


def test_wire_refusals() -> None:
    h = Header(op=Op.PULL, n=2, dim=1)
    frame = wire.encode(h, *wire.rows_body(np.array([1, 2])))
    with pytest.raises(WireError, match="exceeds the limit"):
        wire.decode(frame, max_bytes=50)
    with pytest.raises(WireError, match="shorter than"):
        wire.decode(frame[:10])
    with pytest.raises(WireError, match="bad magic"):
        wire.decode(b"XXXX" + frame[4:])
    with pytest.raises(WireError, match="body_len"):
        wire.decode(frame[:-1])
    bad_version = frame[:4] + bytes([9]) + frame[5:]
    with pytest.raises(WireError, match="version 9"):
        wire.decode(bad_version)
    got, body = wire.decode(wire.encode(Header(op=Op.PULL, n=3, dim=1), *wire.rows_body(np.array([1, 2]))))
    with pytest.raises(WireError, match="expected 24"):
        wire.parse_rows(got, body, with_values=False)


@settings(max_examples=30, deadline=None)
@given(size=st.integers(0, 3 * wire.FRAGMENT_BYTES) | st.sampled_from([wire.FRAGMENT_BYTES - 56, 2**17 - 56]))
def test_fragments_reassemble_to_the_message(size: int) -> None:
    message = wire.encode(Header(op=Op.CREATE, rid=size), np.random.default_rng(size).bytes(size))
    parts = [bytes(p) for p in wire.fragments(message)]
    assert all(len(p) == wire.FRAGMENT_BYTES for p in parts[:-1]) and 0 < len(parts[-1]) <= wire.FRAGMENT_BYTES
    r = wire.Reassembler(max_message=2**20, max_total=2**20)
    got = [r.feed(b"peer", p) for p in parts]
    assert got[:-1] == [None] * (len(parts) - 1) and bytes(got[-1] or b"") == message
    assert r.held == 0 and len(r) == 0


def test_reassembler_bounds_and_refusals() -> None:
    F = wire.FRAGMENT_BYTES
    big = [bytes(p) for p in wire.fragments(wire.encode(Header(op=Op.PUSH, rid=7), bytes(3 * F)))]
    r = wire.Reassembler(max_message=2 * F, max_total=5 * F)
    with pytest.raises(
        wire.FragmentError, match=f"message of {3 * F + 56} bytes exceeds the limit of {2 * F}"
    ) as e:
        r.feed(b"a", big[0])
    assert e.value.head.rid == 7 and r.held == 0  # nothing reserved for it
    assert [r.feed(b"a", p) for p in big[1:]] == [None] * 3  # its other fragments are read and dropped
    ok = [bytes(p) for p in wire.fragments(wire.encode(Header(op=Op.PUSH, rid=8), bytes(F + F // 2)))]
    assert r.feed(b"a", ok[0]) is None and r.held == len(ok[0]) + len(ok[1])
    with pytest.raises(wire.FragmentError, match="fragment of 10 bytes where 32824 were due"):
        r.feed(b"a", ok[1][:10])  # a short fragment before the end: the message is dropped
    assert r.held == 0 and len(r) == 0
    # every peer's unfinished messages together: three of about 1.5 fragments fit 5 fragments, a fourth not
    for peer in (b"p", b"q", b"s"):
        assert r.feed(peer, ok[0]) is None
    with pytest.raises(wire.FragmentError, match="past the limit of 327680 bytes"):
        r.feed(b"t", ok[0])
    assert bytes(r.feed(b"q", ok[1]) or b"") == ok[0] + ok[1]  # peers are kept apart
    assert r.expire(idle=0.0) == 3 and r.held == 0 and len(r) == 0  # p, s and t's dropped rest went quiet
    # frames that do not start a message are messages by themselves, for decode to judge
    assert r.feed(b"a", b"") == b"" and r.feed(b"a", ok[0][:100]) == ok[0][:100]


def test_messages_over_a_fragment_both_ways() -> None:
    """A push and a pull many fragments long, and a client whose max_message_bytes forces pulls to be split
    (its replies must fit too); a reply over the client's limit fails its request, saying why."""
    sp = ServerProcess(ServerConfig())
    addr = sp.start()
    try:
        rows, dim = 40_000, 16  # 2.6 MB a push, 2.6 MB a pull's reply
        vals = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
        with PSClient([addr], timeout=20) as c:
            t = PSTable(c, "f", rows, dim, partitions=1)
            t.create().wait()
            t.set(np.arange(rows), vals).wait()
            assert np.array_equal(t.pull(np.arange(rows)).wait().numpy(), vals)
        with PSClient([addr], timeout=20, max_message_bytes=100_000) as c:
            t = PSTable(c, "f", rows, dim, partitions=1)
            assert np.array_equal(t.pull(np.arange(rows)[::-1]).wait().numpy(), vals[::-1])
            with pytest.raises(
                PSError, match="reply refused: message of 640056 bytes exceeds the limit of 100000"
            ):
                c.request(0, t._head(Op.PULL, 0, n=10_000), *wire.rows_body(np.arange(10_000))).result(20)
            assert t.pull(np.arange(3)).wait().shape == (3, dim)  # the dropped reply left nothing behind
    finally:
        sp.kill()


# --- optimizers against torch ------------------------------------------------------------------------------
def _torch_opt(name: str, p: torch.nn.Parameter) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.SparseAdam([p], lr=0.05)
    if name == "adagrad":
        return torch.optim.Adagrad([p], lr=0.05)
    return torch.optim.SGD([p], lr=0.05)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_server_optimizers_match_torch_sparse_optimizers(two: list[ServerProcess], name: str) -> None:
    rows, dim = 40, 3
    emb = torch.nn.Embedding(rows, dim, sparse=True)
    opt = _torch_opt(name, emb.weight)
    with PSClient([s.address for s in two], timeout=10) as c:
        t = PSTable(c, f"t_{name}", rows, dim, partitions=3, optimizer=OptimizerConfig(name, lr=0.05))
        assert t.create().wait() == 0
        t.set(torch.arange(rows), emb.weight.detach()).wait()
        g = torch.Generator().manual_seed(0)
        for step in range(6):
            idx = torch.randint(0, rows // 2, (12,), generator=g)  # duplicates, untouched rows
            opt.zero_grad()
            (emb(idx) * torch.randn(12, dim, generator=g)).sum().backward()
            grad = emb.weight.grad
            assert grad is not None and grad.is_sparse
            opt.step()
            gi, gv = grad._indices()[0], grad._values()  # uncoalesced: the table sums duplicates
            t.push(gi, gv, step=step).wait()
            t.apply(step).wait()
        torch.testing.assert_close(
            t.pull(torch.arange(rows), step=6).wait(), emb.weight.detach(), rtol=1e-5, atol=1e-6
        )


# --- refusals on the wire, timeouts --------------------------------------------------------------------------
def test_server_refuses_bad_messages_with_an_error_reply() -> None:
    sp = ServerProcess(ServerConfig(max_message_bytes=4096, wait_timeout=2.0))
    addr = sp.start()
    try:
        assert sp.cfg.host == "127.0.0.1" and addr.startswith("tcp://127.0.0.1:")
        with RawClient(addr) as raw:

            def ask(frame: bytes) -> tuple[Header, str]:
                got = raw.ask(frame)
                assert got is not None, "no reply from the server"
                return got

            h, msg = ask(wire.encode(Header(op=Op.PING, rid=8)))
            assert h.status == 0 and h.rid == 8
            h, msg = ask(b"garbage that is not a message" * 3)
            assert h.status == 1 and "magic" in msg
            h, msg = ask(wire.encode(Header(op=77, rid=10)))
            assert h.status == 1 and "unknown op 77" in msg
            h, msg = ask(wire.encode(Header(op=Op.CREATE, rid=11), b"{not json"))
            assert h.status == 1 and "JSON" in msg
            huge = {"name": "h", "rows": 10**12, "lo": 0, "hi": 10**12, "dim": 1000}
            h, msg = ask(wire.encode(Header(op=Op.CREATE, rid=13), wire.json_body(huge)))
            assert h.status == 1 and "max_shard_bytes" in msg
            h, msg = ask(wire.encode(Header(op=Op.CREATE, rid=14), wire.json_body({"rows": "x"})))
            assert h.status == 1 and h.rid == 14
            h, msg = ask(wire.encode(Header(op=Op.PULL, rid=12, n=1, dim=2), bytes(8)))
            assert h.status == 1 and "does not exist" in msg
        with PSClient([addr], timeout=5) as c:
            t = PSTable(c, "e", 10, 2, partitions=2)
            t.create().wait()
            with pytest.raises(PSError, match="outside partition"):  # row 7 sent to partition 0
                c.request(0, t._head(Op.PULL, 0, n=1), *wire.rows_body(np.array([7]))).result(5)
            with pytest.raises(PSError, match="dim 3 does not match"):
                c.request(0, Header(op=Op.PULL, table=t.id, n=1, dim=3), *wire.rows_body(np.array([1]))).result(5)
            with pytest.raises(PSError, match="non-finite"):
                t.push(torch.tensor([1]), torch.tensor([[float("nan"), 0.0]])).wait()
            with pytest.raises(ValueError, match="row 10 out of range"):
                t.pull(torch.tensor([10]))
            with pytest.raises(PSError, match="another config"):
                PSTable(c, "e", 10, 2, partitions=1).create().wait()
    finally:
        sp.kill()


def test_dead_server_gives_a_timeout_error_not_a_hang() -> None:
    own = start_servers(2, wait_timeout=3.0)  # its own pair: it kills one
    try:
        with PSClient([s.address for s in own], timeout=1.5) as c:
            t = PSTable(c, "e", 20, 2)
            t.create().wait()
            own[1].kill()
            t0 = time.monotonic()
            with pytest.raises(PSTimeoutError, match=r"server 1 .*no reply within 1.5 s"):
                t.pull(torch.arange(20)).wait()
            assert time.monotonic() - t0 < 5
            assert t.pull(torch.arange(0, 20, 2)).wait().shape == (10, 2)  # rows on the live server still work
    finally:
        for s in own:
            s.kill()


def test_sync_step_waits_for_every_pusher_then_applies_once(two: list[ServerProcess]) -> None:
    addrs = [s.address for s in two]
    with PSClient(addrs, timeout=10) as c, PSClient(addrs, timeout=10, sender=1) as c1:
        t = PSTable(c, "sync", 8, 1, pushers=2, optimizer=OptimizerConfig("sgd", lr=1.0))
        t1 = PSTable(c1, "sync", 8, 1, pushers=2, optimizer=OptimizerConfig("sgd", lr=1.0))  # worker 1's handle
        t.create().wait()
        t.push(torch.tensor([0, 5]), torch.tensor([[1.0], [2.0]]), step=0).wait()
        with pytest.raises(PSError, match="worker 0 already pushed step 0"):  # not counted twice
            t.push(torch.tensor([0]), torch.tensor([[1.0]]), step=0).wait()
        apply = t.apply(0)
        pull = t.pull(torch.tensor([0, 5]), step=1)  # waits for the chief's update
        time.sleep(0.3)
        assert not apply.is_completed() and not pull.is_completed()
        t1.push(torch.tensor([0]), torch.tensor([[10.0]]), step=0).wait()
        apply.wait()
        assert pull.wait().flatten().tolist() == [-11.0, -2.0]  # summed over pushers, applied once
        # A pusher that never comes: the chief's APPLY fails after the server's wait_timeout (3 s), with why.
        t.push(torch.tensor([1]), torch.tensor([[1.0]]), step=1).wait()
        with pytest.raises(PSError, match="1 of 2 pushes arrived"):
            t.apply(1).wait()


def test_sync_sums_pushes_in_worker_order_not_arrival_order(two: list[ServerProcess]) -> None:
    # float32: (1e8 + 1) - 1e8 = 0 but (-1e8 + 1e8) + 1 = 1, so the order of the sum shows in the result
    grads = {0: 1e8, 1: 1.0, 2: -1e8}
    addrs = [s.address for s in two]
    clients = [PSClient(addrs, timeout=10, sender=w) for w in range(3)]
    try:
        results = []
        for k, arrival in enumerate([(0, 1, 2), (2, 0, 1), (1, 2, 0)]):
            tables = [
                PSTable(c, f"order{k}", 4, 1, pushers=3, optimizer=OptimizerConfig("sgd", lr=1.0)) for c in clients
            ]
            tables[0].create().wait()
            for w in arrival:
                tables[w].push(torch.tensor([2]), torch.tensor([[grads[w]]]), step=0).wait()
            tables[0].apply(0).wait()
            results.append(tables[0].pull(torch.tensor([2]), step=1).wait())
        total = (np.float32(1e8) + np.float32(1.0)) + np.float32(-1e8)  # worker order 0, 1, 2: 0, not 1
        expect = np.array([[np.float32(0.0) - total]], np.float32)  # sgd, lr 1, from zero weights
        for r in results:
            assert r.numpy().tobytes() == expect.tobytes()
    finally:
        for c in clients:
            c.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.large)])
def test_two_sync_hybrid_runs_give_identical_bits(world: int) -> None:
    # at P = 3 the server summed a step's pushes in arrival order, so runs differed in the last bits.
    import _ps_workers as pw

    from sparsync import launch

    pairs = pw.start_pairs(2, wait_timeout=20.0)  # two runs, each on fresh servers
    procs = [s for sv in pairs for s in sv]
    try:
        cases = [dict(opt="adam", reduce="mean", steps=4, addresses=[s.address for s in sv]) for sv in pairs]
        first, second = launch(pw.hybrid_worker, nprocs=world, args=([], cases), timeout=120)[0]
    finally:
        for s in procs:
            s.kill()
    assert first["table"].numpy().tobytes() == second["table"].numpy().tobytes()
    assert all(torch.equal(a, b) for a, b in zip(first["head"], second["head"], strict=True))
    assert first["losses"] == second["losses"]


def test_async_applies_each_push_at_once(two: list[ServerProcess]) -> None:
    with PSClient([s.address for s in two], timeout=10) as c:
        t = PSTable(c, "async", 8, 2, mode="async", pushers=3, optimizer=OptimizerConfig("sgd", lr=1.0))
        t.create().wait()
        t.push(torch.tensor([3, 3]), torch.ones(2, 2)).wait()  # one worker, no one else: applied anyway
        assert t.pull(torch.tensor([3])).wait().tolist() == [[-2.0, -2.0]]


@pytest.mark.parametrize("split", ["stride", "range"])
@pytest.mark.parametrize("partitions", [2, 3])
def test_pull_push_apply_equal_numpy_reference(two: list[ServerProcess], split: str, partitions: int) -> None:
    rows, dim, lr = 23, 3, 0.5
    name = f"ref_{split}{partitions}"  # the module's servers hold every case's table
    rng = np.random.default_rng(partitions)
    ref = rng.standard_normal((rows, dim)).astype(np.float32)
    addrs = [s.address for s in two]
    with PSClient(addrs, timeout=10) as c, PSClient(addrs, timeout=10, sender=1) as c1:
        t, t1 = (
            PSTable(x, name, rows, dim, partitions=partitions, pushers=2, split=split, divisor=2.0,
                    optimizer=OptimizerConfig("sgd", lr=lr))
            for x in (c, c1)
        )  # fmt: skip
        t.create().wait()
        t.set(np.arange(rows), ref).wait()
        for step in range(3):
            total = np.zeros_like(ref)
            for pusher in (t, t1):
                idx = rng.integers(0, rows, 9)  # duplicates, untouched rows
                g = rng.standard_normal((9, dim)).astype(np.float32)
                np.add.at(total, idx, g)
                pusher.push(idx, g, step=step).wait()
            t.apply(step).wait()
            ref -= lr * total / 2
            ask = rng.integers(0, rows, 15)
            np.testing.assert_allclose(t.pull(ask, step=step + 1).wait().numpy(), ref[ask], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(t.read_all().numpy(), ref, rtol=1e-5, atol=1e-6)


def test_stride_split_spreads_low_rows_over_servers() -> None:
    with PSClient(["tcp://127.0.0.1:1", "tcp://127.0.0.1:2"], timeout=1) as c:
        for P in (2, 4):
            t = PSTable(c, "s", 100, 1, partitions=P)
            server = np.empty(100, dtype=np.int64)
            for p, pos in enumerate(t._split(np.arange(100))):
                server[pos] = t.server_of(p)
            assert (server == np.arange(100) % 2).all()  # row r on server r mod S
        t = PSTable(c, "r", 100, 1, partitions=2, split="range")
        hot = t._split(np.arange(8))  # the Zipf-hot rows all land on partition (server) 0
        assert [len(x) for x in hot] == [8, 0]
        with pytest.raises(KeyError, match="unknown split 'cyclic'"):
            PSTable(c, "x", 10, 1, split="cyclic")


@pytest.mark.parametrize("split", ["stride", "range"])
def test_checkpoint_and_restart_resume_tables_and_optimizer_state(tmp_path: object, split: str) -> None:
    sv = start_servers(2, checkpoint_dir=str(tmp_path), wait_timeout=5.0)
    rows, dim = 30, 4
    emb = torch.nn.Embedding(rows, dim, sparse=True)
    opt = torch.optim.SparseAdam([emb.weight], lr=0.05)
    g = torch.Generator().manual_seed(1)
    try:
        with PSClient([s.address for s in sv], timeout=5) as c:
            t = PSTable(c, "ck", rows, dim, partitions=4, optimizer=OptimizerConfig("adam", lr=0.05), split=split)
            t.create().wait()
            t.set(torch.arange(rows), emb.weight.detach()).wait()
            for step in range(6):
                if step == 3:
                    files = save_servers(c).wait()
                    assert len(files) == 2
                    for s in sv:
                        s.kill()  # both crash
                    for s in sv:
                        s.restart()  # same ports, resume from the checkpoint
                    assert t.create().wait() == 3
                idx = torch.randint(0, rows, (10,), generator=g)
                opt.zero_grad()
                (emb(idx) * torch.randn(10, dim, generator=g)).sum().backward()
                opt.step()
                grad = emb.weight.grad
                assert grad is not None
                t.push(grad._indices()[0], grad._values(), step=step).wait()
                t.apply(step).wait()
            # Adam's moments and step counter survived: the run equals an uninterrupted torch run.
            torch.testing.assert_close(t.read_all(), emb.weight.detach(), rtol=1e-5, atol=1e-6)
    finally:
        for s in sv:
            s.kill()


def test_config_validation_names_the_bad_value() -> None:
    from sparsync.hybrid import HybridConfig
    from sparsync.ps.shard import ShardConfig

    with pytest.raises(KeyError, match="unknown server optimizer 'rmsprop'"):
        OptimizerConfig("rmsprop")
    with pytest.raises(ValueError, match="lr must be"):
        OptimizerConfig("sgd", lr=-1.0)
    with pytest.raises(KeyError, match="unknown mode 'semi'"):
        HybridConfig(mode="semi")
    with pytest.raises(ValueError, match="sparse_reduce must be"):
        HybridConfig(sparse_reduce="max")
    with pytest.raises(ValueError, match="bad shard"):
        ShardConfig("t", rows=10, lo=5, hi=20, dim=2)
    with pytest.raises(ValueError, match="stride must be in"):
        ShardConfig("t", rows=10, lo=0, hi=10, dim=2, stride=0)
    with pytest.raises(KeyError, match="unknown split 'rows'"):
        HybridConfig(split="rows")
    with pytest.raises(ValueError, match="unknown table config keys"):
        ShardConfig.from_json({"name": "t", "rows": 1, "lo": 0, "hi": 1, "dim": 1, "evil": 1})
    with pytest.raises(ValueError, match="port"):
        ServerConfig(port=70000)
    with pytest.raises(ValueError, match="at least one server address"):
        PSClient([])


def test_server_exits_when_its_starter_dies() -> None:
    import os
    import subprocess
    import sys

    code = (
        "import os\nfrom sparsync.ps import start_servers\n"
        "sv = start_servers(1)\nprint(sv[0]._proc.pid, flush=True)\nos._exit(0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=os.environ)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return  # gone: no orphaned server
        time.sleep(0.2)
    os.kill(pid, 9)
    pytest.fail(f"server {pid} outlived the process that started it")


def test_server_optimizers_are_one_class_each_with_their_state_slots() -> None:
    """The registry is the one list: names, torch's default eps, and the state a shard allocates (and counts
    in its memory bound) all come from each optimizer's class."""
    from sparsync.ps.optim import OPTIMIZERS, SERVER_OPTIMIZERS, SparseOptimizer
    from sparsync.ps.shard import ShardConfig

    assert OPTIMIZERS == tuple(SERVER_OPTIMIZERS) == ("sgd", "adagrad", "adam")
    for name, slots in (("sgd", 0), ("adagrad", 1), ("adam", 2)):
        cfg = OptimizerConfig(name, initial_accumulator_value=0.5)
        opt = SparseOptimizer(cfg, 3, 2)
        assert cfg.state_slots == len(opt.state) == slots
        assert all(a.shape == (3, 2) and a.dtype == np.float32 for a in opt.state.values())
        assert cfg.epsilon == {"sgd": 0.0, "adagrad": 1e-10, "adam": 1e-8}[name]
        sc = ShardConfig(name="t", rows=3, lo=0, hi=3, dim=2, optimizer=cfg)
        assert sc.nbytes - ShardConfig(name="t", rows=3, lo=0, hi=3, dim=2).nbytes == slots * 3 * 2 * 4
    assert (
        SparseOptimizer(OptimizerConfig("adagrad", initial_accumulator_value=0.5), 1, 1).state["sum"][0, 0] == 0.5
    )


@pytest.mark.multiprocess
def test_measure_server_times_pulls_from_every_rank(two: list[ServerProcess]) -> None:
    """The planner's measured price of the servers: every rank pulls at once and gets the same (slowest rank's)
    round trip and per-byte cost; the probe's table holds what was pulled (zeros)."""
    import _ps_workers as pw

    addrs = [str(sp.address) for sp in two]
    res = launch(pw.probe_worker, nprocs=3, args=(addrs,), timeout=120)
    assert res[0] == res[1] == res[2]
    round_trip, per_byte = res[0]
    assert 0 < round_trip < 60 and 0 <= per_byte < 1
    with PSClient(addrs) as client:
        table = PSTable(client, "__sparsync_probe:200x16", 600, 16, mode="async")
        assert torch.equal(table.pull(np.arange(600)).wait(), torch.zeros(600, 16))
    with PSClient(addrs) as client, pytest.raises(ValueError, match="rows, dim and repeats must be >= 1, got 0"):
        measure_server(client, rows=0, dim=16, repeats=1)

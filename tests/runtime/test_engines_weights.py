"""The weight-sync protocol (`runtime.weight_sync`) over a real gloo group between threads: buckets, packing, tied
aliases, the lazily produced stream; and the hf engine's step gate blocks forward passes while closed."""

from __future__ import annotations

import json
import threading
import time

import torch

from runtime import weight_sync
from runtime.engines.hf_engine import StepGate
from runtime.engines.weights import tied_embeddings
from runtime.trainer import free_port
from runtime.weight_sync import EMBED, LM_HEAD, TensorMeta


def test_bucket_layout_is_consecutive_and_bounded():
    metas = [TensorMeta(f"w{i}", "float32", (n,)) for i, n in enumerate([10, 10, 30, 5, 100, 1])]
    # bytes 40, 40, 120, 20, 400, 4: a bucket closes before it would overflow; a larger tensor travels alone
    assert weight_sync.bucket_layout(metas, bucket_bytes=100) == [[0, 1], [2], [3], [4], [5]]
    assert weight_sync.bucket_layout(metas, bucket_bytes=1 << 20) == [list(range(len(metas)))]


def test_tied_lm_head_is_aliased_only_when_tied_and_not_sent():
    metas = [TensorMeta(EMBED, "float32", (10, 4)), TensorMeta("model.norm.weight", "float32", (4,))]
    assert weight_sync.tied_aliases(metas, tied=True) == {LM_HEAD: EMBED}
    assert weight_sync.tied_aliases(metas, tied=False) == {}
    assert weight_sync.tied_aliases([*metas, TensorMeta(LM_HEAD, "float32", (10, 4))], tied=True) == {}


def test_stream_over_gloo_delivers_every_tensor_in_the_wire_dtype():
    gen = torch.Generator().manual_seed(0)
    state = {EMBED: torch.randn(50, 8, generator=gen), "a.weight": torch.randn(8, 8, generator=gen),
             "b.weight": torch.randn(300, generator=gen), "norm.weight": torch.randn(8, generator=gen)}
    metas = [TensorMeta(n, "bfloat16", tuple(t.shape)) for n, t in state.items()]
    port, world, bucket = free_port(), 3, 1024
    received: dict[int, dict[str, torch.Tensor]] = {1: {}, 2: {}}
    stats: dict[int, weight_sync.SyncStats] = {}

    def member(rank: int) -> None:
        group = weight_sync.join_group("gloo_broadcast", "127.0.0.1", port, rank, world, 30.0)
        if rank == 0:
            tensors = (state[m.name].to(torch.bfloat16) for m in metas)  # produced one at a time
            stats[0] = weight_sync.send_tensors(tensors, metas, bucket, group, torch.device("cpu"))
        else:
            stats[rank] = weight_sync.receive(group, metas, bucket, torch.device("cpu"),
                                              lambda pairs: received[rank].update({n: t.clone() for n, t in pairs}),
                                              {LM_HEAD: EMBED})

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert stats[0].buckets == len(weight_sync.bucket_layout(metas, bucket)) > 1
    for rank in (1, 2):
        got = received[rank]
        assert set(got) == {*state, LM_HEAD}
        assert all(torch.equal(got[n], state[n].to(torch.bfloat16)) for n in state)
        assert torch.equal(got[LM_HEAD], got[EMBED])
        assert stats[rank].bytes == stats[0].bytes == sum(m.nbytes for m in metas)


def test_tied_embeddings_reads_the_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert tied_embeddings(str(tmp_path))
    assert not tied_embeddings(str(tmp_path / "missing"))  # a hub name: nothing to add


def test_step_gate_close_waits_for_the_running_step_and_blocks_the_next():
    gate = StepGate()
    steps: list[float] = []

    def generation_thread():
        for _ in range(3):
            with gate.forward():
                time.sleep(0.05)
                steps.append(time.monotonic())

    gate.enter()  # a step is running when close() is called
    worker = threading.Thread(target=generation_thread)
    closer_done = []

    def close():
        gate.close()
        closer_done.append(time.monotonic())

    closer = threading.Thread(target=close)
    closer.start()
    time.sleep(0.05)
    assert not closer_done  # close() waits for the running step
    gate.leave()
    closer.join(timeout=5)
    assert closer_done
    worker.start()
    time.sleep(0.2)
    assert steps == []  # closed: the next step does not start
    gate.open()
    worker.join(timeout=5)
    assert len(steps) == 3


def test_a_score_goes_before_the_next_generation_chunk():
    """The generation thread re-enters the gate the moment it leaves it: a waiting `score` (the post-sync probe)
    must take the next turn, not wait behind chunk after chunk."""
    gate = StepGate()
    order: list[str] = []

    def generation_thread():
        for _ in range(40):  # bounded: a starved score fails the test instead of hanging it
            with gate.forward():
                time.sleep(0.02)
                order.append("chunk")

    def score():
        with gate.forward(score=True):
            order.append("score")

    worker = threading.Thread(target=generation_thread)
    worker.start()
    time.sleep(0.05)
    chunks_before = len(order)
    scorer = threading.Thread(target=score)
    scorer.start()
    worker.join(timeout=10)
    scorer.join(timeout=10)
    assert order.index("score") <= chunks_before + 1  # at most the chunk running when the score came


def test_shard_boxes_follow_fsdp2_chunking_and_dtensor_offsets():
    """`shard_layout`'s box of each mesh coordinate: FSDP2's torch.chunk rows on one dim, and DTensor's own local
    shape and offset for the placements of HSDP and of experts under ep below the ranks; a box is one run of the
    whole tensor exactly when its elements are consecutive."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from runtime.shard_layout import Piece, _box

    for n in (1, 5, 7, 8, 100, 1003):
        for world in (1, 2, 3, 4, 8):
            chunks = [len(c) for c in torch.arange(n).chunk(world)]
            rows = [_box(0, (r,), (world,), (Shard(0),), (n, 3)).shape[0] for r in range(world)]
            assert rows == chunks + [0] * (world - len(chunks)), (n, world)
    for shape, mesh, placements in [((6, 7, 5), (2, 3), (Shard(1), Shard(0))), ((5, 3), (2, 2), (Replicate(), Shard(0))),
                                    ((3, 9, 4), (3, 2), (Shard(1), Shard(0)))]:
        for coord in itertools.product(*(range(k) for k in mesh)):
            box = _box(0, coord, mesh, placements, shape)
            local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), placements)
            assert box.shape == tuple(local) and box.offset == tuple(offset), (shape, placements, coord)
    # tensor parallelism under FSDP2 ((dp, tp) mesh): FSDP2 chunks each tp rank's torch.chunk rows again (its
    # storage; DTensor's _StridedShard offsets differ from it on uneven splits)
    from torch.distributed.tensor.placement_types import _StridedShard

    for n in (4, 7, 13, 300):
        for dp, tp in ((1, 2), (2, 2), (3, 2), (2, 4)):
            for d, t in itertools.product(range(dp), range(tp)):
                box = _box(0, (d, t), (dp, tp), (_StridedShard(0, split_factor=tp), Shard(0)), (n, 3))
                rows = list(torch.arange(n).chunk(tp)[t].chunk(dp)) if t < len(torch.arange(n).chunk(tp)) else []
                want = rows[d].tolist() if d < len(rows) else []
                assert list(range(box.offset[0], box.offset[0] + box.shape[0])) == want or not (want or box.shape[0])
    whole = (3, 4, 5)
    full = torch.arange(60).reshape(whole)
    for offset in itertools.product(*(range(k) for k in whole)):
        for size in itertools.product(*(range(1, k - o + 1) for k, o in zip(whole, offset, strict=True))):
            box = Piece(0, offset, size)
            flat = box.view(full).reshape(-1)
            run = box.run(whole)
            assert (run is not None) == bool((flat.diff() == 1).all()), (offset, size)
            assert run is None or run == (flat[0].item(), flat.numel())


def test_buffer_pool_keeps_a_viewed_buffer_and_hands_it_out_once_free():
    pool = weight_sync.BufferPool(keep=2)
    cpu = torch.device("cpu")
    buf = pool.take(1000, cpu)
    view = buf[:10]  # the loader still holds a view (vLLM's layer-wise reload of a layer straddling two buckets)
    pool.give(buf)
    other = pool.take(1000, cpu)
    assert other.data_ptr() != buf.data_ptr()  # still viewed: not handed out
    del view
    again = pool.take(1000, cpu)
    assert again.data_ptr() == buf.data_ptr()  # free now: reused, no fresh allocation
    # a full pool makes room by dropping a buffer nobody views, never one still viewed
    a, b, c = (torch.empty(1000, dtype=torch.uint8) for _ in range(3))
    pool = weight_sync.BufferPool(keep=2)
    view_a = a[:1]
    pool.give(a)
    pool.give(b)
    pool.give(c)
    assert {t.data_ptr() for t in pool._kept} == {a.data_ptr(), c.data_ptr()} and view_a.numel() == 1

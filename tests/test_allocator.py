import json
from pathlib import Path

import pytest
import torch

from recipes_lib import allocator, fake_memory, planner
from recipes_lib.allocator import AllocationLog, CachingAllocator, load_traces, replay
from recipes_lib.fake_memory import Stack

MiB = 2**20
RAW = Path(__file__).resolve().parents[1] / "results" / "h100" / "raw"


def test_small_requests_are_packed_into_2_mib_segments():
    a = CachingAllocator()
    blocks = [a.malloc(500_000) for _ in range(5)]  # 500 kB rounds to 500 224: four fit in 2 MiB
    assert (a.segments, a.reserved) == (2, 4 * MiB)
    assert a.allocated == 5 * allocator.round_size(500_000)
    a.free(blocks[4])
    assert a.reserved == 4 * MiB  # cached, not returned


def test_a_request_under_10_mib_takes_a_20_mib_segment_and_splits_it():
    a = CachingAllocator()
    first, second = a.malloc(3 * MiB), a.malloc(3 * MiB)
    assert (a.segments, a.reserved, a.allocated) == (1, 20 * MiB, 6 * MiB)
    assert second.addr == first.addr + 3 * MiB  # the rest of the same segment
    big = a.malloc(15 * MiB + 1)  # more than the 14 MiB left: a segment rounded up to 2 MiB,
    assert (a.segments, big.size) == (2, 16 * MiB)  # handed out whole (< 1 MiB would remain)
    assert a.reserved == 20 * MiB + 16 * MiB


def test_a_large_block_is_split_only_when_more_than_1_mib_would_remain():
    a = CachingAllocator()
    a.free(a.malloc(12 * MiB))
    block = a.malloc(11 * MiB)  # 1 MiB would remain: the whole block is handed out
    assert block.size == 12 * MiB and a.allocated == 12 * MiB
    a.free(block)
    block = a.malloc(10 * MiB)  # 2 MiB remain: split
    assert block.size == 10 * MiB and a.allocated == 10 * MiB


def test_the_smallest_cached_block_that_fits_is_taken():
    a = CachingAllocator()
    big, small = a.malloc(30 * MiB), a.malloc(14 * MiB)
    a.free(big)
    a.free(small)
    assert a.malloc(12 * MiB).addr == small.addr
    assert a.segments == 2


def test_freed_neighbours_merge_and_empty_cache_releases_whole_segments_only():
    a = CachingAllocator()
    x, y, _ = (a.malloc(4 * MiB) for _ in range(3))  # one 20 MiB segment, 8 MiB left
    a.free(y)
    assert a.malloc(5 * MiB).addr != y.addr  # 4 MiB hole too small: the tail serves it
    a.free(x)
    assert a.empty_cache() == 0  # the segment still holds z and the 5 MiB block
    assert a.malloc(8 * MiB).addr == x.addr  # x and y merged into one 8 MiB block


def test_fragmentation_makes_reserved_exceed_allocated():
    a = CachingAllocator()
    first = a.malloc(12 * MiB)
    a.malloc(12 * MiB)
    a.free(first)
    a.malloc(14 * MiB)  # the freed 12 MiB does not fit: a new segment
    assert (a.allocated, a.reserved) == (26 * MiB, 38 * MiB)


def test_a_cached_block_serves_before_the_capacity_is_asked():
    a = CachingAllocator(capacity=40 * MiB)
    a.free(a.malloc(30 * MiB))
    a.malloc(20 * MiB)  # cached 30 MiB serves it, split: nothing new
    assert a.segments == 1


def test_out_of_memory_after_releasing_what_can_be():
    a = CachingAllocator(capacity=40 * MiB)
    a.free(a.malloc(24 * MiB))
    a.malloc(30 * MiB)  # the cached 24 MiB is too small: released, then 30 MiB fits
    assert (a.releases, a.reserved) == (1, 30 * MiB)
    with pytest.raises(allocator.SimulatedOutOfMemory, match="9.0 MiB request needs a 20 MiB"):
        a.malloc(9 * MiB)


def test_expandable_segments_grow_one_segment_by_20_mib_pages():
    a = CachingAllocator(expandable_segments=True)
    first, second = a.malloc(3 * MiB), a.malloc(3 * MiB)
    assert second.addr == first.addr + 3 * MiB
    assert (a.segments, a.reserved) == (1, 20 * MiB)  # one page mapped
    big = a.malloc(30 * MiB)  # the free 14 MiB at the end grows by one more page
    assert (big.addr, big.size) == (second.addr + 3 * MiB, 30 * MiB)
    assert (a.segments, a.reserved) == (1, 40 * MiB)  # the default: 20 + 30 MiB segments


def test_expandable_segments_split_any_block_with_512_bytes_left():
    a = CachingAllocator(expandable_segments=True)
    a.free(a.malloc(12 * MiB))
    assert a.malloc(11 * MiB).size == 11 * MiB  # the default hands out all 12 MiB


def test_expandable_best_fit_passes_over_the_block_that_can_grow():
    a = CachingAllocator(expandable_segments=True)
    hole, _, _ = a.malloc(6 * MiB), a.malloc(2 * MiB), a.malloc(9 * MiB)  # 3 MiB left at the end
    a.free(hole)
    assert a.malloc(5 * MiB // 2).addr == hole.addr  # not the smaller block at the end
    assert a.reserved == 20 * MiB


def test_expandable_segments_fit_where_a_split_segment_strands_its_rest():
    """A 40 MiB segment that serves 10 MiB keeps 30 MiB nothing larger can use and nothing can
    release: the default runs out at 60 MiB where expandable segments map one more page."""
    for expandable, fits in ((False, False), (True, True)):
        a = CachingAllocator(capacity=60 * MiB, expandable_segments=expandable)
        a.free(a.malloc(40 * MiB))
        a.malloc(10 * MiB)
        if fits:
            a.malloc(35 * MiB)
            assert a.reserved == 60 * MiB
        else:
            with pytest.raises(allocator.SimulatedOutOfMemory):
                a.malloc(35 * MiB)


def test_expandable_segments_unmap_free_pages_and_map_them_back_lowest_first():
    a = CachingAllocator(capacity=80 * MiB, expandable_segments=True)
    x, _, _ = (a.malloc(20 * MiB) for _ in range(3))
    a.free(x)
    a.malloc(30 * MiB)  # two more pages pass 80 MiB: x's page is unmapped first
    assert (a.releases, a.reserved, a.allocated) == (1, 80 * MiB, 70 * MiB)
    assert a.empty_cache() == 0  # the 10 MiB after the 30 MiB block is no whole page
    with pytest.raises(allocator.SimulatedOutOfMemory, match="20.0 MiB request needs more pages"):
        a.malloc(20 * MiB)
    b = CachingAllocator(expandable_segments=True)
    x, _ = b.malloc(20 * MiB), b.malloc(20 * MiB)
    b.free(x)
    assert b.empty_cache() == 20 * MiB and b.reserved == 20 * MiB
    assert b.malloc(4 * MiB).addr == x.addr  # the hole is mapped back, not the segment's end
    assert b.reserved == 40 * MiB
    with pytest.raises(allocator.SimulatedOutOfMemory):  # no card at all
        CachingAllocator(capacity=0, expandable_segments=True).malloc(1)


def test_a_share_of_a_larger_card_is_checked_before_an_expandable_segment_grows():
    """Under torch.cuda.set_per_process_memory_fraction, expandable segments check the share
    against the default rules' segment for the request (a 36 MiB one for 35 MiB) before they
    map, where a card of that size checks the pages mapped (one more 20 MiB page): the share
    releases the cache once where the card did not need to. The default rules check alike."""
    def run(**kw):
        a = CachingAllocator(capacity=60 * MiB, **kw)
        a.free(a.malloc(40 * MiB))
        a.malloc(10 * MiB)
        a.malloc(35 * MiB)
        return a.releases, a.reserved
    assert run(expandable_segments=True) == (0, 60 * MiB)
    assert run(expandable_segments=True, fraction=True) == (1, 60 * MiB)
    events = [("alloc", 0, 24 * MiB), ("free", 0, 0), ("alloc", 1, 30 * MiB)]
    same = [replay(events, 40 * MiB, fraction=f) for f in (False, True)]
    assert [(a.releases, a.peak_reserved) for a in same] == [(1, 30 * MiB)] * 2


def test_max_split_size_keeps_oversize_blocks_whole():
    a = CachingAllocator(max_split_size_mb=40)
    a.free(a.malloc(60 * MiB))
    block = a.malloc(30 * MiB)  # under the limit: the cached 60 MiB block is not for it
    assert (block.size, a.reserved) == (30 * MiB, 90 * MiB)
    a.free(block)
    block = a.malloc(45 * MiB)  # oversize, and 60 < 45 + 20: served whole, not split
    assert (block.size, a.allocated, a.reserved) == (60 * MiB, 60 * MiB, 90 * MiB)
    a.free(block)
    assert a.malloc(40 * MiB).size == 40 * MiB  # 60 >= 40 + 20: a new segment
    b = CachingAllocator()  # unset: the cached block is split for both
    b.free(b.malloc(60 * MiB))
    assert (b.malloc(30 * MiB).size, b.malloc(30 * MiB).size, b.reserved) == (
        30 * MiB, 30 * MiB, 60 * MiB)


def test_max_split_size_releases_oversize_segments_before_the_rest():
    events = [("alloc", 0, 60 * MiB), ("alloc", 1, 3 * MiB), ("free", 0, 0), ("free", 1, 0),
              ("alloc", 2, 30 * MiB)]  # cached: a 60 MiB oversize segment, a 20 MiB one
    a = replay(events, 100 * MiB, max_split_size_mb=40)
    assert (a.releases, a.reserved) == (1, 50 * MiB)  # the 60 MiB one went, the 20 stayed
    # no single cached segment holds 100 MiB: the largest go first, until 100 MiB have
    cached = [("alloc", 0, 50 * MiB), ("alloc", 1, 70 * MiB), ("alloc", 2, 44 * MiB),
              ("alloc", 3, 3 * MiB)] + [("free", i, 0) for i in range(4)]
    a = replay([*cached, ("alloc", 4, 100 * MiB)], 230 * MiB, max_split_size_mb=40)
    assert (a.releases, a.reserved) == (1, 164 * MiB)  # 70 and 50 went; 44 and 20 stayed
    # all of them are not enough for 180 MiB: every whole free segment goes too, although
    # the 20 MiB one could have stayed on this card
    a = replay([*cached, ("alloc", 4, 180 * MiB)], 210 * MiB, max_split_size_mb=40)
    assert (a.releases, a.reserved) == (1, 180 * MiB)
    with pytest.raises(ValueError, match="max_split_size_mb=19"):
        CachingAllocator(max_split_size_mb=19)
    with pytest.raises(ValueError, match="max_split_size_mb=True"):
        CachingAllocator(max_split_size_mb=True)



def test_max_split_size_with_expandable_segments_passes_over_oversize_blocks_in_search_only():
    """PyTorch's best fit refuses a free block of N MiB or more to a smaller request with
    expandable segments too; the request then maps pages where the lowest free-and-unmapped
    range has room, which a free block at the segment's end is part of."""
    def run(events, mss):
        return replay(events, expandable_segments=True, max_split_size_mb=mss)

    # A (60 MiB) freed between B and the segment's end: C (30 MiB) maps a new page past B
    middle = [("alloc", 0, 60 * MiB), ("alloc", 1, 10 * MiB), ("free", 0, 0),
              ("alloc", 2, 30 * MiB)]
    assert (run(middle, None).reserved, run(middle, 40).reserved) == (80 * MiB, 100 * MiB)
    # A freed at the segment's end: the same request is served there, split as always
    end = [("alloc", 0, 60 * MiB), ("free", 0, 0), ("alloc", 2, 30 * MiB)]
    assert run(end, 40).reserved == 60 * MiB and run(end, 40).segments == 1
    # an oversize request takes a free block less than 20 MiB larger, not one 20 MiB larger
    near = [("alloc", 0, 60 * MiB), ("alloc", 1, 10 * MiB), ("free", 0, 0),
            ("alloc", 2, 45 * MiB)]
    far = near[:3] + [("alloc", 2, 40 * MiB)]
    assert (run(near, 40).reserved, run(far, 40).reserved) == (80 * MiB, 120 * MiB)


def test_a_launch_setting_parses_into_the_replays_keywords():
    parse = allocator.parse_settings
    unset = {"expandable_segments": False, "max_split_size_mb": None,
             "roundup_power2_divisions": None}
    assert parse("") == unset
    for conf in allocator.SETTINGS.values():  # settings_conf writes back what parse reads
        assert allocator.settings_conf(**parse(conf)) == conf
    assert parse("expandable_segments:True") == {**unset, "expandable_segments": True}
    assert parse(" max_split_size_mb:128 , expandable_segments:False") == {
        **unset, "max_split_size_mb": 128}
    # a threshold without a per-process fraction, and host-memory settings, change nothing
    assert parse("garbage_collection_threshold:0.6,max_split_size_mb:128,"
                 "pinned_use_cuda_host_register:True,backend:native") == {
        **unset, "max_split_size_mb": 128}
    # divisions that round nothing are no setting
    assert parse("roundup_power2_divisions:[>:0]") == unset
    # launch scripts' combination of all three
    conf = "max_split_size_mb:128,expandable_segments:True,roundup_power2_divisions:16"
    assert parse(conf) == {"expandable_segments": True, "max_split_size_mb": 128,
                           "roundup_power2_divisions": 16}
    assert allocator.settings_conf(**parse(conf)) == (
        "expandable_segments:True,max_split_size_mb:128,roundup_power2_divisions:16")
    with pytest.raises(ValueError, match="per-process memory fraction is not modelled"):
        parse("garbage_collection_threshold:0.6", fraction=True)
    # max_non_split_rounding_mb acts only on oversize blocks: without max_split_size_mb there
    # are none (vLLM launches set it beside expandable segments), and 20 is its default
    assert parse("expandable_segments:True,max_non_split_rounding_mb:256") == {
        **unset, "expandable_segments": True}
    assert parse("max_split_size_mb:128,max_non_split_rounding_mb:20") == {
        **unset, "max_split_size_mb": 128}
    gc_and_rounding = ("max_split_size_mb:128,garbage_collection_threshold:0.8,"
                       "max_non_split_rounding_mb:512")  # a launch's, seen in public scripts
    for bad, why in ((gc_and_rounding, "max_non_split_rounding_mb:512 with max_split_size_mb lets"),
                     ("max_non_split_rounding_mb:19", "max_non_split_rounding_mb:19 is under 20"),
                     ("max_non_split_rounding_mb:1.5", "max_non_split_rounding_mb:1.5 does not"),
                     ("backend:cudaMallocAsync", "backend:cudaMallocAsync is not modelled"),
                     ("garbage_collection_threshold:1.5", "threshold:1.5 does not parse"),
                     ("max_split_size_mb:1e3", "max_split_size_mb:1e3 does not parse"),
                     ("expandable_segments:yes", "expandable_segments:yes does not parse"),
                     ("max_split_size_mb:10", "max_split_size_mb=10")):
        with pytest.raises(ValueError, match=why):
            parse(bad)


def test_the_smallest_card_is_where_the_replay_starts_to_fit(config, monkeypatch):
    stranded = [("alloc", 0, 40 * MiB), ("free", 0, 0), ("alloc", 1, 10 * MiB),
                ("alloc", 2, 35 * MiB)]
    # the default rules keep the split 40 MiB segment and take a 36 MiB one; expandable
    # segments map three 20 MiB pages
    assert allocator.min_capacity(stranded) == 76 * MiB
    assert allocator.min_capacity(stranded, expandable_segments=True) == 60 * MiB
    events = fake_memory.allocation_trace(config, Stack(checkpointing=True), 128, 2)
    for expandable, mss in ((False, None), (True, None), (False, 20)):
        card = allocator.min_capacity(events, expandable, 4096, mss)
        unlimited = replay(events, expandable_segments=expandable, max_split_size_mb=mss)
        assert unlimited.peak_allocated <= card <= unlimited.peak_reserved
        replay(events, card, expandable, max_split_size_mb=mss)  # fits there
        with pytest.raises(allocator.SimulatedOutOfMemory):
            replay(events, card - 4096, expandable, max_split_size_mb=mss)
    with pytest.raises(ValueError, match="resolution=0"):
        allocator.min_capacity(events, resolution=0)
    # under each launch setting by name, a setting named twice searched once
    calls, searched = [], allocator.min_capacity
    monkeypatch.setattr(allocator, "min_capacity",
                        lambda *args, **kwargs: calls.append(kwargs) or searched(*args, **kwargs))
    cards = allocator.smallest_cards(stranded, {**allocator.SETTINGS, "again": ""})
    assert len(calls) == len(allocator.SETTINGS)
    assert cards == {name: searched(stranded, **allocator.parse_settings(conf))
                     for name, conf in {**allocator.SETTINGS, "again": ""}.items()}
    assert (cards["default"], cards["expandable segments"]) == (76 * MiB, 60 * MiB)


def _check_tiling(a: CachingAllocator, live: list) -> None:
    """Every segment's blocks tile its addresses; reserved is the mapped bytes; free
    neighbours mapped alike are merged; unmapped ranges are whole pages; the pools hold
    exactly the free blocks."""
    cached = [b for pool in a._free.values() for *_, b in pool]
    unmapped = [b for pool in a._unmapped.values() for _, b in pool]
    assert all(b.mapped for b in cached) and not any(b.mapped for b in unmapped)
    blocks, seen = set(cached) | set(unmapped) | set(live), set()
    for block in (b for b in blocks if b.prev is None):
        while block is not None:
            seen.add(block)
            after = block.next
            if after is not None:
                assert after.prev is block and after.addr == block.addr + block.size
                assert block.allocated or after.allocated or block.mapped != after.mapped
            if not block.mapped:
                page = allocator.SMALL_BUFFER if block.small else allocator.LARGE_BUFFER
                assert block.addr % page == 0 and block.size % page == 0
            block = after
    assert seen == blocks
    assert a.reserved == sum(b.size for b in seen if b.mapped)
    assert a.allocated == sum(b.size for b in live)
    # an oversize block is never split: it is a whole segment, free or allocated (expandable
    # segments split any block)
    oversize = [b for b in seen if b.size >= a._max_split and not a.expandable_segments]
    assert all(b.prev is None and b.next is None for b in oversize)


@pytest.mark.parametrize("expandable, mss, divisions", [
    (False, None, None), (True, None, None), (False, 21, None), (True, None, 16), (False, 21, 4),
    (True, 21, None)])
@pytest.mark.parametrize("capacity", [None, 300 * MiB])
def test_random_requests_keep_the_segments_consistent(expandable, mss, divisions, capacity):
    import random

    a = CachingAllocator(capacity, expandable, False, mss, divisions)
    rng, live = random.Random(0), []
    for _ in range(1500):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        elif rng.random() < 0.01:
            a.empty_cache()
        else:
            try:
                live.append(a.malloc(rng.choice([rng.randint(1, 5000), rng.randint(1, 2 * MiB),
                                                 rng.randint(1, 40 * MiB)])))
            except allocator.SimulatedOutOfMemory:
                assert capacity is not None
        _check_tiling(a, live)
    assert a.peak_reserved <= (capacity or float("inf"))


def test_bad_input_names_the_parameter():
    a = CachingAllocator()
    with pytest.raises(ValueError, match="nbytes=0"):
        a.malloc(0)
    block = a.malloc(10)
    a.free(block)
    with pytest.raises(ValueError, match="block: not allocated"):
        a.free(block)
    with pytest.raises(ValueError, match="events: 'resize'"):
        replay([("resize", 0, 1)])


def test_the_log_records_allocations_and_frees_in_order():
    kept, resize = torch.zeros(10), torch.UntypedStorage.resize_
    with AllocationLog("cpu") as log:
        log.track([kept, kept])  # an existing storage, once
        x = torch.ones(100)
        y = x * 2
        del x
        y.untyped_storage().resize_(40)  # logged as a free and a new allocation
        del y
    assert log.events == [("alloc", 0, 40), ("alloc", 1, 400), ("alloc", 2, 400),
                          ("free", 1, 0), ("free", 2, 0), ("alloc", 3, 40), ("free", 3, 0)]
    assert torch.UntypedStorage.resize_ is resize  # restored on exit


def test_traces_survive_a_save_and_load(tmp_path):
    events = [("alloc", 7, 100), ("alloc", 9, 5), ("free", 7, 0), ("free", 42, 0)]
    allocator.save_traces(tmp_path / "t.json.gz", {"run": events})
    back = load_traces(tmp_path / "t.json.gz")["run"]
    assert back == [("alloc", 0, 100), ("alloc", 1, 5), ("free", 0, 0)]
    assert replay(back).peak_reserved == replay(events).peak_reserved


@pytest.fixture(scope="module")
def config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("stack", [Stack(precision="fp32"), Stack(checkpointing=True),
                                   Stack(method="lora", precision="bf16-mixed")],
                         ids=lambda s: s.label)
def test_a_fake_run_replays_as_the_same_run_on_real_tensors(config, stack):
    fake, real = (fake_memory.replay_allocator(config, stack, 128, 2, fake=f)
                  for f in (True, False))
    assert (fake.peak_allocated, fake.peak_reserved, fake.segments) == (
        real.peak_allocated, real.peak_reserved, real.segments)
    # the trace the replay allocates is the measured step's, rounded to 512-byte blocks
    measured = fake_memory.measure_step(config, stack, 128, 2).peak_bytes
    assert measured <= fake.peak_allocated <= measured + 512 * 200


def test_steps_at_several_lengths_replay_as_the_same_run_on_real_tensors(config):
    """Variable-length batches (an unpacked dataset): one step at each length, fake as real,
    and each step's peak is its own length's."""
    stack, lengths = Stack(checkpointing=True), [96, 32, 128, 64]
    fake, real = (allocator.replay(fake_memory.allocation_trace(config, stack, lengths, 2,
                                                                 fake=f)) for f in (True, False))
    assert (fake.peak_allocated, fake.peak_reserved, fake.segments) == (
        real.peak_allocated, real.peak_reserved, real.segments)
    longest = replay(fake_memory.allocation_trace(config, stack, 128, 2, steps=2))
    assert fake.peak_allocated == longest.peak_allocated  # the longest step sets the peak
    with pytest.raises(ValueError, match=r"seq_len=\[\]"):
        fake_memory.allocation_trace(config, stack, [], 2)
    with pytest.raises(ValueError, match="seq_len=1: must be an integer >= 2"):
        fake_memory.allocation_trace(config, stack, [64, 1], 2)
    with pytest.raises(ValueError, match="seq_len=300"):  # beyond the model's 256 positions
        fake_memory.allocation_trace(config, stack, [64, 300], 2)


def test_replay_refuses_what_it_does_not_model(config):
    with pytest.raises(ValueError, match="stack.fsdp_ranks=2: .*fsdp_one_stream=True"):
        fake_memory.replay_allocator(config, Stack(fsdp_ranks=2), 128, 2)
    with pytest.raises(ValueError, match="stack.fsdp_cpu_offload=True"):
        fake_memory.replay_allocator(config, Stack(fsdp_ranks=2, fsdp_cpu_offload=True), 128, 2,
                                     fsdp_one_stream=True)
    with pytest.raises(ValueError, match="steps=0"):
        fake_memory.replay_allocator(config, Stack(), 128, 2, steps=0)


def test_an_fsdp_rank_replayed_as_one_stream_allocates_its_measured_trace():
    """Rank 0 of a fake process group, its collectives' buffers in the step's own pool: the
    replay allocates what the meter measures (DTensor's metadata ops are not logged), in
    512-byte blocks, which at this size round many small tensors up by 1-2 %."""
    from conftest import FSDP_FAKE_CONFIG

    for stack in (Stack(precision="bf16", fsdp_ranks=2),
                  Stack(precision="bf16-mixed", fsdp_ranks=2, checkpointing=True)):
        a = fake_memory.replay_allocator(FSDP_FAKE_CONFIG, stack, 64, 4, fsdp_one_stream=True)
        measured = fake_memory.measure_step(FSDP_FAKE_CONFIG, stack, 64, 4).peak_bytes
        assert measured <= a.peak_allocated <= 1.03 * measured, stack
        assert a.peak_reserved >= a.peak_allocated


def test_the_replay_predicts_the_h100s_reserved_memory():
    """Llama-3.2-1B, 2 x 2048 tokens, five stacks on an H100 (2026-11-23): the allocations of
    that session's own loop (bench/allocator_traces.py) replayed through the allocator's rules
    give ``max_memory_reserved`` within 2.5 % in bf16, where a fixed 15 % reserve over the
    trace misses by 8-13 %. fp32 misses by 11 %, as its trace misses the allocated peak (CUDA's
    fp32 attention kernel allocates 2 GiB this CPU trace does not see)."""
    traces = load_traces(RAW / "fake_traces_64663d2.json.gz")
    real = {r["stack"]: r for r in
            json.loads((RAW / "gpu_session_memory.json").read_text())["fake_vs_real"]}
    assert traces.keys() == real.keys()
    replayed, fixed = [], []
    for stack, events in traces.items():
        a, r = replay(events), real[stack]
        if "fp32" in stack:
            shortfall = a.peak_allocated / r["allocated_peak"]
            assert shortfall < 0.92
            assert abs(a.peak_reserved / r["reserved_peak"] - shortfall) < 0.03
            continue
        assert abs(a.peak_allocated / r["allocated_peak"] - 1) < 0.01, stack
        replayed.append(abs(a.peak_reserved / r["reserved_peak"] - 1))
        fixed.append(abs((1 + planner.ALLOCATOR_RESERVE) * a.peak_allocated
                         / r["reserved_peak"] - 1))
    assert len(replayed) == 4 and max(replayed) < 0.025
    assert max(fixed) > 0.08


def _pytorch_divisions(conf: str) -> tuple[int, ...] | None:
    """PyTorch's own table for ``conf``: its parser and its interval lookup as compiled into this
    build's libc10 (``AcceleratorAllocatorConfig``, shared by every device's allocator), or None
    where this build has no such symbol."""
    import ctypes
    import os

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    # the static AcceleratorAllocatorConfig::roundup_power2_divisions(size_t), by its C++ name
    name = "_ZN3c1016CachingAllocator26AcceleratorAllocatorConfig24roundup_power2_divisionsEm"
    try:
        lookup = getattr(lib, name)
    except AttributeError:
        return None
    lookup.restype, lookup.argtypes = ctypes.c_size_t, [ctypes.c_size_t]
    before = torch._C._accelerator_getAllocatorSettings()
    torch._C._accelerator_setAllocatorSettings(conf)
    try:
        return tuple(lookup(1 << (20 + i)) for i in range(allocator.ROUNDUP_INTERVALS))
    finally:
        torch._C._accelerator_setAllocatorSettings(before)


def test_roundup_power2_divisions_parse_as_pytorch_parses_them():
    import random

    confs = ["roundup_power2_divisions:16", "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
             "roundup_power2_divisions:[1:1,4:2,16:4]", "roundup_power2_divisions:[>:8]",
             "roundup_power2_divisions:[65536:2]", "roundup_power2_divisions:[ 64:8 , >:0 ]",
             "roundup_power2_divisions:[]", "roundup_power2_divisions:[256:4,]"]
    rng = random.Random(0)
    for _ in range(40):  # random lists, and the value settings_conf writes for a random table
        entries = [f"{1 << rng.randrange(18)}:{rng.choice([0, 1, 2, 4, 16])}"
                   for _ in range(rng.randrange(1, 5))]
        entries += [f">:{rng.choice([0, 2, 8])}"] * rng.randrange(2)
        confs.append(f"roundup_power2_divisions:[{','.join(entries)}]")
        table = tuple(rng.choice([0, 1, 2, 4, 8]) for _ in range(allocator.ROUNDUP_INTERVALS))
        confs.append(allocator.settings_conf(roundup_power2_divisions=table) or "")
        assert allocator.roundup_divisions(allocator.parse_settings(confs[-1])[
            "roundup_power2_divisions"] or (0,) * 16) == (table if any(table) else (0,) * 16)
    if _pytorch_divisions("") is None:
        pytest.skip("this torch build's libc10 has no AcceleratorAllocatorConfig to compare")
    for conf in confs:
        ours = allocator.parse_settings(conf)["roundup_power2_divisions"]
        assert (allocator.roundup_divisions(ours) or (0,) * 16) == _pytorch_divisions(conf), conf


def test_max_non_split_rounding_mb_is_refused_where_pytorch_refuses_it():
    """Our parse refuses the values this build's own parser refuses (under 20 MiB, not a
    number), and reads the others as PyTorch does: acting only beside max_split_size_mb."""
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_settings is None:
        pytest.skip("this torch build has no AcceleratorAllocatorConfig parser to compare")
    before = torch._C._accelerator_getAllocatorSettings()
    try:
        for value in ("0", "1", "19", "20", "21", "512", "x"):
            conf = f"max_non_split_rounding_mb:{value}"
            try:
                set_settings(conf)
                theirs = True
            except (RuntimeError, ValueError):
                theirs = False
            try:
                allocator.parse_settings(conf)
                ours = True
            except ValueError:
                ours = False
            assert ours == theirs, conf
    finally:
        set_settings(before)


def test_roundup_power2_divisions_round_requests_to_the_next_division():
    MiB = 2**20
    table = allocator.roundup_divisions
    assert allocator.round_size(5 * MiB + 1, table(4)) == 6 * MiB
    assert allocator.round_size(5 * MiB + 1, table(16)) == 5 * MiB + MiB // 4
    # pytorch#161139: 514 MiB with [>:2] takes 768 MiB; with [>:1], as without, 514
    assert allocator.round_size(514 * MiB, table((0,) + (2,) * 15)) == 768 * MiB
    assert allocator.round_size(514 * MiB, table(1)) == 514 * MiB
    # a power of two, a request of at most 512 x D bytes, and D = 0 round to 512 bytes only
    assert allocator.round_size(8 * MiB, table(16)) == 8 * MiB
    assert allocator.round_size(8000, table(16)) == 8192 and allocator.round_size(
        8193, table(16)) == 8704  # 8,192 = 512 x 16: above it, steps of 8,192 / 16 = 512
    assert allocator.round_size(100_000, table(64)) == 100_352  # 65,536 / 64 = 1,024 steps
    assert allocator.round_size(3 * MiB + 7, table((0,) * 16)) == 3 * MiB + 512
    # the replay allocates and caches the rounded size, and a setting parses with the others
    a = CachingAllocator(roundup_power2_divisions=4)
    block = a.malloc(5 * MiB + 1)
    assert block.size == a.allocated == 6 * MiB and a.reserved == 20 * MiB
    assert allocator.parse_settings("expandable_segments:True,roundup_power2_divisions:16") == {
        "expandable_segments": True, "max_split_size_mb": None, "roundup_power2_divisions": 16}
    assert allocator.settings_conf(True, None, 16) == (
        "expandable_segments:True,roundup_power2_divisions:16")
    events = [("alloc", 0, 5 * MiB + 1), ("alloc", 1, 5 * MiB + 2), ("free", 0, 0),
              ("alloc", 2, 5 * MiB + 3)]  # the freed block serves the third either way
    for expandable in (False, True):
        plain = replay(events, expandable_segments=expandable)
        rounded = replay(events, expandable_segments=expandable, roundup_power2_divisions=4)
        assert (plain.peak_allocated, rounded.peak_allocated) == (10 * MiB + 1024, 12 * MiB)
    for bad, why in ((3, "roundup_power2_divisions=3: a power of two"),
                     (0, "roundup_power2_divisions=0"), ((2,) * 15, r"\(2, 2"),
                     (True, "roundup_power2_divisions=True")):
        with pytest.raises(ValueError, match=why):
            CachingAllocator(roundup_power2_divisions=bad)
    for conf in ("roundup_power2_divisions:3", "roundup_power2_divisions:[3:2]",
                 "roundup_power2_divisions:[256:3]", "roundup_power2_divisions:[256]"):
        with pytest.raises(ValueError, match="does not parse"):
            allocator.parse_settings(conf)

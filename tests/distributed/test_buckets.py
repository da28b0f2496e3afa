"""Bucket assignment (pure functions): reverse order, byte caps, first-bucket cap, homogeneous keys, rebuild order."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fanfold.distributed.reducer import MiB, assign_buckets, bucket_caps, rebuild_order

F32 = (torch.float32, "cpu")
F16 = (torch.float16, "cpu")


def test_reverse_order_and_caps():
    # 6 params of 400 bytes; first cap 1000 -> 3 params (crossing the cap closes), then cap 800 -> 2 per bucket.
    assert assign_buckets([400] * 6, [F32] * 6, [1000, 800]) == [[5, 4, 3], [2, 1], [0]]


def test_one_cap_per_bucket_the_last_after():
    assert assign_buckets([400] * 6, [F32] * 6, [400, 800, 1200]) == [[5], [4, 3], [2, 1, 0]]
    assert assign_buckets([400] * 6, [F32] * 6, [400, 800]) == [[5], [4, 3], [2, 1], [0]]


def test_parameter_larger_than_cap_gets_its_own_bucket():
    assert assign_buckets([10, 5000, 10], [F32] * 3, [100, 100]) == [[2, 1], [0]]
    assert assign_buckets([5000, 10, 10], [F32] * 3, [15, 100]) == [[2, 1], [0]]


def test_buckets_never_mix_dtypes_or_devices_and_follow_launch_order():
    keys = [F32, F16, F32, F16, (torch.float32, "meta")]
    out = assign_buckets([4, 2, 4, 2, 4], keys, [1000, 1000])
    assert out == [[4], [3, 1], [2, 0]]  # ordered by each bucket's first member in reverse order
    for members in out:
        assert len({keys[i] for i in members}) == 1


def test_first_bucket_cap_is_per_key():
    keys = [F32, F32, F16, F16]
    out = assign_buckets([8, 8, 8, 8], keys, [8, 100])
    assert out == [[3], [2], [1], [0]]  # each key's first bucket closes at 8 bytes; the rest fit under 100


def test_custom_order_is_the_fill_order():
    assert assign_buckets([4] * 4, [F32] * 4, [8, 8], order=[1, 3, 0, 2]) == [[1, 3], [0, 2]]


def test_bad_caps_are_named():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        bucket_caps(0)
    with pytest.raises(ValueError, match="first_bucket_cap_mb"):
        bucket_caps(25, -1)
    with pytest.raises(ValueError, match="bucket_cap_mb_list"):
        bucket_caps(bucket_cap_mb_list=[1, 0])
    with pytest.raises(ValueError, match="give one"):
        bucket_caps(first_bucket_cap_mb=1, bucket_cap_mb_list=[1])


def test_default_caps():
    assert bucket_caps() == [1 * MiB, 25 * MiB]
    assert bucket_caps(0.5) == [MiB // 2, MiB // 2]  # the first cap never exceeds the general one
    assert bucket_caps(10, bucket_cap_mb_list=[2, 4]) == [2 * MiB, 4 * MiB]  # the list wins, as in torch


def test_rebuild_order_appends_unready_in_reverse():
    assert rebuild_order([2, 0], 5) == [2, 0, 4, 3, 1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.sampled_from([F32, F16])), max_size=40),
       st.integers(1, 3000), st.integers(1, 3000))
def test_partition_properties(params, cap, first):
    nbytes, keys = [b for b, _ in params], [k for _, k in params]
    out = assign_buckets(nbytes, keys, [first, cap])
    flat = [i for members in out for i in members]
    assert sorted(flat) == list(range(len(params)))  # a partition
    for members in out:
        assert len({keys[i] for i in members}) == 1
        assert members == sorted(members, reverse=True)
        # only the last member may push a bucket over its cap
        assert sum(nbytes[i] for i in members[:-1]) < max(cap, first)

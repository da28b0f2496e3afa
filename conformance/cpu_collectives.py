"""torch's own collective test helpers on CPU where torch's suite runs them only on MPI or NCCL.

``DistributedTest._DistTestBase`` skips CPU ``all_to_all_single`` unless the backend is MPI, and tests
``all_gather_into_tensor`` / ``reduce_scatter_tensor`` on CUDA only -- yet gloo has all three on CPU, and the
``fanfold`` backend runs them in shared memory. :class:`CpuCollectives` calls the suite's own helpers
(``_test_all_to_all_single_*_helper``, ``_all_gather_into_tensor_helper``, ``_reduce_scatter_tensor_helper``) with CPU
tensors, so ``conformance/collectives.py`` runs them on gloo and on ``fanfold`` like the rest of the suite.

Layer: a tool beside the package, mixed into ``collectives.py``'s test class; imports no fanfold.
"""
from __future__ import annotations

import torch
from torch.testing._internal.common_distributed import skip_if_small_worldsize

__all__ = ["CpuCollectives"]


class CpuCollectives:
    """Test methods over the suite's helpers (``self`` is a ``_DistTestBase``); the names of the ones torch skips
    on CPU stay, so the report lines them up with torch's."""

    def test_all_to_all_single_equal_split(self) -> None:
        self._test_all_to_all_single_equal_split_helper(*self._init_global_test())

    def test_all_to_all_single_equal_split_complex(self) -> None:
        self._test_all_to_all_single_equal_split_helper(*self._init_global_test(), dtype=torch.cfloat)

    def test_all_to_all_single_unequal_split(self) -> None:
        self._test_all_to_all_single_unequal_split_helper(*self._init_global_test())

    def test_all_to_all_single_unequal_split_complex(self) -> None:
        self._test_all_to_all_single_unequal_split_helper(*self._init_global_test(), dtype=torch.cfloat)

    @skip_if_small_worldsize
    def test_all_to_all_single_equal_split_group(self) -> None:
        self._test_all_to_all_single_equal_split_helper(*self._init_group_test())

    @skip_if_small_worldsize
    def test_all_to_all_single_unequal_split_group(self) -> None:
        self._test_all_to_all_single_unequal_split_helper(*self._init_group_test())

    # gloo accepts only the concatenated layout of all_gather_into_tensor / reduce_scatter_tensor; torch documents
    # the stacked one too (NCCL's): one test each, so the report shows which backend takes which.

    def test_all_gather_into_cat_tensor_cpu(self) -> None:
        self._all_gather_into(lambda n: (n * 2, 3), torch.cat)

    def test_all_gather_into_stack_tensor_cpu(self) -> None:
        self._all_gather_into(lambda n: (n, 2, 3), torch.stack)

    def test_reduce_scatter_tensor_cpu(self) -> None:
        self._reduce_scatter(stacked=False)

    def test_reduce_scatter_tensor_stacked_cpu(self) -> None:
        self._reduce_scatter(stacked=True)

    def _all_gather_into(self, shape, join) -> None:
        group, group_id, rank = self._init_global_test()
        out = torch.full(shape(len(group)), -1.0)
        got = self._all_gather_into_tensor_helper(out, torch.full((2, 3), float(rank)), group_id, rank, cuda=False)
        self.assertEqual(got, join([torch.full((2, 3), float(i)) for i in group]))
        self._barrier()

    def _reduce_scatter(self, stacked: bool) -> None:
        group, group_id, rank = self._init_global_test()
        n, size = len(group), 3
        mine = torch.arange(n * size, dtype=torch.int64) * (rank + 1)  # rank-dependent, so the sum is informative
        # every rank's arange times (p + 1), summed over the ranks p: arange times n (n + 1) / 2
        want = torch.arange(rank * size, (rank + 1) * size, dtype=torch.int64) * (n * (n + 1) // 2)
        out = torch.zeros(size, dtype=torch.int64)
        tensor_in = mine.reshape(n, size) if stacked else mine
        self.assertEqual(self._reduce_scatter_tensor_helper(out, tensor_in, group_id, rank, cuda=False), want)
        self._barrier()
